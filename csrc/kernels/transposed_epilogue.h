// Epilogue of the transposed FP8 kernel: at the end of each piece the two computing warpgroups, which took
// alternate pages of it, merge their partial results and write them.
//   1. each warpgroup posts its column references and per-warp column sums        (stats_posted)
//   2. both compute the common reference per column, the factor that moves each warpgroup's part to it, and the
//      total; each scales its O^T and hands the other the dim blocks that one finishes (exchange_posted, in
//      rounds; exchange_read before a round's writes): warpgroup w finishes dims [256 w, + 256)
// The hand-offs are mbarriers of all 256 threads (arrive, then wait for the phase), so every write is ordered
// before the other warpgroup's reads and every read before the next writes (the next piece's stats_posted
// waits for both warpgroups' arrivals, which come after their reads).
//   3. each normalises its dims and writes them: unsplit pieces out (bf16, or fp16 with an fp16 q; attention sink
//      applied) and lse, split ones fp32 partials and lse to the piece's workspace slot (the combine kernel reads them)
// A piece with no pages, or a warpgroup that got none of its pages, has references -inf and sums 0: it adds
// nothing, and a column no key reached gets out 0 and lse -inf.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include <type_traits>

#include "params.h"
#include "result_rows.h"
#include "softmax.h"
#include "tile_scheduler.h"
#include "transposed_mainloop.h"
#include "transposed_traits.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

template <class Traits>
struct TransposedEpilogue {
  using SharedStorage = typename Traits::SharedStorage;
  static constexpr int kWgThreads = Traits::kWarpgroupThreads;
  static constexpr int kSlots = Traits::kSlots;

  // tOrO: the warpgroup's (MMA, 8 dim blocks, 1) O^T accumulator of the piece, its rows in load_vt_fragment's dim
  // order, block k holding dims 64 ((k + 4 w) mod 8) (accumulate_o): blocks 0-3 are the warpgroup's own half, 4-7
  // the other's. `stats` its references and this thread's sums. Leaves tOrO scaled and merged (the caller clears
  // it). Both warpgroups run the same instructions (a block index that depended on the warpgroup would be a runtime
  // index of tOrO, all of it on the stack, or a select the compiler unswitches into a copy per warpgroup).
  // `merges`: the pieces this warpgroup merged before (the mbarriers' phases), incremented here.
  template <class TensorO>
  __device__ __forceinline__ static void write(const DecodeParams& p, const SplitKvScales& scales, SharedStorage& smem,
                                               const Piece& piece, int kv_head, int warpgroup, TensorO& tOrO,
                                               const ColumnStats<kSlots>& stats, int& merges) {
    using Barrier = cutlass::arch::ClusterBarrier;
    constexpr int kRounds = Traits::kExchangeRounds;
    constexpr int kHalf = Traits::kExchangeBlocks;
    const int other = 1 - warpgroup;
    const int t = threadIdx.x % kWgThreads, warp = t / 32, lane = t % 32, quad_lane = lane % 4;

    // ---- 1. references and per-warp sums -----------------------------------------------------------------------
    CUTE_UNROLL
    for (int c = 0; c < kSlots; ++c) {
      float sum = stats.sum[c];    // over the warp's lanes of the column (lane / 4 = the key within 8)
      sum += __shfl_xor_sync(0xffffffffu, sum, 4);
      sum += __shfl_xor_sync(0xffffffffu, sum, 8);
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      if (lane < 4) smem.piece_sum[warpgroup][warp][column_of(c, lane)] = sum;
      if (lane < 4 && warp == 0) smem.piece_ref[warpgroup][column_of(c, lane)] = stats.ref[c];
    }
    Barrier::arrive(&smem.stats_posted);
    Barrier::wait(&smem.stats_posted, merges & 1);

    // ---- 2. the common reference, both parts moved to it, and the hand-over ------------------------------------
    float top[kSlots], total[kSlots], own_factor[kSlots];
    CUTE_UNROLL
    for (int c = 0; c < kSlots; ++c) {
      const int col = column_of(c, quad_lane);
      const float ref[2] = {smem.piece_ref[0][col], smem.piece_ref[1][col]};
      top[c] = fmaxf(ref[0], ref[1]);
      total[c] = 0.f;
      CUTE_UNROLL
      for (int w = 0; w < Traits::kComputeWarpgroups; ++w) {
        const float factor = rescale_factor(ref[w], top[c], scales.score_log2);    // 0 for a part that saw no key
        float sum = 0.f;
        CUTE_UNROLL
        for (int k = 0; k < 4; ++k) sum += smem.piece_sum[w][k][col];
        total[c] += factor * sum;
        if (w == warpgroup) own_factor[c] = factor;
      }
    }
    CUTE_UNROLL
    for (int mb = 0; mb < Traits::kDimBlocks; ++mb) {
      CUTE_UNROLL
      for (int i = 0; i < Traits::kValues; ++i) tOrO(i, mb, 0) *= own_factor[slot_of(i)];
    }
    // Round r hands over blocks kHalf + k (k = kRoundBlocks r ..: the other's half) and adds the other's into
    // blocks k, as float4s of consecutive values (kValues a block).
    CUTE_UNROLL
    for (int round = 0; round < Traits::kExchangeRounds; ++round) {
      if (round > 0) Barrier::wait(&smem.exchange_read, (merges * (kRounds - 1) + round - 1) & 1);
      CUTE_UNROLL
      for (int f = 0; f < Traits::kExchangeFloat4s; ++f) {
        const int k = Traits::kRoundBlocks * round + 4 * f / Traits::kValues, i = 4 * f % Traits::kValues;
        smem.exchange[warpgroup][f][t] = make_float4(tOrO(i, kHalf + k, 0), tOrO(i + 1, kHalf + k, 0),
                                                     tOrO(i + 2, kHalf + k, 0), tOrO(i + 3, kHalf + k, 0));
      }
      Barrier::arrive(&smem.exchange_posted);
      Barrier::wait(&smem.exchange_posted, (merges * kRounds + round) & 1);
      CUTE_UNROLL
      for (int f = 0; f < Traits::kExchangeFloat4s; ++f) {
        const int k = Traits::kRoundBlocks * round + 4 * f / Traits::kValues, i = 4 * f % Traits::kValues;
        const float4 v = smem.exchange[other][f][t];
        tOrO(i, k, 0) += v.x;
        tOrO(i + 1, k, 0) += v.y;
        tOrO(i + 2, k, 0) += v.z;
        tOrO(i + 3, k, 0) += v.w;
      }
      if (round + 1 < kRounds) Barrier::arrive(&smem.exchange_read);
    }
    ++merges;

    // ---- 3. normalise and write: a thread holds dims (2 g, 2 g + 1) of each dim block's warp rows ---------------
    // Every address is a per-piece base plus a row offset from the CTA's row table and a per-thread constant.
    const int dims = 64 * kHalf * warpgroup + 16 * warp + 2 * (lane / 4);    // block 0's dim pair of this thread
    const bool writes_lse = warpgroup == 0 && warp == 0 && lane < 4;
    // column c's lse and the factor that normalises its values (0 for a column no key reached)
    auto normalise = [&](int c, int row, float& lse, float& inv) {
      const bool seen = !(total[c] == 0.f);       // a NaN total stays NaN in out and lse
      lse = seen ? (exp2_base(top[c], scales.score_log2) + log2f(total[c])) * kLn2 : -INFINITY;
      inv = seen ? scales.out / total[c] : 0.f;
      if (!piece.split && seen && p.attn_sink != nullptr) inv /= 1.f + expf(p.attn_sink[smem.row_head[row]] - lse);
    };
    // The slots' rows of this thread, into `out` (Pair: two 16-bit values of out, or a float2 of a split piece's fp32
    // partials) at out_offset(row) + 64 k for dim block k, and lse into lse_out at lse_offset(row).
    auto write_rows = [&](auto pair_tag, auto* out, float* lse_out, auto out_offset, auto lse_offset) {
      using Pair = decltype(pair_tag);
      CUTE_UNROLL
      for (int c = 0; c < kSlots; ++c) {
        const int row = column_of(c, quad_lane);    // the packed query row
        if (row >= p.rows_per_kv) continue;
        float lse, inv;
        normalise(c, row, lse, inv);
        const int i = first_value_of(c);            // the slot's values: i (dim 2 g) and i + 2 (dim 2 g + 1)
        auto* out_row = out + out_offset(row);
        CUTE_UNROLL
        for (int k = 0; k < kHalf; ++k) {
          *reinterpret_cast<Pair*>(out_row + 64 * k) = to_pair<Pair>(tOrO(i, k, 0) * inv, tOrO(i + 2, k, 0) * inv);
        }
        if (writes_lse) lse_out[lse_offset(row)] = lse;
      }
    };
    if (!piece.split) {
      // out is bf16, or with an fp16 q fp16 (the binding's out dtype); rows at the CTA's row table's offsets
      uint16_t* out = static_cast<uint16_t*>(p.out) + ResultRow::seq_out_offset(p, piece.seq) + dims;
      float* lse_out = p.lse + ResultRow::seq_lse_offset(p, piece.seq);
      const auto out_offset = [&](int row) { return smem.row_out[row]; };
      const auto lse_offset = [&](int row) { return smem.row_lse[row]; };
      if (Traits::kWideQ && !p.out_bf16) {
        write_rows(__half2{}, out, lse_out, out_offset, lse_offset);
      } else {
        write_rows(__nv_bfloat162{}, out, lse_out, out_offset, lse_offset);
      }
    } else {
      const int64_t slot_row = partial_row(p, piece.slot, kv_head, 0);
      write_rows(float2{}, p.o_partial + slot_row * kHeadDimV + dims, p.lse_partial + slot_row,
                 [](int row) { return row * kHeadDimV; }, [](int row) { return row; });
    }
  }

 private:
  template <class Pair>
  __device__ __forceinline__ static Pair to_pair(float a, float b) {
    if constexpr (std::is_same_v<Pair, float2>) {
      return make_float2(a, b);
    } else if constexpr (std::is_same_v<Pair, __half2>) {
      return __floats2half2_rn(a, b);
    } else {
      return __floats2bfloat162_rn(a, b);
    }
  }
};

FLASH_MLA_NAMESPACE_END  // flash_mla
