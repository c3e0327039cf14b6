// Small device helpers: 16-byte cp.async with zero fill, quad reductions, accumulator row/column views.
#pragma once

#include <cute/tensor.hpp>

namespace flash_mla {

// Copy 16 bytes global -> shared asynchronously (L2 only: the cache is streamed once). With valid == false
// nothing is read and the destination is zero-filled: slots past a sequence's end may hold NaN, and P = 0
// times NaN would still be NaN in O += P V.
__device__ __forceinline__ void cp_async_16_zfill(void* smem_dst, const void* gmem_src, bool valid) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
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

}  // namespace flash_mla
