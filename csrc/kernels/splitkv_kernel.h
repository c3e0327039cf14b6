// Split-KV MLA decoding kernel for Hopper (sm_90a): SPEC.md "Kernels" (2).
//
// Grid: (query-row tile, KV head, SM part). Each CTA walks the sequence pieces its SM part was given by the
// scheduler and, for each piece, runs attention of one 64-row query tile over the piece's 64-token pages:
//
//   for each page:                       warpgroup w in {0, 1}
//     S_w  = Q K_w^T                     keys [32w, 32w + 32) of the page          (WGMMA 64x32x576)
//     m    = max(m, rowmax(S_0, S_1))    exchanged through shared memory
//     P_w  = exp2(S_w * scale_log2 - m)  written to shared memory as bf16/fp16
//     O_w  = O_w * exp2(m_old - m) + P V[:, 256w : 256w + 256]                      (WGMMA 64x256x64)
//
// and the next page's copy (cp.async through the block table) runs while the current one is computed.
// Unsplit sequences write out/lse directly; pieces of split sequences write fp32 partials to their workspace
// slot for the combine kernel.
#pragma once

#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "named_barriers.h"
#include "params.h"
#include "splitkv_traits.h"
#include "utils.h"

namespace flash_mla {

// One unit of a CTA's work: keys [begin, end) of sequence `seq` and where its result goes.
struct Piece {
  int seq;
  int begin, end;     // token range; begin is a multiple of 64
  int length;         // the sequence's full length (the causal rule counts from its end)
  bool split;         // true: fp32 partial to workspace slot `slot`; false: final result to out/lse
  int slot;
};

template <class Traits>
struct SplitKvKernel {
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kThreads = Traits::kThreads;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kVec = Traits::kVecElems;
  static constexpr float kLn2 = 0.6931471805599453f;

  // ===================================== copies (global -> shared) ===========================================

  // Both tiles (64 rows x 576) are copied in 16-byte chunks with one fixed thread mapping: thread t owns chunk
  // t % 8 of each 128-byte row segment, rows t / 8 and t / 8 + 32, all 9 segments. Only the first address is
  // computed through the swizzled layout: moving by 32 rows or one 64-column segment adds a constant that
  // leaves the swizzle bits alone, so the 18 copies need two base addresses, not 18.
  static constexpr int kCopyRowStep = kThreads / 8;                 // 32 rows
  static constexpr int kCopyRowIters = kBlockM / kCopyRowStep;      // 2
  static constexpr int kSegment = 128 / sizeof(Element);            // 64 columns: one swizzle atom row
  static constexpr int kSegments = kHeadDimQK / kSegment;           // 9
  static_assert(kBlockM == kBlockN, "Q tiles and K pages share the copy mapping");
  static_assert(kSegment == 8 * kVec, "8 chunks of 16 bytes per swizzle atom row");

  template <class SmemTensor>
  __device__ static Element* copy_dst(SmemTensor& sX, int h, int d) {
    using namespace cute;
    // sX(r + 32h, c + 64d) == sX(r, c) + 32h * 64 + d * 64 * 64: both steps are whole 8 x 64 swizzle atoms.
    static_assert(decltype(cosize(typename Traits::SmemLayoutK{}))::value == kBlockN * kHeadDimQK, "dense tile");
    const int r = threadIdx.x / 8, c = threadIdx.x % 8 * kVec;
    return &sX(r, c) + h * kCopyRowStep * kSegment + d * kBlockN * kSegment;
  }

  // Q tile: rows [64 * m_tile, 64 * m_tile + 64) of the KV head's packed rows; rows past rows_per_kv are zero.
  __device__ static void load_q_tile(const DecodeParams& p, SharedStorage& smem, int seq, int kv_head, int m_tile) {
    using namespace cute;
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});   // (BLK_M, D_QK)
    const Element* q = static_cast<const Element*>(p.q);
    CUTE_UNROLL
    for (int h = 0; h < kCopyRowIters; ++h) {
      const int row = m_tile * kBlockM + threadIdx.x / 8 + h * kCopyRowStep;
      const bool valid = row < p.rows_per_kv;
      const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
      const Element* src = valid ? q + seq * p.q_batch_stride + token * p.q_token_stride + head * p.q_head_stride +
                                       threadIdx.x % 8 * kVec
                                 : q;
      CUTE_UNROLL
      for (int d = 0; d < kSegments; ++d) cp_async_16_zfill(copy_dst(sQ, h, d), src + d * kSegment, valid);
    }
  }

  // One page: tokens [page_start, page_start + 64) of the sequence; tokens at or past `end` are zero-filled and
  // never read (the page's block-table entry is read only because page_start < end).
  __device__ static void load_page(const DecodeParams& p, Element* smem_page, int seq, int kv_head, int page_start,
                                   int end) {
    using namespace cute;
    Tensor sK = make_tensor(make_smem_ptr(smem_page), typename Traits::SmemLayoutK{});        // (BLK_N, D_QK)
    const Element* cache = static_cast<const Element*>(p.k_cache);
    const int64_t block = p.block_table[seq * p.block_table_stride + page_start / kPageBlockSize];
    CUTE_UNROLL
    for (int h = 0; h < kCopyRowIters; ++h) {
      const int r = threadIdx.x / 8 + h * kCopyRowStep;
      const bool valid = page_start + r < end;
      const Element* src = valid ? cache + block * p.k_block_stride + r * p.k_token_stride + kv_head * p.k_head_stride +
                                       threadIdx.x % 8 * kVec
                                 : cache;
      CUTE_UNROLL
      for (int d = 0; d < kSegments; ++d) cp_async_16_zfill(copy_dst(sK, h, d), src + d * kSegment, valid);
    }
  }

  // ========================================== WGMMA helper ==================================================

  // C (+)= A B over all K blocks of the operands, issued by the calling warpgroup, waited for before return.
  template <class TiledMma, class FragA, class FragB, class FragC>
  __device__ static void warpgroup_gemm(TiledMma& mma, const FragA& tCrA, const FragB& tCrB, FragC& tCrC,
                                        bool zero_init) {
    using namespace cute;
    warpgroup_fence_operand(tCrC);
    warpgroup_arrive();
    mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      gemm(mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
      mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tCrC);
  }

  // ============================================ one piece ===================================================

  __device__ static void attend_piece(const DecodeParams& p, SharedStorage& smem, const Piece& piece, int kv_head,
                                      int m_tile) {
    using namespace cute;
    using KeysPerWg = Int<Traits::kKeysPerWarpgroup>;
    using ColsPerWg = Int<Traits::kColsPerWarpgroup>;
    const int warpgroup = threadIdx.x / 128;
    const int wg_thread = threadIdx.x % 128;
    const bool quad_leader = threadIdx.x % 4 == 0;

    if (piece.end <= piece.begin) {   // L = 0: nothing to read, not even Q or the block table
      write_empty(p, piece, kv_head, m_tile, warpgroup, wg_thread);
      return;
    }

    typename Traits::TiledMmaS mma_s;
    typename Traits::TiledMmaO mma_o;
    auto thr_mma_s = mma_s.get_slice(wg_thread);
    auto thr_mma_o = mma_o.get_slice(wg_thread);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});   // (BLK_M, D_QK)
    Tensor sP = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutP{});   // (BLK_M, BLK_N)
    Tensor tSrQ = thr_mma_s.partition_fragment_A(sQ);                                        // (MMA, MMA_M, MMA_K)
    Tensor tOrP = thr_mma_o.partition_fragment_A(sP);                                        // (MMA, MMA_M, MMA_K)
    // This warpgroup's 32 columns of P, partitioned like its S accumulator.
    Tensor tSsP = thr_mma_s.partition_C(local_tile(sP, Shape<Int<kBlockM>, KeysPerWg>{},
                                                   make_coord(0, warpgroup)));               // (MMA, MMA_M, MMA_N)
    // Coordinates (row, key within the warpgroup's half) of each S element this thread holds.
    Tensor tScS = as_rows_cols(thr_mma_s.partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, KeysPerWg>{})));                            // (ROW, COL)
    Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<kBlockM>, ColsPerWg>{});            // (MMA, MMA_M, MMA_N)
    Tensor O = as_rows_cols(tOrO);                                                           // (ROW, COL)
    clear(tOrO);

    // Per-row state for the two rows a thread owns. Raw-score maxima; the scale is applied inside exp2.
    constexpr int kRows = decltype(size<0>(tScS))::value;
    static_assert(kRows == 2, "an SM90 accumulator thread owns two rows");
    float row_max[kRows], row_sum[kRows];
    int last_visible[kRows];          // the last key index each row may see
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
      const int token = (m_tile * kBlockM + get<0>(tScS(r, 0))) / p.heads_per_kv;
      last_visible[r] = p.causal ? piece.length - p.seqlen_q + token : piece.length - 1;
    }

    // ---- prologue: Q tile and the first page --------------------------------------------------------------
    const int num_pages = (piece.end - piece.begin + kBlockN - 1) / kBlockN;
    load_q_tile(p, smem, piece.seq, kv_head, m_tile);
    load_page(p, smem.k[0].data(), piece.seq, kv_head, piece.begin, piece.end);
    cp_async_commit();

    // ---- main loop over pages -----------------------------------------------------------------------------
    for (int i = 0; i < num_pages; ++i) {
      const int stage = i % Traits::kStages;
      const int page_start = piece.begin + i * kBlockN;
      cp_async_wait_all();
      cutlass::arch::fence_view_async_shared();   // cp.async wrote through the generic proxy; WGMMA reads async
      barrier_sync<kThreads>(SplitKvBarrier::kPageLanded);

      // Both warpgroups finished O += P V of page i - 1 before arriving here: its stage takes page i + 1 now,
      // so the copy overlaps all of page i's math.
      if (i + 1 < num_pages) {
        load_page(p, smem.k[stage ^ 1].data(), piece.seq, kv_head, page_start + kBlockN, piece.end);
      }
      cp_async_commit();

      // S = Q K^T over this warpgroup's 32 keys of the page
      Tensor sK = make_tensor(make_smem_ptr(smem.k[stage].data()), typename Traits::SmemLayoutK{});   // (BLK_N, D_QK)
      Tensor tSrK = thr_mma_s.partition_fragment_B(local_tile(sK, Shape<KeysPerWg, Int<kHeadDimQK>>{},
                                                              make_coord(warpgroup, 0)));    // (MMA, MMA_N, MMA_K)
      Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, KeysPerWg>{});           // (MMA, MMA_M, MMA_N)
      warpgroup_gemm(mma_s, tSrQ, tSrK, tSrS, /*zero_init=*/true);
      Tensor S = as_rows_cols(tSrS);                                                         // (ROW, COL)

      // Mask keys past the piece (past L) and, when causal, past each row's last visible key.
      const int key0 = page_start + warpgroup * Traits::kKeysPerWarpgroup;
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float m = -INFINITY;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
          const int key = key0 + get<1>(tScS(r, c));
          const bool visible = key < piece.end && key <= last_visible[r];
          S(r, c) = visible ? S(r, c) : -INFINITY;
          m = fmaxf(m, S(r, c));
        }
        m = quad_max(m);
        if (quad_leader) smem.row_max[warpgroup][get<0>(tScS(r, 0))] = m;
      }
      barrier_sync<kThreads>(SplitKvBarrier::kRowMaxExchanged);

      // Online softmax: P = exp2(S * scale - m), rescale O and the row sums by exp2(m_old - m).
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int row = get<0>(tScS(r, 0));
        const float new_max = fmaxf(row_max[r], fmaxf(smem.row_max[0][row], smem.row_max[1][row]));
        const float base = new_max == -INFINITY ? 0.f : new_max * p.scale_log2;   // no key yet: avoid inf - inf
        const float rescale = exp2f(row_max[r] * p.scale_log2 - base);
        row_max[r] = new_max;
        float sum = 0.f;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
          S(r, c) = exp2f(S(r, c) * p.scale_log2 - base);
          sum += S(r, c);
        }
        row_sum[r] = row_sum[r] * rescale + sum;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(O); ++c) O(r, c) *= rescale;
      }
      CUTE_UNROLL
      for (int e = 0; e < size(tSrS); ++e) tSsP(e) = static_cast<Element>(tSrS(e));
      cutlass::arch::fence_view_async_shared();   // P was written by ordinary stores; WGMMA reads it next
      barrier_sync<kThreads>(SplitKvBarrier::kProbsWritten);

      // O += P V over this warpgroup's 256 output columns
      Tensor sVt = make_tensor(make_smem_ptr(smem.k[stage].data()), typename Traits::SmemLayoutVt{});  // (D_V, BLK_N)
      Tensor tOrV = thr_mma_o.partition_fragment_B(local_tile(sVt, Shape<ColsPerWg, Int<kBlockN>>{},
                                                              make_coord(warpgroup, 0)));    // (MMA, MMA_N, MMA_K)
      warpgroup_gemm(mma_o, tOrP, tOrV, tOrO, /*zero_init=*/false);
    }

    // ---- epilogue: combine the warpgroups' row sums, normalise, write ------------------------------------
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float s = quad_sum(row_sum[r]);
      if (quad_leader) smem.row_sum[warpgroup][get<0>(tScS(r, 0))] = s;
    }
    barrier_sync<kThreads>(SplitKvBarrier::kRowSumExchanged);

    Tensor tOcO = as_rows_cols(thr_mma_o.partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, ColsPerWg>{})));                            // (ROW, COL)
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int row = get<0>(tScS(r, 0));
      const float total = smem.row_sum[0][row] + smem.row_sum[1][row];
      const bool seen = total > 0.f;     // false: the row saw no key of this piece
      const float inv = seen ? 1.f / total : 0.f;
      const float lse = seen ? (row_max[r] * p.scale_log2 + log2f(total)) * kLn2 : -INFINITY;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c) O(r, c) *= inv;
      write_row(p, piece, kv_head, m_tile * kBlockM + row, warpgroup, lse, quad_leader,
                [&](auto&& store) {
                  CUTE_UNROLL
                  for (int c = 0; c < size<1>(O); c += 2) store(get<1>(tOcO(r, c)), O(r, c), O(r, c + 1));
                });
    }
  }

  // ========================================== epilogue stores =================================================

  // Stores one packed row: `for_each_pair(store)` calls store(col, x0, x1) for adjacent columns col, col + 1 of
  // this warpgroup's 256; the quad leader of warpgroup 0 also stores the row's lse.
  template <class ForEachPair>
  __device__ static void write_row(const DecodeParams& p, const Piece& piece, int kv_head, int row, int warpgroup,
                                   float lse, bool quad_leader, ForEachPair&& for_each_pair) {
    if (row >= p.rows_per_kv) return;       // padding row of the last tile
    const int col0 = warpgroup * Traits::kColsPerWarpgroup;
    if (!piece.split) {
      const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
      Element* dst = static_cast<Element*>(p.out) +
                     ((int64_t(piece.seq) * p.seqlen_q + token) * p.num_heads_q + head) * kHeadDimV + col0;
      for_each_pair([&](int col, float x0, float x1) {
        struct alignas(4) Pair { Element v[2]; };
        *reinterpret_cast<Pair*>(dst + col) = Pair{{static_cast<Element>(x0), static_cast<Element>(x1)}};
      });
      if (warpgroup == 0 && quad_leader) p.lse[(int64_t(piece.seq) * p.num_heads_q + head) * p.seqlen_q + token] = lse;
    } else {
      const int64_t partial_row = (int64_t(piece.slot) * p.num_heads_k + kv_head) * p.rows_per_kv + row;
      float* dst = p.o_partial + partial_row * kHeadDimV + col0;
      for_each_pair([&](int col, float x0, float x1) { *reinterpret_cast<float2*>(dst + col) = make_float2(x0, x1); });
      if (warpgroup == 0 && quad_leader) p.lse_partial[partial_row] = lse;
    }
  }

  // A piece with no keys: every row of the tile gets out 0 and lse -inf. Touches no shared memory.
  __device__ static void write_empty(const DecodeParams& p, const Piece& piece, int kv_head, int m_tile,
                                     int warpgroup, int wg_thread) {
    // 128 threads of a warpgroup: thread t writes row t / 2, columns [128 * (t % 2), + 128) of the half.
    const int row = m_tile * kBlockM + wg_thread / 2;
    const int first = (wg_thread % 2) * (Traits::kColsPerWarpgroup / 2);
    write_row(p, piece, kv_head, row, warpgroup, -INFINITY, wg_thread % 2 == 0, [&](auto&& store) {
      for (int c = 0; c < Traits::kColsPerWarpgroup / 2; c += 2) store(first + c, 0.f, 0.f);
    });
  }

  // ============================================ CTA entry ====================================================

  __device__ static void run(const DecodeParams& p, char* smem_raw) {
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    const int m_tile = blockIdx.x, kv_head = blockIdx.y, part = blockIdx.z;
    const int32_t* meta = p.metadata + part * kMetadataWidth;
    const int begin_seq = meta[kBeginSeq], begin_token = meta[kBeginToken];
    const int end_seq = meta[kEndSeq], end_token = meta[kEndToken], begin_split = meta[kBeginSplit];
    // begin_seq == batch marks a part with no work; the other clamps only guard against foreign metadata.
    if (begin_seq < 0 || begin_seq >= p.batch) return;
    const int last_seq = min(end_seq, p.batch - 1);
    for (int seq = begin_seq; seq <= last_seq; ++seq) {
      Piece piece;
      piece.seq = seq;
      piece.length = p.seqlens[seq];
      piece.begin = seq == begin_seq ? begin_token : 0;
      piece.end = seq == end_seq ? min(end_token, piece.length) : piece.length;
      const int first_slot = p.num_splits[seq];
      piece.split = p.num_splits[seq + 1] - first_slot > 1;
      piece.slot = first_slot + (seq == begin_seq ? begin_split : 0);
      attend_piece(p, smem, piece, kv_head, m_tile);
    }
  }
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1) mla_splitkv_kernel(const __grid_constant__ DecodeParams params) {
  extern __shared__ __align__(1024) char smem[];
  SplitKvKernel<Traits>::run(params, smem);
}

template <class Element>
void launch_splitkv(const DecodeParams& params, cudaStream_t stream) {
  using Traits = SplitKvTraits<Element>;
  auto kernel = mla_splitkv_kernel<Traits>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  const dim3 grid(params.num_row_tiles, params.num_heads_k, params.num_sm_parts);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
}

}  // namespace flash_mla
