// Combine kernel: merges the fp32 partial results of split sequences, SPEC.md "Kernels" (3):
//   lse = log sum_k exp(lse_k),   out = sum_k exp(lse_k - lse) * O_k      (k over the sequence's pieces)
// and, with an attention sink, scales out by 1 / (1 + exp(attn_sink[head] - lse)) (lse itself is unchanged).
//
// Design goal: the time must not grow with the number of pieces (b = 1 is cut into ~num_SMs pieces), whatever
// else is in the batch (a CUDA-graph batch padded to b = 32 with one long sequence included).
//
// Which rows. Only sequences cut into two or more pieces. Unsplit sequences (L = 0 ones included: they are never
// cut) were written by the split kernel and are not touched. Sequence s is split exactly when one SM part starts
// with its piece 1 (metadata begin_split == 1), so at most min(batch, num_sm_parts - 1) sequences are split, and
// the work is bounded by the plan, not by the batch size.
//
// Work items. A split sequence with n pieces is cut into items of 256 threads, by one of two tiles chosen on the
// device from n (the host cannot know n without a sync):
//   wide (n >= 16): 1 row x 64 columns per item; the pieces spread over 16 groups of 16 threads (a float4 each),
//        8 pieces' loads in flight per thread. b = 1, h_q = 16: 16 rows x 8 chunks = 128 items; 133 pieces are
//        8-9 per thread, two rounds of loads.
//   tall (n < 16): 8 rows x 512 columns per item, a warp per row, 4 pieces (16 float4 per lane) in flight.
// Thread layout within an item, outermost first: (row) x (piece group) x (column thread); column thread c
// accumulates float4 columns c, c + kColThreads, ... (coalesced); piece group g takes pieces g, g + kGroups, ...
// A warp always serves a single row.
//
// Grid: (CTAs, 1, 1), at most one resident wave; CTA i processes items i, i + gridDim.x, ... in order.
// Order inside a CTA:
//   1. prologue (may run while the split kernel is still running: programmatic dependent launch): warp 0 lists
//      the split sequences (ballot over the metadata's begin_split == 1), their slots and pieces (num_splits),
//      and each one's first item (a warp scan), into shared memory. It reads only the metadata and num_splits,
//      written by the metadata kernel, which had finished before the split kernel (an ordinary launch) started.
//   2. griddepcontrol.wait, by every CTA: from here on the split kernel's results are complete and visible, and
//      this grid cannot complete before the split kernel.
//   3. per item: each thread issues the loads of its first batch of pieces (O_k and lse_k: they do not need the
//      row's lse), then the row's lse (lanes read the pieces' lse strided, warp max, warp sum of
//      exp(lse_k - max); the wide tile's 8 warps per row merge their (max, sum) through shared memory in warp
//      order), the weighted sum over the thread's pieces, the groups' sums added in group order (wide), the
//      sink, the stores of out and (one thread per row) lse.
// Deterministic: every sum has a fixed order (a thread's pieces in order, xor-shuffle trees, warp order, group
// order), whichever CTA runs an item; no atomics. Semantics kept from the split kernel: a row with no key in any
// piece gets out 0, lse -inf; a NaN lse_k makes the row's lse and out NaN (never mistaken for "no key").
// Split results are read with ld.global.cg: each O element is read once, from L2, where the split kernel's
// writes are; L1 would only hold lines this kernel never reads again.
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <atomic>

#include "params.h"

namespace flash_mla {
namespace {

constexpr int kCombineThreads = 256;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxSplitSeqs = 1024;     // >= num_sm_parts - 1 for any get_mla_metadata plan (<= 1024 parts)
constexpr int kWideMinPieces = 16;      // below this the tall tile needs at most 4 rounds of loads

template <int kRows_, int kCols_, int kVecs_, int kBatch_>
struct CombineTile {
  static constexpr int kRows = kRows_;              // packed query rows per item
  static constexpr int kCols = kCols_;              // output columns per item
  static constexpr int kVecs = kVecs_;              // float4 columns each thread accumulates
  static constexpr int kBatch = kBatch_;            // pieces whose loads a thread has in flight at once
  static constexpr int kChunks = kHeadDimV / kCols;                 // items across one row
  static constexpr int kColThreads = kCols / (4 * kVecs);           // threads across the item's columns
  static constexpr int kThreadsPerRow = kCombineThreads / kRows;
  static constexpr int kGroups = kThreadsPerRow / kColThreads;      // piece groups per row
  static constexpr int kWarpsPerRow = kThreadsPerRow / kWarpSize;

  static_assert(kHeadDimV % kCols == 0 && kCols % (4 * kVecs) == 0, "whole float4 columns, whole chunks");
  static_assert(kCombineThreads % kRows == 0 && kThreadsPerRow % kColThreads == 0, "threads tile the item");
  static_assert(kThreadsPerRow % kWarpSize == 0, "a warp serves one row: its lanes share the row's lse");
  static_assert(kGroups == 1 || kVecs == 1, "the cross-group sum in shared memory holds one float4 per thread");

  // Items of one KV head of a sequence with `rows` packed query rows.
  __host__ __device__ static int items_per_head(int rows) { return (rows + kRows - 1) / kRows * kChunks; }
};

using WideTile = CombineTile<1, 64, 1, 8>;
using TallTile = CombineTile<8, 512, 4, 4>;

__host__ __device__ inline bool is_wide(int num_pieces) { return num_pieces >= kWideMinPieces; }

__host__ __device__ inline int items_of(int num_pieces, int rows, int num_heads_k) {
  return num_heads_k * (is_wide(num_pieces) ? WideTile::items_per_head(rows) : TallTile::items_per_head(rows));
}

// The split sequences, listed by warp 0 in the prologue (shared memory).
struct WorkList {
  int seq[kMaxSplitSeqs];
  int first_slot[kMaxSplitSeqs];        // workspace slot of piece 0
  int num_pieces[kMaxSplitSeqs];        // >= 2, or 0 for an entry that failed the slot guard (no items)
  int first_item[kMaxSplitSeqs];        // exclusive prefix of the entries' item counts
  int count;
  int total_items;
};

// log-sum-exp state of a set of lse values: `max` ignores NaN (fmaxf); `sum` = sum exp(lse_k - base) with
// base = max, or 0 when max is -inf (then sum is 0, or NaN if a NaN was seen: NaN must survive to the end).
struct LseState {
  float max;
  float sum;
};

// Per-tile shared memory: the warps' lse states of each row and the piece groups' sums (one-element arrays for
// the tall tile, which has one warp and one group per row and uses neither).
template <class Tile>
struct TileShared {
  static constexpr bool kShares = Tile::kGroups > 1;
  LseState warp_states[Tile::kRows][Tile::kWarpsPerRow];
  float4 group_sums[kShares ? Tile::kGroups - 1 : 1][kShares ? Tile::kRows : 1][kShares ? Tile::kColThreads : 1];
};

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  // xor butterfly: lanes i and i ^ offset add the same two values, so every lane ends with the same bits.
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}
__device__ __forceinline__ int warp_inclusive_scan(int x, int lane) {
  for (int offset = 1; offset < kWarpSize; offset *= 2) {
    const int y = __shfl_up_sync(kFullMask, x, offset);
    if (lane >= offset) x += y;
  }
  return x;
}

// Blocks until the split kernel (the programmatic-launch predecessor) has finished and its writes are visible.
// Without the launch attribute it returns at once: the ordinary stream order already holds.
__device__ __forceinline__ void wait_for_split_kernel() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

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

// Warp 0 fills `list` (prologue: metadata and num_splits only). Sequence s is listed when an SM part starts with
// its piece 1, in part order (= sequence order).
__device__ void list_split_sequences(const DecodeParams& p, WorkList& list, int lane) {
  constexpr int kRounds = 8;            // 256 parts' or sequences' loads in flight per round
  int count = 0;
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
      const int position = count + __popc(hits & ((1u << lane) - 1u));
      if (starts_piece_1 && position < kMaxSplitSeqs) list.seq[position] = begin_seq[i];
      count += __popc(hits);
    }
  }
  count = min(count, kMaxSplitSeqs);
  __syncwarp();

  int items_before = 0;
  for (int base = 0; base < count; base += kRounds * kWarpSize) {
    int first[kRounds], end[kRounds];
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      const int j = base + i * kWarpSize + lane;
      const int seq = j < count ? list.seq[j] : -1;
      const bool in_batch = seq >= 0 && seq < p.batch;        // a foreign plan may name any sequence
      first[i] = in_batch ? p.num_splits[seq] : 0;
      end[i] = in_batch ? p.num_splits[seq + 1] : 0;
    }
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      const int j = base + i * kWarpSize + lane;
      // Workspace slots exist for [0, batch + num_sm_parts): num_splits of another plan must not lead past them.
      const bool valid = j < count && first[i] >= 0 && end[i] - first[i] >= 2 && end[i] <= p.batch + p.num_sm_parts;
      const int pieces = valid ? end[i] - first[i] : 0;
      const int items = valid ? items_of(pieces, p.rows_per_kv, p.num_heads_k) : 0;
      const int inclusive = warp_inclusive_scan(items, lane);
      if (j < count) {
        list.first_slot[j] = first[i];
        list.num_pieces[j] = pieces;
        list.first_item[j] = items_before + inclusive - items;
      }
      items_before += __shfl_sync(kFullMask, inclusive, kWarpSize - 1);
    }
  }
  if (lane == 0) {
    list.count = count;
    list.total_items = items_before;
  }
}

// The list entry that owns `item`: the last one whose first_item <= item (entries without items share their
// first_item with the next one, which then wins).
__device__ int entry_of_item(const WorkList& list, int item) {
  int lo = 0, hi = list.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (list.first_item[mid] <= item) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// One item: `local_item` of the sequence's items (KV-head major, then row block, then column chunk).
template <class Element, class Tile>
__device__ void combine_item(const DecodeParams& p, int seq, int first_slot, int num_pieces, int local_item,
                             TileShared<Tile>& shared) {
  const int lane = threadIdx.x % kWarpSize;
  const int row_in_item = threadIdx.x / Tile::kThreadsPerRow;
  const int group = threadIdx.x % Tile::kThreadsPerRow / Tile::kColThreads;
  const int col_thread = threadIdx.x % Tile::kColThreads;
  const int warp_in_row = threadIdx.x % Tile::kThreadsPerRow / kWarpSize;
  const int per_head = Tile::items_per_head(p.rows_per_kv);
  const int kv_head = local_item / per_head;
  const int chunk = local_item % per_head % Tile::kChunks;
  const int row = local_item % per_head / Tile::kChunks * Tile::kRows + row_in_item;   // packed query row
  const bool row_valid = row < p.rows_per_kv;      // false: padding rows of the last tall block
  const int my_pieces = row_valid ? num_pieces : 0;
  const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;

  // Partial row `row` of piece k: ((first_slot + k) * h_kv + kv_head) * rows_per_kv + row.
  const int64_t piece_stride = int64_t(p.num_heads_k) * p.rows_per_kv;
  const int64_t first_partial_row = (int64_t(first_slot) * p.num_heads_k + kv_head) * p.rows_per_kv + (row_valid ? row : 0);
  const float* piece_lse = p.lse_partial + first_partial_row;                                  // [k * piece_stride]
  const float4* piece_o = reinterpret_cast<const float4*>(p.o_partial + first_partial_row * kHeadDimV +
                                                          chunk * Tile::kCols) + col_thread;
  const int64_t piece_o_stride = piece_stride * (kHeadDimV / 4);                               // in float4s

  // ---- first batch of this thread's pieces, O_k and lse_k, before the row's lse is known ----------------------
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
  const float sink = p.attn_sink != nullptr && row_valid ? p.attn_sink[head] : -INFINITY;    // -inf: no sink

  // ---- the row's lse over all its pieces ------------------------------------------------------------------------
  constexpr int kHeld = std::max(1, 256 / (Tile::kWarpsPerRow * kWarpSize));
  LseState state = warp_lse_state<kHeld>(piece_lse, piece_stride, my_pieces, warp_in_row * kWarpSize,
                                         Tile::kWarpsPerRow * kWarpSize, lane);
  if constexpr (Tile::kWarpsPerRow > 1) {
    if (lane == 0) shared.warp_states[row_in_item][warp_in_row] = state;
    __syncthreads();
    state = shared.warp_states[row_in_item][0];
#pragma unroll
    for (int w = 1; w < Tile::kWarpsPerRow; ++w) state = merge(state, shared.warp_states[row_in_item][w]);
  }
  const float lse = finish_lse(state);
  const bool saw_key = lse != -INFINITY;           // NaN counts as seen: it must reach out

  // ---- out = sum_k exp(lse_k - lse) O_k over this thread's pieces ----------------------------------------------
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

  // ---- the groups' sums in group order (group 0 owns the output) -------------------------------------------------
  if constexpr (Tile::kGroups > 1) {
    if (group > 0) shared.group_sums[group - 1][row_in_item][col_thread] = acc[0];
    __syncthreads();
    if (group == 0) {
#pragma unroll
      for (int g = 1; g < Tile::kGroups; ++g) {
        const float4 s = shared.group_sums[g - 1][row_in_item][col_thread];
        acc[0].x += s.x; acc[0].y += s.y; acc[0].z += s.z; acc[0].w += s.w;
      }
    }
  }

  if (group == 0 && row_valid) {
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
    if (chunk == 0 && col_thread == 0) p.lse[(int64_t(seq) * p.num_heads_q + head) * p.seqlen_q + token] = lse;
  }
  // The next item reuses the shared memory: nobody may still be reading it.
  if constexpr (Tile::kWarpsPerRow > 1 || Tile::kGroups > 1) __syncthreads();
}

template <class Element>
__global__ void __launch_bounds__(kCombineThreads, 1) mla_combine_kernel(const __grid_constant__ DecodeParams p) {
  __shared__ WorkList list;
  __shared__ TileShared<WideTile> wide_shared;
  __shared__ TileShared<TallTile> tall_shared;

  // ---- 1. prologue: only data of kernels that finished before the split kernel started -------------------------
  if (threadIdx.x < kWarpSize) list_split_sequences(p, list, threadIdx.x);
  __syncthreads();

  // ---- 2. the split kernel's results are complete from here on --------------------------------------------------
  wait_for_split_kernel();

  // ---- 3. the items, grid-strided; every branch below is uniform across the CTA -------------------------------
  for (int item = blockIdx.x; item < list.total_items; item += gridDim.x) {
    const int entry = entry_of_item(list, item);
    const int num_pieces = list.num_pieces[entry];
    const int local_item = item - list.first_item[entry];
    if (is_wide(num_pieces)) {
      combine_item<Element, WideTile>(p, list.seq[entry], list.first_slot[entry], num_pieces, local_item, wide_shared);
    } else {
      combine_item<Element, TallTile>(p, list.seq[entry], list.first_slot[entry], num_pieces, local_item, tall_shared);
    }
  }
}

// ---- host side --------------------------------------------------------------------------------------------------

// CTAs of `kernel` that fit on the current device at once (cached per device; a benign race at worst recomputes).
template <class Element>
int resident_ctas() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= kMaxDevices) device = 0;
  int value = cached[device].load(std::memory_order_relaxed);
  if (value == 0) {
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, mla_combine_kernel<Element>, kCombineThreads, 0);
    value = std::max(sms * per_sm, 1);
    cached[device].store(value, std::memory_order_relaxed);
  }
  return value;
}

template <class Element>
void launch_combine(const DecodeParams& p, cudaStream_t stream) {
  // Each split sequence has exactly one SM part starting with its piece 1, and part 0 starts with a piece 0.
  const int max_split = std::min(p.batch, p.num_sm_parts - 1);
  if (max_split <= 0) return;                      // one SM part: no sequence was split
  // Items are counted on the device; bound them here to size the grid. A wide sequence (>= kWideMinPieces
  // pieces) starts >= kWideMinPieces - 1 parts, so at most (num_sm_parts - 1) / (kWideMinPieces - 1) are wide.
  const int64_t max_wide = std::min<int64_t>(max_split, (p.num_sm_parts - 1) / (kWideMinPieces - 1));
  const int64_t max_items = max_wide * items_of(kWideMinPieces, p.rows_per_kv, p.num_heads_k) +
                            int64_t(max_split) * items_of(2, p.rows_per_kv, p.num_heads_k);
  const int ctas = static_cast<int>(std::min<int64_t>(max_items, resident_ctas<Element>()));

  cudaLaunchConfig_t config{};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(kCombineThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  // Programmatic dependent launch: the CTAs may be scheduled once every split CTA has started (the split kernel
  // triggers at its start), run the prologue, and wait in griddepcontrol.wait. Captured into a CUDA graph this
  // becomes a programmatic edge. Measured on the H100 (docs/PERF.md): 1-6% faster end to end than a plain
  // launch on b = 1 long contexts, so there is no switch. A launch error is left for cudaGetLastError (the binding checks it).
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, mla_combine_kernel<Element>, p);
}

}  // namespace

void launch_mla_combine_bf16(const DecodeParams& params, void* stream) {
  launch_combine<cutlass::bfloat16_t>(params, static_cast<cudaStream_t>(stream));
}
void launch_mla_combine_fp16(const DecodeParams& params, void* stream) {
  launch_combine<cutlass::half_t>(params, static_cast<cudaStream_t>(stream));
}

}  // namespace flash_mla
