// Online softmax of the split-KV kernel, on one warpgroup's S accumulator (64 query rows x one 64-key page).
//
// Scores stay raw (unscaled) until exp2: P = exp2(S * scale_log2 - m * scale_log2), where m is the running
// row maximum of raw scores. A row that has seen no key yet has m = -inf; its "base" is 0 so that nothing
// computes inf - inf, and every scale factor exp2(m_old * scale_log2 - base) from m_old = -inf is 0.
#pragma once

#include <cute/tensor.hpp>

#include "utils.h"

namespace flash_mla {

// A thread of an SM90 accumulator owns two rows (r and r + 8 of its warp's 16).
constexpr int kRowsPerThread = 2;

struct RowStats {
  float max[kRowsPerThread];    // running maximum of raw scores
  float sum[kRowsPerThread];    // running softmax denominator, relative to exp2(max * scale_log2)
};

__device__ __forceinline__ float exp2_base(float row_max, float scale_log2) {
  return row_max == -INFINITY ? 0.f : row_max * scale_log2;
}

// exp2(old_max * scale_log2 - new base): the factor that moves a sum or an O row from old_max to new_max.
__device__ __forceinline__ float rescale_factor(float old_max, float new_max, float scale_log2) {
  return exp2f(old_max * scale_log2 - exp2_base(new_max, scale_log2));
}

// Masks keys past the piece (key >= end) and, when causal, past each row's last visible key; returns each
// row's maximum over this page (quad-reduced: all four threads of a row agree).
//   S:          (ROW, COL) view of the accumulator
//   tScS:       (ROW, COL) -> (row in tile, key in page) coordinates of the same elements
template <class TensorS, class TensorC>
__device__ __forceinline__ void mask_and_row_max(TensorS& S, const TensorC& tScS, int page_start, int end,
                                                 const int (&last_visible)[kRowsPerThread],
                                                 float (&page_max)[kRowsPerThread]) {
  using namespace cute;
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    float m = -INFINITY;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(S); ++c) {
      const int key = page_start + get<1>(tScS(r, c));
      const bool visible = key < end && key <= last_visible[r];
      S(r, c) = visible ? S(r, c) : -INFINITY;
      m = fmaxf(m, S(r, c));
    }
    page_max[r] = quad_max(m);
  }
}

// S <- exp2(S * scale_log2 - base(new_max)) in place; returns this thread's part of each row's sum.
template <class TensorS>
__device__ __forceinline__ void exponentiate(TensorS& S, const float (&new_max)[kRowsPerThread], float scale_log2,
                                             float (&thread_sum)[kRowsPerThread]) {
  using namespace cute;
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    const float base = exp2_base(new_max[r], scale_log2);
    float sum = 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(S); ++c) {
      S(r, c) = exp2f(S(r, c) * scale_log2 - base);
      sum += S(r, c);
    }
    thread_sum[r] = sum;
  }
}

// O row r *= factor[r]. Skipped when every factor of the warp is exactly 1 (no row maximum moved, the common
// case once a row has seen a few pages): x * 1 == x, so the result is bitwise the same, and the warp saves
// 128 multiplies per call.
template <class TensorO>
__device__ __forceinline__ void scale_rows(TensorO& O, const float (&factor)[kRowsPerThread]) {
  using namespace cute;
  static_assert(kRowsPerThread == 2, "one vote over both rows");
  if (!__any_sync(0xffffffffu, factor[0] != 1.f || factor[1] != 1.f)) return;
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(O); ++c) O(r, c) *= factor[r];
  }
}

}  // namespace flash_mla
