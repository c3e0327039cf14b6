// bf16 instantiation of the split-KV kernel (one file per element type keeps builds parallel).
#include "splitkv_kernel.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN
void launch_mla_splitkv_bf16(const DecodeParams& params, void* stream) {
  launch_splitkv<cutlass::bfloat16_t>(params, static_cast<cudaStream_t>(stream));
}
FLASH_MLA_NAMESPACE_END  // flash_mla
