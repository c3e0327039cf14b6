// Online softmax of the split-KV kernel, on one warpgroup's S accumulator (64 query rows x one 64-key page).
//
// Scores stay raw (unscaled) until exp2: P = exp2(S * scale_log2 - m * scale_log2), where m is the row's
// reference: a raw score at least as large as every score the row has seen minus kLazyRescaleLog2 / scale_log2
// (so P <= 2^kLazyRescaleLog2). The reference moves only when a page's maximum passes it by more than that
// (lazy_reference): then, and only then, O and the row sum are rescaled. Whatever the reference, O / l and
// lse = m + log(l) are the same; a late reference only lets P grow up to 256, which a 16-bit P holds with its
// full precision (bf16 and fp16 alike; fp16 has room up to 65504). A row that has seen no key yet has m = -inf;
// its "base" is 0 so that nothing computes inf - inf, and every scale factor exp2(m_old * scale_log2 - base)
// from m_old = -inf is 0.
#pragma once

#include <cute/tensor.hpp>

#include "utils.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// A thread of an SM90 accumulator owns two rows (r and r + 8 of its warp's 16).
constexpr int kRowsPerThread = 2;

// The scales of one launch, read on the device at the kernel's start (the descales may change between CUDA graph
// replays): scores enter exp2 as S * score_log2, and the normalised O is multiplied by `out`.
struct SplitKvScales {
  float score_log2;    // softmax_scale * log2(e) * descale_q * descale_k
  float out;           // descale_k (V is the cache's first 512 columns)
};

// lse is kept in log2 units until it is written: lse = (reference * score_log2 + log2(sum)) * ln 2.
constexpr float kLn2 = 0.6931471805599453f;

struct RowStats {
  float max[kRowsPerThread];    // the rows' references (raw scores; lazy_reference)
  float sum[kRowsPerThread];    // running softmax denominator, relative to exp2(max * scale_log2)
};

// How far (in log2 units of P) a page's maximum may pass a row's reference before the reference moves. With the
// running maximum as the reference (0 here) nearly every page of a random-score row moves some row maximum of a
// warpgroup, and each move costs 128 multiplies of O (and, when the measurement was made, a wait for the
// warpgroup's P V in flight); with 8 a reference set by a row's first page is rarely passed by 8 (a factor 256)
// later on.
constexpr float kLazyRescaleLog2 = 8.f;

// The reference a page is exponentiated against: `reference` while the page's maximum exceeds it by at most
// kLazyRescaleLog2 in log2 units, else the page's maximum (a row's first key always sets it: -inf is passed by
// anything; a page with no key leaves it).
__device__ __forceinline__ float lazy_reference(float reference, float page_max, float scale_log2) {
  const bool passed = reference == -INFINITY || (page_max - reference) * scale_log2 > kLazyRescaleLog2;
  return passed ? fmaxf(reference, page_max) : reference;
}

// A score above reference_threshold(reference, kLazyRescaleLog2 / scale_log2) passes `reference`: lazy_reference's
// test as one compare a score (a row's maximum passes exactly when one of its scores does), up to the rounding of
// the threshold, which only moves where within an ulp of 2^kLazyRescaleLog2 a reference moves. -inf for a row
// that has seen no key: any score passes (NaN none, as fmaxf leaves it out of a maximum).
__device__ __forceinline__ float reference_threshold(float reference, float margin) {
  return reference == -INFINITY ? -INFINITY : reference + margin;
}

__device__ __forceinline__ float exp2_base(float row_max, float scale_log2) {
  return row_max == -INFINITY ? 0.f : __fmul_rn(row_max, scale_log2);
}

// exp2(old_max * scale_log2 - new base): the factor that moves a sum or an O row from old_max to new_max. Exactly 1
// when the reference did not move, which is what lets a warp skip its rescale (rows_need_rescale): both products
// are rounded alike (__fmul_rn), where a contracted fma(old_max, scale_log2, -base) would leave the product's
// rounding error, exp2 of which is 1 + 1 ulp for most references (kPageA then rescaled O on 92 % of its pairs).
__device__ __forceinline__ float rescale_factor(float old_max, float new_max, float scale_log2) {
  return exp2f(__fmul_rn(old_max, scale_log2) - exp2_base(new_max, scale_log2));
}

// Masks keys past the piece (key >= end) and, when causal, past each row's last visible key; returns each
// row's maximum over this page (quad-reduced: all four threads of a row agree). Only a piece's last page (and,
// causal, the pages holding the last s_q keys) has keys to mask: every other page skips the per-element
// compares, which are most of the softmax's instructions.
//   S:          (ROW, COL) view of the accumulator
//   tScS:       (ROW, COL) -> (row in tile, key in page) coordinates of the same elements
template <class TensorS, class TensorC>
__device__ __forceinline__ void mask_and_row_max(TensorS& S, const TensorC& tScS, int page_start, int end,
                                                 const int (&last_visible)[kRowsPerThread],
                                                 float (&page_max)[kRowsPerThread]) {
  using namespace cute;
  constexpr int kPageKeys = decltype(size<1>(S))::value * 4;    // a quad's threads cover the page's keys
  const int page_last = page_start + kPageKeys - 1;
  const bool all_visible = page_last < end && page_last <= min(last_visible[0], last_visible[1]);
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    float m = -INFINITY;
    if (all_visible) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(S); ++c) m = fmaxf(m, S(r, c));
    } else {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(S); ++c) {
        const int key = page_start + get<1>(tScS(r, c));
        const bool visible = key < end && key <= last_visible[r];
        S(r, c) = visible ? S(r, c) : -INFINITY;
        m = fmaxf(m, S(r, c));
      }
    }
    page_max[r] = quad_max(m);
  }
}

// Sparse decoding: keys whose index slot holds no token become -inf. key_valid: 4 words, word w bit 2 k set when
// key 16 w + k holds one (splitkv_traits.h). Most pages have every slot filled and skip the per-element work.
template <class TensorS, class TensorC>
__device__ __forceinline__ void mask_empty_slots(TensorS& S, const TensorC& tScS, const uint32_t* key_valid) {
  using namespace cute;
  const uint4 words = *reinterpret_cast<const uint4*>(key_valid);
  if ((words.x & words.y & words.z & words.w) == 0xffffffffu) return;
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(S); ++c) {
      const int key = get<1>(tScS(r, c));
      const uint32_t word = key < 32 ? (key < 16 ? words.x : words.y) : (key < 48 ? words.z : words.w);
      if (((word >> (2 * (key % 16))) & 1u) == 0) S(r, c) = -INFINITY;
    }
  }
}

// S <- exp2(S * scale_log2 - base(new_max) + offset) in place; returns this thread's part of each row's sum (with
// the offset: the sparse kernel's P V frame, sparse_gather.h, whose caller takes it out of the sums).
template <class TensorS>
__device__ __forceinline__ void exponentiate(TensorS& S, const float (&new_max)[kRowsPerThread], float scale_log2,
                                             float (&thread_sum)[kRowsPerThread], float offset = 0.f) {
  using namespace cute;
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    const float base = exp2_base(new_max[r], scale_log2) - offset;
    float sum = 0.f;
    CUTE_UNROLL
    for (int c = 0; c < size<1>(S); ++c) {
      S(r, c) = exp2f(S(r, c) * scale_log2 - base);
      sum += S(r, c);
    }
    thread_sum[r] = sum;
  }
}

// True when one of this thread's rows has factor != 1 (a reference moved, or a NaN): only then does a rescale
// change anything (x * 1 == x bitwise), and with lazy references it rarely does after a row's first page.
__device__ __forceinline__ bool rows_need_rescale(const float (&factor)[kRowsPerThread]) {
  static_assert(kRowsPerThread == 2, "one vote over both rows");
  return factor[0] != 1.f || factor[1] != 1.f;
}

// The same over the warp: every lane gets the same answer.
__device__ __forceinline__ bool warp_needs_rescale(const float (&factor)[kRowsPerThread]) {
  return __any_sync(0xffffffffu, rows_need_rescale(factor));
}

// O row r *= factor[r], skipped by a warp whose factors are all 1 (saves 128 multiplies a call).
template <class TensorO>
__device__ __forceinline__ void scale_rows(TensorO& O, const float (&factor)[kRowsPerThread]) {
  using namespace cute;
  if (!warp_needs_rescale(factor)) return;
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(O); ++c) O(r, c) *= factor[r];
  }
}

// The other warpgroup's probabilities P (16-bit, (ROW, COL) view) row r *= factor[r]: the seesaw's cross-
// warpgroup rescale, which moves P_a from m_a to m_b so that one O rescale serves both pages of a pair.
template <class TensorP>
__device__ __forceinline__ void scale_probs(TensorP& P, const float (&factor)[kRowsPerThread]) {
  using namespace cute;
  using Element = typename std::remove_reference_t<TensorP>::value_type;
  if (!warp_needs_rescale(factor)) return;
  CUTE_UNROLL
  for (int r = 0; r < kRowsPerThread; ++r) {
    CUTE_UNROLL
    for (int c = 0; c < size<1>(P); ++c) P(r, c) = static_cast<Element>(static_cast<float>(P(r, c)) * factor[r]);
  }
}

FLASH_MLA_NAMESPACE_END  // flash_mla
