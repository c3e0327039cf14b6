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
#include <type_traits>
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

template <class Traits, int kPipeline>
struct SplitKvKernel {
  // kRefillBehindS: page i + 1's copies are issued behind S(i)'s WGMMAs, and the next piece's Q tile and first
  // page are prefetched during a piece's last page. kSOwner: one warpgroup (alternating by page) computes all of
  // S = Q K^T for the page (WGMMA N = 64: Q is read from shared memory once per page instead of twice, and no
  // row-maximum exchange is needed); it publishes the new row maxima with P, and the other warpgroup rescales.
  static constexpr bool kRefillBehindS = kPipeline != kPipelineRefillFirst;
  static constexpr bool kSOwner = kPipeline == kPipelineSOwner;
  using Element = typename Traits::Element;
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kThreads = Traits::kThreads;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kVec = Traits::kVecElems;
  static constexpr float kLn2 = 0.6931471805599453f;

  // ===================================== copies (global -> shared) ===========================================

  // Tiles are 64 rows x 576 columns, copied in 16-byte chunks: 8 chunks fill one 128-byte row segment of a
  // swizzle atom (64 columns), and there are 9 segments. Only the first address of a thread is computed through
  // the swizzled layout: moving by a multiple of 8 rows or by whole 64-column segments adds a constant that
  // leaves the swizzle bits alone.
  static constexpr int kSegment = 128 / sizeof(Element);            // 64 columns: one swizzle atom row
  static constexpr int kSegments = kHeadDimQK / kSegment;           // 9
  static constexpr int kSegmentElems = kBlockN * kSegment;          // one 64 x 64 column block of a tile
  static_assert(kBlockM == kBlockN, "Q tiles and K pages share the swizzled layout");
  static_assert(kSegment == 8 * kVec, "8 chunks of 16 bytes per swizzle atom row");
  static_assert(decltype(cute::cosize(typename Traits::SmemLayoutK{}))::value == kBlockN * kHeadDimQK, "dense tile");

  // Address of chunk `chunk` of row `row` in segment 0; add row_step * kSegment per `row_step` rows (row_step a
  // multiple of 8) and kSegmentElems per segment.
  template <class SmemTensor>
  __device__ static Element* chunk_dst(SmemTensor& sX, int row, int chunk) {
    return &sX(row, chunk * kVec);
  }

  // Q tile (all 256 threads): rows [64 * m_tile, + 64) of the KV head's packed rows; rows past rows_per_kv are
  // zero. Thread t owns chunk t % 8 of rows t / 8 and t / 8 + 32, all 9 segments.
  __device__ static void load_q_tile(const DecodeParams& p, SharedStorage& smem, int seq, int kv_head, int m_tile) {
    using namespace cute;
    constexpr int kRowStep = kThreads / 8;                          // 32 rows
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});   // (BLK_M, D_QK)
    const Element* q = static_cast<const Element*>(p.q);
    Element* dst0 = chunk_dst(sQ, threadIdx.x / 8, threadIdx.x % 8);
    CUTE_UNROLL
    for (int h = 0; h < kBlockM / kRowStep; ++h) {
      const int row = m_tile * kBlockM + threadIdx.x / 8 + h * kRowStep;
      const bool valid = row < p.rows_per_kv;
      const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
      const Element* src = valid ? q + seq * p.q_batch_stride + token * p.q_token_stride + head * p.q_head_stride +
                                       threadIdx.x % 8 * kVec
                                 : q;
      CUTE_UNROLL
      for (int d = 0; d < kSegments; ++d) {
        cp_async_16_zfill(dst0 + h * kRowStep * kSegment + d * kSegmentElems, src + d * kSegment, valid);
      }
    }
  }

  // This warpgroup's share of one page: tokens [page_start, page_start + 64) of the sequence. A page is split
  // by column segment so that each warpgroup overwrites only bytes that nothing but itself still reads when it
  // refills a stage: warpgroup 0 copies V columns [0, 256) (segments 0-3, read by its own P V only), warpgroup 1
  // the other V columns and the RoPE columns (segments 4-8). S of the stage's previous page finished in both
  // warpgroups before the P exchange, so "my P V is done" is all a warpgroup must know before refilling.
  // Tokens at or past `end` are zero-filled and never read; `block` is the page's block-table entry (read by
  // the caller, early, so that its latency is not paid at issue time; read only when page_start < end).
  static constexpr int kSegmentsOfWg0 = Traits::kColsPerWarpgroup / kSegment;                // 4
  static constexpr int kSegmentsOfWg1 = kSegments - kSegmentsOfWg0;                          // 5
  __device__ static int64_t page_block(const DecodeParams& p, int seq, int page_start) {
    return p.block_table[seq * p.block_table_stride + page_start / kPageBlockSize];
  }
  __device__ static void load_page_share(const DecodeParams& p, Element* smem_page, int64_t block, int kv_head,
                                         int page_start, int end, int warpgroup, int wg_thread) {
    using namespace cute;
    constexpr int kRowStep = 128 / 8;                               // 16 rows per pass of a warpgroup
    Tensor sK = make_tensor(make_smem_ptr(smem_page), typename Traits::SmemLayoutK{});        // (BLK_N, D_QK)
    const Element* cache = static_cast<const Element*>(p.k_cache);
    const int first_segment = warpgroup * kSegmentsOfWg0;
    Element* dst0 = chunk_dst(sK, wg_thread / 8, wg_thread % 8) + first_segment * kSegmentElems;
    CUTE_UNROLL
    for (int h = 0; h < kBlockN / kRowStep; ++h) {
      const int r = wg_thread / 8 + h * kRowStep;
      const bool valid = page_start + r < end;
      const Element* src = valid ? cache + block * p.k_block_stride + r * p.k_token_stride + kv_head * p.k_head_stride +
                                       wg_thread % 8 * kVec + first_segment * kSegment
                                 : cache;
      CUTE_UNROLL
      for (int d = 0; d < kSegmentsOfWg1; ++d) {
        if (d < kSegmentsOfWg0 || warpgroup == 1) {
          cp_async_16_zfill(dst0 + h * kRowStep * kSegment + d * kSegmentElems, src + d * kSegment, valid);
        }
      }
    }
  }

  // ========================================== WGMMA helpers =================================================

  // Issue C (+)= A B over all K blocks of the operands as one commit group of the calling warpgroup. The
  // accumulator must not be touched until a warpgroup_wait that covers this group (then wgmma_done(C)).
  template <class TiledMma, class FragA, class FragB, class FragC>
  __device__ static void wgmma_issue(TiledMma& mma, const FragA& tCrA, const FragB& tCrB, FragC& tCrC,
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
    warpgroup_fence_operand(tCrC);
  }

  // Wait until at most `kPending` of this warpgroup's commit groups are still running.
  template <int kPending, class FragC>
  __device__ static void wgmma_wait(FragC& tCrC) {
    cute::warpgroup_wait<kPending>();
    cute::warpgroup_fence_operand(tCrC);
  }

  // ============================================ one piece ===================================================

  // Returns the stage where the next piece's first page goes (prefetched there when prefetch_next: its Q tile
  // and first page are issued during this piece's last page, so a new piece does not start with a full copy
  // latency; pieces are short when a part holds many sequences).
  __device__ static int attend_piece(const DecodeParams& p, SharedStorage& smem, const Piece& piece, int kv_head,
                                     int m_tile, int first_stage, bool prefetched, const Piece& next,
                                     bool prefetch_next) {
    using namespace cute;
    // Keys of one S WGMMA: the warpgroup's half of the page, or (kSOwner) the whole page.
    constexpr int kKeysPerS = kSOwner ? kBlockN : Traits::kKeysPerWarpgroup;
    using KeysPerS = Int<kKeysPerS>;
    using ColsPerWg = Int<Traits::kColsPerWarpgroup>;
    const int s_key_tile = kSOwner ? 0 : threadIdx.x / 128;    // which kKeysPerS-key slice of the page
    const int warpgroup = threadIdx.x / 128;
    const int wg_thread = threadIdx.x % 128;
    const bool quad_leader = threadIdx.x % 4 == 0;

    if (piece.end <= piece.begin) {   // L = 0: nothing to read, not even Q or the block table
      write_empty(p, piece, kv_head, m_tile, warpgroup, wg_thread);
      return first_stage;
    }

    std::conditional_t<kSOwner, typename Traits::TiledMmaSPage, typename Traits::TiledMmaS> mma_s;
    typename Traits::TiledMmaO mma_o;
    auto thr_mma_s = mma_s.get_slice(wg_thread);
    auto thr_mma_o = mma_o.get_slice(wg_thread);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});   // (BLK_M, D_QK)
    Tensor sP = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutP{});   // (BLK_M, BLK_N)
    Tensor tSrQ = thr_mma_s.partition_fragment_A(sQ);                                        // (MMA, MMA_M, MMA_K)
    Tensor tOrP = thr_mma_o.partition_fragment_A(sP);                                        // (MMA, MMA_M, MMA_K)
    // The columns of P this warpgroup writes, partitioned like its S accumulator.
    Tensor tSsP = thr_mma_s.partition_C(local_tile(sP, Shape<Int<kBlockM>, KeysPerS>{},
                                                   make_coord(0, s_key_tile)));              // (MMA, MMA_M, MMA_N)
    // Coordinates (row, key within the slice) of each S element this thread holds.
    Tensor tScS = as_rows_cols(thr_mma_s.partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, KeysPerS>{})));                             // (ROW, COL)
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
    if (!prefetched) {
      load_q_tile(p, smem, piece.seq, kv_head, m_tile);
      load_page_share(p, smem.k[first_stage].data(), page_block(p, piece.seq, piece.begin), kv_head, piece.begin,
                      piece.end, warpgroup, wg_thread);
      cp_async_commit();
    }

    // ---- main loop over pages -----------------------------------------------------------------------------
    // kRefillBehindS: the copies of page i + 1 are issued right after S(i)'s WGMMAs, so the ~20 cp.async per
    // thread run while the tensor cores work instead of delaying S(i). (P V (i - 1) was waited for in its own
    // iteration: with only two stages, page i + 1 cannot be requested before it is done, and a deferred
    // warpgroup_wait<1> makes ptxas serialize every WGMMA, C7514.)
    for (int i = 0; i < num_pages; ++i) {
      const int stage = (first_stage + i) % Traits::kStages;
      const int page_start = piece.begin + i * kBlockN;
      const bool has_next = i + 1 < num_pages;
      const bool last = !has_next;
      // The page that goes into the other stage: page i + 1, or on the last page the next piece's first page.
      const int64_t next_block = has_next ? page_block(p, piece.seq, page_start + kBlockN)
                                 : prefetch_next ? page_block(p, next.seq, next.begin) : 0;
      cp_async_wait_all();
      cutlass::arch::fence_view_async_shared();   // cp.async wrote through the generic proxy; WGMMA reads async
      // Page i landed (both warpgroups' copies), and both finished P V (i - 1): its stage takes page i + 1.
      barrier_sync<kThreads>(SplitKvBarrier::kPageLanded);

      auto refill_other_stage = [&] {
        if (has_next) {
          load_page_share(p, smem.k[stage ^ 1].data(), next_block, kv_head, page_start + kBlockN, piece.end,
                          warpgroup, wg_thread);
        } else if (prefetch_next) {
          load_page_share(p, smem.k[stage ^ 1].data(), next_block, kv_head, next.begin, next.end, warpgroup,
                          wg_thread);
        }
        cp_async_commit();
      };
      if constexpr (!kRefillBehindS) refill_other_stage();

      // kSOwner: warpgroup i % 2 owns page i's S and softmax; the other only rescales and does its P V half.
      const bool s_owner = !kSOwner || (i & 1) == warpgroup;

      // S = Q K^T over this warpgroup's keys of the page
      Tensor sK = make_tensor(make_smem_ptr(smem.k[stage].data()), typename Traits::SmemLayoutK{});   // (BLK_N, D_QK)
      Tensor tSrK = thr_mma_s.partition_fragment_B(local_tile(sK, Shape<KeysPerS, Int<kHeadDimQK>>{},
                                                              make_coord(s_key_tile, 0)));   // (MMA, MMA_N, MMA_K)
      Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<kBlockM>, KeysPerS>{});            // (MMA, MMA_M, MMA_N)
      Tensor S = as_rows_cols(tSrS);                                                         // (ROW, COL)
      if (s_owner) wgmma_issue(mma_s, tSrQ, tSrK, tSrS, /*zero_init=*/true);
      if constexpr (kRefillBehindS) refill_other_stage();

      // Mask keys past the piece (past L) and, when causal, past each row's last visible key; row maxima.
      float page_max[kRows];
      if (s_owner) {
        wgmma_wait<0>(tSrS);
        const int key0 = page_start + s_key_tile * kKeysPerS;
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
          page_max[r] = quad_max(m);
          if (!kSOwner && quad_leader) smem.row_max[warpgroup][get<0>(tScS(r, 0))] = page_max[r];
        }
      }
      if constexpr (!kSOwner) {
        barrier_sync<kThreads>(SplitKvBarrier::kRowMaxExchanged);
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const int row = get<0>(tScS(r, 0));
          page_max[r] = fmaxf(smem.row_max[0][row], smem.row_max[1][row]);
        }
        // Both warpgroups' S of the piece's last page is done: the Q tile is free for the next piece.
        if (last && prefetch_next) {
          load_q_tile(p, smem, next.seq, kv_head, m_tile);
          cp_async_commit();
        }
      }

      // Online softmax: P = exp2(S * scale - m), rescale O and the row sums by exp2(m_old - m).
      if (s_owner) {
        CUTE_UNROLL
        for (int r = 0; r < kRows; ++r) {
          const float new_max = fmaxf(row_max[r], page_max[r]);
          const float base = new_max == -INFINITY ? 0.f : new_max * p.scale_log2;   // no key yet: no inf - inf
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
          if (kSOwner && quad_leader) smem.row_max[0][get<0>(tScS(r, 0))] = new_max;   // for the other warpgroup
        }
        CUTE_UNROLL
        for (int e = 0; e < size(tSrS); ++e) tSsP(e) = static_cast<Element>(tSrS(e));
        cutlass::arch::fence_view_async_shared();   // P was written by ordinary stores; WGMMA reads it next
      }
      barrier_sync<kThreads>(SplitKvBarrier::kProbsWritten);
      if constexpr (kSOwner) {
        if (!s_owner) {                             // follow the owner's new maxima: same rescale of O and sums
          CUTE_UNROLL
          for (int r = 0; r < kRows; ++r) {
            const float new_max = smem.row_max[0][get<0>(tScS(r, 0))];
            const float base = new_max == -INFINITY ? 0.f : new_max * p.scale_log2;
            const float rescale = exp2f(row_max[r] * p.scale_log2 - base);
            row_max[r] = new_max;
            row_sum[r] *= rescale;
            CUTE_UNROLL
            for (int c = 0; c < size<1>(O); ++c) O(r, c) *= rescale;
          }
        }
        // The owner's S of the piece's last page is done: the Q tile is free for the next piece.
        if (last && prefetch_next) {
          load_q_tile(p, smem, next.seq, kv_head, m_tile);
          cp_async_commit();
        }
      }

      // O += P V over this warpgroup's 256 output columns
      Tensor sVt = make_tensor(make_smem_ptr(smem.k[stage].data()), typename Traits::SmemLayoutVt{});  // (D_V, BLK_N)
      Tensor tOrV = thr_mma_o.partition_fragment_B(local_tile(sVt, Shape<ColsPerWg, Int<kBlockN>>{},
                                                              make_coord(warpgroup, 0)));    // (MMA, MMA_N, MMA_K)
      wgmma_issue(mma_o, tOrP, tOrV, tOrO, /*zero_init=*/false);
      wgmma_wait<0>(tOrO);
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
      // total == 0: the row saw no key of this piece (out 0, lse -inf). A NaN total (NaN in q) stays NaN in out and
      // lse, so the combine kernel propagates it too instead of mistaking the row for one that saw no key.
      const bool no_key = total == 0.f;
      const float inv = no_key ? 0.f : 1.f / total;
      const float lse = no_key ? -INFINITY : (row_max[r] * p.scale_log2 + log2f(total)) * kLn2;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c) O(r, c) *= inv;
      write_row(p, piece, kv_head, m_tile * kBlockM + row, warpgroup, lse, quad_leader,
                [&](auto&& store) {
                  CUTE_UNROLL
                  for (int c = 0; c < size<1>(O); c += 2) store(get<1>(tOcO(r, c)), O(r, c), O(r, c + 1));
                });
    }
    return (first_stage + num_pages) % Traits::kStages;
  }

  // ========================================== epilogue stores =================================================

  // Stores one packed row: `for_each_pair(store)` calls store(col, x0, x1) for adjacent columns col, col + 1 of
  // this warpgroup's 256; the quad leader of warpgroup 0 also stores the row's lse.
  template <class ForEachPair>
  __device__ static void write_row(const DecodeParams& p, const Piece& piece, int kv_head, int row, int warpgroup,
                                   float lse, bool quad_leader, ForEachPair&& for_each_pair) {
    if (row >= p.rows_per_kv) return;       // padding row of the last tile
    if (piece.split && (piece.slot < 0 || piece.slot >= p.batch + p.num_sm_parts)) return;   // foreign num_splits
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
    // Let the combine kernel (launched with programmatic stream serialization) be scheduled now: it waits for
    // this whole grid to finish before reading anything, so triggering early only hides its launch latency.
    cudaTriggerProgrammaticLaunchCompletion();
    const int m_tile = blockIdx.x, kv_head = blockIdx.y, part = blockIdx.z;
    const int32_t* meta = p.metadata + part * kMetadataWidth;
    const int begin_seq = meta[kBeginSeq], begin_token = meta[kBeginToken];
    const int end_seq = meta[kEndSeq], end_token = meta[kEndToken], begin_split = meta[kBeginSplit];
    // begin_seq == batch marks a part with no work; the other clamps only guard against foreign metadata.
    if (begin_seq < 0 || begin_seq >= p.batch) return;
    const int last_seq = min(end_seq, p.batch - 1);
    auto piece_of = [&](int seq) {
      Piece piece;
      piece.seq = seq;
      piece.length = p.seqlens[seq];
      piece.begin = seq == begin_seq ? begin_token : 0;
      piece.end = seq == end_seq ? min(end_token, piece.length) : piece.length;
      const int first_slot = p.num_splits[seq];
      piece.split = p.num_splits[seq + 1] - first_slot > 1;
      piece.slot = first_slot + (seq == begin_seq ? begin_split : 0);
      return piece;
    };
    Piece piece = piece_of(begin_seq);
    int first_stage = 0;          // stage of the piece's first page
    bool prefetched = false;      // its Q tile and first page were issued during the previous piece
    for (int seq = begin_seq; seq <= last_seq; ++seq) {
      const bool has_next = seq < last_seq;
      const Piece next = has_next ? piece_of(seq + 1) : Piece{};
      const bool prefetch_next = kRefillBehindS && has_next && next.end > next.begin && piece.end > piece.begin;
      first_stage = attend_piece(p, smem, piece, kv_head, m_tile, first_stage, prefetched, next, prefetch_next);
      prefetched = prefetch_next;
      piece = next;
    }
  }
};

template <class Traits, int kPipeline>
__global__ void __launch_bounds__(Traits::kThreads, 1) mla_splitkv_kernel(const __grid_constant__ DecodeParams params) {
  extern __shared__ __align__(1024) char smem[];
  SplitKvKernel<Traits, kPipeline>::run(params, smem);
}

template <class Element, int kPipeline>
void launch_splitkv_variant(const DecodeParams& params, cudaStream_t stream) {
  using Traits = SplitKvTraits<Element>;
  auto kernel = mla_splitkv_kernel<Traits, kPipeline>;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kSmemBytes);
  const dim3 grid(params.num_row_tiles, params.num_heads_k, params.num_sm_parts);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
}

// Runtime -> template dispatch of the kernel variant (DecodeParams::pipeline, see params.h).
template <class Element>
void launch_splitkv(const DecodeParams& params, cudaStream_t stream) {
  switch (params.pipeline) {
    case kPipelineRefillFirst: launch_splitkv_variant<Element, kPipelineRefillFirst>(params, stream); break;
    case kPipelineSOwner: launch_splitkv_variant<Element, kPipelineSOwner>(params, stream); break;
    default: launch_splitkv_variant<Element, kPipelineRefillBehindS>(params, stream); break;
  }
}

}  // namespace flash_mla
