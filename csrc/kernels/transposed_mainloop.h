// Mainloop of the transposed FP8 kernel (transposed_traits.h): the producer warp's copies and a computing
// warpgroup's pages. The schedule, per CTA (one per SM; the CTA's stream is the pages of its pieces in order):
//
//   producer warp 0                         warpgroup w (0, 1): stream pages n = w, w + 2, ...
//   ---------------                         -------------------------------------------------
//   per piece with pages:                   per piece with pages:
//     (an e4m3 q) wait q_empty[slot];    ->   an e4m3 q: wait q_full[slot]
//       Q by cp.async, arrive q_full          a 16-bit q: both warpgroups load the Q tile, |q| maxima met by
//     per page n:                               bar.sync (kQAmaxWritten), 3 e4m3 terms stored (kQTermsWritten)
//       wait page_empty[n % ring]             per own page n of the piece:
//       5 TMA boxes -> page_full                (odd ring) wait page_empty[n % ring] of page n - ring
//                                               wait page_full[n % ring]
//                                               per S tile (one; a 16-bit q at 32 rows two, 16 columns each):
//                                                 S^T = K Q^T      e4m3, a float32 step a unit (5), two units
//                                                                  in flight; a 16-bit q's 3 terms as N = 48
//                                                                  (own columns), a unit at a time
//                                                 mask (partial / causal pages),
//                                                 vote: did a score pass its column's threshold? (bar.red.or)
//                                                 if so: column maxima (shuffles, then the warps' via shared
//                                                 memory), the tile's O^T columns and sums rescaled to the
//                                                 new reference
//                                                 P^T = exp2(S^T scale - reference) -> shared (stmatrix.trans)
//                                               O^T += V^T P^T     4 key blocks x 8 dim blocks, in batches
//                                                                  of 8 (16 rows) or 4 (32) dim blocks, V^T
//                                                                  widened into registers one batch ahead
//                                                                  of the WGMMAs that read it
//                                               arrive page_empty[n % ring] (its O^T WGMMAs complete)
//                                             an e4m3 q: arrive q_empty[slot]
//                                             epilogue (both warpgroups: merge, normalise, write)
//
// The two warpgroups keep separate references, sums and O^T per piece (a split of the piece's keys, merged at its
// end: transposed_epilogue.h), so neither ever waits for the other inside a piece.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <climits>

#include "params.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "transposed_traits.h"
#include "utils.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// A computing warpgroup's running softmax state per query column it holds (slot c: column column_of(c, lane % 4)).
template <int kSlots>
struct ColumnStats {
  float ref[kSlots];    // references (raw scores; softmax.h lazy_reference), the same in each warp
  float sum[kSlots];    // this thread's part of the column sums, relative to exp2(ref * scale)
};

// Accumulator value i of an m64nN fragment (S^T or an O^T dim block): row (key or dim) 16 warp + lane / 4 +
// 8 ((i >> 1) & 1), column 2 (lane % 4) + (i & 1) + 8 (i >> 2); slot (i & 1) + 2 (i >> 2) of the thread's N / 4.
__device__ __forceinline__ constexpr int slot_of(int i) { return (i & 1) + 2 * (i >> 2); }
// The first of slot c's two values (the other is + 2: the same column, the row 8 below).
__device__ __forceinline__ constexpr int first_value_of(int slot) { return (slot & 1) + 4 * (slot >> 1); }
__device__ __forceinline__ constexpr int column_of(int slot, int quad_lane) {
  return 2 * quad_lane + (slot & 1) + 8 * (slot >> 1);
}

template <class Traits>
struct TransposedMainloop {
  using SharedStorage = typename Traits::SharedStorage;
  using Stats = ColumnStats<Traits::kSlots>;
  using Barrier = cutlass::arch::ClusterBarrier;
  using E4m3 = typename Traits::E4m3;
  using Half = typename Traits::Half;
  static constexpr int kRing = Traits::kRing;
  static constexpr int kQSlots = Traits::kQSlots;
  static constexpr int kWgThreads = Traits::kWarpgroupThreads;
  static constexpr int kSlots = Traits::kSlots;
  // An S tile's query columns and the slots a thread holds of them (Traits::kSTileCols: its B rows, all terms)
  static constexpr int kTileRows = Traits::kSTileCols / Traits::kQTerms;
  static constexpr int kTileSlots = kTileRows / 4;
  static_assert(kTileRows % 16 == 0 && kTileRows * Traits::kSTiles == Traits::kRows, "S tiles of 16-column groups");
  // Evict-first: the cache is streamed once, by one row tile per KV head.
  static constexpr uint64_t kEvictFirst = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST);

  // ========================================= producer ========================================================

  // Warp 0: pages of the CTA's stream into the ring, an e4m3 q's Q tiles into their slots. The block table is read
  // 32 entries at a time (a lane each) so that no copy waits for a block id's load.
  __device__ __forceinline__ static void produce(const DecodeParams& p, SharedStorage& smem, const PieceRange<>& range, int kv_head) {
    const int lane = threadIdx.x % 32;
    int stream_page = 0, q_count = 0;
#pragma unroll 1
    for (int seq = range.first_seq(); seq <= range.last_seq(); ++seq) {
      const Piece piece = range.piece(seq);
      const int pages = piece.num_pages();
      if (pages == 0) continue;
      if constexpr (!Traits::kWideQ) load_q(p, smem, piece.seq, kv_head, q_count++);    // (else quantise_q)
      int block = 0;
#pragma unroll 1
      for (int page = 0; page < pages; ++page, ++stream_page) {
        if (page % 32 == 0) block = page + lane < pages ? range.page_of(piece, page + lane).block : 0;
        const int page_block = __shfl_sync(0xffffffffu, block, page % 32);
        const int buffer = stream_page % kRing;
        if (stream_page >= kRing) Barrier::wait(&smem.page_empty[buffer], ((stream_page / kRing) & 1) ^ 1);
        if (lane == 0) {
          uint64_t* full = &smem.page_full[buffer];
          cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, Traits::kPageBytes);
          CUTE_UNROLL
          for (int unit = 0; unit < Traits::kUnits; ++unit) {
            cute::SM90_TMA_LOAD_4D::copy(p.k_cache_tma, full, kEvictFirst, smem.page[buffer] + unit * Traits::kUnitBytes,
                                         unit * Traits::kUnitCols, 0, kv_head, page_block);
          }
        }
      }
    }
  }

  // Q tile number q_count (of the CTA's pieces with pages) of an e4m3 q: the KV head's rows_per_kv packed rows of
  // `seq` as bytes in SmemLayoutQ, by cp.async from warp 0's 32 lanes, completing on q_full. Rows past rows_per_kv
  // stay zero (the kernel zeroes the slots once); columns 576..639 are never read.
  __device__ __forceinline__ static void load_q(const DecodeParams& p, SharedStorage& smem, int seq, int kv_head, int q_count) {
    using namespace cute;
    static_assert(!Traits::kWideQ, "a 16-bit q: quantise_q");
    const int slot = q_count % kQSlots;
    if (q_count >= kQSlots) Barrier::wait(&smem.q_empty[slot], ((q_count / kQSlots) & 1) ^ 1);
    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<E4m3*>(smem.q[slot])), typename Traits::SmemLayoutQ{});
    const uint8_t* q = static_cast<const uint8_t*>(p.q) + int64_t(seq) * p.q_batch_stride;
#pragma unroll 1
    for (int chunk = threadIdx.x % 32; chunk < p.rows_per_kv * Traits::kQChunksPerRow; chunk += 32) {
      const int row = chunk / Traits::kQChunksPerRow, col = chunk % Traits::kQChunksPerRow * 16;
      const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
      cp_async_16_zfill(&sQ(row, col, 0), q + token * p.q_token_stride + head * p.q_head_stride + col, true);
    }
    cutlass::arch::cpasync_barrier_arrive_noinc(&smem.q_full[slot]);
  }

  // ====================================== the computing warpgroups ==========================================

  // A bf16 or fp16 Q tile as kQTerms e4m3 terms, by both computing warpgroups (threads 0..255) at the start of its
  // piece: d = max(amax / 448, 2^-126) over the tile (its rows_per_kv rows; the warps' maxima meet in q_amax), then per
  // value y = x / d = t0 + t1 / 16 + t2 / 256, t0 = e4m3(y), t1 = e4m3(16 (y - t0)), ... (kQLoScale; round to
  // nearest, saturating), term t of row r at row 16 t + r % 16 of S tile r / 16 (SmemLayoutQ), and d into
  // q_descale. NaN stays NaN (fmaxf leaves it out of the maximum; x / d is NaN). Every thread's loads are in flight
  // at once, their values kept for the second pass. The first named barrier also says that both warpgroups are done
  // with the slot's previous tile (each waited for its last S^T WGMMAs before its epilogue) and with q_amax and
  // q_descale; the second, after the fence, that the terms are in place for either warpgroup's WGMMAs.
  __device__ __forceinline__ static void quantise_q(const DecodeParams& p, SharedStorage& smem, int seq, int kv_head) {
    using namespace cute;
    constexpr int kThreads = Traits::kQThreads, kStepsPerRow = kHeadDimQK / 8;
    constexpr int kLoads = (Traits::kRows * kStepsPerRow + kThreads - 1) / kThreads;    // 16-byte loads a thread
    static_assert(Traits::kWideQ && Traits::kQSlots == 1 && kThreads == Traits::kComputeWarpgroups * kWgThreads,
                  "a 16-bit q's one slot, filled by threads 0..255");
    const uint16_t* q = static_cast<const uint16_t*>(p.q) + int64_t(seq) * p.q_batch_stride;    // 16-bit values
    const bool bf16 = p.q_format == kQBf16;    // else fp16
    auto widen = [&](uint32_t pair) {    // two 16-bit values as float32
      return bf16 ? __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pair))
                  : __half22float2(*reinterpret_cast<const __half2*>(&pair));
    };
    // the thread index from a volatile read: else the compiler hoists each chunk's offsets and predicates (loop
    // invariants) out of the piece loop, and ptxas spilled them across the pages (280 bytes at 32 rows)
    uint32_t t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    const int chunks = p.rows_per_kv * kStepsPerRow;
    uint4 raw[kLoads];    // a thread's chunks t, t + 256, ... (8 values each)
    CUTE_UNROLL
    for (int i = 0; i < kLoads; ++i) {
      const int chunk = int(t) + i * kThreads, row = chunk / kStepsPerRow, col = chunk % kStepsPerRow * 8;
      const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
      raw[i] = chunk < chunks ? *reinterpret_cast<const uint4*>(q + token * p.q_token_stride + head * p.q_head_stride + col)
                              : make_uint4(0, 0, 0, 0);
    }
    float amax = 0.f;
    CUTE_UNROLL
    for (int i = 0; i < kLoads; ++i) {
      const uint32_t pairs[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
      CUTE_UNROLL
      for (int k = 0; k < 4; ++k) {
        const float2 f = widen(pairs[k]);
        amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
    CUTE_UNROLL
    for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if (t % 32 == 0) smem.q_amax[t / 32] = amax;
    named_sync(static_cast<uint32_t>(TransposedBarrier::kQAmaxWritten), kThreads);
    CUTE_UNROLL
    for (int w = 0; w < kThreads / 32; ++w) amax = fmaxf(amax, smem.q_amax[w]);
    const float descale = fmaxf(amax / 448.f, 1.17549435e-38f), scale = 1.f / descale;
    if (t == 0) smem.q_descale = descale;
    Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<E4m3*>(smem.q[0])), typename Traits::SmemLayoutQ{});
    CUTE_UNROLL
    for (int i = 0; i < kLoads; ++i) {
      const int chunk = int(t) + i * kThreads, row = chunk / kStepsPerRow, col = chunk % kStepsPerRow * 8;
      if (chunk >= chunks) continue;
      const uint32_t pairs[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
      float2 y[4];
      CUTE_UNROLL
      for (int k = 0; k < 4; ++k) {
        y[k] = widen(pairs[k]);
        y[k].x *= scale;
        y[k].y *= scale;
      }
      CUTE_UNROLL
      for (int term = 0; term < Traits::kQTerms; ++term) {
        uint32_t codes[4];
        CUTE_UNROLL
        for (int k = 0; k < 4; ++k) {
          codes[k] = __nv_cvt_float2_to_fp8x2(y[k], __NV_SATFINITE, __NV_E4M3);
          const float2 c = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(codes[k], __NV_E4M3)));
          y[k] = make_float2((y[k].x - c.x) * Traits::kQLoScale, (y[k].y - c.y) * Traits::kQLoScale);
        }
        *reinterpret_cast<uint2*>(&sQ(16 * term + row % 16, col, row / 16)) =
            make_uint2(codes[0] | codes[1] << 16, codes[2] | codes[3] << 16);
      }
    }
    cutlass::arch::fence_view_async_shared();    // generic-proxy writes before the WGMMAs (async proxy) read them
    named_sync(static_cast<uint32_t>(TransposedBarrier::kQTermsWritten), kThreads);
  }

  // One page: S^T, softmax, O^T += V^T P^T. `key0`: the page's first key (token index); keys at or past `end`
  // (the piece's end), and with causal masking past each column's last visible key, do not count.
  template <class TensorO>
  __device__ __forceinline__ static void page(const DecodeParams& p, const SplitKvScales& scales, SharedStorage& smem, int warpgroup,
                              int buffer, int q_slot, const Piece& piece, int key0, TensorO& tOrO, Stats& stats) {
    using namespace cute;
    typename Traits::TiledMmaS mma_s;
    const int t = threadIdx.x % kWgThreads, warp = t / 32, lane = t % 32;
    auto thr_s = mma_s.get_slice(t);

    // ---- S^T = K Q^T: e4m3 WGMMAs keep ~14 bits while accumulating, so each 128-column unit's partial sum is
    // added in float32 (the e4m3-scores kernel's rule; tests/test_fp8.py's lse bound). A 16-bit q's terms are B's
    // column blocks (N = 48: K is read once for all three), so each term's partial is its own: value i of term t is
    // value i + 8 t of the part (column + 16 t), summed with weights kQLoScale^-t ----------------------------------
    auto issue_unit = [&](auto& acc, const auto& tSrK, const auto& tSrQ, int unit, int tile) {    // acc: zeroed
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      constexpr int kSteps = Traits::kUnitCols / 32;
      CUTE_UNROLL
      for (int kk = 0; kk < (unit == Traits::kUnits - 1 ? (kHeadDimQK % Traits::kUnitCols) / 32 : kSteps); ++kk) {
        mma_s.accumulate_ = kk == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
        gemm(mma_s, tSrK(_, _, unit * kSteps + kk), tSrQ(_, _, unit * kSteps + kk, tile), acc);
      }
      warpgroup_commit_batch();
    };
    // S^T of S tile `tile` (its kTileRows query columns): kTileRows / 2 values, value i at slot slot_of(i) of the
    // tile (the thread's slot tile kTileSlots + slot_of(i))
    auto tile_scores = [&](int tile) {
      // With several S tiles, the buffer and slot pass through a shuffle that the compiler cannot see through, so
      // that each tile computes its own descriptors: else ptxas kept the page's 18 descriptor pairs (36 registers)
      // live from one tile's WGMMAs to the next across the softmax, and spilled.
      const int tile_buffer = Traits::kSTiles > 1 ? __shfl_sync(0xffffffffu, buffer, 0) : buffer;
      const int tile_q_slot = Traits::kSTiles > 1 ? __shfl_sync(0xffffffffu, q_slot, 0) : q_slot;
      Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<E4m3*>(smem.q[tile_q_slot])),
                              typename Traits::SmemLayoutQ{});                              // (N_S, 640, S tiles)
      Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<E4m3*>(smem.page[tile_buffer])),
                              typename Traits::SmemLayoutPage{});                           // (64, 640)
      Tensor tSrQ = thr_s.partition_fragment_B(sQ);                                         // (MMA, 1, 20, S tiles)
      Tensor tSrK = thr_s.partition_fragment_A(sK);                                         // (MMA, 1, 20)
      Tensor tSrU = partition_fragment_C(mma_s, Shape<_64, Int<Traits::kSTileCols>>{});    // a unit's part
      // the tile's scores: an e4m3 q's first unit writes them as its accumulator; a 16-bit q's terms are summed in
      auto tSrS = [&] {
        if constexpr (Traits::kQTerms == 1) {
          return make_fragment_like(tSrU);
        } else {
          return make_tensor<float>(Int<kTileRows / 2>{});
        }
      }();
      if constexpr (Traits::kQTerms == 1) {
        // Two units in flight: unit u + 1's WGMMAs run while unit u's are waited for and unit u - 1's partial is
        // added (two partials in turn; H200: +2-3 % on the 32-row rows, same on the 16-row ones).
        Tensor tSrU1 = make_fragment_like(tSrU);
        auto fold = [&](auto& acc) {
          warpgroup_fence_operand(acc);
          CUTE_UNROLL
          for (int i = 0; i < size(tSrS); ++i) tSrS(i) += acc(i);
        };
        static_assert(Traits::kUnits == 5, "the unit schedule below");
        issue_unit(tSrS, tSrK, tSrQ, 0, tile);
        issue_unit(tSrU, tSrK, tSrQ, 1, tile);
        warpgroup_wait<1>();             // unit 0
        warpgroup_fence_operand(tSrS);
        issue_unit(tSrU1, tSrK, tSrQ, 2, tile);
        warpgroup_wait<1>();             // unit 1
        fold(tSrU);
        issue_unit(tSrU, tSrK, tSrQ, 3, tile);
        warpgroup_wait<1>();             // unit 2
        fold(tSrU1);
        issue_unit(tSrU1, tSrK, tSrQ, 4, tile);
        warpgroup_wait<1>();             // unit 3
        fold(tSrU);
        warpgroup_wait<0>();             // unit 4
        fold(tSrU1);
      } else {
        // a unit at a time: the part is 24 values
        static_assert(Traits::kQTerms == 3 && Traits::kSTileCols == 48, "three terms of 16 rows an S tile");
        clear(tSrS);    // zeroed, each unit added: with `unit == 0 ? v : ...` ptxas dropped unit 0's WGMMAs
        CUTE_UNROLL
        for (int unit = 0; unit < Traits::kUnits; ++unit) {
          issue_unit(tSrU, tSrK, tSrQ, unit, tile);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tSrU);
          CUTE_UNROLL
          for (int i = 0; i < 8; ++i) {
            tSrS(i) += tSrU(i) + (tSrU(i + 8) + tSrU(i + 16) * (1.f / Traits::kQLoScale)) * (1.f / Traits::kQLoScale);
          }
        }
        // in q's units: the Q tile's descale, read here rather than held in a register across pages and pieces
        const float descale = smem.q_descale;
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) tSrS(i) *= descale;
      }
      return tSrS;
    };

    // ---- per S tile (one; a 16-bit q at 32 rows two, one after the other, so that one tile's part and scores
    // are live at a time): S^T, masks, softmax, P^T --------------------------------------------------------------
    const int page_last = key0 + kPageBlockSize - 1;
    const int first_causal_limit = piece.length - p.seqlen_q;    // column 0's last visible key
    const bool masked = !(page_last < piece.end && (!p.causal || page_last <= first_causal_limit));
    for_each(make_int_sequence<Traits::kSTiles>{}, [&](auto tile_c) {
      constexpr int kTile = decltype(tile_c)::value, kSlot0 = kTile * kTileSlots;
      Tensor tSrS = tile_scores(kTile);

      // masks: only a piece's last page, and with causal masking the pages holding its last s_q keys
      if (masked) {
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) {
          const int key = key0 + 16 * warp + lane / 4 + 8 * ((i >> 1) & 1);
          const int column = column_of(kSlot0 + slot_of(i), lane % 4);
          const int last = p.causal ? first_causal_limit + column / p.heads_per_kv : INT_MAX;
          if (!(key < piece.end && key <= last)) tSrS(i) = -INFINITY;
        }
      }

      // softmax over the page's keys, per query column: the lazy reference moves only when a warpgroup vote says
      // that some score passed its column's reference (one compare a score against reference_threshold), and only
      // then are the column maxima formed (shuffles within the warp, then shared memory), off the common path
      const float margin = kLazyRescaleLog2 / scales.score_log2;
      float threshold[kTileSlots];
      CUTE_UNROLL
      for (int c = 0; c < kTileSlots; ++c) threshold[c] = reference_threshold(stats.ref[kSlot0 + c], margin);
      int passed = 0;
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) passed |= tSrS(i) > threshold[slot_of(i)];
      passed = vote_any(passed, barrier_id(TransposedBarrier::kReferenceVote, warpgroup));
      if (passed) {
        float col_max[kTileSlots];
        CUTE_UNROLL
        for (int c = 0; c < kTileSlots; ++c) {
          const int i = first_value_of(c);
          float m = fmaxf(tSrS(i), tSrS(i + 2));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
          col_max[c] = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
        }
        move_references<kSlot0>(scales, smem, warpgroup, col_max, tOrO, stats);
      }

      uint32_t probs[kTileSlots];    // fp16 pairs: register j holds values 2 j, 2 j + 1 (one key, two columns)
      CUTE_UNROLL
      for (int j = 0; j < kTileSlots; ++j) {
        const int c = kSlot0 + slot_of(2 * j);
        const float e0 = exp2f(tSrS(2 * j) * scales.score_log2 - exp2_base(stats.ref[c], scales.score_log2));
        const float e1 = exp2f(tSrS(2 * j + 1) * scales.score_log2 - exp2_base(stats.ref[c + 1], scales.score_log2));
        stats.sum[c] += e0;
        stats.sum[c + 1] += e1;
        const __half2 h = __floats2half2_rn(e0, e1);
        probs[j] = *reinterpret_cast<const uint32_t*>(&h);
      }
      store_pt<kTile * kTileRows / 16>(smem, warpgroup, probs);
    });
    cutlass::arch::fence_view_async_shared();    // generic-proxy writes before the WGMMAs (async proxy) read them
    named_sync(barrier_id(TransposedBarrier::kPtWritten, warpgroup), kWgThreads);

    // ---- O^T += V^T P^T ---------------------------------------------------------------------------------------
    const int valid_keys = piece.end - key0;
    if (valid_keys < kPageBlockSize) {
      accumulate_o<true>(smem, warpgroup, buffer, valid_keys, tOrO);
    } else {
      accumulate_o<false>(smem, warpgroup, buffer, valid_keys, tOrO);
    }
  }

 private:
  // True in every thread of the warpgroup if `flag` is nonzero in any of its threads.
  __device__ __forceinline__ static int vote_any(int flag, uint32_t barrier) {
    int any;
    asm volatile("{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, %2, 128, p;\n"
                 " selp.s32 %0, 1, 0, q;\n}" : "=r"(any) : "r"(flag), "r"(barrier));
    return any;
  }

  // Some column of the S tile whose slots start at kSlot0 passed its reference: the warps' column maxima through
  // shared memory, the same new reference in every warp, and those columns of O^T and their sums moved to it. The
  // warpgroup's O^T WGMMAs of its page before are complete (waited at that page's end).
  template <int kSlot0, class TensorO>
  __device__ __forceinline__ static void move_references(const SplitKvScales& scales, SharedStorage& smem, int warpgroup,
                                         const float (&col_max)[kTileSlots], TensorO& tOrO, Stats& stats) {
    const int t = threadIdx.x % kWgThreads, warp = t / 32, lane = t % 32;
    if (lane < 4) {
      CUTE_UNROLL
      for (int c = 0; c < kTileSlots; ++c) smem.col_max[warpgroup][warp][column_of(kSlot0 + c, lane)] = col_max[c];
    }
    named_sync(barrier_id(TransposedBarrier::kColMaxWritten, warpgroup), kWgThreads);
    float factor[kTileSlots];
    CUTE_UNROLL
    for (int c = 0; c < kTileSlots; ++c) {
      float m = -INFINITY;
      CUTE_UNROLL
      for (int w = 0; w < 4; ++w) m = fmaxf(m, smem.col_max[warpgroup][w][column_of(kSlot0 + c, lane % 4)]);
      const float moved = lazy_reference(stats.ref[kSlot0 + c], m, scales.score_log2);
      factor[c] = rescale_factor(stats.ref[kSlot0 + c], moved, scales.score_log2);
      stats.ref[kSlot0 + c] = moved;
      stats.sum[kSlot0 + c] *= factor[c];
    }
    named_sync(barrier_id(TransposedBarrier::kColMaxRead, warpgroup), kWgThreads);
    // O^T's values of the tile's slots: i with slot_of(i) in kSlot0 .. (slot_of(i + 8) = slot_of(i) + 4)
    constexpr int kValue0 = kSlot0 / 4 * 8, kTileValues = kTileSlots * 2;
    CUTE_UNROLL
    for (int mb = 0; mb < Traits::kDimBlocks; ++mb) {
      CUTE_UNROLL
      for (int i = kValue0; i < kValue0 + kTileValues; ++i) tOrO(i, mb, 0) *= factor[slot_of(i) - kSlot0];
    }
  }

  // An S tile's columns of P^T (16-column groups kGroup0 ..) into the warpgroup's (N rows, 64 keys) fp16 buffer:
  // 8 x 8 matrices (keys x columns) stored transposed, four a stmatrix; register j is the matrix of keys 16 warp +
  // 8 (j & 1) .. + 7 and columns 16 kGroup0 + 8 (j >> 1) .. + 7. The caller fences and syncs (kPtWritten).
  template <int kGroup0>
  __device__ __forceinline__ static void store_pt(SharedStorage& smem, int warpgroup, const uint32_t (&probs)[kTileSlots]) {
    const int t = threadIdx.x % kWgThreads, warp = t / 32, lane = t % 32;
    const uint32_t pt = static_cast<uint32_t>(__cvta_generic_to_shared(smem.pt[warpgroup]));
    CUTE_UNROLL
    for (int s = 0; s < kTileRows / 16; ++s) {
      const int j = 4 * s + lane / 8;
      const int row = 16 * kGroup0 + 8 * (j >> 1) + lane % 8;    // P^T's row: a query column
      const int key0 = 16 * warp + 8 * (j & 1);                  // the matrix's first key
      const uint32_t addr = pt + Traits::pt_chunk_offset(row, key0 / 8);
      asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                   :: "r"(addr), "r"(probs[4 * s]), "r"(probs[4 * s + 1]), "r"(probs[4 * s + 2]), "r"(probs[4 * s + 3])
                   : "memory");
    }
  }

  // The A fragment of one m64nNk16 O^T WGMMA (warp w: dims dim0 .. dim0 + 15, keys key0 .. key0 + 15): two 8 x 16-
  // byte matrices of e4m3 (keys x dim pairs) transposed by ldmatrix, so that a thread holds, for the dim pair
  // (2 g, 2 g + 1) (g = lane / 4), keys 2 t, 2 t + 1 and 8 + 2 t, 9 + 2 t (t = lane % 4); one prmt per register
  // sorts its bytes by dim and cvt widens each half. The fragment's rows g and g + 8 are then dims 2 g and 2 g + 1
  // (the RS A layout: a0 (g, 2 t), a1 (g + 8, 2 t), a2 (g, 8 + 2 t), a3 (g + 8, 8 + 2 t)): O^T's rows come out in that
  // order, which the epilogue's stores follow (a thread's values i and i + 2 are dims 2 g and 2 g + 1). `row`: this
  // lane's ldmatrix row address (VtAddresses). kTail: keys at or past valid_keys become zeros (a partial page: the
  // cache's slots past a sequence's end may hold NaN, and P = 0 times NaN would be NaN).
  template <bool kTail>
  __device__ __forceinline__ static void load_vt_fragment(uint32_t row, int key0, int valid_keys, uint32_t (&a)[4]) {
    const int lane = threadIdx.x % 32;
    uint32_t m[2];
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(m[0]), "=r"(m[1]) : "r"(row));
    CUTE_UNROLL
    for (int j = 0; j < 2; ++j) {
      if constexpr (kTail) {
        // m[j] = bytes (key k: dim d, dim d + 1), (key k + 1: d, d + 1), k = key0 + 8 j + 2 t
        const int k = key0 + 8 * j + 2 * (lane % 4);
        m[j] = k >= valid_keys ? 0u : k + 1 >= valid_keys ? (m[j] & 0xffffu) : m[j];
      }
      // -> low half (d: k, k + 1), high half (d + 1: k, k + 1)
      const uint32_t by_dim = __byte_perm(m[j], 0, 0x3120);
      asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;\n}"
          : "=r"(a[2 * j]), "=r"(a[2 * j + 1]) : "r"(by_dim));
    }
  }

  // Where this lane's ldmatrix rows of a page's V^T fragments lie (Traits::vt_lane_offset / vt_block_offset): per
  // page two adds, per fragment an xor shared by its key blocks and an add, where the general page_chunk_offset
  // cost ~4 instructions a fragment.
  struct VtAddresses {
    uint32_t chunk_row[2];    // page + the lane's row and swizzled chunk, for even and odd dim blocks
    uint32_t unit_flip;       // the warpgroup's rotation of the units

    __device__ __forceinline__ VtAddresses(uint32_t page, int warpgroup) {
      const int t = threadIdx.x % kWgThreads, warp = t / 32, lane = t % 32;
      CUTE_UNROLL
      for (int parity = 0; parity < 2; ++parity) chunk_row[parity] = page + Traits::vt_lane_offset(parity, warp, lane);
      unit_flip = Traits::vt_unit_flip(warpgroup);
      static_assert(Traits::kDimBlocks == 8 && Traits::kUnitCols == 128, "two dim blocks a unit, four units");
    }
    __device__ __forceinline__ uint32_t operator()(int mb, int kb) const {
      return chunk_row[mb & 1] + Traits::vt_block_offset(mb, kb, unit_flip);
    }
  };

  // O^T += V^T P^T over the page's four key blocks, in batches of kBatchBlocks dim blocks: two sets of V^T
  // fragments, one read by the WGMMAs in flight while the other is loaded; returns with every WGMMA complete (the
  // page and P^T may be overwritten). Dim block mb of warpgroup w's O^T holds dims 64 ((mb + 4 w) mod 8): each
  // warpgroup's own half of the dims first, so that the epilogue's hand-over is the same code for both
  // (transposed_epilogue.h).
  template <bool kTail, class TensorO>
  __device__ __forceinline__ static void accumulate_o(SharedStorage& smem, int warpgroup, int buffer, int valid_keys,
                                                      TensorO& tOrO) {
    using namespace cute;
    constexpr int kBatch = Traits::kBatchBlocks, kBatchesPerKeyBlock = Traits::kDimBlocks / kBatch;
    typename Traits::TiledMmaO mma_o;
    const int t = threadIdx.x % kWgThreads;
    auto thr_o = mma_o.get_slice(t);
    Tensor sPt = make_tensor(make_smem_ptr(smem.pt[warpgroup]), typename Traits::SmemLayoutPt{});    // (N, 64)
    Tensor tOrPt = thr_o.partition_fragment_B(sPt);                                                 // (MMA, 1, 4)
    Tensor tOrA0 = make_tensor<Half>(partition_shape_A(mma_o, Shape<Int<64 * kBatch>, _16>{}));     // (MMA, B, 1)
    Tensor tOrA1 = make_tensor<Half>(partition_shape_A(mma_o, Shape<Int<64 * kBatch>, _16>{}));     // (MMA, B, 1)
    const VtAddresses vt_address(static_cast<uint32_t>(__cvta_generic_to_shared(smem.page[buffer])), warpgroup);
    auto batch = [&](auto step) {
      constexpr int kStep = decltype(step)::value;
      constexpr int kb = kStep / kBatchesPerKeyBlock, mb0 = kStep % kBatchesPerKeyBlock * kBatch;
      auto& tOrA = kStep % 2 == 0 ? tOrA0 : tOrA1;
      if constexpr (kStep >= 2) warpgroup_wait<1>();    // the batch before the last no longer reads this set
      warpgroup_fence_operand(tOrA);
      CUTE_UNROLL
      for (int b = 0; b < kBatch; ++b) {
        uint32_t a[4];
        load_vt_fragment<kTail>(vt_address(mb0 + b, kb), 16 * kb, valid_keys, a);
        Tensor words = recast<uint32_t>(tOrA(_, b, 0));
        CUTE_UNROLL
        for (int i = 0; i < 4; ++i) words(i) = a[i];
      }
      warpgroup_fence_operand(tOrA);
      warpgroup_fence_operand(tOrO);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int b = 0; b < kBatch; ++b) gemm(mma_o, tOrA(_, b, 0), tOrPt(_, 0, kb), tOrO(_, mb0 + b, 0));
      warpgroup_commit_batch();
      warpgroup_fence_operand(tOrO);
    };
    for_each(make_int_sequence<Traits::kKeyBlocks * kBatchesPerKeyBlock>{}, batch);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
  }
};

FLASH_MLA_NAMESPACE_END  // flash_mla
