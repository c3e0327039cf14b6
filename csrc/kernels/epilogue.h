// Epilogue of the split-KV kernel: normalises a warpgroup's half of O (and multiplies in descale_k) and writes it.
//   unsplit sequence: out (bf16/fp16) and lse, with the attention sink applied;
//   piece of a split sequence: fp32 partial O and lse to the piece's workspace slot (the combine kernel
//   applies the sink once it knows the final lse).
#pragma once

#include <cute/tensor.hpp>

#include "params.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "utils.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

template <class Traits>
struct SplitKvEpilogue {
  using Element = typename Traits::Element;
  static constexpr int kColsPerWarpgroup = Traits::kColsPerWarpgroup;
  static constexpr float kLn2 = 0.6931471805599453f;

  // Writes this warpgroup's 256 columns of the piece's 64 x 512 result. `stats` holds the rows' final references
  // and this thread's part of the row sums (quad-reduced here); O is the (ROW, COL) accumulator view and
  // tOcO its (row, col) coordinates within the warpgroup's 64 x 256 half.
  template <class TensorO, class TensorC>
  __device__ static void write(const DecodeParams& p, const SplitKvScales& scales, const Piece& piece, int kv_head,
                               int m_tile, int warpgroup, const RowStats& stats, TensorO& O, const TensorC& tOcO) {
    using namespace cute;
    const bool quad_leader = threadIdx.x % 4 == 0;
    CUTE_UNROLL
    for (int r = 0; r < kRowsPerThread; ++r) {
      const float total = quad_sum(stats.sum[r]);
      // false only when the row saw no key of this piece (total exactly 0); a NaN total (NaN in q or in a
      // visible key) stays NaN in out and lse, split or not.
      const bool seen = !(total == 0.f);
      const float lse = seen ? (stats.max[r] * scales.score_log2 + log2f(total)) * kLn2 : -INFINITY;
      const int row = m_tile * Traits::kBlockM + get<0>(tOcO(r, 0));
      float inv = seen ? scales.out / total : 0.f;
      if (!piece.split && seen) inv *= sink_factor(p, row, kv_head, lse);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(O); ++c) O(r, c) *= inv;
      write_row(p, piece, kv_head, row, warpgroup, lse, quad_leader, [&](auto&& store) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(O); c += 2) store(get<1>(tOcO(r, c)), O(r, c), O(r, c + 1));
      });
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
  // 1 / (1 + exp(sink - lse)) for packed row `row` (SPEC.md "attn_sink"); 1 without a sink.
  __device__ static float sink_factor(const DecodeParams& p, int row, int kv_head, float lse) {
    if (p.attn_sink == nullptr || row >= p.rows_per_kv) return 1.f;
    const float sink = p.attn_sink[kv_head * p.heads_per_kv + row % p.heads_per_kv];
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
      const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
      const int64_t offset = ((int64_t(piece.seq) * p.seqlen_q + token) * p.num_heads_q + head) * kHeadDimV + col0;
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
      if (warpgroup == 0 && quad_leader) p.lse[(int64_t(piece.seq) * p.num_heads_q + head) * p.seqlen_q + token] = lse;
    } else {
      const int64_t partial_row = (int64_t(piece.slot) * p.num_heads_k + kv_head) * p.rows_per_kv + row;
      float* dst = p.o_partial + partial_row * kHeadDimV + col0;
      for_each_pair([&](int col, float x0, float x1) { *reinterpret_cast<float2*>(dst + col) = make_float2(x0, x1); });
      if (warpgroup == 0 && quad_leader) p.lse_partial[partial_row] = lse;
    }
  }
};

FLASH_MLA_NAMESPACE_END  // flash_mla
