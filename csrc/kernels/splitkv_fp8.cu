// FP8-cache instantiation of the split-KV kernel for a 16-bit q: e4m3 pages widened to fp16 in shared memory
// (mainloop.h).
#include "splitkv_kernel.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN
void launch_mla_splitkv_fp8(const DecodeParams& params, void* stream) {
  launch_splitkv<cutlass::half_t, cutlass::float_e4m3_t>(params, static_cast<cudaStream_t>(stream));
}
FLASH_MLA_NAMESPACE_END  // flash_mla
