// Named (bar.sync) barriers of the split-KV kernel, each named by the event it signals. The two warpgroups'
// hand-offs are mbarriers (SharedStorage::probs_posted, see mainloop.h); these are warpgroup-local.
#pragma once

#include <cutlass/arch/barrier.h>

#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// Barriers inside one warpgroup (128 threads): value + the warpgroup's index is the id given to cutlass's
// NamedBarrier, which adds its reserved count (8), so the hardware barriers are 10, 11 / 12 / 14, 15.
enum class WarpgroupBarrier : uint32_t {
  // the warpgroup's generic-proxy writes into its V segments of a page buffer are done (2, 3): the V rows past a
  // piece's end zeroed before its P V, or its half of O staged for the TMA store of out (epilogue.h), or that
  // store's reads of them complete (the half may be refilled)
  kVSegmentsWritten = 2,
  kRawRowsRead = 4,       // sparse: the gather warpgroup read the raw rows it overwrites next (one: 4)
  kUnitWidened = 6,       // FP8 cache and sparse: the warpgroup widened or dequantised a page unit for its S (6, 7)
};

// Barriers of both computing warpgroups (256 threads), hardware ids (bar.sync directly).
enum class CtaBarrier : uint32_t {
  kQWidened = 8,          // FP8-cache kernel: the Q tile is fp16 in shared memory (after an e4m3 or bf16 q)
};

constexpr uint32_t kWarpgroupBarrierThreads = 128;
// The hardware id of a warpgroup barrier. bar.sync takes 0..15 (0: __syncthreads); ptxas accepted 18 without a
// word (and used 2) before these were checked.
constexpr uint32_t hardware_barrier(WarpgroupBarrier barrier, int warpgroup) {
  return cutlass::arch::NamedBarrier::ReservedNamedBarrierCount + static_cast<uint32_t>(barrier) + warpgroup;
}
static_assert(static_cast<uint32_t>(CtaBarrier::kQWidened) <
                  hardware_barrier(WarpgroupBarrier::kVSegmentsWritten, 0), "one event per barrier id");
static_assert(hardware_barrier(WarpgroupBarrier::kVSegmentsWritten, 1) <
                  hardware_barrier(WarpgroupBarrier::kRawRowsRead, 0), "one event per barrier id");
static_assert(hardware_barrier(WarpgroupBarrier::kRawRowsRead, 0) <
                  hardware_barrier(WarpgroupBarrier::kUnitWidened, 0), "one event per barrier id");
static_assert(hardware_barrier(WarpgroupBarrier::kUnitWidened, 1) < 16, "bar.sync ids are 0..15");

__device__ __forceinline__ void warpgroup_sync(WarpgroupBarrier barrier, int warpgroup) {
  cutlass::arch::NamedBarrier::sync(kWarpgroupBarrierThreads, static_cast<uint32_t>(barrier) + warpgroup);
}

FLASH_MLA_NAMESPACE_END  // flash_mla
