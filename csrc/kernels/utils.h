// Small device helpers: 16-byte cp.async with zero fill, quad reductions, accumulator row/column views.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cute/tensor.hpp>

#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// Copy 16 bytes global -> shared asynchronously (L2 only: the cache is streamed once). With valid == false
// nothing is read and the destination is zero-filled: slots past a sequence's end may hold NaN, and P = 0
// times NaN would still be NaN in O += P V.
__device__ __forceinline__ void cp_async_16_zfill(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}

// A 16-byte chunk from its two 8-byte halves, `first_half` into words 0-1: the FP8 widenings' lanes that store their
// second widened chunk first (bank spread) load their chunk's halves swapped instead of selecting registers after.
__device__ __forceinline__ uint4 load_halves(const char* first_half, const char* second_half) {
  const uint2 a = *reinterpret_cast<const uint2*>(first_half);
  const uint2 b = *reinterpret_cast<const uint2*>(second_half);
  return make_uint4(a.x, a.y, b.x, b.y);
}

// 16 e4m3 values (bytes 0..15) -> 16 fp16 values, 0..7 in `lo` and 8..15 in `hi`. Exact: every e4m3 value
// (subnormals, +-448, NaN) is an fp16 value.
__device__ __forceinline__ void widen_e4m3x16(const uint4& in, uint4& lo, uint4& hi) {
  const uint32_t words[4] = {in.x, in.y, in.z, in.w};
  uint32_t out[8];
  CUTE_UNROLL
  for (int w = 0; w < 4; ++w) {
    // The word's two 16-bit halves as PTX register halves: the conversion then reads bytes 2, 3 straight from the
    // register's upper half (`.H1`), where the intrinsic on `word >> 16` cost a shift per conversion.
    asm("{\n"
        "  .reg .b16 lo, hi;\n"
        "  mov.b32 {lo, hi}, %2;\n"
        "  cvt.rn.f16x2.e4m3x2 %0, lo;\n"
        "  cvt.rn.f16x2.e4m3x2 %1, hi;\n"
        "}\n"
        : "=r"(out[2 * w]), "=r"(out[2 * w + 1])
        : "r"(words[w]));
  }
  lo = make_uint4(out[0], out[1], out[2], out[3]);
  hi = make_uint4(out[4], out[5], out[6], out[7]);
}

// 8 bf16 -> 8 fp16, rounded to nearest. Finite values beyond fp16's range saturate to +-65504 (a q that large
// would overflow any softmax anyway); inf and NaN stay inf and NaN.
__device__ __forceinline__ uint4 bf16x8_to_f16x8(uint4 in) {
  uint32_t* words = reinterpret_cast<uint32_t*>(&in);
  CUTE_UNROLL
  for (int w = 0; w < 4; ++w) {
    float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[w]));
    constexpr float kHalfMax = 65504.f;
    if (fabsf(x.x) > kHalfMax && fabsf(x.x) != INFINITY) x.x = copysignf(kHalfMax, x.x);
    if (fabsf(x.y) > kHalfMax && fabsf(x.y) != INFINITY) x.y = copysignf(kHalfMax, x.y);
    const __half2 h = __float22half2_rn(x);
    words[w] = *reinterpret_cast<const uint32_t*>(&h);
  }
  return in;
}

// Lane `src_lane`'s `value` (every lane of the warp takes part), shuffled where it is written: a volatile asm keeps
// it at its place among the WGMMAs and barriers, where the compiler would move a plain shuffle down to its value's
// use (there the result's latency, and the wait for `value`'s load, would sit on the path to a copy's issue).
__device__ __forceinline__ int shuffle_here(int value, int src_lane) {
  int out;
  asm volatile("shfl.sync.idx.b32 %0, %1, %2, 0x1f, 0xffffffff;\n" : "=r"(out) : "r"(value), "r"(src_lane));
  return out;
}

// The four lanes of a quad hold the columns of the same accumulator rows.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// View a single-atom SM90 accumulator fragment ((2,2,N/8),1,1) as (ROW=2, COL=N/4): a thread owns rows
// r and r + 8 of its warp's 16, and N/4 columns of each (value modes: column pair, row half, column group).
template <class Tensor>
__device__ __forceinline__ auto as_rows_cols(Tensor&& acc) {
  using namespace cute;
  static_assert(decltype(rank(acc.layout()))::value == 3, "expects an (MMA, MMA_M, MMA_N) fragment");
  static_assert(decltype(size<1>(acc))::value == 1 && decltype(size<2>(acc))::value == 1, "one atom only");
  auto v = get<0>(acc.layout());                                   // ((2,2,N/8)) : strides
  auto rows = make_layout(get<1>(v.shape()), get<1>(v.stride()));
  auto cols = make_layout(make_shape(get<0>(v.shape()), get<2>(v.shape())),
                          make_stride(get<0>(v.stride()), get<2>(v.stride())));
  return make_tensor(acc.data(), make_layout(rows, cols));        // (ROW, COL)
}

FLASH_MLA_NAMESPACE_END  // flash_mla
