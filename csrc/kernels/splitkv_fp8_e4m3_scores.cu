// FP8-cache instantiation of the split-KV kernel for an e4m3 q: S on the e4m3 tensor cores straight from the
// copied bytes, only V widened to fp16 (mainloop.h, "FP8 cache").
#include "splitkv_kernel.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN
void launch_mla_splitkv_fp8_e4m3_scores(const DecodeParams& params, void* stream) {
  launch_splitkv<cutlass::half_t, cutlass::float_e4m3_t, /*kE4m3Scores=*/true>(params, static_cast<cudaStream_t>(stream));
}
FLASH_MLA_NAMESPACE_END  // flash_mla
