// Combine kernel: merges the fp32 partial results of split sequences, SPEC.md "Kernels" (3):
//   lse = log sum_k exp(lse_k),   out = sum_k exp(lse_k - lse) * O_k
// One warp per packed query row; unsplit sequences were written by the split kernel and are skipped.
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include "params.h"

namespace flash_mla {
namespace {

constexpr int kWarps = 4;
constexpr int kColsPerLane = kHeadDimV / 32;     // 16 columns, as 4 float4
static_assert(kColsPerLane % 4 == 0, "float4 loads");

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffff, x, o);
  return x;
}

template <class Element>
__global__ void __launch_bounds__(kWarps * 32) mla_combine_kernel(const __grid_constant__ DecodeParams p) {
  const int seq = blockIdx.x, kv_head = blockIdx.y;
  const int row = blockIdx.z * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int first_slot = p.num_splits[seq];
  const int num_pieces = p.num_splits[seq + 1] - first_slot;
  if (num_pieces <= 1 || row >= p.rows_per_kv) return;

  // Partial row `row` of piece k lives at ((first_slot + k) * h_kv + kv_head) * rows_per_kv + row.
  const int64_t piece_stride = int64_t(p.num_heads_k) * p.rows_per_kv;
  const int64_t first_row = (int64_t(first_slot) * p.num_heads_k + kv_head) * p.rows_per_kv + row;

  // ---- lse = logsumexp over the pieces (lanes stride over pieces) ----------------------------------------
  float max_lse = -INFINITY;
  for (int k = lane; k < num_pieces; k += 32) max_lse = fmaxf(max_lse, p.lse_partial[first_row + k * piece_stride]);
  max_lse = warp_max(max_lse);
  const float base = max_lse == -INFINITY ? 0.f : max_lse;      // no piece saw a key: everything stays 0
  float sum = 0.f;
  for (int k = lane; k < num_pieces; k += 32) sum += __expf(p.lse_partial[first_row + k * piece_stride] - base);
  sum = warp_sum(sum);
  const float lse = sum > 0.f ? base + __logf(sum) : -INFINITY;

  // ---- out = sum_k exp(lse_k - lse) O_k ------------------------------------------------------------------
  float4 acc[kColsPerLane / 4];
  for (int v = 0; v < kColsPerLane / 4; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (sum > 0.f) {
    for (int k = 0; k < num_pieces; ++k) {
      const int64_t partial_row = first_row + k * piece_stride;
      const float w = __expf(p.lse_partial[partial_row] - lse);
      const float4* o = reinterpret_cast<const float4*>(p.o_partial + partial_row * kHeadDimV);
#pragma unroll
      for (int v = 0; v < kColsPerLane / 4; ++v) {
        const float4 x = o[v * 32 + lane];                          // coalesced: lanes take adjacent float4s
        acc[v].x += w * x.x; acc[v].y += w * x.y; acc[v].z += w * x.z; acc[v].w += w * x.w;
      }
    }
  }

  const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
  Element* out = static_cast<Element*>(p.out) + ((int64_t(seq) * p.seqlen_q + token) * p.num_heads_q + head) * kHeadDimV;
  struct alignas(8) Quad { Element v[4]; };
#pragma unroll
  for (int v = 0; v < kColsPerLane / 4; ++v) {
    reinterpret_cast<Quad*>(out)[v * 32 + lane] = Quad{{static_cast<Element>(acc[v].x), static_cast<Element>(acc[v].y),
                                                        static_cast<Element>(acc[v].z), static_cast<Element>(acc[v].w)}};
  }
  if (lane == 0) p.lse[(int64_t(seq) * p.num_heads_q + head) * p.seqlen_q + token] = lse;
}

template <class Element>
void launch_combine(const DecodeParams& p, cudaStream_t stream) {
  const dim3 grid(p.batch, p.num_heads_k, (p.rows_per_kv + kWarps - 1) / kWarps);
  mla_combine_kernel<Element><<<grid, kWarps * 32, 0, stream>>>(p);
}

}  // namespace

void launch_mla_combine_bf16(const DecodeParams& params, void* stream) {
  launch_combine<cutlass::bfloat16_t>(params, static_cast<cudaStream_t>(stream));
}
void launch_mla_combine_fp16(const DecodeParams& params, void* stream) {
  launch_combine<cutlass::half_t>(params, static_cast<cudaStream_t>(stream));
}

}  // namespace flash_mla
