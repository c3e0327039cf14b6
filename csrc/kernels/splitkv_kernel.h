// Split-KV MLA decoding kernel for Hopper (sm_90a): SPEC.md "Kernels" (2). The kernel shell: grid, shared
// memory, barrier set-up and the warpgroup dispatch. The parts live in
//   tile_scheduler.h  which pieces (and pages) a CTA owns
//   mainloop.h        page copies, barriers and the two warpgroups' schedule (drawn at its top)
//   softmax.h         masking and the online softmax
//   epilogue.h        normalisation and the writes (out/lse, or fp32 partials for the combine kernel)
//
// Grid: (query-row tile, KV head, SM part); 256 threads = two warpgroups; one CTA per SM (227 KiB of shared
// memory: the Q tile, two K pages and the warpgroups' mailbox).
#pragma once

#include <cstdlib>
#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>

#include "kv_cache_tma.h"
#include "launch.h"
#include "mainloop.h"
#include "params.h"
#include "splitkv_traits.h"
#include "tile_scheduler.h"

namespace flash_mla {

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) mla_splitkv_kernel(const __grid_constant__ DecodeParams params) {
  using Mainloop = SplitKvMainloop<Traits>;
  using SharedStorage = typename Traits::SharedStorage;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);

  if (threadIdx.x == 0) {
    for (int stage = 0; stage < Traits::kStages; ++stage) {
      for (int unit = 0; unit < Traits::kUnits; ++unit) {
        cutlass::arch::ClusterBarrier::init(&smem.unit_full[stage][unit], 1);    // TMA: one arrive + bytes
      }
    }
    for (auto& stage_releases : smem.group_releases) {
      for (uint32_t& releases : stage_releases) releases = 0;
    }
    cutlass::arch::ClusterBarrier::init(&smem.q_full, Traits::kWarpgroupThreads);    // cp.async: 128 arrivals
    for (uint64_t& posted : smem.probs_posted) cutlass::arch::ClusterBarrier::init(&posted, Traits::kWarpgroupThreads);
    cutlass::arch::fence_barrier_init();
    // The cache's tensor map lives in the kernel parameters (not written by any kernel): warm its cache line.
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(params.k_cache_tma));
  }

  // One-tile grids are launched as programmatic dependents of the kernel before them (launch_splitkv): everything
  // above touched only this CTA's shared memory; every input (q, the cache, the block table, the plan) may be that
  // kernel's output, and this grid's outputs may reuse memory that kernel still reads.
  cutlass::arch::wait_on_dependent_grids();
  // The combine kernel (our programmatic dependent) may start its prologue now. Not earlier: its prologue reads
  // num_splits, which the kernel before this one may have written.
  cutlass::arch::launch_dependent_grids();

  // The descales are inputs too (maybe written by the kernel before this one): read after the wait.
  const float descale_k = params.descale_k != nullptr ? *params.descale_k : 1.f;
  const float descale_q = params.descale_q != nullptr ? *params.descale_q : 1.f;
  const SplitKvScales scales{params.scale_log2 * descale_q * descale_k, descale_k};

  const int m_tile = blockIdx.x, kv_head = blockIdx.y;
  const PieceRange range(params, blockIdx.z);
  // An SM part with no work: no thread waits on a barrier (both CTAs of a pair share the part, so both leave).
  if (range.last_seq() < range.first_seq()) return;
  if (threadIdx.x == 0) Mainloop::arm_first_pages(smem, range);
  // Paired tiles: the barriers of both CTAs are initialised and armed before either CTA's copies can reach them.
  const bool paired = params.tiles_per_cluster > 1;
  if (paired) {
    cluster_sync_all();
  } else {
    __syncthreads();
  }

  if (threadIdx.x / Traits::kWarpgroupThreads == static_cast<int>(WarpgroupRole::kPageA)) {
    Mainloop::template run<WarpgroupRole::kPageA>(params, scales, smem, range, kv_head, m_tile);
  } else {
    Mainloop::template run<WarpgroupRole::kPageB>(params, scales, smem, range, kv_head, m_tile);
  }
  // A CTA's shared memory must outlive the other CTA's arrivals on it and copies into it.
  if (paired) cluster_sync_all();
}

// Row tiles per cluster for a grid of `num_row_tiles` tiles per KV head (SPEC.md "Kernels"): pairs of tiles of
// one SM part walk the same pages, so a pair fetches each page once and multicasts it to both (half the L2 -> SM
// traffic of the multi-tile rows). Only where every tile has a partner and the pairs are as resident as single
// CTAs would be (`resident_pairs`, the occupancy of clusters of two; single CTAs fill min(grid, SMs)).
constexpr int tiles_per_cluster_for(int num_row_tiles, int grid_ctas, int num_sms, int resident_pairs) {
  const int resident_single = grid_ctas < num_sms ? grid_ctas : num_sms;
  return num_row_tiles % 2 == 0 && 2 * resident_pairs >= resident_single ? 2 : 1;
}

template <class Element, class CacheElement = Element>
void launch_splitkv(const DecodeParams& binding_params, cudaStream_t stream) {
  using Traits = SplitKvTraits<Element, CacheElement>;
  DecodeParams params = binding_params;
  encode_kv_cache_tma(params, Traits::kFp8Cache                             ? CacheDtype::kE4m3
                              : std::is_same_v<Element, cutlass::half_t> ? CacheDtype::kFp16
                                                                           : CacheDtype::kBf16);
  auto kernel = mla_splitkv_kernel<Traits>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  const dim3 grid(params.num_row_tiles, params.num_heads_k, params.num_sm_parts);
  // Residency of pairs and the SM count, asked once per process and kernel type (of the first device that runs it).
  static int resident_pairs = -1, num_sms = 0;
  if (resident_pairs < 0) {
    int device = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(2, 1, 1);
    config.blockDim = dim3(Traits::kThreads);
    config.dynamicSmemBytes = Traits::kSmemBytes;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 2;
    cluster.val.clusterDim.y = 1;
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&resident_pairs, kernel, &config) != cudaSuccess) {
      cudaGetLastError();    // not an error of this call: run unpaired
      resident_pairs = 0;
    }
  }
  params.tiles_per_cluster =
      tiles_per_cluster_for(params.num_row_tiles, grid.x * grid.y * grid.z, num_sms, resident_pairs);
  if (getenv("FLASH_MLA_EXP_UNPAIRED") != nullptr) params.tiles_per_cluster = 1;    // EXPERIMENT ONLY
  // Programmatic dependent launch for one-tile grids (<= 64 query rows per KV head): the CTAs may be scheduled
  // before the kernel ahead of this one (the previous call's combine kernel in a decoding loop) has finished, set
  // up their barriers and wait in griddepcontrol.wait (H100, with the prologue's page-a-first order: one-tile
  // table rows -0.45 %, small-batch rows -1 %; docs/PERF.md "Split kernel"). Not for several tiles: there it cost up to
  // +21 % (b = 1024, L = 512, h_q 128), probably because the tiles of one SM part read the same pages and find
  // them in L2 only if they start together, and CTAs scheduled one by one as the combine's CTAs leave do not.
  launch_kernel(kernel, grid, dim3(Traits::kThreads), Traits::kSmemBytes, stream,
                /*programmatic=*/params.num_row_tiles == 1, params.tiles_per_cluster, params);
}

}  // namespace flash_mla
