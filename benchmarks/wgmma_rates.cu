// Tensor-pipe throughput of the WGMMA shapes the split kernel uses or could use, with two warpgroups of one CTA per
// SM issuing at once (as the split kernel's two computing warpgroups do) and nothing else running: the ceiling of
// each shape, and of the kernel's own mix of S and P V, against the dense peak (4,096 bf16 / 8,192 e4m3 FLOP per
// clock per SM). Decides whether a schedule change that alters a WGMMA's N (or moves an operand into registers)
// can pay before any kernel is built around it. Operands are zeros in shared memory, laid out as the kernel's
// (K-major with the 128-byte swizzle; V^T MN-major); each warpgroup issues batches of four WGMMAs into its
// accumulator, one commit group each, with at most two groups in flight. Cycles by clock64 per warpgroup.
//
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -I<cutlass>/include \
//        -I$CUDA_HOME/include/cccl -Icsrc/kernels benchmarks/wgmma_rates.cu -o /tmp/wgmma && /tmp/wgmma
//   (<cutlass>: python3 -c "import cutlass_library, os; print(os.path.dirname(cutlass_library.__file__))"/source)
//
// One row per configuration: FLOP per clock per SM (median over CTAs of both warpgroups' work over the longer of
// their two spans) and its fraction of the dense peak.
//
// A second table times a refill while the tensor pipe streams: a ninth warp copies 32 KiB (four 8 KiB bulk copies,
// a V half of a 16-bit page) from global memory into its own shared-memory buffer, one refill after another, and
// clock64 times each from issue to its mbarrier's completion, while the two warpgroups run a shape (or nothing).
// The sources are an L2-resident 4 MiB window, so the row says how much the WGMMAs' shared-memory operand reads slow
// the copies' writes into shared memory (the split kernel's release-to-landing loop, docs/PERF.md).
//
// A third table times the FP8 cache's V widening (csrc/kernels/fp8_widening.h widen_unit, the kernel's own code): a
// third warpgroup widens a V half (two units, e4m3 -> fp16 in place) again and again while the two warpgroups stream
// a shape (or nothing); clock64 per half, against the conversions' floor at the SM's cvt rate (16,384 values at 62 a
// clock: 264 cycles, benchmarks/instruction_rates.cu). Says whether the widening is bound by its own instructions or
// by the shared memory the WGMMAs read. (Compile with -Icsrc/kernels as well.)
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/numeric_types.h>

#include "fp8_widening.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"

using namespace cute;

constexpr int kKBlocksPerBatch = 4;    // WGMMAs per commit group (a 64-column unit of a 16-bit page, as S issues)
constexpr int kWgThreads = 128;

// One WGMMA shape: element T, N, A from registers (RS) or shared memory (SS), B K-major or MN-major (V^T).
template <class T, int N, bool kRegisterA, bool kBMnMajor>
struct Shape_ {
  using Element = T;
  static constexpr int kN = N;
  static constexpr bool kRegA = kRegisterA;
  static constexpr int kK = 32 / int(sizeof(T));                       // K of one instruction: 16 (16-bit), 32 (e4m3)
  static constexpr int kBatchK = kK * kKBlocksPerBatch;
  using BatchShape = cute::Shape<_64, Int<N>, Int<kBatchK>>;
  static constexpr auto kMajorB = kBMnMajor ? GMMA::Major::MN : GMMA::Major::K;
  static auto make_mma() {
    if constexpr (kRegisterA) return make_tiled_mma(GMMA::rs_op_selector<T, T, float, BatchShape, GMMA::Major::K, kMajorB>());
    else return make_tiled_mma(GMMA::ss_op_selector<T, T, float, BatchShape, GMMA::Major::K, kMajorB>());
  }
  using TiledMma = decltype(make_mma());
  using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, cute::Shape<_64, Int<kBatchK>>{}));
  static auto make_layout_b() {    // (N, K); MN-major tiled key-first, as the kernel's V^T
    if constexpr (kBMnMajor) {
      return tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, cute::Shape<Int<N>, Int<kBatchK>>{}, Step<_2, _1>{});
    } else {
      return tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, cute::Shape<Int<N>, Int<kBatchK>>{});
    }
  }
  using SmemLayoutB = decltype(make_layout_b());
  static constexpr int kSmemBytes = (64 + N) * kBatchK * int(sizeof(T));
  static constexpr double kBatchFlop = 2.0 * 64 * N * kBatchK;
  static constexpr bool kE4m3 = sizeof(T) == 1;
  static const char* name();
};

// `batches` commit groups of kKBlocksPerBatch WGMMAs of shape S on operands at `smem`, at most kInFlight groups in
// flight (1: each batch waited for before the next is issued, as the split kernel waits for a page's P V); returns
// the accumulator's sum (so that nothing is dead code).
template <class S, int kInFlight = 2>
__device__ float issue(char* smem, int batches) {
  static_assert(kInFlight == 1 || kInFlight == 2, "wait<0> or wait<1> after each batch");
  using T = typename S::Element;
  typename S::TiledMma mma;
  auto thr = mma.get_slice(threadIdx.x % kWgThreads);
  Tensor sA = make_tensor(make_smem_ptr(reinterpret_cast<T*>(smem)), typename S::SmemLayoutA{});          // (64, K)
  Tensor sB = make_tensor(make_smem_ptr(reinterpret_cast<T*>(smem) + cosize(typename S::SmemLayoutA{})),
                          typename S::SmemLayoutB{});                                                      // (N, K)
  Tensor tCrB = thr.partition_fragment_B(sB);                                                              // (MMA, 1, 4)
  Tensor acc = partition_fragment_C(mma, cute::Shape<_64, Int<S::kN>>{});                                 // (MMA, 1, 1)
  clear(acc);
  auto run = [&](auto& tCrA) {
#pragma unroll 1
    for (int b = 0; b < batches; ++b) {
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tCrB); ++k) gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
      warpgroup_commit_batch();
      warpgroup_wait<kInFlight - 1>();
      warpgroup_fence_operand(acc);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
  };
  if constexpr (S::kRegA) {
    Tensor tCrA = make_tensor<T>(partition_shape_A(mma, cute::Shape<_64, Int<S::kBatchK>>{}));           // (MMA, 1, 4)
    clear(tCrA);
    run(tCrA);
  } else {
    Tensor tCrA = thr.partition_fragment_A(sA);                                                            // (MMA, 1, 4)
    run(tCrA);
  }
  float sum = 0.f;
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) sum += acc(i);
  return sum;
}

// The operands: zeros in shared memory (the callers fence them into the async proxy before any WGMMA reads them).
__device__ void zero_fill(char* smem, int bytes) {
  for (int i = threadIdx.x; i < bytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
}

// Warpgroup 0 streams `rounds` batches of shape A, warpgroup 1 of shape B (operands of A, then of B, at `smem`).
template <class A, class B>
__device__ float one_shape_each(char* smem, int rounds) {
  return threadIdx.x / kWgThreads == 0 ? issue<A>(smem, rounds) : issue<B>(smem + A::kSmemBytes, rounds);
}

// Warpgroup 0 issues shape A, warpgroup 1 shape B; kMix: each warpgroup alternates the kernel's per-page mix
// instead (nine S batches of shape A, then two P V batches of shape B: 36 + 8 WGMMAs, one page's S and a V half's
// two P V).
template <class A, class B, bool kMix>
__global__ void __launch_bounds__(2 * kWgThreads, 1) rate_kernel(int rounds, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) char smem[];
  zero_fill(smem, A::kSmemBytes + B::kSmemBytes);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int warpgroup = threadIdx.x / kWgThreads;
  const long long start = clock64();
  float sum = 0.f;
  if constexpr (kMix) {
#pragma unroll 1
    for (int r = 0; r < rounds; ++r) {
      sum += issue<A>(smem, 9);
      sum += issue<B>(smem + A::kSmemBytes, 2);
    }
  } else {
    sum = one_shape_each<A, B>(smem, rounds);
  }
  const long long end = clock64();
  if (threadIdx.x % kWgThreads == 0) cycles[blockIdx.x * 2 + warpgroup] = end - start;
  if (sum != 0.f) sink[blockIdx.x] = sum;    // the operands are zeros: never stores
}

// Warpgroup 0 issues `rounds` batches of shape S, each waited for before the next (kInFlight 1) or two in flight;
// warpgroup 1 the same (kBoth) or nothing: how much of a lone warpgroup's batch is the tensor pipe's fill and drain.
template <class S, bool kBoth, int kInFlight>
__global__ void __launch_bounds__(2 * kWgThreads, 1) batch_kernel(int rounds, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) char smem[];
  zero_fill(smem, 2 * S::kSmemBytes);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int warpgroup = threadIdx.x / kWgThreads;
  if (!kBoth && warpgroup == 1) return;
  const long long start = clock64();
  const float sum = issue<S, kInFlight>(smem + warpgroup * S::kSmemBytes, rounds);
  const long long end = clock64();
  if (threadIdx.x % kWgThreads == 0) cycles[blockIdx.x * 2 + warpgroup] = end - start;
  if (sum != 0.f) sink[blockIdx.x] = sum;    // the operands are zeros: never stores
}

constexpr int kCopyBytes = 32 * 1024, kCopyBoxes = 4, kCopyRefills = 48;
constexpr int kWindowBytes = 4 << 20;    // L2-resident source window

// Warpgroups 0 and 1 issue shape A / B (kIdle: nothing) for `rounds` batches; warp 8's lane 0 meanwhile refills a
// 32 KiB buffer kCopyRefills times from `src` (CTA c's refill r at offset ((c * 7 + r) * 32 KiB) mod the window),
// cycles[c * kCopyRefills + r] = clock64 from the first copy's issue to the barrier's completion.
template <class A, class B, bool kIdle>
__global__ void __launch_bounds__(2 * kWgThreads + 32, 1) copy_kernel(int rounds, const char* src, long long* cycles,
                                                                       float* sink) {
  extern __shared__ __align__(1024) char smem[];
  __shared__ alignas(8) uint64_t full;
  constexpr int kBytes = A::kSmemBytes + B::kSmemBytes;
  char* copy_buffer = smem + kBytes;
  zero_fill(smem, kBytes);
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&full));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int warpgroup = threadIdx.x / kWgThreads;
  float sum = 0.f;
  if (warpgroup == 2) {
    if (threadIdx.x % 32 != 0) return;
    const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(copy_buffer));
    uint32_t parity = 0;
#pragma unroll 1
    for (int r = 0; r < kCopyRefills; ++r) {
      const char* from = src + (int64_t(blockIdx.x * 7 + r) * kCopyBytes) % kWindowBytes;
      const long long start = clock64();
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kCopyBytes) : "memory");
      for (int b = 0; b < kCopyBoxes; ++b) {
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(dst + b * (kCopyBytes / kCopyBoxes)), "l"(from + b * (kCopyBytes / kCopyBoxes)),
                     "r"(kCopyBytes / kCopyBoxes), "r"(bar) : "memory");
      }
      asm volatile(
          "{\n .reg .pred p;\n WAIT:\n"
          " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
          " @!p bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
      parity ^= 1;
      cycles[int64_t(blockIdx.x) * kCopyRefills + r] = clock64() - start;
    }
    return;
  }
  if constexpr (!kIdle) sum = one_shape_each<A, B>(smem, rounds);
  if (sum != 0.f) sink[blockIdx.x] = sum;    // the operands are zeros: never stores
}

using WidenTraits = flash_mla::SplitKvTraits<cutlass::half_t, cutlass::float_e4m3_t, true>;
using Widening = flash_mla::Fp8Widening<WidenTraits>;
constexpr int kWidenHalves = 64;
constexpr int kBlockRows = WidenTraits::kBlockN;    // every row of the page valid
constexpr int kPageBytes = WidenTraits::kSegments * int(WidenTraits::kSegmentBytes);    // 72 KiB

// What warpgroup 2 moves through shared memory in widen_kernel: a V half widened (16 KiB read, 32 KiB written), or the
// same bytes only read (16 B loads) or only written (16 B stores), to tell which direction the WGMMAs starve.
enum BulkTraffic : int { kWidenHalf = 0, kReadHalf = 1, kWriteHalf = 2 };

// Warpgroups 0 and 1 stream shape A / B (kIdle: nothing) for `rounds` batches; warpgroup 2 moves a V half's bytes
// (kTraffic) kWidenHalves times, each followed by the kernel's fence and warpgroup barrier;
// cycles[c * kWidenHalves + h] = clock64 of half h (thread 0 of warpgroup 2).
template <class A, class B, bool kIdle, int kTraffic>
__global__ void __launch_bounds__(3 * kWgThreads, 1) widen_kernel(int rounds, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) char smem[];
  constexpr int kBytes = A::kSmemBytes + B::kSmemBytes;
  auto* page = reinterpret_cast<cutlass::half_t*>(smem + kBytes);    // (kBytes is a multiple of 1 KiB)
  zero_fill(smem, kBytes + kPageBytes);
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int warpgroup = threadIdx.x / kWgThreads;
  float sum = 0.f;
  if (warpgroup == 2) {
#pragma unroll 1
    for (int h = 0; h < kWidenHalves; ++h) {
      const long long start = clock64();
      if constexpr (kTraffic == kWidenHalf) {
        Widening::widen_unit(page, 0, kBlockRows);
        Widening::widen_unit(page, 1, kBlockRows);
      } else if constexpr (kTraffic == kReadHalf) {    // the half's 16 KiB of e4m3 bytes (two units' first halves)
        const uint4* bytes = reinterpret_cast<const uint4*>(page);
        uint4 acc = make_uint4(0, 0, 0, 0);
        CUTE_UNROLL
        for (int k = 0; k < 8; ++k) {
          const uint4 v = bytes[(k / 4) * 1024 + (k % 4) * kWgThreads + threadIdx.x % kWgThreads];
          acc.x ^= v.x, acc.y ^= v.y, acc.z ^= v.z, acc.w ^= v.w;
        }
        if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) sink[blockIdx.x] = 1.f;    // zeros: never stores
      } else {                                         // the half's 32 KiB of fp16 values
        uint4* values = reinterpret_cast<uint4*>(page);
        CUTE_UNROLL
        for (int k = 0; k < 16; ++k) values[k * kWgThreads + threadIdx.x % kWgThreads] = make_uint4(0, 0, 0, h);
      }
      cutlass::arch::fence_view_async_shared();
      flash_mla::warpgroup_sync(flash_mla::WarpgroupBarrier::kUnitWidened, 0);
      if (threadIdx.x % kWgThreads == 0) cycles[int64_t(blockIdx.x) * kWidenHalves + h] = clock64() - start;
    }
    return;
  }
  if constexpr (!kIdle) sum = one_shape_each<A, B>(smem, rounds);
  if (sum != 0.f) sink[blockIdx.x] = sum;    // the operands are zeros: never stores
}

// What a CUDA-core shared-memory access costs while the warpgroups stream a shape: warp 8's lane 0 times
// kAccesses of one kind, one after another (each waits for the previous one's result): kTryWait, an
// mbarrier.try_wait on a phase already complete (the split kernel's unit and mailbox waits); kArrive, an mbarrier
// arrive (a TMA refill's expect_tx, a mailbox post); kLoad, a 4-byte ld.shared. cycles[c * kAccesses + i].
enum SmemAccess : int { kTryWait = 0, kArrive = 1, kLoad = 2 };
constexpr int kAccesses = 64;

template <class A, class B, bool kIdle, int kAccess>
__global__ void __launch_bounds__(2 * kWgThreads + 32, 1) access_kernel(int rounds, long long* cycles, float* sink) {
  extern __shared__ __align__(1024) char smem[];
  __shared__ alignas(8) uint64_t bar;
  constexpr int kBytes = A::kSmemBytes + B::kSmemBytes;
  zero_fill(smem, kBytes);
  const uint32_t bar_addr = static_cast<uint32_t>(__cvta_generic_to_shared(&bar));
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar_addr));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  float sum = 0.f;
  if (threadIdx.x / kWgThreads == 2) {
    if (threadIdx.x % 32 != 0) return;
    if (kAccess == kTryWait) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar_addr) : "memory");
    uint32_t value = 0;
    // Let the WGMMA streams start before the first access.
    for (long long t0 = clock64(); clock64() - t0 < 20000;) {
    }
#pragma unroll 1
    for (int i = 0; i < kAccesses; ++i) {
      const long long start = clock64();
      if constexpr (kAccess == kTryWait) {
        asm volatile(
            "{\n .reg .pred p;\n WAIT:\n"
            " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
            " @!p bra WAIT;\n}\n" ::"r"(bar_addr), "r"(0u) : "memory");    // phase 0 complete: returns at once
      } else if constexpr (kAccess == kArrive) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar_addr) : "memory");
      } else {
        uint32_t loaded;
        asm volatile("ld.shared.u32 %0, [%1];" : "=r"(loaded) : "r"(bar_addr + (value & 4u)) : "memory");
        value += loaded;
      }
      cycles[int64_t(blockIdx.x) * kAccesses + i] = clock64() - start + (value & 1u);
    }
    return;
  }
  if constexpr (!kIdle) sum = one_shape_each<A, B>(smem, rounds);
  if (sum != 0.f) sink[blockIdx.x] = sum;    // the operands are zeros: never stores
}

// What a kernel writes into `slots` clock64 counts: launch(cycles, sink, warm_up) launches it, once with warm_up set
// and once without (a launcher may skip the first); the second launch's counts come back. One sink float a CTA.
template <class Launch>
std::vector<long long> measured_cycles(size_t slots, int ctas, Launch&& launch) {
  long long* cycles = nullptr;
  float* sink = nullptr;
  CHECK(cudaMalloc(&cycles, slots * sizeof(long long)));
  CHECK(cudaMalloc(&sink, ctas * sizeof(float)));
  launch(cycles, sink, true);
  launch(cycles, sink, false);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<long long> host(slots);
  CHECK(cudaMemcpy(host.data(), cycles, host.size() * sizeof(long long), cudaMemcpyDeviceToHost));
  CHECK(cudaFree(cycles));
  CHECK(cudaFree(sink));
  return host;
}

template <class A, class B, bool kIdle>
void report_access(const char* label, int sms, int rounds) {
  constexpr int kBytes = A::kSmemBytes + B::kSmemBytes;
  long long medians[3];
  auto one = [&](auto kernel, int which) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    std::vector<long long> host = measured_cycles(size_t(sms) * kAccesses, sms, [&](long long* cycles, float* sink,
                                                                                    bool warm_up) {
      if (!warm_up) kernel<<<sms, 2 * kWgThreads + 32, kBytes>>>(rounds, cycles, sink);    // (no warm-up)
    });
    std::sort(host.begin(), host.end());
    medians[which] = host[host.size() / 2];
  };
  one(access_kernel<A, B, kIdle, kTryWait>, kTryWait);
  one(access_kernel<A, B, kIdle, kArrive>, kArrive);
  one(access_kernel<A, B, kIdle, kLoad>, kLoad);
  std::printf("%-58s %8lld %8lld %8lld\n", label, medians[kTryWait], medians[kArrive], medians[kLoad]);
}

// One row: the median cycles a half of each kind of traffic (and the widening's p90).
template <class A, class B, bool kIdle>
void report_widen(const char* label, int sms, int rounds) {
  constexpr int kBytes = A::kSmemBytes + B::kSmemBytes + kPageBytes;
  long long median[3], widen_p90 = 0;
  auto one = [&](auto kernel, int which) {
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    std::vector<long long> host = measured_cycles(size_t(sms) * kWidenHalves, sms, [&](long long* cycles,
                                                                                       float* sink, bool) {
      kernel<<<sms, 3 * kWgThreads, kBytes>>>(rounds, cycles, sink);
    });
    std::sort(host.begin(), host.end());
    median[which] = host[host.size() / 2];
    if (which == kWidenHalf) widen_p90 = host[host.size() * 9 / 10];
  };
  one(widen_kernel<A, B, kIdle, kWidenHalf>, kWidenHalf);
  one(widen_kernel<A, B, kIdle, kReadHalf>, kReadHalf);
  one(widen_kernel<A, B, kIdle, kWriteHalf>, kWriteHalf);
  std::printf("%-58s %8lld %8lld %8lld %8lld\n", label, median[kWidenHalf], widen_p90, median[kReadHalf],
              median[kWriteHalf]);
}

template <class A, class B, bool kIdle>
void report_copy(const char* label, int sms, int rounds, const char* src) {
  constexpr int kBytes = A::kSmemBytes + B::kSmemBytes + kCopyBytes;
  auto kernel = copy_kernel<A, B, kIdle>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  // (the warm-up also brings the window into L2)
  std::vector<long long> host = measured_cycles(size_t(sms) * kCopyRefills, sms, [&](long long* cycles, float* sink,
                                                                                     bool) {
    kernel<<<sms, 2 * kWgThreads + 32, kBytes>>>(rounds, src, cycles, sink);
  });
  std::sort(host.begin(), host.end());
  std::printf("%-58s %8lld %8lld\n", label, host[host.size() / 2], host[host.size() * 9 / 10]);
}

template <class T, int N, bool kRegisterA, bool kBMnMajor>
const char* Shape_<T, N, kRegisterA, kBMnMajor>::name() {
  static char buf[64];
  std::snprintf(buf, sizeof(buf), "%s %s m64n%dk%d%s", kE4m3 ? "e4m3" : "bf16", kRegisterA ? "RS" : "SS", N, kK,
                kBMnMajor ? " (B MN-major)" : "");
  return buf;
}

// Launches a two-warpgroup kernel of (rounds, cycles, sink): an eighth of the rounds to warm up, then all of them.
template <class Kernel>
std::vector<long long> two_warpgroup_cycles(Kernel kernel, int bytes, int sms, int rounds) {
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
  return measured_cycles(size_t(sms) * 2, sms, [&](long long* cycles, float* sink, bool warm_up) {
    kernel<<<sms, 2 * kWgThreads, bytes>>>(warm_up ? rounds / 8 : rounds, cycles, sink);
  });
}

template <class A, class B, bool kMix>
void report(const char* label, int sms, int rounds) {
  const std::vector<long long> host =
      two_warpgroup_cycles(rate_kernel<A, B, kMix>, A::kSmemBytes + B::kSmemBytes, sms, rounds);
  const double flop = kMix ? 2.0 * rounds * (9 * A::kBatchFlop + 2 * B::kBatchFlop)
                           : rounds * (A::kBatchFlop + B::kBatchFlop);
  const double peak = (A::kE4m3 && B::kE4m3) ? 8192.0 : 4096.0;
  std::vector<double> rate(sms);
  for (int c = 0; c < sms; ++c) rate[c] = flop / double(std::max(host[2 * c], host[2 * c + 1]));
  std::sort(rate.begin(), rate.end());
  const double median = rate[sms / 2];
  std::printf("%-58s %8.0f FLOP / clock / SM  %5.1f %% of peak\n", label, median, 100.0 * median / peak);
}

// Cycles per batch of warpgroup 0 (median over CTAs) and the tensor pipe's share of them (a batch's FLOP at the
// dense peak, both warpgroups' batches counted with kBoth).
template <class S, bool kBoth, int kInFlight>
void report_batch(const char* label, int sms, int rounds) {
  const std::vector<long long> host = two_warpgroup_cycles(batch_kernel<S, kBoth, kInFlight>, 2 * S::kSmemBytes, sms,
                                                           rounds);
  std::vector<double> per_batch(sms);
  for (int c = 0; c < sms; ++c) per_batch[c] = double(host[2 * c]) / rounds;
  std::sort(per_batch.begin(), per_batch.end());
  const double median = per_batch[sms / 2];
  const double peak = S::kE4m3 ? 8192.0 : 4096.0;
  const double busy = (kBoth ? 2 : 1) * S::kBatchFlop / peak;    // tensor cycles of the batches issued meanwhile
  std::printf("%-58s %8.0f cycles a batch  %5.1f %% of peak\n", label, median, 100.0 * busy / median);
}

using Bf16 = cutlass::bfloat16_t;
using E4m3 = cutlass::float_e4m3_t;
using S64 = Shape_<Bf16, 64, false, false>;       // S today: Q and K from shared memory, N = 64
using S128 = Shape_<Bf16, 128, false, false>;
using S256 = Shape_<Bf16, 256, false, false>;
using R64 = Shape_<Bf16, 64, true, false>;        // S with Q in registers
using PV128 = Shape_<Bf16, 128, true, true>;
using PV256 = Shape_<Bf16, 256, true, true>;      // P V today: P in registers, V^T MN-major, N = 256
using PV256S = Shape_<Bf16, 256, false, true>;    // P V with P in shared memory
using E64 = Shape_<E4m3, 64, false, false>;       // the e4m3-scores kernel's S
using E32 = Shape_<E4m3, 32, false, false>;
using E128 = Shape_<E4m3, 128, false, false>;     // e4m3 S over a page pair side by side
using ER64 = Shape_<E4m3, 64, true, false>;       // e4m3 S with Q in registers

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount, rounds = 4096;
  std::printf("%s, %d SMs; one CTA per SM, two warpgroups, batches of %d WGMMAs, at most two commit groups in flight\n",
              prop.name, sms, kKBlocksPerBatch);
  char label[128];
  auto both = [&](const char* name) { std::snprintf(label, sizeof(label), "both: %s", name); return label; };
  report<S64, S64, false>(both(S64::name()), sms, rounds);
  report<S128, S128, false>(both(S128::name()), sms, rounds);
  report<S256, S256, false>(both(S256::name()), sms, rounds);
  report<R64, R64, false>(both(R64::name()), sms, rounds);
  report<PV128, PV128, false>(both(PV128::name()), sms, rounds);
  report<PV256, PV256, false>(both(PV256::name()), sms, rounds);
  report<E64, E64, false>(both(E64::name()), sms, rounds);
  report<E32, E32, false>(both(E32::name()), sms, rounds);
  report<E128, E128, false>(both(E128::name()), sms, rounds);
  report<ER64, ER64, false>(both(ER64::name()), sms, rounds);
  report<S64, PV256, false>("one each: bf16 SS m64n64k16 | bf16 RS m64n256k16 (MN)", sms, rounds);
  report<S64, PV256, true>("kernel mix: 36 x SS m64n64k16 + 8 x RS m64n256k16 (MN)", sms, rounds / 8);
  report<R64, PV256, true>("kernel mix, S from registers: 36 x RS m64n64k16 + 8 x PV", sms, rounds / 8);
  report<S128, PV256, true>("mix with S at N = 128: 36 x SS m64n128k16 + 8 x PV", sms, rounds / 8);

  std::printf("\n# batches of %d WGMMAs into one accumulator, by one warpgroup or both: cycles a batch of warpgroup 0 "
              "(median over CTAs)\n", kKBlocksPerBatch);
  auto row = [&](const char* who, const char* name, const char* how) {
    std::snprintf(label, sizeof(label), "%s: %s, %s", who, name, how);
    return label;
  };
  report_batch<PV256, false, 1>(row("one", PV256::name(), "each waited"), sms, rounds);
  report_batch<PV256, false, 2>(row("one", PV256::name(), "two in flight"), sms, rounds);
  report_batch<PV256, true, 1>(row("both", PV256::name(), "each waited"), sms, rounds);
  report_batch<PV256S, false, 1>(row("one", PV256S::name(), "each waited"), sms, rounds);
  report_batch<PV256S, false, 2>(row("one", PV256S::name(), "two in flight"), sms, rounds);
  report_batch<PV256S, true, 1>(row("both", PV256S::name(), "each waited"), sms, rounds);
  report_batch<PV128, false, 1>(row("one", PV128::name(), "each waited"), sms, rounds);
  report_batch<S64, false, 1>(row("one", S64::name(), "each waited"), sms, rounds);
  report_batch<S64, false, 2>(row("one", S64::name(), "two in flight"), sms, rounds);
  report_batch<E64, false, 1>(row("one", E64::name(), "each waited"), sms, rounds);

  char* window = nullptr;
  CHECK(cudaMalloc(&window, kWindowBytes));
  CHECK(cudaMemset(window, 0, kWindowBytes));
  std::printf("\n# a 32 KiB refill (four 8 KiB bulk copies from an L2-resident window) while both warpgroups stream a "
              "shape: clock64 cycles issue -> landing, median / p90 over %d refills a CTA\n", kCopyRefills);
  std::printf("%-58s %8s %8s\n", "warpgroups", "p50", "p90");
  report_copy<S64, S64, true>("idle", sms, rounds, window);
  report_copy<S64, S64, false>(both(S64::name()), sms, rounds, window);
  report_copy<S128, S128, false>(both(S128::name()), sms, rounds, window);
  report_copy<R64, R64, false>(both(R64::name()), sms, rounds, window);
  // P V at N = 128 (N = 256 with the copy warp's registers serialises its WGMMAs): the same shared-memory bytes a
  // tensor cycle as the kernel's N = 256.
  report_copy<PV128, PV128, false>(both(PV128::name()), sms, rounds, window);
  report_copy<S64, PV128, false>("one each: bf16 SS m64n64k16 | bf16 RS m64n128k16 (MN)", sms, rounds, window);
  CHECK(cudaFree(window));

  // The widening's halves take ~64 x 1,000 cycles; the WGMMA streams outlast them (4,096 batches of >= 128 cycles).
  std::printf("\n# the FP8 V widening (fp8_widening.h widen_unit, two units = a V half, 16,384 values) by a third "
              "warpgroup while both warpgroups stream a shape: clock64 cycles a half (median; the widening's p90), "
              "and the same bytes only read (16 KiB) or only written (32 KiB); the conversions' floor is 264\n");
  std::printf("%-58s %8s %8s %8s %8s\n", "warpgroups", "widen", "p90", "read", "write");
  report_widen<E64, E64, true>("idle", sms, rounds);
  report_widen<E64, E64, false>(both(E64::name()), sms, rounds);
  report_widen<PV128, PV128, false>(both(PV128::name()), sms, rounds);
  report_widen<E64, PV128, false>("one each: e4m3 SS m64n64k32 | bf16 RS m64n128k16 (MN)", sms, rounds);
  report_widen<S64, S64, false>(both(S64::name()), sms, rounds);
  report_widen<S128, S128, false>(both(S128::name()), sms, rounds);
  report_widen<E128, E128, false>(both(E128::name()), sms, rounds);
  report_widen<ER64, ER64, false>(both(ER64::name()), sms, rounds);

  std::printf("\n# one CUDA-core shared-memory access at a time by a ninth warp while both warpgroups stream a shape: "
              "clock64 cycles, median of %d a CTA\n", kAccesses);
  std::printf("%-58s %8s %8s %8s\n", "warpgroups", "try_wait", "arrive", "ld.shared");
  report_access<S64, S64, true>("idle", sms, rounds);
  report_access<S64, S64, false>(both(S64::name()), sms, rounds);
  report_access<E64, E64, false>(both(E64::name()), sms, rounds);
  report_access<S128, S128, false>(both(S128::name()), sms, rounds);
  report_access<PV128, PV128, false>(both(PV128::name()), sms, rounds);
  report_access<S64, PV128, false>("one each: bf16 SS m64n64k16 | bf16 RS m64n128k16 (MN)", sms, rounds);
  return 0;
}
