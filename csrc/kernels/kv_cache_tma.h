// Host side of the split kernel's TMA copies: the tensor map (CUtensorMap) of the paged KV cache, the sparse
// kernel's map of q (encode_q_tma) and the map its epilogue stores out through (encode_out_tma, at the end).
//
// The cache (num_blocks, 64, num_heads_k, 576) is described as a 4-D tensor, innermost first:
//   (576 columns, 64 tokens, num_heads_k, num_blocks)     strides in bytes: (element size, token, head, block)
// and copied in boxes of 128-byte rows x 64 tokens (one copy unit of one page of one KV head: 8 KiB) with the
// 128-byte swizzle, exactly the K-major SW128 layout WGMMA reads:
//   16-bit cache: 64 columns (SplitKvTraits::SmemLayoutK, one segment);
//   e4m3 cache:   128 columns (SplitKvTraits::SmemLayoutK8, one unit): with an e4m3 q read as they are by S's
//                 e4m3 WGMMAs and only the V units widened to fp16 in place, with a 16-bit q every unit widened
//                 before S (mainloop.h); the box at column 512 reaches past the 576 columns and TMA fills that
//                 part with zeros without reading.
// A box never crosses a page, so the block table is applied per copy: coordinate 3 is the physical block.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "params.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

using TensorMapEncoder = decltype(&cuTensorMapEncodeTiled);

inline TensorMapEncoder tensor_map_encoder() {
  // Through the runtime's driver entry point: the extension links cudart only, not libcuda.
  static const TensorMapEncoder encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                                             &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
      throw std::runtime_error("flash_mla: the CUDA driver has no cuTensorMapEncodeTiled (needs CUDA 12+)");
    }
    return reinterpret_cast<TensorMapEncoder>(fn);
  }();
  return encode;
}

enum class CacheDtype { kBf16, kFp16, kE4m3 };

// Fills params.k_cache_tma for a cache of `dtype`. An empty cache gets no map: no page of it is ever copied.
inline void encode_kv_cache_tma(DecodeParams& params, CacheDtype dtype) {
  static_assert(sizeof(CUtensorMap) == sizeof(params.k_cache_tma), "DecodeParams.k_cache_tma holds a CUtensorMap");
  std::memset(params.k_cache_tma, 0, sizeof(params.k_cache_tma));
  if (params.num_kv_blocks == 0) return;
  const bool fp8 = dtype == CacheDtype::kE4m3;
  const cuuint64_t element_bytes = fp8 ? 1 : 2;
  const cuuint32_t box_cols = 128 / element_bytes;    // one 128-byte row per token
  const CUtensorMapDataType tma_dtype = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                        : dtype == CacheDtype::kFp16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                                     : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t dims[4] = {cuuint64_t(kHeadDimQK), cuuint64_t(kPageBlockSize), cuuint64_t(params.num_heads_k),
                              cuuint64_t(params.num_kv_blocks)};
  // Byte strides of dims 1..3 (the binding checks they are multiples of 16 bytes, as TMA requires).
  const cuuint64_t strides[3] = {cuuint64_t(params.k_token_stride) * element_bytes,
                                 cuuint64_t(params.k_head_stride) * element_bytes,
                                 cuuint64_t(params.k_block_stride) * element_bytes};
  const cuuint32_t box[4] = {box_cols, cuuint32_t(kPageBlockSize), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult res = tensor_map_encoder()(
      reinterpret_cast<CUtensorMap*>(params.k_cache_tma), tma_dtype, 4, const_cast<void*>(params.k_cache), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    throw std::runtime_error("flash_mla: cuTensorMapEncodeTiled failed for k_cache (CUresult " +
                             std::to_string(int(res)) + "); strides must be multiples of 16 bytes");
  }
}

// Fills params.q_tma: q (batch, seqlen_q, num_heads_q, 576) of 16-bit elements as the 4-D tensor
//   (576 columns, num_heads_q, seqlen_q, batch)     strides in bytes: (2, head, token, batch)
// copied in boxes of 64 columns x 64 heads with the 128-byte swizzle: one segment of SmemLayoutK (the Q tile's
// layout), so a Q tile of the sparse kernel (64 heads of one query token: num_heads_q is a multiple of 64 there)
// is nine copies. The copies are bytes to TMA (UINT16): q's dtype does not matter. A dimension of one entry may
// have any stride in torch; TMA wants nonzero multiples of 16 bytes, and its stride is never used: 16 then.
inline void encode_q_tma(DecodeParams& params) {
  static_assert(sizeof(CUtensorMap) == sizeof(params.q_tma), "DecodeParams.q_tma holds a CUtensorMap");
  std::memset(params.q_tma, 0, sizeof(params.q_tma));
  constexpr cuuint64_t kElementBytes = 2;
  const cuuint64_t dims[4] = {cuuint64_t(kHeadDimQK), cuuint64_t(params.num_heads_q), cuuint64_t(params.seqlen_q),
                              cuuint64_t(params.batch)};
  const int64_t element_strides[3] = {params.q_head_stride, params.q_token_stride, params.q_batch_stride};
  cuuint64_t strides[3];
  for (int d = 0; d < 3; ++d) strides[d] = dims[d + 1] == 1 ? 16 : cuuint64_t(element_strides[d]) * kElementBytes;
  const cuuint32_t box[4] = {128 / kElementBytes, cuuint32_t(kRowsPerTile), 1, 1};    // 128-byte rows
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult res = tensor_map_encoder()(
      reinterpret_cast<CUtensorMap*>(params.q_tma), CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(params.q),
      dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    throw std::runtime_error("flash_mla: cuTensorMapEncodeTiled failed for q (CUresult " + std::to_string(int(res)) +
                             "); strides must be nonzero multiples of 16 bytes");
  }
}

// Fills params.out_tma and sets params.out_by_tma where it applies: out (batch, seqlen_q, num_heads_q, 512) of
// 16-bit elements, contiguous (the binding allocates it), with one KV head, is the 3-D tensor
//   (512 columns, rows_per_kv packed rows, batch)     strides in bytes: (2, 1024, 1024 rows_per_kv)
// (packed row = token * num_heads_q + head), stored in boxes of 64 columns x 64 rows with the 128-byte swizzle:
// one segment of SmemLayoutK, so a warpgroup's half of a row tile is four stores; rows past rows_per_kv lie
// outside the tensor and are not written. Where it is used is measured (H200, docs/PERF.md "Split kernel"): with
// 128 query heads or more (each query token's heads fill two row tiles) the measured rows ran 0-2.9 % faster; with
// fewer, one-tile rows stream pages and must not have a V half's refill wait for the epilogue, and h_q 64, s_q 2
// on a bf16 cache lost 0.5-3.4 % at L = 8192. With several KV heads a tile's rows are not consecutive in out. The
// FP8-cache kernels stage bf16 only (`fp8_cache`: the out of an e4m3 or bf16 q; an fp16 q's goes by registers).
inline void encode_out_tma(DecodeParams& params, bool fp8_cache) {
  static_assert(sizeof(CUtensorMap) == sizeof(params.out_tma), "DecodeParams.out_tma holds a CUtensorMap");
  std::memset(params.out_tma, 0, sizeof(params.out_tma));
  params.out_by_tma = params.num_heads_k == 1 && params.batch > 0 && params.heads_per_kv >= 2 * kRowsPerTile &&
                      (!fp8_cache || params.out_bf16);
  if (!params.out_by_tma) return;
  constexpr cuuint64_t kElementBytes = 2, kRowBytes = kHeadDimV * kElementBytes;
  const cuuint64_t dims[3] = {cuuint64_t(kHeadDimV), cuuint64_t(params.rows_per_kv), cuuint64_t(params.batch)};
  const cuuint64_t strides[2] = {kRowBytes, kRowBytes * cuuint64_t(params.rows_per_kv)};
  const cuuint32_t box[3] = {128 / kElementBytes, cuuint32_t(kRowsPerTile), 1};    // 128-byte rows
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult res = tensor_map_encoder()(
      reinterpret_cast<CUtensorMap*>(params.out_tma), CU_TENSOR_MAP_DATA_TYPE_UINT16, 3, params.out, dims, strides,
      box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (res != CUDA_SUCCESS) {
    throw std::runtime_error("flash_mla: cuTensorMapEncodeTiled failed for out (CUresult " + std::to_string(int(res)) +
                             ")");
  }
}

FLASH_MLA_NAMESPACE_END  // flash_mla
