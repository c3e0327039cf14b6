// Issue rates of the instructions the kernels' softmax and dequantisation lean on, relative to FFMA: how many
// results per clock per SM each delivers when nothing else runs (8 independent chains per thread, 32 warps per SM).
// Decides whether moving work from one pipe to another can pay: exp2 on MUFU vs an FMA-pipe polynomial (the
// split kernel's softmax), e4m3 -> f16x2 by the hardware conversion vs bit operations (the sparse kernel's
// dequantisation), and the f32 -> bf16x2 / f16x2 packing of P.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a benchmarks/instruction_rates.cu -o /tmp/rates
//   /tmp/rates            # one row per instruction: ns per launch (median of 9), results / clock / SM
//
// Results per clock per SM assume the SM clock the device reports (clockRate); the FFMA row (the documented 128 on
// sm_90) shows how far that assumption is off, and the other rows are best read relative to it.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"

constexpr int kChains = 8;          // independent dependency chains per thread
constexpr int kIters = 4096;        // steps per chain
constexpr int kThreads = 256;
constexpr int kCtasPerSm = 4;       // 32 warps per SM

enum Op : int {
  kFfma, kEx2, kCvtE4m3x2ToF16x2, kCvtF32x2ToBf16x2, kCvtF32x2ToF16x2, kHmul2Bf16, kLop3,
  kBitsE4m3x2ToF16x2,    // the same two values by bit operations (e4m3_pair_bits: 2^-8 times the value)
  kMixedE4m3x2ToF16x2,   // half the chains by cvt, half by bit operations: do the two share a pipe?
  kNumOps
};
const char* const kNames[kNumOps] = {"ffma.f32", "ex2.approx.ftz.f32", "cvt.rn.f16x2.e4m3x2",
                                     "cvt.rn.bf16x2.f32", "cvt.rn.f16x2.f32", "mul.rn.bf16x2", "lop3.b32",
                                     "e4m3x2 by bits", "e4m3x2 cvt + bits"};

// Bytes 0 and 1 of `in` (e4m3) -> fp16x2 of 2^-8 times their values, exactly (subnormals included; NaN is not
// kept): the seven magnitude bits shifted into fp16's exponent and mantissa (e4m3's bias 7 against fp16's 15 is
// the factor 2^-8), the sign moved to bit 15. prmt places byte b at bits 8..15 of each half; four instructions.
__device__ __forceinline__ uint32_t e4m3_pair_bits(uint32_t in) {
  uint32_t w, t, y;
  asm volatile("prmt.b32 %0, %1, 0, 0x1404;" : "=r"(w) : "r"(in));             // [b1, 0, b0, 0]
  asm volatile("shr.b32 %0, %1, 1;" : "=r"(t) : "r"(w));
  asm volatile("and.b32 %0, %1, 0x3f803f80;" : "=r"(t) : "r"(t));               // |b| << 7 per half
  asm volatile("lop3.b32 %0, %1, %2, 0x80008000, 0xf8;" : "=r"(y) : "r"(t), "r"(w));    // t | (w & sign)
  return y;
}

// One step of chain c: the result feeds the next step of the same chain, so the chains are independent of each
// other and each step's latency is hidden by the other chains and warps. Results per step: 1 (2 for the paired
// conversions and the bf16x2 multiply count as 1 instruction; the table reports instructions).
template <int kOp>
__device__ __forceinline__ uint32_t step(uint32_t x, uint32_t k, int chain = 0) {
  uint32_t y;
  if constexpr (kOp == kBitsE4m3x2ToF16x2) {
    y = e4m3_pair_bits(x ^ k);
  } else if constexpr (kOp == kMixedE4m3x2ToF16x2) {
    y = chain % 2 == 0 ? step<kCvtE4m3x2ToF16x2>(x, k) : step<kBitsE4m3x2ToF16x2>(x, k);
  } else if constexpr (kOp == kFfma) {
    float f = __uint_as_float(x);
    asm volatile("fma.rn.f32 %0, %1, %2, %3;" : "=f"(f) : "f"(f), "f"(0.999f), "f"(__uint_as_float(k)));
    y = __float_as_uint(f);
  } else if constexpr (kOp == kEx2) {
    float f = __uint_as_float(x);
    asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(f) : "f"(f));
    y = __float_as_uint(f);
  } else if constexpr (kOp == kCvtE4m3x2ToF16x2) {
    asm volatile("{ .reg .b16 lo; mov.b32 {lo, _}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(y) : "r"(x ^ k));
  } else if constexpr (kOp == kCvtF32x2ToBf16x2) {
    asm volatile("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(y) : "f"(__uint_as_float(x)), "f"(__uint_as_float(k)));
  } else if constexpr (kOp == kCvtF32x2ToF16x2) {
    asm volatile("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(y) : "f"(__uint_as_float(x)), "f"(__uint_as_float(k)));
  } else if constexpr (kOp == kHmul2Bf16) {
    asm volatile("mul.rn.bf16x2 %0, %1, %2;" : "=r"(y) : "r"(x), "r"(0x3f803f80u));
  } else {
    asm volatile("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(y) : "r"(x), "r"(k), "r"(0x5a5a5a5au));
  }
  return y;
}

template <int kOp>
__global__ void __launch_bounds__(kThreads) run(uint32_t seed, uint32_t* sink) {
  uint32_t v[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) v[c] = seed + threadIdx.x * 131u + c * 7919u;
  const uint32_t k = seed * 2654435761u;
#pragma unroll 4
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) v[c] = step<kOp>(v[c], k, c);
  }
  uint32_t acc = 0;
#pragma unroll
  for (int c = 0; c < kChains; ++c) acc ^= v[c];
  if (acc == 0x12345678u) sink[blockIdx.x] = acc;     // keeps the chains alive; practically never stores
}

template <int kOp>
float median_ms(int sms, uint32_t* sink) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  run<kOp><<<sms * kCtasPerSm, kThreads>>>(1u, sink);    // warm-up
  CHECK(cudaGetLastError());
  std::vector<float> ms;
  for (int r = 0; r < 9; ++r) {
    CHECK(cudaEventRecord(a));
    run<kOp><<<sms * kCtasPerSm, kThreads>>>(r + 2u, sink);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0.f;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return ms[ms.size() / 2];
}

// Instructions per clock per SM of `kOp` (the device's reported clock), printed as one row against FFMA's rate
// (ffma_rate 0: this is the FFMA row). Returns the rate.
template <int kOp>
double report(int sms, double clock_hz, uint32_t* sink, double ffma_rate) {
  const float ms = median_ms<kOp>(sms, sink);
  const double instructions = double(sms) * kCtasPerSm * kThreads * kChains * kIters;
  const double per_clock_per_sm = instructions / (ms * 1e-3 * clock_hz * sms);
  std::printf("%-22s %10.1f us %9.1f / clock / SM %8.3f x ffma\n", kNames[kOp], ms * 1e3, per_clock_per_sm,
              ffma_rate > 0 ? per_clock_per_sm / ffma_rate : 1.0);
  return per_clock_per_sm;
}

// Every pair of e4m3 bytes (NaN excluded) through both conversions: e4m3_pair_bits must give 2^-8 times cvt's
// fp16 values, bit for bit after the multiply. Returns the number of mismatching pairs (0 expected).
__global__ void check_bits(uint32_t* mismatches) {
  const uint32_t in = blockIdx.x * 256u + threadIdx.x;                 // bytes b1 = blockIdx.x, b0 = threadIdx.x
  if ((in & 0x7fu) == 0x7fu || (in & 0x7f00u) == 0x7f00u) return;      // e4m3 NaN
  uint32_t hw;
  asm("{ .reg .b16 lo; mov.b32 {lo, _}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }" : "=r"(hw) : "r"(in));
  const uint32_t bits = e4m3_pair_bits(in);
  const __half2 scaled = __hmul2(*reinterpret_cast<const __half2*>(&bits), __floats2half2_rn(256.f, 256.f));
  if (*reinterpret_cast<const uint32_t*>(&scaled) != hw) atomicAdd(mismatches, 1u);
}

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const double clock_hz = clock_khz * 1e3;
  uint32_t* sink = nullptr;
  CHECK(cudaMalloc(&sink, prop.multiProcessorCount * kCtasPerSm * sizeof(uint32_t)));
  std::printf("%s, %d SMs, %.0f MHz reported; %d threads x %d CTAs per SM, %d chains x %d steps per thread\n",
              prop.name, prop.multiProcessorCount, clock_hz / 1e6, kThreads, kCtasPerSm, kChains, kIters);
  const int sms = prop.multiProcessorCount;
  const double ffma_rate = report<kFfma>(sms, clock_hz, sink, 0.0);
  report<kEx2>(sms, clock_hz, sink, ffma_rate);
  report<kCvtE4m3x2ToF16x2>(sms, clock_hz, sink, ffma_rate);
  report<kCvtF32x2ToBf16x2>(sms, clock_hz, sink, ffma_rate);
  report<kCvtF32x2ToF16x2>(sms, clock_hz, sink, ffma_rate);
  report<kHmul2Bf16>(sms, clock_hz, sink, ffma_rate);
  report<kLop3>(sms, clock_hz, sink, ffma_rate);
  // Conversions (two values each) per clock: the bit form is four instructions a conversion; if the mixed row
  // beats cvt's, the two run on different pipes and the widening could split its values between them.
  report<kBitsE4m3x2ToF16x2>(sms, clock_hz, sink, ffma_rate);
  report<kMixedE4m3x2ToF16x2>(sms, clock_hz, sink, ffma_rate);
  uint32_t* mismatches = nullptr;
  CHECK(cudaMalloc(&mismatches, sizeof(uint32_t)));
  CHECK(cudaMemset(mismatches, 0, sizeof(uint32_t)));
  check_bits<<<256, 256>>>(mismatches);
  uint32_t host_mismatches = 0;
  CHECK(cudaMemcpy(&host_mismatches, mismatches, sizeof(uint32_t), cudaMemcpyDeviceToHost));
  std::printf("e4m3 pairs where the bit form != cvt / 256: %u of 65,536 less NaNs\n", host_mismatches);
  CHECK(cudaFree(mismatches));
  CHECK(cudaFree(sink));
  return 0;
}
