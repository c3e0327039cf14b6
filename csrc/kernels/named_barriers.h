// CTA-wide named barriers of the split-KV kernel, each named by the event it signals.
// Both warpgroups (all 256 threads) take part in every one of them.
#pragma once

#include <cutlass/arch/barrier.h>

namespace flash_mla {

enum class SplitKvBarrier : uint32_t {
  kPageLanded = 0,       // the page (and, first time, the Q tile) copied by cp.async is visible to WGMMA
  kRowMaxExchanged = 1,  // each warpgroup published its half-page row maxima
  kProbsWritten = 2,     // each warpgroup wrote its half of P (64 x 64) to shared memory
  kRowSumExchanged = 3,  // each warpgroup published its partial row sums
};

template <int NumThreads>
__device__ __forceinline__ void barrier_sync(SplitKvBarrier barrier) {
  cutlass::arch::NamedBarrier::sync(NumThreads, static_cast<uint32_t>(barrier));
}

}  // namespace flash_mla
