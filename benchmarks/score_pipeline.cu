// Pace of a proposed page pipeline for the FP8 cache with an e4m3 q (docs/PERF.md "What would close the rest", FP8),
// with real WGMMAs, widening and softmax but no copies: one CTA per SM, three warpgroups, two page buffers that are
// never refilled (zeros: every value stays finite), a refill's latency stood in for by a wait.
//
//   kScore (warpgroup 0): Q (e4m3, 64 rows x 576) in registers, so that S = Q K^T reads only K from shared memory
//                         (RS m64n64k32; SS at N = 64 leaves the CUDA cores no shared memory, "Ceilings"); per page:
//                         S (a float32 partial a 128-column unit, as the kernel's), its softmax, P (fp16, by
//                         stmatrix) into a slot of a two-slot ring, each row's rescale factor beside it.
//   kHalf0, kHalf1:       O[:, 256 h : 256 h + 256] each; per page: widen its V half in place once S has read those
//                         units, then O = O x factor + P V_half (SS m64n256k16: P and V^T from shared memory).
//
//   kScore                                        kHalf h
//   -------------------------------------------   ---------------------------------------------------------------
//   wait buffer_free (both halves' P V of the     wait v_unit_read of units 2h, 2h + 1, widen them, fence, sync
//     page two back complete), then refill_wait   the page before's P V complete -> arrive p_free, buffer_free
//     cycles (the copy's latency)                 wait p_full, O *= factor (per warp, only if a factor is not 1)
//   S: RoPE, units 0..3 (v_unit_read after each)  O += P V_half (issued)
//   softmax; wait p_free; P, factors -> slot;
//   arrive p_full
//
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode arch=compute_90a,code=sm_90a -I<cutlass>/include \
//        -I$CUDA_HOME/include/cccl -Icsrc/kernels benchmarks/score_pipeline.cu -o /tmp/score && /tmp/score
//
// Prints cycles a page pair (median over CTAs) for a few refill latencies, against today's kernel's ~6,800 (FP8,
// h_q 128 s_q 2, the pair timeline) and the tensor work's floor (a pair's S and P V: ~3,200 cycles).
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>

#include "fp8_widening.h"
#include "named_barriers.h"
#include "softmax.h"
#include "utils.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"

using namespace cute;
using Traits = flash_mla::SplitKvTraits<cutlass::half_t, cutlass::float_e4m3_t, true>;
using Widening = flash_mla::Fp8Widening<Traits>;
using Barrier = cutlass::arch::ClusterBarrier;
using Half = cutlass::half_t;
using E4m3 = cutlass::float_e4m3_t;

enum Role : int { kScore = 0, kHalf0 = 1, kHalf1 = 2 };
constexpr int kWgThreads = 128;
constexpr int kPages = 256;                          // pages a CTA walks
constexpr int kStages = 2;
// No setmaxnreg: kScore (Q's 72 registers, S and its partial) fits the launch's 168 without spills, and a half (O's
// 128 and the widening) needs them all (ptxas ignored a split of 200 / 152 / 152: C7507).

// P of one page: (64 rows, 64 keys) fp16, K-major with the 128-byte swizzle (the A operand of P V).
using SmemLayoutP = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Half>{}, Shape<_64, _64>{}));    // (BLK_M, BLK_N)
// S = Q K^T, Q from registers (e4m3, K-major), the page's e4m3 bytes as SmemLayoutK8.
using TiledMmaS = decltype(make_tiled_mma(GMMA::rs_op_selector<E4m3, E4m3, float, Shape<_64, _64, Int<5 * 128>>>()));
// O_half += P V_half: P and V^T (MN-major) from shared memory.
using TiledMmaO = decltype(make_tiled_mma(GMMA::ss_op_selector<Half, Half, float, Shape<_64, _256, _64>,
                                                                GMMA::Major::K, GMMA::Major::MN>()));

struct Smem {
  alignas(1024) uint8_t page[kStages][Traits::kSegments * Traits::kSegmentBytes];    // 72 KiB each
  alignas(1024) Half p[kStages][64 * 64];                                           // 8 KiB each
  alignas(1024) E4m3 q[64 * 640];                                                   // 40 KiB
  alignas(16) float2 factor[kStages][kWgThreads];     // each thread's two rows' rescale factors
  alignas(8) uint64_t v_unit_read[kStages][4];       // kScore's 128 threads
  alignas(8) uint64_t p_full[kStages];               // kScore's 128 threads
  alignas(8) uint64_t p_free[kStages];               // both halves' 256 threads
  alignas(8) uint64_t buffer_free[kStages];          // both halves' 256 threads
};

__device__ void spin(long long cycles) {
  for (const long long t0 = clock64(); clock64() - t0 < cycles;) {
  }
}

// Parts left out (timing only), to see what the pair's pace is made of: the halves' widening, kScore's softmax
// (P = S as it is), S's float32 steps (every unit into S, one commit group a page).
enum Skip : int { kSkipWidening = 1, kSkipSoftmax = 2, kSkipUnitSteps = 4 };

__device__ float score_role(Smem& smem, int refill_wait, int skip) {
  TiledMmaS mma;
  auto thr = mma.get_slice(threadIdx.x % kWgThreads);
  Tensor sQ = make_tensor(make_smem_ptr(smem.q), typename Traits::SmemLayoutQ8{});                 // (BLK_M, 640)
  Tensor tSsQ = thr.partition_A(sQ);                                                                // (MMA, 1, 20)
  Tensor tSrQ = thr.make_fragment_A(tSsQ);                                                          // (MMA, 1, 20)
  copy(tSsQ, tSrQ);                                                                                 // Q -> registers
  Tensor tSrS = partition_fragment_C(mma, Shape<_64, _64>{});                                       // (MMA, 1, 1)
  Tensor tSrU = make_fragment_like(tSrS);                                                           // (MMA, 1, 1)
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
#pragma unroll 1
  for (int page = 0; page < kPages; ++page) {
    const int stage = page % kStages;
    const uint32_t phase = (page / kStages) & 1;
    if (page >= kStages) {
      Barrier::wait(&smem.buffer_free[stage], phase ^ 1);
      spin(refill_wait);
    }
    Tensor sK = make_tensor(make_smem_ptr(reinterpret_cast<E4m3*>(smem.page[stage])),
                            typename Traits::SmemLayoutK8{});                                      // (BLK_N, 1152)
    Tensor tSrK = thr.partition_fragment_B(sK);                                                     // (MMA, 1, 36)
    // ---- S = Q K^T: the RoPE unit's two K blocks into S, each V unit into U, added to S in float32 ------------
    auto issue_unit = [&](int unit, auto& acc) {
      warpgroup_fence_operand(acc);
      warpgroup_arrive();
      const int k_blocks = unit == 4 ? 2 : 4;
      CUTE_UNROLL
      for (int kk = 0; kk < k_blocks; ++kk) {
        mma.accumulate_ = kk == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
        gemm(mma, tSrQ(_, _, unit * 4 + kk), tSrK(_, _, 2 * unit * 4 + kk), acc);
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(acc);
    };
    auto add_unit = [&] {
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      warpgroup_fence_operand(tSrU);
      CUTE_UNROLL
      for (int i = 0; i < size(tSrS); ++i) tSrS(i) += tSrU(i);
    };
    if (skip & kSkipUnitSteps) {
      warpgroup_fence_operand(tSrS);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int unit = 0; unit < 5; ++unit) {
        CUTE_UNROLL
        for (int kk = 0; kk < (unit == 4 ? 2 : 4); ++kk) {
          mma.accumulate_ = unit == 0 && kk == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
          gemm(mma, tSrQ(_, _, unit * 4 + kk), tSrK(_, _, 2 * unit * 4 + kk), tSrS);
        }
      }
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrS);
      CUTE_UNROLL
      for (int v = 0; v < 4; ++v) Barrier::arrive(&smem.v_unit_read[stage][v]);
    } else {
      issue_unit(4, tSrS);
      issue_unit(0, tSrU);
      CUTE_UNROLL
      for (int v = 1; v < 4; ++v) {
        add_unit();
        Barrier::arrive(&smem.v_unit_read[stage][v - 1]);
        issue_unit(v, tSrU);
      }
      add_unit();
      Barrier::arrive(&smem.v_unit_read[stage][3]);
    }
    // ---- softmax against a lazy reference ------------------------------------------------------------------------
    Tensor S = flash_mla::as_rows_cols(tSrS);                                                       // (ROW, COL)
    float ref[2], factor[2] = {1.f, 1.f}, page_sum[2] = {0.f, 0.f};
    CUTE_UNROLL
    for (int r = 0; r < 2 && !(skip & kSkipSoftmax); ++r) {
      float m = -INFINITY;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(S); ++c) m = fmaxf(m, S(r, c));
      ref[r] = flash_mla::lazy_reference(row_max[r], flash_mla::quad_max(m), 0.0625f);
      factor[r] = flash_mla::rescale_factor(row_max[r], ref[r], 0.0625f);
    }
    if (!(skip & kSkipSoftmax)) flash_mla::exponentiate(S, ref, 0.0625f, page_sum);
    CUTE_UNROLL
    for (int r = 0; r < 2 && !(skip & kSkipSoftmax); ++r) {
      row_sum[r] = row_sum[r] * factor[r] + page_sum[r];
      row_max[r] = ref[r];
    }
    // ---- P and the factors into the slot, once both halves' P V of the page two back is complete ---------------
    if (page >= kStages) Barrier::wait(&smem.p_free[stage], phase ^ 1);
    // P by stmatrix (four 8 x 8 fp16 matrices an instruction), as an epilogue stores an accumulator
    Tensor sP = make_tensor(make_smem_ptr(smem.p[stage]), SmemLayoutP{});                          // (BLK_M, BLK_N)
    Tensor tSrP = make_tensor_like<Half>(tSrS);                                                     // (MMA, 1, 1)
    CUTE_UNROLL
    for (int i = 0; i < size(tSrS); ++i) tSrP(i) = static_cast<Half>(tSrS(i));
    auto store_p = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Half>{}, mma);
    auto thr_store = store_p.get_thread_slice(threadIdx.x % kWgThreads);
    copy(store_p, thr_store.retile_S(tSrP), thr_store.partition_D(sP));
    smem.factor[stage][threadIdx.x % kWgThreads] = make_float2(factor[0], factor[1]);
    cutlass::arch::fence_view_async_shared();    // P's generic-proxy writes before the P V WGMMAs read them
    Barrier::arrive(&smem.p_full[stage]);
  }
  return row_sum[0] + row_sum[1];
}

template <int kHalf>
__device__ float half_role(Smem& smem, int skip) {
  TiledMmaO mma;
  auto thr = mma.get_slice(threadIdx.x % kWgThreads);
  Tensor tOrO = partition_fragment_C(mma, Shape<_64, _256>{});                                      // (MMA, 1, 1)
  clear(tOrO);
  Tensor O = flash_mla::as_rows_cols(tOrO);                                                          // (ROW, COL)
#pragma unroll 1
  for (int page = 0; page < kPages; ++page) {
    const int stage = page % kStages;
    const uint32_t phase = (page / kStages) & 1;
    // ---- this half's V units widened in place, once S has read them --------------------------------------------
    CUTE_UNROLL
    for (int u = 2 * kHalf; u < 2 * kHalf + 2; ++u) {
      Barrier::wait(&smem.v_unit_read[stage][u], phase);
      if (!(skip & kSkipWidening)) Widening::widen_unit(reinterpret_cast<Half*>(smem.page[stage]), u, 64);
    }
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    flash_mla::warpgroup_sync(flash_mla::WarpgroupBarrier::kUnitWidened, kHalf);
    // ---- the page before's P V complete: its slot and buffer are free, O may be rescaled ----------------------
    warpgroup_wait<0>();                         // (unconditional: a wait on a path ptxas cannot rule out)
    warpgroup_fence_operand(tOrO);
    if (page > 0) {
      Barrier::arrive(&smem.p_free[(page - 1) % kStages]);
      Barrier::arrive(&smem.buffer_free[(page - 1) % kStages]);
    }
    // ---- O = O x factor + P V_half ------------------------------------------------------------------------------
    Barrier::wait(&smem.p_full[stage], phase);
    const float2 f = smem.factor[stage][threadIdx.x % kWgThreads];
    const float factor[2] = {f.x, f.y};
    flash_mla::scale_rows(O, factor);
    Tensor sP = make_tensor(make_smem_ptr(smem.p[stage]), SmemLayoutP{});                           // (BLK_M, BLK_N)
    Tensor sVt = make_tensor(make_smem_ptr(reinterpret_cast<Half*>(smem.page[stage])),
                             typename Traits::SmemLayoutVt{});                                       // (D_V, BLK_N)
    Tensor tOsP = thr.partition_A(sP);                                                               // (MMA, 1, 4)
    Tensor tOsV = thr.partition_B(local_tile(sVt, Shape<_256, _64>{}, make_coord(kHalf, 0)));       // (MMA, 1, 4)
    Tensor tOrP = thr.make_fragment_A(tOsP);
    Tensor tOrV = thr.make_fragment_B(tOsV);
    warpgroup_fence_operand(tOrO);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int k = 0; k < size<2>(tOrP); ++k) gemm(mma, tOrP(_, _, k), tOrV(_, _, k), tOrO);
    warpgroup_commit_batch();
    warpgroup_fence_operand(tOrO);
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(tOrO);
  float sum = 0.f;
  CUTE_UNROLL
  for (int i = 0; i < size(tOrO); ++i) sum += tOrO(i);
  return sum;
}

__global__ void __launch_bounds__(3 * kWgThreads, 1) pipeline_kernel(int refill_wait, int skip, long long* cycles,
                                                                          float* sink) {
  extern __shared__ __align__(1024) char smem_raw[];
  Smem& smem = *reinterpret_cast<Smem*>(smem_raw);
  for (int i = threadIdx.x; i < int(sizeof(Smem)) / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(smem_raw)[i] = make_uint4(0, 0, 0, 0);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      for (uint64_t& b : smem.v_unit_read[s]) Barrier::init(&b, kWgThreads);
      Barrier::init(&smem.p_full[s], kWgThreads);
      Barrier::init(&smem.p_free[s], 2 * kWgThreads);
      Barrier::init(&smem.buffer_free[s], 2 * kWgThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();
  const int role = threadIdx.x / kWgThreads;
  const long long start = clock64();
  float sum;
  if (role == kScore) {
    sum = score_role(smem, refill_wait, skip);
  } else {
    sum = role == kHalf0 ? half_role<0>(smem, skip) : half_role<1>(smem, skip);
  }
  const long long end = clock64();
  if (threadIdx.x % kWgThreads == 0) cycles[blockIdx.x * 3 + role] = end - start;
  if (sum != 0.f && sum != 1.f) sink[blockIdx.x] = sum;    // zeros in, finite values out: never stores
}

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  constexpr int kBytes = sizeof(Smem);
  CHECK(cudaFuncSetAttribute(pipeline_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
  long long* cycles = nullptr;
  float* sink = nullptr;
  CHECK(cudaMalloc(&cycles, sms * 3 * sizeof(long long)));
  CHECK(cudaMalloc(&sink, sms * sizeof(float)));
  std::printf("%s, %d SMs, %d bytes of shared memory a CTA; %d pages a CTA; cycles a page pair, median over CTAs\n",
              prop.name, sms, kBytes, kPages);
  std::printf("%-34s %-44s %10s\n", "refill latency stood in (cycles)", "left out (timing only)", "pair");
  const struct { int refill_wait, skip; const char* label; } rows[] = {
      {0, 0, "-"}, {800, 0, "-"}, {1600, 0, "-"}, {2400, 0, "-"},
      {0, kSkipWidening, "widening"}, {0, kSkipSoftmax, "softmax"}, {0, kSkipUnitSteps, "S's float32 steps"},
      {0, kSkipWidening | kSkipSoftmax | kSkipUnitSteps, "all three"}};
  for (const auto& row : rows) {
    const int refill_wait = row.refill_wait;
    pipeline_kernel<<<sms, 3 * kWgThreads, kBytes>>>(refill_wait, row.skip, cycles, sink);    // warm-up
    pipeline_kernel<<<sms, 3 * kWgThreads, kBytes>>>(refill_wait, row.skip, cycles, sink);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<long long> host(sms * 3);
    CHECK(cudaMemcpy(host.data(), cycles, host.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    std::vector<double> pair(sms);
    for (int c = 0; c < sms; ++c) {
      pair[c] = 2.0 * double(std::max({host[3 * c], host[3 * c + 1], host[3 * c + 2]})) / kPages;
    }
    std::sort(pair.begin(), pair.end());
    std::printf("%-34d %-44s %10.0f\n", refill_wait, row.label, pair[sms / 2]);
  }
  CHECK(cudaFree(cycles));
  CHECK(cudaFree(sink));
  return 0;
}
