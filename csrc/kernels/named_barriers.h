// Named (bar.sync) barriers of the split-KV kernel, each named by the event it signals. The two warpgroups'
// hand-offs are mbarriers (SharedStorage::probs_posted, see mainloop.h); these are warpgroup-local.
#pragma once

#include <cutlass/arch/barrier.h>

namespace flash_mla {

// Barriers inside one warpgroup (128 threads); ids are this value + the warpgroup's index.
enum class WarpgroupBarrier : uint32_t {
  kTailRowsZeroed = 2,    // the warpgroup zeroed the V rows past a piece's end in its segments (ids 2, 3)
  kRescaleVoted = 4,      // every thread of the warpgroup voted on "some row reference moved" (ids 4, 5)
  kUnitWidened = 6,       // FP8 cache: the warpgroup widened a page unit for its S (ids 6, 7)
};

// Barriers of both warpgroups (256 threads).
enum class CtaBarrier : uint32_t {
  kQWidened = 8,          // FP8-cache kernel: the Q tile is fp16 in shared memory (after an e4m3 or bf16 q)
};

constexpr uint32_t kWarpgroupBarrierThreads = 128;

__device__ __forceinline__ void warpgroup_sync(WarpgroupBarrier barrier, int warpgroup) {
  cutlass::arch::NamedBarrier::sync(kWarpgroupBarrierThreads, static_cast<uint32_t>(barrier) + warpgroup);
}

// True when `pred` holds in any thread of the warpgroup (bar.red.or over its 128 threads): a decision every
// warp of the warpgroup takes alike, as a branch around WGMMA waits must be (wgmma is .aligned).
__device__ __forceinline__ bool warpgroup_any(WarpgroupBarrier barrier, int warpgroup, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n"
      "  .reg .pred p, q;\n"
      "  setp.ne.u32 p, %1, 0;\n"
      "  bar.red.or.pred q, %2, %3, p;\n"
      "  selp.u32 %0, 1, 0, q;\n"
      "}\n"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "r"(static_cast<uint32_t>(barrier) + warpgroup),
        "r"(kWarpgroupBarrierThreads));
  return any != 0;
}

}  // namespace flash_mla
