// Pace of a proposed kernel for memory-bound FP8 rows (h_q x s_q <= 16: one 16-row query tile a KV head), with the
// tile transposed so that the few query rows are WGMMA's N and the 64 keys of a page its M, and V never widened into
// shared memory (docs/PERF.md "What would close the rest", FP8). Real page streaming (bulk copies of zeros from
// device memory, a CTA's own run of pages, a ring of kRing pages), real WGMMAs, conversions and softmax; nothing
// checked for values (zeros in, zeros out). One CTA per SM:
//
//   producer (warp 8, one thread): each page's five 8 KiB units (V in four of 128 e4m3 columns, RoPE in the fifth)
//     by cp.async.bulk into the ring's next buffer, once the warpgroup that read it released it
//   warpgroup w (0, 1): pages w, w + 2, ... independently (a split of the keys; its own O^T, merged at the end):
//     S^T = K Q^T          e4m3 SS m64n16k32 (A the page, K-major; B Q's 16 rows), a float32 step a unit
//     softmax over keys    per query column: shuffles within a warp, a warpgroup vote on the lazy reference
//     P^T -> shared        fp16, stmatrix.trans (16 query rows x 64 keys, the B operand of O^T)
//     O^T += V^T P^T       fp16 RS m64n16k16, 8 dim blocks x 4 key blocks; A = V^T from the page's e4m3 bytes by
//                          ldmatrix.trans (byte pairs as b16), prmt and cvt.rn.f16x2.e4m3x2: no fp16 V stored
//     release the buffer once its O^T WGMMAs are complete
//
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -I<cutlass>/include \
//        -I$CUDA_HOME/include/cccl -Icsrc/kernels benchmarks/transposed_pipeline.cu -o /tmp/transposed && /tmp/transposed
//
// Prints per configuration (rings of 2, 3, 4 pages) the us a page and SM and the fp8 bytes' rate, against the same
// stream with no compute (the copies' ceiling) and today's kernel (H200, h_q 16 s_q 1: ~1.9 us a page and CTA,
// docs/PERF.md).
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "softmax.h"
#include "utils.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                                   \
  do {                                                                                             \
    cudaError_t e = (x);                                                                           \
    if (e != cudaSuccess) { std::printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e)); std::exit(1); } \
  } while (0)

using namespace cute;
using Barrier = cutlass::arch::ClusterBarrier;
using Half = cutlass::half_t;
using E4m3 = cutlass::float_e4m3_t;

constexpr int kWgThreads = 128;
constexpr int kUnitBytes = 64 * 128;                      // 64 keys x 128 e4m3 columns
constexpr int kUnits = 5;                                 // four V units, then RoPE (its columns 64..127 unused)
constexpr int kPageBytes = kUnits * kUnitBytes;           // 40 KiB in shared memory
constexpr int kCachePageBytes = 36 * 1024;                // 576 bytes a token

// One configuration: kRows query rows (N of S^T and O^T), a ring of kRing page buffers. 16 rows only: at 32 a
// warpgroup's O^T alone is 128 registers a thread, and with S, its partial and a set of V^T fragments ptxas spills
// 764 bytes at the 168 a thread the launch allows (and serialises the WGMMAs); 32 rows would split O^T's dims between
// the warpgroups (each on every page, as the seesaw splits O's columns) instead of the pages.
template <int kRows_, int kRing_>
struct Config {
  static constexpr int kRows = kRows_, kRing = kRing_;
  static_assert(kRows == 16, "one 16-row query tile (see above)");
  static constexpr int kSlots = kRows / 4;                // query columns a thread holds: 2 t + {0, 1} + 8 j
  // S^T = K Q^T: (64 keys, kRows) over 640 e4m3 columns, both operands K-major in shared memory.
  using SmemLayoutPage = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E4m3>{}, Shape<_64, Int<kUnits * 128>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<E4m3>{}, Shape<Int<kRows>, Int<kUnits * 128>>{}));
  using TiledMmaS = decltype(make_tiled_mma(GMMA::ss_op_selector<E4m3, E4m3, float, Shape<_64, Int<kRows>, _128>>()));
  // O^T += V^T P^T: (64 dims, kRows) += (64 dims, 16 keys) (16 keys, kRows); V^T from registers, P^T (rows, keys)
  // K-major in shared memory.
  using SmemLayoutPt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Half>{}, Shape<Int<kRows>, _64>{}));
  using TiledMmaO = decltype(make_tiled_mma(GMMA::rs_op_selector<Half, Half, float, Shape<_64, Int<kRows>, _16>>()));
  struct Smem {
    alignas(1024) uint8_t page[kRing][kPageBytes];
    alignas(1024) E4m3 q[kRows * kUnits * 128];             // 10 KiB
    alignas(1024) Half pt[2][kRows * 64];                    // each warpgroup's P^T, 2 KiB
    alignas(8) uint64_t full[kRing];
    alignas(8) uint64_t empty[kRing];
  };
};

// The A fragment of one m64nNk16 O^T WGMMA (warp w: dims dim0 .. dim0 + 15, keys key0 .. key0 + 15): two 8 x 16-byte
// matrices of e4m3 (keys x dim pairs) transposed by ldmatrix, so that a thread holds, for the dim pair (2 g, 2 g + 1),
// keys 2 t, 2 t + 1 and 8 + 2 t, 9 + 2 t; prmt splits each register by dim and cvt widens it. The fragment's rows g
// and g + 8 are then dims 2 g and 2 g + 1 (CuTe's RS A layout: a0 (g, 2 t), a1 (g + 8, 2 t), a2 (g, 8 + 2 t), a3
// (g + 8, 8 + 2 t), checked on the host): O^T's rows come out in that order, a fixed permutation an epilogue undoes.
__device__ __forceinline__ void load_vt_fragment(uint32_t page_addr, int dim0, int key0, uint32_t (&a)[4]) {
  const int lane = threadIdx.x % 32;
  const int key = key0 + (lane & 15);                     // lanes 0-7 matrix 0's rows, 8-15 matrix 1's
  const int unit = dim0 / 128, chunk = (dim0 % 128) / 16;
  const uint32_t row = page_addr + unit * kUnitBytes + key * 128 + ((chunk ^ (key % 8)) * 16);
  uint32_t m[2];
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(m[0]), "=r"(m[1]) : "r"(row));
  CUTE_UNROLL
  for (int j = 0; j < 2; ++j) {
    // m[j] = bytes (key k: dim d, dim d + 1), (key k + 1: d, d + 1) -> (d: k, k + 1), (d + 1: k, k + 1)
    const uint32_t even = __byte_perm(m[j], 0, 0x0020);    // bytes 0, 2
    const uint32_t odd = __byte_perm(m[j], 0, 0x0031);     // bytes 1, 3
    asm("{\n .reg .b16 x;\n cvt.u16.u32 x, %1;\n cvt.rn.f16x2.e4m3x2 %0, x;\n}" : "=r"(a[2 * j]) : "r"(even));
    asm("{\n .reg .b16 x;\n cvt.u16.u32 x, %1;\n cvt.rn.f16x2.e4m3x2 %0, x;\n}" : "=r"(a[2 * j + 1]) : "r"(odd));
  }
}

template <class C, bool kCompute>
__device__ float consumer(typename C::Smem& smem, int warpgroup, int pages) {
  typename C::TiledMmaS mma_s;
  typename C::TiledMmaO mma_o;
  const int t = threadIdx.x % kWgThreads;
  auto thr_s = mma_s.get_slice(t);
  auto thr_o = mma_o.get_slice(t);
  Tensor sQ = make_tensor(make_smem_ptr(smem.q), typename C::SmemLayoutQ{});                       // (16, 640)
  Tensor tSrQ = thr_s.partition_fragment_B(sQ);                                                   // (MMA, 1, 20)
  Tensor sPt = make_tensor(make_smem_ptr(smem.pt[warpgroup]), typename C::SmemLayoutPt{});         // (16, 64)
  Tensor tOrPt = thr_o.partition_fragment_B(sPt);                                                  // (MMA, 1, 4)
  Tensor tOrO = partition_fragment_C(mma_o, Shape<_512, Int<C::kRows>>{});                         // (MMA, 8, 1)
  Tensor tSrS = partition_fragment_C(mma_s, Shape<_64, Int<C::kRows>>{});                          // (MMA, 1, 1)
  Tensor tSrU = make_fragment_like(tSrS);
  // V^T fragments of all eight dim blocks for one key block
  Tensor tOrA0 = make_tensor<Half>(partition_shape_A(mma_o, Shape<_512, _16>{}));                  // (MMA, 8, 1)
  Tensor tOrA1 = make_tensor<Half>(partition_shape_A(mma_o, Shape<_512, _16>{}));                  // (MMA, 8, 1)
  clear(tOrO);
  float ref[C::kSlots], sum = 0.f;
  CUTE_UNROLL
  for (int c = 0; c < C::kSlots; ++c) ref[c] = -INFINITY;
  const uint32_t pt_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem.pt[warpgroup]));
  const int warp = t / 32, lane = t % 32;
#pragma unroll 1
  for (int page = warpgroup; page < pages; page += 2) {
    const int buffer = page % C::kRing;
    Barrier::wait(&smem.full[buffer], (page / C::kRing) & 1);
    if constexpr (kCompute) {
      Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<E4m3*>(smem.page[buffer])),
                              typename C::SmemLayoutPage{});                                      // (64, 640)
      Tensor tSrK = thr_s.partition_fragment_A(sK);                                               // (MMA, 1, 20)
      // ---- S^T = K Q^T, a float32 step a unit ----------------------------------------------------------------
      CUTE_UNROLL
      for (int unit = 0; unit < kUnits; ++unit) {
        auto& acc = unit == 0 ? tSrS : tSrU;
        warpgroup_fence_operand(acc);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int kk = 0; kk < (unit == kUnits - 1 ? 2 : 4); ++kk) {
          mma_s.accumulate_ = kk == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
          gemm(mma_s, tSrK(_, _, unit * 4 + kk), tSrQ(_, _, unit * 4 + kk), acc);
        }
        warpgroup_commit_batch();
        warpgroup_wait<0>();
        warpgroup_fence_operand(acc);
        if (unit > 0) {
          CUTE_UNROLL
          for (int i = 0; i < size(tSrS); ++i) tSrS(i) += tSrU(i);
        }
      }
      // ---- softmax over the page's keys, per query column. Value i of the fragment: column 2 t + (i & 1) +
      // 8 (i >> 2), key g + 8 ((i >> 1) & 1); slot c = (i & 1) + 2 (i >> 2). Column maxima within the warp by
      // shuffles; the lazy reference moves only when a warpgroup vote says some column passed it (zeros here:
      // never after the first page).
      float col_max[C::kSlots];
      CUTE_UNROLL
      for (int c = 0; c < C::kSlots; ++c) {
        const int i = c % 2 + 4 * (c / 2);
        float m = fmaxf(tSrS(i), tSrS(i + 2));
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 4));
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 8));
        col_max[c] = fmaxf(m, __shfl_xor_sync(0xffffffff, m, 16));
      }
      int passed = 0;
      CUTE_UNROLL
      for (int c = 0; c < C::kSlots; ++c) passed |= flash_mla::lazy_reference(ref[c], col_max[c], 0.0625f) != ref[c];
      asm volatile("{\n .reg .pred p, q;\n setp.ne.s32 p, %1, 0;\n bar.red.or.pred q, %2, 128, p;\n"
                   " selp.s32 %0, 1, 0, q;\n}" : "=r"(passed) : "r"(passed), "r"(8 + warpgroup));
      if (passed) {    // a reference moves (the whole warpgroup agrees on each column's; shown here as the max)
        CUTE_UNROLL
        for (int c = 0; c < C::kSlots; ++c) ref[c] = fmaxf(ref[c] == -INFINITY ? col_max[c] : ref[c], col_max[c]);
      }
      uint32_t p[C::kRows / 4];
      CUTE_UNROLL
      for (int j = 0; j < C::kRows / 4; ++j) {    // values 2 j, 2 j + 1: one key, two adjacent columns
        const int c = 2 * (j / 2);
        const float e0 = exp2f(tSrS(2 * j) * 0.0625f - ref[c] * 0.0625f);
        const float e1 = exp2f(tSrS(2 * j + 1) * 0.0625f - ref[c + 1] * 0.0625f);
        sum += e0 + e1;
        const __half2 h = __floats2half2_rn(e0, e1);
        p[j] = *reinterpret_cast<const uint32_t*>(&h);
      }
      // ---- P^T -> shared: 8 x 8 fp16 matrices (keys x columns) stored transposed (columns x keys), four a
      // stmatrix; register j is matrix (keys 8 (j & 1) of the warp's 16, columns 8 (j >> 1)) ----------------------
      CUTE_UNROLL
      for (int s = 0; s < C::kRows / 16; ++s) {
        const int j = 4 * s + lane / 8;
        const int q = 8 * (j >> 1) + lane % 8;               // P^T's row: a query column
        const int key0 = 16 * warp + 8 * (j & 1);            // the matrix's first key
        const uint32_t addr = pt_addr + q * 128 + (((key0 / 8) ^ (q % 8)) * 16);
        asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                     :: "r"(addr), "r"(p[4 * s]), "r"(p[4 * s + 1]), "r"(p[4 * s + 2]), "r"(p[4 * s + 3]) : "memory");
      }
      cutlass::arch::fence_view_async_shared();
      asm volatile("bar.sync %0, 128;" :: "r"(10 + warpgroup) : "memory");
      // ---- O^T += V^T P^T -------------------------------------------------------------------------------------
      const uint32_t page_addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem.page[buffer]));
      auto key_block = [&](int kb, auto& tOrA) {
        warpgroup_fence_operand(tOrA);
        CUTE_UNROLL
        for (int mb = 0; mb < 8; ++mb) {
          uint32_t a[4];
          load_vt_fragment(page_addr, 64 * mb + 16 * warp, 16 * kb, a);
          Tensor words = recast<uint32_t>(tOrA(_, mb, 0));
          CUTE_UNROLL
          for (int i = 0; i < 4; ++i) words(i) = a[i];
        }
        warpgroup_fence_operand(tOrA);
        warpgroup_fence_operand(tOrO);
        warpgroup_arrive();
        gemm(mma_o, tOrA(_, _, 0), tOrPt(_, _, kb), tOrO);
        warpgroup_commit_batch();
        warpgroup_fence_operand(tOrO);
      };
      key_block(0, tOrA0);             // two sets of fragments: one read by WGMMAs in flight, one loading
      key_block(1, tOrA1);
      warpgroup_wait<1>();             // key block 0's WGMMAs no longer read tOrA0
      key_block(2, tOrA0);
      warpgroup_wait<1>();
      key_block(3, tOrA1);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tOrO);
    }
    Barrier::arrive(&smem.empty[buffer]);
  }
  CUTE_UNROLL
  for (int i = 0; i < size(tOrO); ++i) sum += tOrO(i);
  return sum;
}

template <class C, bool kCompute>
__global__ void __launch_bounds__(2 * kWgThreads + 32, 1) transposed_kernel(const uint8_t* cache, int pages,
                                                                            long long* cycles, float* sink) {
  using Smem = typename C::Smem;
  extern __shared__ __align__(1024) char smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw);
  for (int i = threadIdx.x; i < int(sizeof(Smem)) / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(smem_raw)[i] = make_uint4(0, 0, 0, 0);
  }
  if (threadIdx.x == 0) {
    for (int b = 0; b < C::kRing; ++b) {
      Barrier::init(&smem.full[b], 1);
      Barrier::init(&smem.empty[b], kWgThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const long long start = clock64();
  float sum = 0.f;
  if (threadIdx.x / kWgThreads == 2) {     // the producer
    if (threadIdx.x % 32 == 0) {
      // this CTA's run of pages: 36 KiB of cache a page (RoPE 4 KiB), read as five 8 KiB units (the last one's
      // second half lies in the next page: bytes that exist and do not matter here)
      const uint8_t* run = cache + size_t(blockIdx.x) * pages * kCachePageBytes;
#pragma unroll 1
      for (int page = 0; page < pages; ++page) {
        const int buffer = page % C::kRing;
        if (page >= C::kRing) Barrier::wait(&smem.empty[buffer], ((page / C::kRing) & 1) ^ 1);
        const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&smem.full[buffer]));
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kPageBytes) : "memory");
        for (int u = 0; u < kUnits; ++u) {
          const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem.page[buffer] + u * kUnitBytes));
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                       ::"r"(dst), "l"(run + size_t(page) * kCachePageBytes + u * kUnitBytes), "r"(kUnitBytes),
                       "r"(bar) : "memory");
        }
      }
    }
  } else {
    sum = consumer<C, kCompute>(smem, threadIdx.x / kWgThreads, pages);
  }
  __syncthreads();
  if (threadIdx.x == 0) cycles[blockIdx.x] = clock64() - start;
  if (sum == 1.2345f) sink[blockIdx.x] = sum;    // never: keeps the work
}

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount, pages = 512;
  const size_t cache_bytes = size_t(sms) * pages * kCachePageBytes + kUnitBytes;
  uint8_t* cache = nullptr;
  long long* cycles = nullptr;
  float* sink = nullptr;
  CHECK(cudaMalloc(&cache, cache_bytes));
  CHECK(cudaMemset(cache, 0, cache_bytes));
  CHECK(cudaMalloc(&cycles, sms * sizeof(long long)));
  CHECK(cudaMalloc(&sink, sms * sizeof(float)));
  std::printf("%s, %d SMs, %d pages a CTA (%.0f MB of fp8 cache); one CTA per SM\n", prop.name, sms, pages,
              cache_bytes / 1e6);
  auto run = [&](auto config, auto compute, const char* label) {
    using C = decltype(config);
    constexpr int kBytes = sizeof(typename C::Smem);
    auto kernel = transposed_kernel<C, decltype(compute)::value>;
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    kernel<<<sms, 2 * kWgThreads + 32, kBytes>>>(cache, pages, cycles, sink);    // warm-up
    CHECK(cudaEventRecord(e0));
    kernel<<<sms, 2 * kWgThreads + 32, kBytes>>>(cache, pages, cycles, sink);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaGetLastError());
    CHECK(cudaEventSynchronize(e1));
    float ms = 0.f;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    std::vector<long long> host(sms);
    CHECK(cudaMemcpy(host.data(), cycles, host.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    std::sort(host.begin(), host.end());
    std::printf("%-44s %8.3f us a page and SM  %7.0f cycles a page (median CTA)  %6.0f GB/s of fp8 pages\n", label,
                1e3 * ms / pages, double(host[sms / 2]) / pages, double(sms) * pages * kCachePageBytes / (ms * 1e6));
  };
  run(Config<16, 4>{}, false_type{}, "copies only, ring of 4");
  run(Config<16, 2>{}, false_type{}, "copies only, ring of 2");
  run(Config<16, 4>{}, true_type{}, "16 rows: S^T, softmax, O^T; ring of 4");
  run(Config<16, 3>{}, true_type{}, "16 rows, ring of 3");
  run(Config<16, 2>{}, true_type{}, "16 rows, ring of 2");
  CHECK(cudaFree(cache));
  CHECK(cudaFree(cycles));
  CHECK(cudaFree(sink));
  return 0;
}
