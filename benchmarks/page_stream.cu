// The page-streaming ceiling: how fast can one CTA per SM read random 64-token cache pages (64 x 576 bf16,
// 72 KiB) into shared memory, by copy pattern, pages in flight per SM and the time an SM holds a page.
// No attention math: a page is waited for, held for `hold_ns` (the compute it would get), and its buffer
// refilled with the CTA's next page. The split kernel can stream no faster than the best row here with
// its own pattern and depth (two buffers, nine 64 x 64 TMA boxes a page, evict-first).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a benchmarks/page_stream.cu -o /tmp/page_stream
//   /tmp/page_stream            # one row per config: median of 9 runs, GB/s, first page's landing time
//   /tmp/page_stream --refills  # the single-refill table alone
//   /tmp/page_stream --compare  # the copy patterns side by side alone (box9 / bulk9 / cpa16 / half3 / page1)
//
// A second table times single refills (refill_latency): a CTA issues `boxes` 8 KiB boxes of one page at once (1: a
// unit, 4: a V half, 9: a page) and waits for them, one refill at a time, clock64 cycles from the first issue to
// the barrier's completion; pages fresh from DRAM or from a 64-page window already in L2 (the split kernel's
// several row tiles read each page from L2 after the first), one CTA alone or one per SM at once. The split
// kernel's release-to-landing time (~2,600-2,900 cycles in its pair timeline, docs/PERF.md) against these says how
// much of it is the copy itself and how much the load around it. Rows pf3000 / pf6000: DRAM pages prefetched into L2
// (one cp.async.bulk.prefetch.L2 a page) 3,000 / 6,000 cycles before their refill: whether such a prefetch lands.
//
// Patterns:
//   box9     nine 64-column x 64-row TMA boxes a page, 128-byte swizzle (what the split kernel issues)
//   bulk9    nine contiguous 8 KiB bulk copies a page (cp.async.bulk: no tensor map, no swizzle)
//   cpa16    the page by 16-byte cp.async.cg from the CTA's 32 lanes, token row after token row (a warp
//            instruction reads 512 contiguous bytes), into the 128-byte-swizzled segments box9 writes; completion
//            by one cp.async.mbarrier.arrive.noinc a lane (the load path of a cp.async kernel)
//   half3    the page as (64 columns, 8 tokens, 9 segments, 8 token groups) by a 5-D tensor map: three boxes, each V
//            half {64, 8, 4, 8} (global: 8 token rows' 512 contiguous bytes a token group) and the RoPE columns
//            {64, 8, 1, 8}, into [group][segment][token][128 B] regions (a K-major SW128 layout whose 8-row atoms
//            lie 4 KiB / 1 KiB apart: WGMMA descriptors express it with that stride byte offset)
//   page1    the same map, one box {64, 8, 9, 8} a page: each token group's 9 KiB read contiguously
// each with the evict-first L2 hint (ef) or none (half3 and page1: always evict-first), and for box9 the tensor
// map's L2 promotion (none/128/256; half3 and page1 take 256).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda_check.h"

constexpr int kPageRows = 64, kCols = 576, kSegCols = 64, kSegments = kCols / kSegCols;    // 9 segments
constexpr int kSegBytes = kPageRows * kSegCols * 2;                                         // 8 KiB
constexpr int kPageBytes = kSegments * kSegBytes;                                           // 72 KiB
constexpr int kMaxDepth = 3;

enum Pattern : int { kBox9 = 0, kBulk9 = 1, kCpAsync16 = 2, kHalf3 = 3, kPage1 = 4 };

struct Config {
  int pattern, depth, pages_per_cta, evict_first, hold_ns;
  int pairs;    // 1: buffers are held and refilled two at a time (the split kernel's pages a and b of a pair)
};

__device__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ void wait_parity(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n LAB_WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra LAB_WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

// One box of a 5-D map (columns, tokens of a group, segments, token groups, pages) from segment `seg` of `page`.
__device__ void issue_box5(const CUtensorMap* map, uint32_t dst, uint32_t bar, int seg, int page, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2], %8;" ::"r"(dst), "l"(map), "r"(bar), "r"(0), "r"(0), "r"(seg), "r"(0),
      "r"(page), "l"(policy) : "memory");
}

struct GroupMaps {    // the 5-D maps of half3 / page1: boxes of 4 (a V half), 1 (RoPE) and 9 segments
  CUtensorMap half, rope, page;
};

// Segments [0, segments) of one page (cache page `page`; the whole page by default; box9 and bulk9 only) into
// buffer `dst`, completing on mbarrier `bar`.
__device__ void issue_page(const CUtensorMap* tmap, const char* cache, int pattern, bool evict_first, uint32_t dst,
                           uint32_t bar, int page, int segments = kSegments, const GroupMaps* groups = nullptr) {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  if (pattern == kHalf3 || pattern == kPage1) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kPageBytes) : "memory");
    if (pattern == kPage1) {
      issue_box5(&groups->page, dst, bar, 0, page, policy);
    } else {
      issue_box5(&groups->half, dst, bar, 0, page, policy);                    // V[:, 0:256]: 32 KiB
      issue_box5(&groups->half, dst + 4 * kSegBytes, bar, 4, page, policy);    // V[:, 256:512]
      issue_box5(&groups->rope, dst + 8 * kSegBytes, bar, 8, page, policy);    // RoPE: 8 KiB
    }
    return;
  }
  if (pattern == kCpAsync16) {    // every lane: chunk k = 16 bytes, token k / 72, chunk k % 72 of its 1152-byte row
    constexpr int kRowChunks = kCols * 2 / 16, kPageChunks = kPageRows * kRowChunks;    // 72, 4608
    const char* src = cache + int64_t(page) * kPageBytes;
    for (int k = threadIdx.x % 32; k < kPageChunks; k += 32) {
      const int row = k / kRowChunks, seg = k % kRowChunks / 8, chunk = k % 8;
      const uint32_t d = dst + seg * kSegBytes + row * 128 + ((chunk ^ (row % 8)) * 16);
      if (evict_first) {
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(d), "l"(src + k * 16),
                     "l"(policy) : "memory");
      } else {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src + k * 16) : "memory");
      }
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
    return;
  }
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(segments * kSegBytes)
               : "memory");
  for (int s = 0; s < segments; ++s) {
    const uint32_t d = dst + s * kSegBytes;
    if (pattern == kBox9) {
      const int c0 = s * kSegCols, c1 = 0, c2 = 0, c3 = page;
      if (evict_first) {
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
            " [%0], [%1, {%3, %4, %5, %6}], [%2], %7;" ::"r"(d), "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "r"(c2),
            "r"(c3), "l"(policy) : "memory");
      } else {
        asm volatile(
            "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
            " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(d), "l"(tmap), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
            : "memory");
      }
    } else {
      const char* src = cache + int64_t(page) * kPageBytes + s * kSegBytes;
      if (evict_first) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
            ::"r"(d), "l"(src), "r"(kSegBytes), "r"(bar), "l"(policy) : "memory");
      } else {
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     ::"r"(d), "l"(src), "r"(kSegBytes), "r"(bar) : "memory");
      }
    }
  }
}

// One thread per CTA (cpa16: one warp) does everything: `depth` buffers, each refilled with the CTA's next page
// once the page in it has landed and been held for hold_ns. first_land[cta] = ns from this CTA's entry to its first
// page's landing.
__global__ void __launch_bounds__(32, 1) stream_pages(const __grid_constant__ CUtensorMap tmap,
                                                      const __grid_constant__ GroupMaps groups, const char* cache,
                                                      const int* page_list, Config cfg, uint64_t* first_land) {
  extern __shared__ __align__(1024) char smem[];
  __shared__ alignas(8) uint64_t full[kMaxDepth];
  const bool warp_copies = cfg.pattern == kCpAsync16;    // cp.async: all 32 lanes copy and wait; else thread 0
  if (threadIdx.x != 0 && !warp_copies) return;
  const uint64_t t_entry = globaltimer();
  const uint32_t buf0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const int* pages = page_list + int64_t(blockIdx.x) * cfg.pages_per_cta;
  if (threadIdx.x == 0) {
    for (int b = 0; b < cfg.depth; ++b) {
      const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&full[b]));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(warp_copies ? 32 : 1));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  for (int b = 0; b < cfg.depth && b < cfg.pages_per_cta; ++b) {
    issue_page(&tmap, cache, cfg.pattern, cfg.evict_first, buf0 + b * kPageBytes,
               static_cast<uint32_t>(__cvta_generic_to_shared(&full[b])), pages[b], kSegments, &groups);
  }
  uint32_t parity[kMaxDepth] = {0, 0, 0};
  const int step = cfg.pairs ? 2 : 1;    // pages waited for, held and refilled together
  for (int i = 0; i < cfg.pages_per_cta; i += step) {
    for (int j = i; j < i + step && j < cfg.pages_per_cta; ++j) {
      const int b = j % cfg.depth;
      wait_parity(static_cast<uint32_t>(__cvta_generic_to_shared(&full[b])), parity[b]);
      parity[b] ^= 1;
    }
    if (i == 0 && threadIdx.x == 0) first_land[blockIdx.x] = globaltimer() - t_entry;
    if (cfg.hold_ns > 0) {
      const uint64_t until = globaltimer() + cfg.hold_ns;
      while (globaltimer() < until) {}
    }
    for (int j = i; j < i + step && j + cfg.depth < cfg.pages_per_cta; ++j) {
      const int b = j % cfg.depth;
      issue_page(&tmap, cache, cfg.pattern, cfg.evict_first, buf0 + b * kPageBytes,
                 static_cast<uint32_t>(__cvta_generic_to_shared(&full[b])), pages[j + cfg.depth], kSegments, &groups);
    }
  }
}

// Cycles from issuing `boxes` boxes of a page (segments 0..boxes-1) to their landing, `reps` refills one after
// another per CTA (each issued once the previous one landed), pages page_list[cta * reps + r]:
// cycles[cta * reps + r].
// prefetch_cycles > 0: each page is first prefetched into L2 by one cp.async.bulk.prefetch.L2 of its 72 KiB, and
// the timed refill issued that many cycles later.
__global__ void __launch_bounds__(32, 1) refill_latency(const __grid_constant__ CUtensorMap tmap, const char* cache,
                                                        const int* page_list, int boxes, int reps,
                                                        long long* cycles, int prefetch_cycles = 0) {
  extern __shared__ __align__(1024) char smem[];
  __shared__ alignas(8) uint64_t full;
  if (threadIdx.x != 0) return;
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&full));
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  uint32_t parity = 0;
  for (int r = 0; r < reps; ++r) {
    const int page = page_list[int64_t(blockIdx.x) * reps + r];
    if (prefetch_cycles > 0) {
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(cache + int64_t(page) * kPageBytes),
                   "r"(kPageBytes) : "memory");
      const long long until = clock64() + prefetch_cycles;
      while (clock64() < until) {}
    }
    const long long start = clock64();
    issue_page(&tmap, nullptr, kBox9, /*evict_first=*/false, dst, bar, page, boxes);
    wait_parity(bar, parity);
    parity ^= 1;
    cycles[int64_t(blockIdx.x) * reps + r] = clock64() - start;
  }
}

using Encode = decltype(&cuTensorMapEncodeTiled);

// A bf16 tensor map over the cache with the 128-byte swizzle (rank 4 or 5).
template <int kRank>
static CUtensorMap encode_map(void* cache, const cuuint64_t (&dims)[kRank], const cuuint64_t (&strides)[kRank - 1],
                              const cuuint32_t (&box)[kRank], CUtensorMapL2promotion promotion) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
  CUtensorMap map;
  cuuint32_t elem_strides[kRank];
  for (cuuint32_t& e : elem_strides) e = 1;
  const CUresult r = reinterpret_cast<Encode>(fn)(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, kRank, cache, dims, strides,
                                                  box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                                  CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                                                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) { std::printf("cuTensorMapEncodeTiled (rank %d) failed: %d\n", kRank, int(r)); std::exit(1); }
  return map;
}

// The split kernel's view: (576 columns, 64 tokens, 1 head, pages), 64 x 64 boxes.
static CUtensorMap make_tmap(void* cache, int num_pages, CUtensorMapL2promotion promotion) {
  return encode_map<4>(cache, {kCols, kPageRows, 1, cuuint64_t(num_pages)}, {kCols * 2, kPageBytes, kPageBytes},
                       {kSegCols, kPageRows, 1, 1}, promotion);
}

// The token-group view (64 columns, 8 tokens, 9 segments, 8 token groups, pages), boxes of `box_segments` segments.
static CUtensorMap make_group_map(void* cache, int num_pages, int box_segments) {
  return encode_map<5>(cache, {kSegCols, 8, kSegments, kPageRows / 8, cuuint64_t(num_pages)},
                       {kCols * 2, kSegCols * 2, 8 * kCols * 2, kPageBytes},
                       {kSegCols, 8, cuuint32_t(box_segments), kPageRows / 8, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

int main(int argc, char** argv) {
  const bool refills_only = argc > 1 && std::string(argv[1]) == "--refills";    // the second table alone
  const bool compare_only = argc > 1 && std::string(argv[1]) == "--compare";    // the copy patterns alone
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int num_pages = 40000;    // 2.9 GB: no run reads a page twice, nor one an earlier run left in the L2
  char* cache;
  CHECK(cudaMalloc(&cache, size_t(num_pages) * kPageBytes));
  CHECK(cudaMemset(cache, 1, size_t(num_pages) * kPageBytes));
  std::vector<int> perm(num_pages);
  for (int i = 0; i < num_pages; ++i) perm[i] = i;
  std::mt19937 rng(0);
  std::shuffle(perm.begin(), perm.end(), rng);
  int* d_perm;
  CHECK(cudaMalloc(&d_perm, 2 * num_pages * sizeof(int)));    // doubled: a run's window may wrap around
  CHECK(cudaMemcpy(d_perm, perm.data(), num_pages * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_perm + num_pages, perm.data(), num_pages * sizeof(int), cudaMemcpyHostToDevice));
  uint64_t* d_first;
  CHECK(cudaMalloc(&d_first, sms * sizeof(uint64_t)));
  CHECK(cudaFuncSetAttribute(stream_pages, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDepth * kPageBytes));

  const CUtensorMap maps[3] = {make_tmap(cache, num_pages, CU_TENSOR_MAP_L2_PROMOTION_L2_256B),
                               make_tmap(cache, num_pages, CU_TENSOR_MAP_L2_PROMOTION_L2_128B),
                               make_tmap(cache, num_pages, CU_TENSOR_MAP_L2_PROMOTION_NONE)};
  const char* promo_names[3] = {"256", "128", "none"};
  const GroupMaps groups{make_group_map(cache, num_pages, 4), make_group_map(cache, num_pages, 1),
                         make_group_map(cache, num_pages, kSegments)};
  std::printf("# %s, %d SMs; one CTA per SM, random pages of %d bytes; median of 9 runs\n", prop.name, sms,
              kPageBytes);
  std::printf("%-6s %-5s %-3s %5s %5s %6s %5s %10s %8s %12s\n", "patt", "promo", "ef", "depth", "pairs", "pages",
              "hold", "us", "GB/s", "first_land_p50_us");

  struct Row { int pattern, promo, ef, depth, pairs, pages, hold; };
  std::vector<Row> rows;
  for (int pages : {62, 248}) {    // --compare: the copy mechanisms side by side, all with evict-first
    for (int pattern : {kBox9, kBulk9, kCpAsync16, kHalf3, kPage1}) {
      if (!compare_only) break;
      rows.push_back({pattern, 0, 1, 2, 0, pages, 0});
      rows.push_back({pattern, 0, 1, 3, 0, pages, 0});
      rows.push_back({pattern, 0, 1, 2, 1, pages, 1600});    // the split kernel's pairs held ~its compute
    }
  }
  for (int pages : {4, 16, 62, 248}) {
    if (compare_only) break;
    for (int depth : {1, 2, 3}) rows.push_back({kBox9, 0, 1, depth, 0, pages, 0});
    for (int hold : {800, 1600}) {
      rows.push_back({kBox9, 0, 1, 2, 0, pages, hold});
      rows.push_back({kBox9, 0, 1, 3, 0, pages, hold});
      rows.push_back({kBox9, 0, 1, 2, 1, pages, hold});    // the split kernel today: a pair held, then refilled
    }
    rows.push_back({kBox9, 0, 0, 2, 0, pages, 0});
    rows.push_back({kBox9, 1, 1, 2, 0, pages, 0});
    rows.push_back({kBox9, 2, 1, 2, 0, pages, 0});
    rows.push_back({kBulk9, 0, 1, 2, 0, pages, 0});
    rows.push_back({kBulk9, 0, 1, 3, 0, pages, 0});
    for (int pattern : {kCpAsync16, kHalf3, kPage1}) rows.push_back({pattern, 0, 1, 2, 0, pages, 0});
  }
  int window = 0;
  for (const Row& row : rows) {
    if (refills_only) break;
    const Config cfg{row.pattern, row.depth, row.pages, row.ef, row.hold, row.pairs};
    const int per_run = sms * row.pages;
    std::vector<float> times;
    std::vector<uint64_t> first(sms);
    std::vector<double> first_p50;
    for (int rep = 0; rep < 10; ++rep) {
      const int* list = d_perm + window;
      window = (window + per_run) % num_pages;
      cudaEvent_t a, b;
      CHECK(cudaEventCreate(&a));
      CHECK(cudaEventCreate(&b));
      CHECK(cudaEventRecord(a));
      stream_pages<<<sms, 32, kMaxDepth * kPageBytes>>>(maps[row.promo], groups, cache, list, cfg, d_first);
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      CHECK(cudaGetLastError());
      float ms;
      CHECK(cudaEventElapsedTime(&ms, a, b));
      CHECK(cudaMemcpy(first.data(), d_first, sms * sizeof(uint64_t), cudaMemcpyDeviceToHost));
      if (rep == 0) continue;    // warm-up
      times.push_back(ms * 1e3f);
      std::sort(first.begin(), first.end());
      first_p50.push_back(first[sms / 2] * 1e-3);
    }
    std::sort(times.begin(), times.end());
    std::sort(first_p50.begin(), first_p50.end());
    const double us = times[times.size() / 2];
    const double gbs = double(per_run) * kPageBytes / (us * 1e-6) / 1e9;
    const char* pattern_names[5] = {"box9", "bulk9", "cpa16", "half3", "page1"};
    const bool tensor_map = row.pattern == kBox9 || row.pattern >= kHalf3;
    std::printf("%-6s %-5s %-3d %5d %5d %6d %5d %10.1f %8.0f %12.2f\n", pattern_names[row.pattern],
                tensor_map ? promo_names[row.promo] : "-", row.ef, row.depth, row.pairs, row.pages, row.hold, us, gbs,
                first_p50[first_p50.size() / 2]);
  }

  if (compare_only) return 0;
  // Single refills: cycles from issue to landing.
  constexpr int kReps = 32, kWindow = 64;
  std::printf("\n# single refills (refill_latency): clock64 cycles from the first box's issue to the landing, "
              "%d refills a CTA one after another; median / p90 over all refills\n", kReps);
  std::printf("%-6s %-8s %5s %10s %10s\n", "source", "ctas", "boxes", "p50", "p90");
  long long* d_cycles;
  CHECK(cudaMalloc(&d_cycles, size_t(sms) * kReps * sizeof(long long)));
  CHECK(cudaFuncSetAttribute(refill_latency, cudaFuncAttributeMaxDynamicSharedMemorySize, kPageBytes));
  std::vector<int> l2_list(size_t(sms) * kReps);
  for (size_t i = 0; i < l2_list.size(); ++i) l2_list[i] = perm[(i * 7) % kWindow];    // 64 pages, shared by all
  int* d_l2_list;
  CHECK(cudaMalloc(&d_l2_list, l2_list.size() * sizeof(int)));
  CHECK(cudaMemcpy(d_l2_list, l2_list.data(), l2_list.size() * sizeof(int), cudaMemcpyHostToDevice));
  // source: 0 DRAM, 1 an L2-resident window, 2 / 3 DRAM pages prefetched 3,000 / 6,000 cycles before the refill
  const char* source_names[4] = {"DRAM", "L2", "pf3000", "pf6000"};
  for (int source : {0, 1, 2, 3}) {
    for (int ctas : {1, sms}) {
      for (int boxes : {1, 4, 9}) {
        if (source >= 2 && boxes == 1) continue;
        const int* list = d_l2_list;
        if (source == 1) {    // warm the window into L2 first
          refill_latency<<<sms, 32, kPageBytes>>>(maps[0], cache, d_l2_list, kSegments, kReps, d_cycles);
        } else {
          list = d_perm + window;
          window = (window + sms * kReps) % num_pages;
        }
        refill_latency<<<ctas, 32, kPageBytes>>>(maps[0], cache, list, boxes, kReps, d_cycles,
                                                 source == 2 ? 3000 : source == 3 ? 6000 : 0);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        std::vector<long long> c(size_t(ctas) * kReps);
        CHECK(cudaMemcpy(c.data(), d_cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
        std::sort(c.begin(), c.end());
        std::printf("%-6s %-8d %5d %10lld %10lld\n", source_names[source], ctas, boxes, c[c.size() / 2],
                    c[c.size() * 9 / 10]);
      }
    }
  }
  return 0;
}
