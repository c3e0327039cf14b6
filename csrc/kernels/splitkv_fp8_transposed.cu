// The transposed FP8 split-KV kernel (an e4m3 cache, an e4m3 or a 16-bit q, at most 32 packed query rows per KV
// head): the kernel shell and its launcher. The parts:
//   transposed_traits.h     tile, layouts, WGMMA shapes, shared memory, named barriers
//   transposed_mainloop.h   the producer warp's copies, a 16-bit q's quantisation and a computing warpgroup's page
//                           (schedule at its top)
//   transposed_epilogue.h   the two warpgroups' merge and the writes
//   tile_scheduler.h        which pieces a CTA owns (the same plan as the split-KV kernel)
// Grid: (1, KV head, SM part), one CTA per SM; 384 threads = two computing warpgroups and a producer warpgroup
// (one warp of it issues the copies).
// S^T of a 16-bit q's three Q terms is one m64n48k32 WGMMA, a shape CUTLASS declares among its extended ones
// (transposed_traits.h checks that the atom is that wide); before any CuTe header.
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/grid_dependency_control.h>
#include <cutlass/arch/reg_reconfig.h>

#include "kv_cache_tma.h"
#include "launch.h"
#include "params.h"
#include "result_rows.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "transposed_epilogue.h"
#include "transposed_mainloop.h"
#include "transposed_traits.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

template <int kRows, bool kWideQ>
__global__ void __launch_bounds__(TransposedTraits<kRows, kWideQ>::kThreads, 1)
    mla_splitkv_fp8_transposed_kernel(const __grid_constant__ DecodeParams params) {
  using Traits = TransposedTraits<kRows, kWideQ>;
  using Mainloop = TransposedMainloop<Traits>;
  using Epilogue = TransposedEpilogue<Traits>;
  using Barrier = cutlass::arch::ClusterBarrier;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  // The Q slots zeroed once: a tile's rows past rows_per_kv are never written, and S^T reads them.
  for (int i = threadIdx.x; i < int(sizeof(smem.q)) / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(smem.q)[i] = make_uint4(0, 0, 0, 0);
  }
  if (threadIdx.x == 0) {
    for (int b = 0; b < Traits::kRing; ++b) {
      Barrier::init(&smem.page_full[b], 1);                                   // the producer's arrival + bytes
      Barrier::init(&smem.page_empty[b], Traits::kWarpgroupThreads);          // the consuming warpgroup
    }
    for (int s = 0; s < (kWideQ ? 0 : Traits::kQSlots); ++s) {    // (a 16-bit q: quantise_q's named barriers)
      Barrier::init(&smem.q_full[s], Traits::kQThreads);                      // the producer warp filling it
      Barrier::init(&smem.q_empty[s], Traits::kComputeWarpgroups * Traits::kWarpgroupThreads);
    }
    for (uint64_t* merge : {&smem.stats_posted, &smem.exchange_posted, &smem.exchange_read}) {
      Barrier::init(merge, Traits::kComputeWarpgroups * Traits::kWarpgroupThreads);
    }
    cutlass::arch::fence_barrier_init();
    cute::prefetch_tma_descriptor(reinterpret_cast<const cute::TmaDescriptor*>(params.k_cache_tma));
  }
  cutlass::arch::fence_view_async_shared();    // the zeros (generic proxy) before the WGMMAs read them

  // Launched as a programmatic dependent of the kernel before it (launcher): everything above touched only this
  // CTA's shared memory; every input may be that kernel's output.
  cutlass::arch::wait_on_dependent_grids();
  cutlass::arch::launch_dependent_grids();
  const float descale_k = params.descale_k != nullptr ? *params.descale_k : 1.f;
  const float descale_q = params.descale_q != nullptr ? *params.descale_q : 1.f;
  const SplitKvScales scales{params.scale_log2 * descale_q * descale_k, descale_k};

  const int kv_head = blockIdx.y;
  const PieceRange<> range(params, blockIdx.z);
  if (range.last_seq() < range.first_seq()) return;    // an SM part with no work (no thread waits on a barrier)
  if (threadIdx.x < params.rows_per_kv && threadIdx.x < kRows) {    // the epilogue's row table
    const ResultRow row(params, kv_head, threadIdx.x);
    smem.row_out[threadIdx.x] = row.out_offset_in_seq(params);
    smem.row_lse[threadIdx.x] = row.lse_offset_in_seq(params);
    smem.row_head[threadIdx.x] = row.head;
  }
  __syncthreads();

  const int role = threadIdx.x / Traits::kWarpgroupThreads;
  if (role == static_cast<int>(TransposedRole::kProducer)) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegisters>();
    if (threadIdx.x % Traits::kWarpgroupThreads < 32) Mainloop::produce(params, smem, range, kv_head);
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kComputeRegisters>();

  // ---- a computing warpgroup: its pages of each piece, then the piece's epilogue ---------------------------------
  using namespace cute;
  const int warpgroup = role;
  typename Traits::TiledMmaO mma_o;
  Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kHeadDimV>, Int<Traits::kRows>>{});       // (MMA, 8, 1)
  int stream_page = 0, q_count = 0, merges = 0;
#pragma unroll 1
  for (int seq = range.first_seq(); seq <= range.last_seq(); ++seq) {
    const Piece piece = range.piece(seq);
    const int pages = piece.num_pages();
    const int q_slot = q_count % Traits::kQSlots;
    if (pages > 0) {
      if constexpr (kWideQ) {
        // before O^T and the statistics are set (their registers free for the tile's loads)
        Mainloop::quantise_q(params, smem, piece.seq, kv_head);
      } else {
        Barrier::wait(&smem.q_full[q_slot], (q_count / Traits::kQSlots) & 1);
        cutlass::arch::fence_view_async_shared();    // cp.async's writes (generic proxy) before the WGMMAs read them
      }
    }
    ColumnStats<Traits::kSlots> stats;
    CUTE_UNROLL
    for (int c = 0; c < Traits::kSlots; ++c) stats.ref[c] = -INFINITY, stats.sum[c] = 0.f;
    clear(tOrO);
    if (pages > 0) {
#pragma unroll 1
      for (int page = (stream_page + warpgroup) % 2; page < pages; page += 2) {
        const int n = stream_page + page, buffer = n % Traits::kRing;
        // An odd ring gives a buffer's pages to the warpgroups in turn (page n - kRing was the other's), so this
        // warpgroup's wait skips a phase of page_full[buffer]: a parity wait is only sound once page n - kRing has
        // landed (else that phase's parity still reads "complete" from page n - 2 kRing, and this warpgroup would
        // read the buffer early and arrive on page_empty out of turn). Its release says so, and page_empty is then
        // at most one phase behind this wait (page n's release is this warpgroup's own).
        if constexpr (Traits::kRing % 2 == 1) {
          if (n >= Traits::kRing) Barrier::wait(&smem.page_empty[buffer], ((n / Traits::kRing) & 1) ^ 1);
        }
        Barrier::wait(&smem.page_full[buffer], (n / Traits::kRing) & 1);
        Mainloop::page(params, scales, smem, warpgroup, buffer, q_slot, piece,
                       piece.begin + page * kPageBlockSize, tOrO, stats);
        Barrier::arrive(&smem.page_empty[buffer]);
      }
      if constexpr (!kWideQ) Barrier::arrive(&smem.q_empty[q_slot]);
      ++q_count;
      stream_page += pages;
    }
    Epilogue::write(params, scales, smem, piece, kv_head, warpgroup, tOrO, stats, merges);
  }
}

template <int kRows, bool kWideQ = false>
void launch_transposed(DecodeParams& params, cudaStream_t stream) {
  using Traits = TransposedTraits<kRows, kWideQ>;
  auto kernel = mla_splitkv_fp8_transposed_kernel<kRows, kWideQ>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  // One row tile per KV head: launched as a programmatic dependent, as the split-KV kernel's one-tile grids are
  // (splitkv_kernel.h).
  const dim3 grid(1, params.num_heads_k, params.num_sm_parts), block(Traits::kThreads);
  launch_kernel(kernel, grid, block, Traits::kSmemBytes, stream, /*programmatic=*/true, /*cluster_x=*/1, params);
}

// The tile's N: 16 rows where they fit (O^T 64 registers a thread, a ring of four pages), else 32.
void launch_mla_splitkv_fp8_transposed(const DecodeParams& binding_params, void* stream) {
  DecodeParams params = binding_params;
  encode_kv_cache_tma(params, CacheDtype::kE4m3);
  params.out_by_tma = false;
  if (params.q_format != kQFp8) {    // a bf16 or fp16 q: its Q tiles as three e4m3 terms
    if (params.rows_per_kv <= 16) {
      launch_transposed<16, true>(params, static_cast<cudaStream_t>(stream));
    } else {
      launch_transposed<32, true>(params, static_cast<cudaStream_t>(stream));
    }
  } else if (params.rows_per_kv <= 16) {
    launch_transposed<16>(params, static_cast<cudaStream_t>(stream));
  } else {
    launch_transposed<32>(params, static_cast<cudaStream_t>(stream));
  }
}

FLASH_MLA_NAMESPACE_END  // flash_mla
