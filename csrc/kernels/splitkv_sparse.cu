// Sparse FP8 instantiation of the split-KV kernel (DeepSeek-V3.2): 656-byte tokens gathered by index and
// dequantised to bf16 in shared memory (sparse_gather.h), the dense bf16 kernel's schedule otherwise.
#include "splitkv_kernel.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN
void launch_mla_splitkv_sparse(const DecodeParams& params, void* stream) {
  launch_splitkv<cutlass::bfloat16_t, SparseFp8Token>(params, static_cast<cudaStream_t>(stream));
}
FLASH_MLA_NAMESPACE_END  // flash_mla
