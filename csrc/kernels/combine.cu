// Combine kernel: merges the fp32 partial results of split sequences, SPEC.md "Kernels" (3):
//   lse = log sum_k exp(lse_k),   out = sum_k exp(lse_k - lse) * O_k      (k over the sequence's pieces)
// and, with an attention sink, scales out by 1 / (1 + exp(attn_sink[head] - lse)) (lse itself is unchanged).
//
// Design goal: the time must not grow with the number of pieces (b = 1 is cut into ~num_SMs pieces).
//
// Which rows. Only sequences cut into two or more pieces. Unsplit sequences (L = 0 ones included: they are never
// cut) were written by the split kernel and are not touched. Sequence s is split exactly when one SM part starts
// with its piece 1 (metadata begin_split == 1), so at most min(batch, num_sm_parts - 1) sequences are split.
// Grid z enumerates these candidates: CTA z finds the z-th such part with one warp-wide scan of the metadata
// (ballot + popcount over <= 256 parts per round of loads), so neither the batch size nor unsplit sequences
// cost CTAs.
//
// Grid: (row blocks x column chunks, KV head, split-sequence candidate), 256 threads. A CTA owns kRows packed
// query rows x kCols output columns of one split sequence and KV head. Thread layout, outermost first:
//   (row in the CTA) x (piece group) x (column thread)
// Column thread c accumulates kVecs float4s of the row, at float4 columns c, c + kColThreads, ... (coalesced);
// piece group g takes pieces g, g + kGroups, g + 2 kGroups, ... A warp always serves a single row.
// Two tiles, picked on the host from shapes alone (launch_combine):
//   wide: 1 row x 64 columns, 16 piece groups. Few split rows with many pieces each: b = 1, h_q = 16 gives
//         16 rows x 8 chunks = 128 CTAs, and 133 pieces are 8-9 per thread.
//   tall: 8 rows x 512 columns, 1 piece group, one warp per row. Many split rows with 2-4 pieces each (b >= ~20).
//
// Order inside a CTA:
//   1. prologue (may run while the split kernel is still running: programmatic dependent launch): find the
//      sequence and its workspace slots. It reads only the metadata and num_splits, written by the metadata
//      kernel, which had finished before the split kernel (an ordinary launch) started.
//   2. griddepcontrol.wait: from here on the split kernel has finished and its writes are visible.
//   3. each thread issues the loads of its first kBatch pieces (O_k and lse_k): they do not need the row's lse.
//   4. meanwhile the row's lse: lanes read the pieces' lse strided (up to 256 per round, all loads in flight),
//      warp max, warp sum of exp(lse_k - max); with several warps per row (wide) the warps' (max, sum) pairs are
//      merged through shared memory in warp order.
//   5. weighted sum over the thread's pieces, kBatch pieces' loads in flight per round.
//   6. piece groups > 0 leave their sums in shared memory; group 0 adds them in group order, applies the sink,
//      converts and stores out; one thread per row stores lse.
// Deterministic: every sum has a fixed order (a thread's pieces in order, xor-shuffle trees, warp order, group
// order); no atomics. Semantics kept from the split kernel: a row with no key in any piece gets out 0, lse -inf;
// a NaN lse_k makes the row's lse and out NaN (never mistaken for "no key").
// Split results are read with ld.global.cg: each O element is read once, from L2, where the split kernel's
// writes are; L1 would only hold lines this kernel never reads again.
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "params.h"

namespace flash_mla {
namespace {

constexpr int kCombineThreads = 256;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

template <int kRows_, int kCols_, int kVecs_, int kBatch_>
struct CombineTile {
  static constexpr int kRows = kRows_;              // packed query rows per CTA
  static constexpr int kCols = kCols_;              // output columns per CTA
  static constexpr int kVecs = kVecs_;              // float4 columns each thread accumulates
  static constexpr int kBatch = kBatch_;            // pieces whose loads a thread has in flight at once
  static constexpr int kChunks = kHeadDimV / kCols;                 // CTAs across one row
  static constexpr int kColThreads = kCols / (4 * kVecs);           // threads across the CTA's columns
  static constexpr int kThreadsPerRow = kCombineThreads / kRows;
  static constexpr int kGroups = kThreadsPerRow / kColThreads;      // piece groups per row
  static constexpr int kWarpsPerRow = kThreadsPerRow / kWarpSize;

  static_assert(kHeadDimV % kCols == 0 && kCols % (4 * kVecs) == 0, "whole float4 columns, whole chunks");
  static_assert(kCombineThreads % kRows == 0 && kThreadsPerRow % kColThreads == 0, "threads tile the CTA");
  static_assert(kThreadsPerRow % kWarpSize == 0, "a warp serves one row: its lanes share the row's lse");
  static_assert(kGroups == 1 || kVecs == 1, "the cross-group sum in shared memory holds one float4 per thread");
};

// Few split rows, many pieces each (b = 1..~16): spread the pieces over 16 groups and the row over 8 CTAs.
using WideTile = CombineTile<1, 64, 1, 8>;
// Many split rows, few pieces each: a warp owns a whole row; no shared memory, no barrier.
using TallTile = CombineTile<8, 512, 4, 2>;

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  // xor butterfly: lanes i and i ^ offset add the same two values, so every lane ends with the same bits.
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// Blocks until the split kernel (the programmatic-launch predecessor) has finished and its writes are visible.
// Without the launch attribute it returns at once: the ordinary stream order already holds.
__device__ __forceinline__ void wait_for_split_kernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// log-sum-exp state of a set of lse values: `max` ignores NaN (fmaxf); `sum` = sum exp(lse_k - base) with
// base = max, or 0 when max is -inf (then sum is 0, or NaN if a NaN was seen: NaN must survive to the end).
struct LseState {
  float max;
  float sum;
};

__device__ __forceinline__ float lse_base(float max) { return max == -INFINITY ? 0.f : max; }

// `state`'s sum relative to base `max` (>= state.max, finite).
__device__ __forceinline__ float rebased_sum(LseState state, float max) {
  return state.max == -INFINITY ? state.sum : state.sum * __expf(state.max - max);
}

__device__ __forceinline__ LseState merge(LseState a, LseState b) {
  const float max = fmaxf(a.max, b.max);
  if (max == -INFINITY) return {max, a.sum + b.sum};
  return {max, rebased_sum(a, max) + rebased_sum(b, max)};
}

__device__ __forceinline__ float finish_lse(LseState state) {
  return state.sum == 0.f ? -INFINITY : lse_base(state.max) + __logf(state.sum);
}

// LseState of pieces first + lane, first + lane + stride, ... (< num_pieces) of one row, reduced over the warp;
// every lane returns the same value. piece_lse[k * piece_stride] is piece k's lse.
template <int kHeld>
__device__ LseState warp_lse_state(const float* piece_lse, int64_t piece_stride, int num_pieces, int first, int stride,
                                   int lane) {
  // The first kHeld rounds are loaded before any is used (kHeld loads in flight per lane) and kept in
  // registers for the second pass; more pieces than that (more SM parts than an H100 has) are read again.
  float held[kHeld];
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    const int k = first + lane + i * stride;
    held[i] = k < num_pieces ? __ldcg(piece_lse + k * piece_stride) : -INFINITY;
  }
  const int rest = first + lane + kHeld * stride;
  float max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kHeld; ++i) max = fmaxf(max, held[i]);
  for (int k = rest; k < num_pieces; k += stride) max = fmaxf(max, __ldcg(piece_lse + k * piece_stride));
  max = warp_max(max);

  const float base = lse_base(max);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kHeld; ++i) sum += __expf(held[i] - base);   // -inf (absent, or no key) adds 0
  for (int k = rest; k < num_pieces; k += stride) sum += __expf(__ldcg(piece_lse + k * piece_stride) - base);
  return {max, warp_sum(sum)};
}

// The sequence that is the `candidate`-th split one (in part order), or -1 when fewer were split. Warp-wide;
// every lane returns the same value.
__device__ int find_split_sequence(const DecodeParams& p, int candidate, int lane) {
  constexpr int kRounds = 8;                      // 256 parts per round of loads (an H100 plan has <= 132)
  int to_skip = candidate;
  for (int base = 0; base < p.num_sm_parts; base += kRounds * kWarpSize) {
    int begin_seq[kRounds], begin_split[kRounds];
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      const int part = base + i * kWarpSize + lane;
      const int32_t* row = p.metadata + int64_t(part) * kMetadataWidth;
      begin_seq[i] = part < p.num_sm_parts ? row[kBeginSeq] : -1;
      begin_split[i] = part < p.num_sm_parts ? row[kBeginSplit] : 0;
    }
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      const bool starts_piece_1 = begin_split[i] == 1;
      const unsigned hits = __ballot_sync(kFullMask, starts_piece_1);
      const int count = __popc(hits);
      if (to_skip < count) {
        const int rank = __popc(hits & ((1u << lane) - 1u));         // hits in lanes below this one
        const unsigned chosen = __ballot_sync(kFullMask, starts_piece_1 && rank == to_skip);
        return __shfl_sync(kFullMask, begin_seq[i], __ffs(chosen) - 1);
      }
      to_skip -= count;
    }
  }
  return -1;
}

template <class Element, class Tile>
__global__ void __launch_bounds__(kCombineThreads, 2) mla_combine_kernel(const __grid_constant__ DecodeParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int row_in_cta = threadIdx.x / Tile::kThreadsPerRow;
  const int group = threadIdx.x % Tile::kThreadsPerRow / Tile::kColThreads;
  const int col_thread = threadIdx.x % Tile::kColThreads;
  const int warp_in_row = threadIdx.x % Tile::kThreadsPerRow / kWarpSize;
  const int chunk = blockIdx.x % Tile::kChunks;
  const int row = blockIdx.x / Tile::kChunks * Tile::kRows + row_in_cta;     // packed query row of the KV head
  const int kv_head = blockIdx.y;

  // ---- 1. prologue: only data of kernels that finished before the split kernel started ---------------------
  const int seq = find_split_sequence(p, blockIdx.z, lane);
  int first_slot = 0, num_pieces = 0;
  if (seq >= 0 && seq < p.batch) {
    first_slot = p.num_splits[seq];
    const int end_slot = p.num_splits[seq + 1];
    // Workspace slots exist for [0, batch + num_sm_parts): num_splits of another plan must not lead past them.
    if (first_slot >= 0 && end_slot <= p.batch + p.num_sm_parts) num_pieces = end_slot - first_slot;
  }
  const bool row_valid = row < p.rows_per_kv;      // false: padding rows of the last tall block
  const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
  const float sink = p.attn_sink != nullptr && row_valid ? p.attn_sink[head] : -INFINITY;   // -inf: no sink

  // ---- 2. the split kernel's results are complete from here on ------------------------------------------------
  // Every CTA waits, also one with nothing to do, so that this grid never completes before the split kernel.
  wait_for_split_kernel();
  if (num_pieces <= 1) return;                     // the same for the whole CTA (no barrier has been passed)
  const int my_pieces = row_valid ? num_pieces : 0;

  // Partial row `row` of piece k: ((first_slot + k) * h_kv + kv_head) * rows_per_kv + row.
  const int64_t piece_stride = int64_t(p.num_heads_k) * p.rows_per_kv;
  const int64_t first_partial_row = (int64_t(first_slot) * p.num_heads_k + kv_head) * p.rows_per_kv + (row_valid ? row : 0);
  const float* piece_lse = p.lse_partial + first_partial_row;                                  // [k * piece_stride]
  const float4* piece_o = reinterpret_cast<const float4*>(p.o_partial + first_partial_row * kHeadDimV +
                                                          chunk * Tile::kCols) + col_thread;
  const int64_t piece_o_stride = piece_stride * (kHeadDimV / 4);                               // in float4s

  // ---- 3. first batch of this thread's pieces: O_k and lse_k ------------------------------------------------
  float4 o[Tile::kBatch][Tile::kVecs];
  float o_lse[Tile::kBatch];
  auto load_batch = [&](int first) {
#pragma unroll
    for (int i = 0; i < Tile::kBatch; ++i) {
      const int k = first + i * Tile::kGroups;
      if (k < my_pieces) {
        o_lse[i] = __ldcg(piece_lse + k * piece_stride);
#pragma unroll
        for (int v = 0; v < Tile::kVecs; ++v) o[i][v] = __ldcg(piece_o + k * piece_o_stride + v * Tile::kColThreads);
      }
    }
  };
  load_batch(group);

  // ---- 4. the row's lse over all its pieces ------------------------------------------------------------------
  constexpr int kHeld = std::max(1, 256 / (Tile::kWarpsPerRow * kWarpSize));
  LseState state = warp_lse_state<kHeld>(piece_lse, piece_stride, my_pieces, warp_in_row * kWarpSize,
                                         Tile::kWarpsPerRow * kWarpSize, lane);
  if constexpr (Tile::kWarpsPerRow > 1) {
    __shared__ LseState warp_states[Tile::kRows][Tile::kWarpsPerRow];
    if (lane == 0) warp_states[row_in_cta][warp_in_row] = state;
    __syncthreads();
    state = warp_states[row_in_cta][0];
#pragma unroll
    for (int w = 1; w < Tile::kWarpsPerRow; ++w) state = merge(state, warp_states[row_in_cta][w]);
  }
  const float lse = finish_lse(state);
  const bool saw_key = lse != -INFINITY;           // NaN counts as seen: it must reach out

  // ---- 5. out = sum_k exp(lse_k - lse) O_k over this thread's pieces ------------------------------------------
  float4 acc[Tile::kVecs];
#pragma unroll
  for (int v = 0; v < Tile::kVecs; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (saw_key) {
    for (int first = group; first < my_pieces; first += Tile::kBatch * Tile::kGroups) {
      if (first != group) load_batch(first);
#pragma unroll
      for (int i = 0; i < Tile::kBatch; ++i) {
        if (first + i * Tile::kGroups < my_pieces) {
          const float w = __expf(o_lse[i] - lse);
#pragma unroll
          for (int v = 0; v < Tile::kVecs; ++v) {
            acc[v].x = fmaf(w, o[i][v].x, acc[v].x); acc[v].y = fmaf(w, o[i][v].y, acc[v].y);
            acc[v].z = fmaf(w, o[i][v].z, acc[v].z); acc[v].w = fmaf(w, o[i][v].w, acc[v].w);
          }
        }
      }
    }
  }

  // ---- 6. groups' sums in group order, sink, store ------------------------------------------------------------
  if constexpr (Tile::kGroups > 1) {
    __shared__ float4 group_sums[Tile::kGroups - 1][Tile::kRows][Tile::kColThreads];
    if (group > 0) group_sums[group - 1][row_in_cta][col_thread] = acc[0];
    __syncthreads();
    if (group > 0) return;
#pragma unroll
    for (int g = 1; g < Tile::kGroups; ++g) {
      const float4 s = group_sums[g - 1][row_in_cta][col_thread];
      acc[0].x += s.x; acc[0].y += s.y; acc[0].z += s.z; acc[0].w += s.w;
    }
  }
  if (!row_valid) return;

  // Attention sink, as the split kernel's epilogue does for unsplit rows. A row with no key keeps out 0 (its
  // acc is 0; the factor is not even computed, so a -inf sink cannot turn it into NaN).
  const float sink_scale = saw_key && sink != -INFINITY ? 1.f / (1.f + __expf(sink - lse)) : 1.f;
  Element* out = static_cast<Element*>(p.out) +
                 ((int64_t(seq) * p.seqlen_q + token) * p.num_heads_q + head) * kHeadDimV + chunk * Tile::kCols;
  struct alignas(8) Quad { Element v[4]; };
#pragma unroll
  for (int v = 0; v < Tile::kVecs; ++v) {
    const float4 x = acc[v];
    reinterpret_cast<Quad*>(out)[v * Tile::kColThreads + col_thread] =
        Quad{{static_cast<Element>(x.x * sink_scale), static_cast<Element>(x.y * sink_scale),
              static_cast<Element>(x.z * sink_scale), static_cast<Element>(x.w * sink_scale)}};
  }
  if (chunk == 0 && group == 0 && col_thread == 0) p.lse[(int64_t(seq) * p.num_heads_q + head) * p.seqlen_q + token] = lse;
}

// ---- host side --------------------------------------------------------------------------------------------------

// Overrides for side-by-side timing, read once per process: FLASH_MLA_COMBINE_PDL=0 launches the combine as an
// ordinary kernel; FLASH_MLA_COMBINE_TILE=wide|tall forces a tile.
struct CombineOverrides {
  bool pdl = true;
  int tile = -1;          // -1: by shape, 0: tall, 1: wide
};

const CombineOverrides& overrides() {
  static const CombineOverrides value = [] {
    CombineOverrides o;
    const char* pdl = std::getenv("FLASH_MLA_COMBINE_PDL");
    o.pdl = pdl == nullptr || std::strcmp(pdl, "0") != 0;
    const char* tile = std::getenv("FLASH_MLA_COMBINE_TILE");
    if (tile != nullptr && std::strcmp(tile, "wide") == 0) o.tile = 1;
    if (tile != nullptr && std::strcmp(tile, "tall") == 0) o.tile = 0;
    return o;
  }();
  return value;
}

template <class Element, class Tile>
void launch_tile(const DecodeParams& p, int candidates, cudaStream_t stream) {
  const int row_blocks = (p.rows_per_kv + Tile::kRows - 1) / Tile::kRows;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(row_blocks * Tile::kChunks, p.num_heads_k, candidates);
  config.blockDim = dim3(kCombineThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  // Programmatic dependent launch: the CTAs may be scheduled once every split CTA has started (the split kernel
  // triggers at its start), run the prologue, and wait in griddepcontrol.wait. Captured into a CUDA graph this
  // becomes a programmatic edge. A launch error is left for cudaGetLastError (the binding checks it).
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = overrides().pdl ? 1 : 0;
  config.attrs = attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, mla_combine_kernel<Element, Tile>, p);
}

template <class Element>
void launch_combine(const DecodeParams& p, cudaStream_t stream) {
  // Each split sequence has exactly one SM part starting with its piece 1, and part 0 starts with a piece 0.
  // Grid z is capped at CUDA's limit; get_mla_metadata plans have at most 1024 parts.
  const int candidates = std::min({p.batch, p.num_sm_parts - 1, 65535});
  if (candidates <= 0) return;                     // one SM part: no sequence was split
  // Pieces per split sequence are about 1 + (num_sm_parts - 1) / (split sequences). At >= 9 (at most
  // (num_sm_parts - 1) / 8 candidates) the pieces are spread over the wide tile's 16 groups; below, the
  // tall tile's one warp per row walks them with 2 pieces in flight.
  bool wide = p.num_sm_parts - 1 >= 8 * candidates;
  if (overrides().tile >= 0) wide = overrides().tile == 1;
  if (wide) {
    launch_tile<Element, WideTile>(p, candidates, stream);
  } else {
    launch_tile<Element, TallTile>(p, candidates, stream);
  }
}

}  // namespace

void launch_mla_combine_bf16(const DecodeParams& params, void* stream) {
  launch_combine<cutlass::bfloat16_t>(params, static_cast<cudaStream_t>(stream));
}
void launch_mla_combine_fp16(const DecodeParams& params, void* stream) {
  launch_combine<cutlass::half_t>(params, static_cast<cudaStream_t>(stream));
}

}  // namespace flash_mla
