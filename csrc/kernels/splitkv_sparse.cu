// Sparse FP8 instantiation of the split-KV kernel (DeepSeek-V3.2): 656-byte tokens gathered by index, their latent
// part dequantised to fp16 in shared memory (sparse_gather.h), the dense kernel's schedule otherwise.
#include "splitkv_kernel.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN
void launch_mla_splitkv_sparse(const DecodeParams& params, void* stream) {
  launch_splitkv<cutlass::half_t, SparseFp8Token>(params, static_cast<cudaStream_t>(stream));
}
FLASH_MLA_NAMESPACE_END  // flash_mla
