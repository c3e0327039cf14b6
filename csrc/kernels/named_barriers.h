// Named (bar.sync) barriers of the split-KV kernel, each named by the event it signals. The two warpgroups'
// hand-offs are mbarriers (SharedStorage::probs_posted, see mainloop.h); these are warpgroup-local.
#pragma once

#include <cutlass/arch/barrier.h>

#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// Barriers inside one warpgroup (128 threads); ids are this value + the warpgroup's index.
enum class WarpgroupBarrier : uint32_t {
  kTailRowsZeroed = 2,    // the warpgroup zeroed the V rows past a piece's end in its segments (ids 2, 3)
  kUnitWidened = 6,       // FP8 cache: the warpgroup widened a page unit for its S (ids 6, 7)
  kRawRowsRead = 10,      // sparse: the gather warpgroup read the raw rows it overwrites next (one id: 10)
};

// Barriers of both computing warpgroups (256 threads).
enum class CtaBarrier : uint32_t {
  kQWidened = 8,          // FP8-cache kernel: the Q tile is fp16 in shared memory (after an e4m3 or bf16 q)
};

constexpr uint32_t kWarpgroupBarrierThreads = 128;

__device__ __forceinline__ void warpgroup_sync(WarpgroupBarrier barrier, int warpgroup) {
  cutlass::arch::NamedBarrier::sync(kWarpgroupBarrierThreads, static_cast<uint32_t>(barrier) + warpgroup);
}

FLASH_MLA_NAMESPACE_END  // flash_mla
