// Split-KV MLA decoding kernel for Hopper (sm_90a): SPEC.md "Kernels" (2). The kernel shell: grid, shared
// memory, barrier set-up and the warpgroup dispatch. The parts live in
//   tile_scheduler.h  which pieces (and pages) a CTA owns
//   mainloop.h        page copies, barriers and the two warpgroups' schedule (drawn at its top)
//   fp8_widening.h    the FP8 cache's e4m3 -> fp16 widening in shared memory
//   softmax.h         masking and the online softmax
//   epilogue.h        normalisation and the writes (out/lse, or fp32 partials for the combine kernel)
//
// Grid: (query-row tile, KV head, SM part); 256 threads = two computing warpgroups (384 with a third: sparse
// decoding's gathers and dequantises the pages, sparse_gather.h; the FP8 cache with an e4m3 q's widens V,
// fp8_widening.h); one CTA per SM (227 KiB of shared memory: the Q tile, two K
// pages and the warpgroups' mailbox).
#pragma once

#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/arch/reg_reconfig.h>

#include "fp8_widening.h"
#include "kv_cache_tma.h"
#include "launch.h"
#include "mainloop.h"
#include "params.h"
#include "probe.h"
#include "sparse_gather.h"
#include "splitkv_traits.h"
#include "tile_scheduler.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) mla_splitkv_kernel(const __grid_constant__ DecodeParams params) {
  using Mainloop = SplitKvMainloop<Traits>;
  using SharedStorage = typename Traits::SharedStorage;
  extern __shared__ __align__(1024) char smem_raw[];
  SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
  probe_time(params, kProbeEntry);
  probe_sm(params);

  if (threadIdx.x == 0) {
    // TMA: one arrival and the bytes; sparse: one arrival per thread of the gather warpgroup.
    constexpr int kUnitArrivals = Traits::kSparse ? Traits::kWarpgroupThreads : 1;
    for (int stage = 0; stage < Traits::kStages; ++stage) {
      for (int unit = 0; unit < Traits::kUnits; ++unit) {
        cutlass::arch::ClusterBarrier::init(&smem.unit_full[stage][unit], kUnitArrivals);
      }
    }
    // cp.async: 128 arrivals; sparse (TMA): one arrival and the bytes.
    cutlass::arch::ClusterBarrier::init(&smem.q_full, Traits::kSparse ? 1 : Traits::kWarpgroupThreads);
    for (uint64_t& posted : smem.probs_posted) cutlass::arch::ClusterBarrier::init(&posted, Traits::kWarpgroupThreads);
    if (Traits::kE4m3Scores) {
      for (int stage = 0; stage < Traits::kStages; ++stage) {
        for (uint64_t& read : smem.v_unit_read[stage]) {
          cutlass::arch::ClusterBarrier::init(&read, Traits::kWarpgroupThreads);
        }
        for (uint64_t& widened : smem.v_half_widened[stage]) {
          cutlass::arch::ClusterBarrier::init(&widened, Traits::kWarpgroupThreads);
        }
      }
    }
    if (Traits::kSparse) {
      for (int stage = 0; stage < Traits::kStages; ++stage) {
        for (uint64_t& raw : smem.raw_full[stage]) cutlass::arch::ClusterBarrier::init(&raw, Traits::kWarpgroupThreads);
        for (uint64_t& part : smem.part_free[stage]) {
          cutlass::arch::ClusterBarrier::init(&part, Traits::kWarpgroupThreads);
        }
      }
    }
    cutlass::arch::fence_barrier_init();
    // The cache's tensor map lives in the kernel parameters (not written by any kernel): warm its cache line.
    if (!Traits::kSparse) cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(params.k_cache_tma));
    if (Traits::kSparse) cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(params.q_tma));
    if (params.out_by_tma) cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(params.out_tma));
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
  // A sparse page is dequantised to 2^-E times its values, E per page, taken back in the mainloop (sparse_gather.h).
  const SplitKvScales scales{params.scale_log2 * descale_q * descale_k, Traits::kSparse ? 1.f : descale_k};

  const int m_tile = blockIdx.x, kv_head = blockIdx.y;
  const int warpgroup = threadIdx.x / Traits::kWarpgroupThreads;
  // Sparse: each gather thread copies one row of every page (sparse_gather.h); the range looks up its token. The
  // computing warpgroups' range looks up none (copy row -1).
  const bool gathers = Traits::kSparse && warpgroup == static_cast<int>(WarpgroupRole::kGather);
  const int copy_row = gathers ? static_cast<int>(threadIdx.x % Traits::kWarpgroupThreads / 2) : -1;
  const PieceRange<Traits::kSparse> range(params, blockIdx.z, m_tile, copy_row);
  if (range.last_seq() < range.first_seq()) return;    // an SM part with no work (no thread waits on a barrier)
  __syncthreads();
  probe_time(params, kProbeRoleStart);

  if constexpr (Traits::kSparse) {
    if (gathers) {
      cutlass::arch::warpgroup_reg_dealloc<Traits::kHelperRegisters>();
      SparseGather<Traits>::run(params, smem, range);
      return;
    }
  }
  if constexpr (Traits::kE4m3Scores) {
    if (warpgroup == static_cast<int>(WarpgroupRole::kWiden)) {
      cutlass::arch::warpgroup_reg_dealloc<Traits::kHelperRegisters>();
      Fp8Widening<Traits>::widen_pages(smem, range);
      probe_time(params, kProbeExit);
      return;
    }
  }
  if (warpgroup == static_cast<int>(WarpgroupRole::kPageA)) {
    if constexpr (Traits::kHelperWarpgroups) cutlass::arch::warpgroup_reg_alloc<Traits::kPageARegisters>();
    Mainloop::template run<WarpgroupRole::kPageA>(params, scales, smem, range, kv_head, m_tile);
  } else {
    if constexpr (Traits::kHelperWarpgroups) cutlass::arch::warpgroup_reg_alloc<Traits::kPageBRegisters>();
    Mainloop::template run<WarpgroupRole::kPageB>(params, scales, smem, range, kv_head, m_tile);
  }
  probe_time(params, kProbeExit);
}

template <class Element, class CacheElement = Element, bool kE4m3Scores = false>
void launch_splitkv(const DecodeParams& binding_params, cudaStream_t stream) {
  using Traits = SplitKvTraits<Element, CacheElement, kE4m3Scores>;
  DecodeParams params = binding_params;
  if constexpr (!Traits::kSparse) {    // sparse tokens are gathered by cp.async, not TMA; its Q tiles are TMA's
    encode_kv_cache_tma(params, Traits::kFp8Cache                             ? CacheDtype::kE4m3
                                : std::is_same_v<Element, cutlass::half_t> ? CacheDtype::kFp16
                                                                             : CacheDtype::kBf16);
    encode_out_tma(params, Traits::kFp8Cache);
  } else {
    encode_q_tma(params);
    params.out_by_tma = false;    // the sparse kernel stores from registers (epilogue.h)
  }
  auto kernel = mla_splitkv_kernel<Traits>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  // Programmatic dependent launch for one-tile grids (<= 64 query rows per KV head): the CTAs may be scheduled
  // before the kernel ahead of this one (the previous call's combine kernel in a decoding loop) has finished, set
  // up their barriers and wait in griddepcontrol.wait (H100, with the prologue's page-a-first order: one-tile
  // table rows -0.45 %, small-batch rows -1 %; docs/PERF.md "Split kernel"). Not for several tiles: there it cost up to
  // +21 % (b = 1024, L = 512, h_q 128), probably because the tiles of one SM part read the same pages and find
  // them in L2 only if they start together, and CTAs scheduled one by one as the combine's CTAs leave do not.
  // Sparse: the two row tiles of an SM part (h_q 128: the two 64-head halves, which gather the same tokens) are
  // launched as a cluster of two, co-scheduled on one GPC; nothing else in the kernel changes (no cluster feature
  // is used). H100, same process, order rotated: b = 1, h_q 128 rows 20.3 / 20.8 vs 21.6 / 22.0 us (s_q 1) and
  // 23.1 / 23.5 vs 24.6 / 25.0 (s_q 2); b = 16 and b = 128 rows unchanged, the dense rows too (so they stay plain).
  // Only where the device keeps every pair of the plan's grid resident at once (the plan fills the SMs with one
  // wave of CTAs; SPEC "Kernels"): else the same grid without clusters.
  const dim3 grid(params.num_row_tiles, params.num_heads_k, params.num_sm_parts), block(Traits::kThreads);
  int cluster_x = 1;
  if (Traits::kSparse && params.num_row_tiles % 2 == 0) {
    const int pairs = static_cast<int>(grid.x * grid.y * grid.z / 2);
    if (max_active_pairs(kernel, grid, block, Traits::kSmemBytes) >= pairs) cluster_x = 2;
  }
  launch_kernel(kernel, grid, block, Traits::kSmemBytes, stream, /*programmatic=*/params.num_row_tiles == 1, cluster_x,
                params);
}

FLASH_MLA_NAMESPACE_END  // flash_mla
