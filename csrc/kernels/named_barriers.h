// Named barriers between the two warpgroups of the split-KV kernel, each named by the event it signals.
// Each is a producer/consumer pair: one warpgroup arrives (does not wait), the other syncs (waits), so 256
// threads take part and only the consumer ever stalls.
#pragma once

#include <cutlass/arch/barrier.h>

namespace flash_mla {

enum class SplitKvBarrier : uint32_t {
  kPageAProbsReady = 0,   // kPageA wrote P_a, m_a and rowsum_a to the mailbox (and its S_a is complete)
  kPageBProbsReady = 1,   // kPageB read them and wrote P_b, m_b and l (and its S_b is complete)
};

constexpr uint32_t kBarrierThreads = 256;

// Barriers inside one warpgroup (128 threads); ids are this value + the warpgroup's index.
enum class WarpgroupBarrier : uint32_t {
  kTailRowsZeroed = 2,    // the warpgroup zeroed the V rows past a piece's end in its segments (ids 2, 3)
};

constexpr uint32_t kWarpgroupBarrierThreads = 128;

__device__ __forceinline__ void barrier_arrive(SplitKvBarrier barrier) {
  cutlass::arch::NamedBarrier::arrive(kBarrierThreads, static_cast<uint32_t>(barrier));
}
__device__ __forceinline__ void barrier_sync(SplitKvBarrier barrier) {
  cutlass::arch::NamedBarrier::sync(kBarrierThreads, static_cast<uint32_t>(barrier));
}

__device__ __forceinline__ void warpgroup_sync(WarpgroupBarrier barrier, int warpgroup) {
  cutlass::arch::NamedBarrier::sync(kWarpgroupBarrierThreads, static_cast<uint32_t>(barrier) + warpgroup);
}

}  // namespace flash_mla
