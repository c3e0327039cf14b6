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

#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>

#include "kv_cache_tma.h"
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

  // The combine kernel (launched as a programmatic dependent) may start its prologue now; it waits for this
  // grid's results before reading them.
  cutlass::arch::launch_dependent_grids();

  const int m_tile = blockIdx.x, kv_head = blockIdx.y;
  const PieceRange range(params, blockIdx.z);
  if (range.last_seq() < range.first_seq()) return;    // an SM part with no work

  if (threadIdx.x == 0) {
    for (int stage = 0; stage < Traits::kStages; ++stage) {
      for (int seg = 0; seg < Traits::kSegments; ++seg) {
        cutlass::arch::ClusterBarrier::init(&smem.segment_full[stage][seg], 1);    // TMA: one arrive + bytes
      }
    }
    cutlass::arch::ClusterBarrier::init(&smem.q_full, Traits::kWarpgroupThreads);    // cp.async: 128 arrivals
    for (uint64_t& posted : smem.probs_posted) cutlass::arch::ClusterBarrier::init(&posted, Traits::kWarpgroupThreads);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (threadIdx.x / Traits::kWarpgroupThreads == static_cast<int>(WarpgroupRole::kPageA)) {
    Mainloop::template run<WarpgroupRole::kPageA>(params, smem, range, kv_head, m_tile);
  } else {
    Mainloop::template run<WarpgroupRole::kPageB>(params, smem, range, kv_head, m_tile);
  }
}

template <class Element>
void launch_splitkv(const DecodeParams& binding_params, cudaStream_t stream) {
  using Traits = SplitKvTraits<Element>;
  DecodeParams params = binding_params;
  encode_kv_cache_tma(params, std::is_same_v<Element, cutlass::half_t> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                       : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16);
  auto kernel = mla_splitkv_kernel<Traits>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  const dim3 grid(params.num_row_tiles, params.num_heads_k, params.num_sm_parts);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
}

}  // namespace flash_mla
