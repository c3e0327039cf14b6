// Epilogue of the split-KV kernel: normalises a warpgroup's half of O (and multiplies in descale_k) and writes it.
//   unsplit sequence: out (bf16/fp16) and lse, with the attention sink applied;
//   piece of a split sequence: fp32 partial O and lse to the piece's workspace slot (the combine kernel
//   applies the sink once it knows the final lse).
// Out goes one of two ways. Where the launcher set p.out_by_tma (one KV head, 128 query heads or more: kv_cache_tma.h
// encode_out_tma) the warpgroup stages its 64 x 256 half in the V half of the page buffer it read last (four
// swizzled 64 x 64 segments, free once its last P V is complete) and one thread stores them with four TMA boxes
// (stage_and_store); that V half is refilled only after the stores have read it. Otherwise, and for fp32 partials,
// each thread stores its pairs of columns from registers (write_row): 64 four- or eight-byte stores a thread, each
// warp instruction touching 8 rows.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>

#include <type_traits>

#include "named_barriers.h"
#include "params.h"
#include "result_rows.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "utils.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

template <class Traits>
struct SplitKvEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kColsPerWarpgroup = Traits::kColsPerWarpgroup;

  // Writes this warpgroup's 256 columns of the piece's 64 x 512 result. `stats` holds the rows' final references
  // and this thread's part of the row sums (quad-reduced here); O is the (ROW, COL) accumulator view and
  // tOcO its (row, col) coordinates within the warpgroup's 64 x 256 half. `staging`: nullptr to store from
  // registers, or (an unsplit piece with p.out_by_tma) the page buffer whose V half of this warpgroup stages the
  // result for the TMA store, which calls release(unit) as each unit of that half is free again (stage_and_store).
  template <class TensorO, class TensorC, class Release>
  __device__ static void write(const DecodeParams& p, const SplitKvScales& scales, const Piece& piece, int kv_head,
                               int m_tile, int warpgroup, const RowStats& stats, TensorO& O, const TensorC& tOcO,
                               Element* staging, Release&& release) {
    using namespace cute;
    // Without staging each row is stored as soon as it is normalised (H200, FP8 one-tile rows, which never stage:
    // +1.1 % against the kernel before staging with both rows normalised first, +0.5 % so).
    const bool staged = !Traits::kSparse && staging != nullptr;    // (the sparse kernel has no registers to spare)
    const bool quad_leader = threadIdx.x % 4 == 0;
    float lse[kRowsPerThread];
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const float total = quad_sum(stats.sum[r]);
      // false only when the row saw no key of this piece (total exactly 0); a NaN total (NaN in q or in a
      // visible key) stays NaN in out and lse, split or not.
      const bool seen = !(total == 0.f);
      lse[r] = seen ? (stats.max[r] * scales.score_log2 + log2f(total)) * kLn2 : -INFINITY;
      const int row = m_tile * Traits::kBlockM + get<0>(tOcO(r, 0));
      float inv = seen ? scales.out / total : 0.f;
      if (!piece.split && seen) inv *= sink_factor(p, row, kv_head, lse[r]);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c) O(r, c) *= inv;
      if (staged) continue;
      write_row(p, piece, kv_head, row, warpgroup, lse[r], quad_leader, [&](auto&& store) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(O); c += 2) store(get<1>(tOcO(r, c)), O(r, c), O(r, c + 1));
      });
    }
    if constexpr (!Traits::kSparse) {
      if (staged) stage_and_store(p, piece, kv_head, m_tile, warpgroup, lse, O, tOcO, staging, release);
    }
  }

  // A piece with no keys: every row of the tile gets out 0 and lse -inf. Touches no shared memory.
  __device__ static void write_empty(const DecodeParams& p, const Piece& piece, int kv_head, int m_tile,
                                     int warpgroup) {
    // 128 threads of a warpgroup: thread t writes row t / 2, columns [128 * (t % 2), + 128) of the half.
    const int wg_thread = threadIdx.x % Traits::kWarpgroupThreads;
    const int row = m_tile * Traits::kBlockM + wg_thread / 2;
    const int first = (wg_thread % 2) * (kColsPerWarpgroup / 2);
    write_row(p, piece, kv_head, row, warpgroup, -INFINITY, wg_thread % 2 == 0, [&](auto&& store) {
      for (int c = 0; c < kColsPerWarpgroup / 2; c += 2) store(first + c, 0.f, 0.f);
    });
  }

 private:
  // Out by TMA: the normalised O goes (in out's type) into `buffer`'s V segments of this warpgroup,
  // [kSegmentsPerVHalf * warpgroup, + kSegmentsPerVHalf), which no one else reads or writes until they are
  // released; they then hold exactly the (row, column) layout of out's boxes. The warpgroup's first thread stores
  // them (one TMA store and bulk group per segment) and calls release(unit) for each of the half's copy units (0,
  // 1, ...) as soon as the stores have read its segments; the other threads go on at once.
  template <class TensorO, class TensorC, class Release>
  __device__ static void stage_and_store(const DecodeParams& p, const Piece& piece, int kv_head, int m_tile,
                                         int warpgroup, const float (&lse)[kRowsPerThread], TensorO& O,
                                         const TensorC& tOcO, Element* buffer, Release&& release) {
    using namespace cute;
    constexpr int kVHalf = Traits::kSegmentsPerVHalf;
    constexpr int kSegmentCols = Traits::kSegmentCols;
    static_assert(kSegmentCols * sizeof(Element) == 128 && sizeof(Element) == 2, "out's 128-byte box rows");
    char* tile = reinterpret_cast<char*>(buffer);
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const int row = m_tile * Traits::kBlockM + get<0>(tOcO(r, 0));
      if (warpgroup == 0 && threadIdx.x % 4 == 0 && row < p.rows_per_kv) store_lse(p, piece, kv_head, row, lse[r]);
    }
    // In WGMMA's accumulator layout a thread's pairs of a row sit at columns col0 + 8 j
    // (col0 < 8, even): pair j lies in segment j / 8, 16-byte chunk j % 8 (swizzled: Traits::swizzled_chunk_offset),
    // bytes 2 col0.. of it, so a row needs its eight swizzled chunk offsets once and every store adds a constant.
    const int col0 = get<1>(tOcO(0, 0));
    auto stage_rows = [&](auto type_tag) {
      using Out = decltype(type_tag);
      CUTE_UNROLL
      for (int r = 0; r < kRowsPerThread; ++r) {
        const int tile_row = get<0>(tOcO(r, 0));
        char* row_base = tile + kVHalf * warpgroup * Traits::kBlockN * 128 + tile_row * 128 + col0 * 2;
        CUTE_UNROLL
        for (int c = 0; c < size<1>(O); c += 2) {
          const int j = (get<1>(tOcO(r, c)) - col0) / 8;    // a compile-time constant
          const int offset = j / 8 * Traits::kBlockN * 128 + ((j % 8) ^ (tile_row % 8)) * 16;
          struct alignas(4) Pair { Out v[2]; };
          *reinterpret_cast<Pair*>(row_base + offset) = Pair{{static_cast<Out>(O(r, c)), static_cast<Out>(O(r, c + 1))}};
        }
      }
    };
    // The FP8-cache kernels stage bf16 only (an fp16 out, from an fp16 q, goes by registers: encode_out_tma).
    stage_rows(std::conditional_t<Traits::kFp8Cache, cutlass::bfloat16_t, Element>{});
    cutlass::arch::fence_view_async_shared();    // generic-proxy writes before the TMA store (async proxy) reads
    warpgroup_sync(WarpgroupBarrier::kVSegmentsWritten, warpgroup);
    if (threadIdx.x % Traits::kWarpgroupThreads == 0) {
      CUTE_UNROLL
      for (int s = 0; s < kVHalf; ++s) {
        const int seg = kVHalf * warpgroup + s;
        SM90_TMA_STORE_3D::copy(p.out_tma, tile + seg * Traits::kBlockN * 128, seg * kSegmentCols,
                                m_tile * Traits::kBlockM, piece.seq);
        tma_store_arrive();
      }
      // Unit u of the half covers segments [kSegmentsPerUnit u, + kSegmentsPerUnit): free once their groups have
      // read shared memory (wait_group.read N: at most N groups still reading).
      constexpr int kUnitsPerHalf = Traits::kUnitsPerVHalf, kSegmentsPerUnit = Traits::kSegmentsPerUnit;
      static_assert(kUnitsPerHalf * kSegmentsPerUnit == kVHalf, "a V half is whole units");
      for_each(make_int_sequence<kUnitsPerHalf>{}, [&](auto unit) {
        tma_store_wait<kVHalf - (decltype(unit)::value + 1) * kSegmentsPerUnit>();
        release(int(decltype(unit)::value));
      });
    }
  }

  // An unsplit piece's lse of packed row `row` (< rows_per_kv).
  __device__ static void store_lse(const DecodeParams& p, const Piece& piece, int kv_head, int row, float lse) {
    p.lse[ResultRow(p, kv_head, row).lse_offset(p, piece.seq)] = lse;
  }

  // 1 / (1 + exp(sink - lse)) for packed row `row` (SPEC.md "attn_sink"); 1 without a sink.
  __device__ static float sink_factor(const DecodeParams& p, int row, int kv_head, float lse) {
    if (p.attn_sink == nullptr || row >= p.rows_per_kv) return 1.f;
    const float sink = p.attn_sink[ResultRow(p, kv_head, row).head];
    return 1.f / (1.f + expf(sink - lse));
  }

  // Stores one packed row: `for_each_pair(store)` calls store(col, x0, x1) for adjacent columns col, col + 1 of
  // this warpgroup's 256; the quad leader of warpgroup 0 also stores the row's lse.
  template <class ForEachPair>
  __device__ static void write_row(const DecodeParams& p, const Piece& piece, int kv_head, int row, int warpgroup,
                                   float lse, bool quad_leader, ForEachPair&& for_each_pair) {
    if (row >= p.rows_per_kv) return;       // padding row of the last tile
    const int col0 = warpgroup * kColsPerWarpgroup;
    if (!piece.split) {
      const int64_t offset = ResultRow(p, kv_head, row).out_offset(p, piece.seq) + col0;
      auto store_out = [&](auto type_tag) {
        using Out = decltype(type_tag);
        Out* dst = static_cast<Out*>(p.out) + offset;
        for_each_pair([&](int col, float x0, float x1) {
          struct alignas(4) Pair { Out v[2]; };
          *reinterpret_cast<Pair*>(dst + col) = Pair{{static_cast<Out>(x0), static_cast<Out>(x1)}};
        });
      };
      // The FP8-cache kernel computes in fp16 and writes bf16 (an e4m3 or bf16 q) or fp16 (an fp16 q); the sparse
      // kernel computes in fp16 and writes bf16 only (one unrolled copy of the stores: 448 SASS instructions fewer).
      if constexpr (Traits::kSparse) {
        store_out(cutlass::bfloat16_t{});
      } else if (Traits::kFp8Cache && p.out_bf16) {
        store_out(cutlass::bfloat16_t{});
      } else {
        store_out(Element{});
      }
      if (warpgroup == 0 && quad_leader) store_lse(p, piece, kv_head, row, lse);
    } else {
      const int64_t slot_row = partial_row(p, piece.slot, kv_head, row);
      float* dst = p.o_partial + slot_row * kHeadDimV + col0;
      for_each_pair([&](int col, float x0, float x1) { *reinterpret_cast<float2*>(dst + col) = make_float2(x0, x1); });
      if (warpgroup == 0 && quad_leader) p.lse_partial[slot_row] = lse;
    }
  }
};

FLASH_MLA_NAMESPACE_END  // flash_mla
