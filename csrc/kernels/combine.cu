// Combine kernel: merges the fp32 partial results of split sequences, SPEC.md "Kernels" (3):
//   lse = log sum_k exp(lse_k),   out = sum_k exp(lse_k - lse) * O_k      (k over the sequence's pieces)
// and, with an attention sink, scales out by 1 / (1 + exp(attn_sink[head] - lse)) (lse itself is unchanged).
//
// Design goal: the time must not grow with the number of pieces (b = 1 is cut into ~num_SMs pieces) nor with the
// number of split rows (b = 128, h_q = 128: 16k rows of two pieces), whatever else is in the batch (a CUDA-graph
// batch padded to b = 32 around one long sequence included). The kernel is latency-bound, so: every warp works
// alone (no CTA barrier after the prologue), every warp issues one round of loads per item where it can, and
// several CTAs share an SM.
//
// Which rows. Only sequences cut into two or more pieces. Unsplit sequences (L = 0 ones included: they are never
// cut) were written by the split kernel and are not touched. Sequence s is split exactly when one SM part starts
// with its piece 1 (metadata begin_split == 1), so at most min(batch, num_sm_parts - 1) sequences are split, and
// the work is bounded by the plan, not by the batch size.
//
// Work items. One item = one warp = (packed query row, slice of kCols output columns) of a split sequence. The
// slice width follows the piece count n, on the device (the host cannot know n without a sync): kCols =
// clamp(pow2_floor(1024 / n), 8, 512), so that n x kCols <= 1024, i.e. a warp's share is n x kCols x 4 B
// <= 4 KiB = 8 float4 per lane: one round of loads up to n = 128 (b = 1 on an H100), more only beyond. Lanes are
// (piece group) x (column lane): kCols >= 128 puts all 32 lanes across the columns (kCols / 128 float4 each per
// piece); narrower slices leave 32 / (kCols / 4) piece groups, group g taking pieces g, g + groups, ...
//   n = 2: 512 columns (one item per row, 4 float4 x 2 pieces per lane); n = 16: 64 columns, 2 groups;
//   n = 128: 8 columns (one 32 B sector per piece), 16 groups of 2 lanes, 8 pieces per lane.
//
// Grid: (CTAs, 1, 1) of kCombineWarps warps, at most the resident CTAs (several per SM); warp w of the grid
// processes items w, w + total warps, ... Order inside a CTA:
//   1. prologue (may run while the split kernel is still running: programmatic dependent launch): warp 0 lists
//      the split sequences (ballot over the metadata's begin_split == 1), their slots and pieces (num_splits),
//      and each one's first item (a warp scan), into shared memory. It reads only the metadata and num_splits,
//      written by the metadata kernel, which had finished before the split kernel (an ordinary launch) started.
//   2. griddepcontrol.wait, by every CTA: from here on the split kernel's results are complete and visible, and
//      this grid cannot complete before the split kernel.
//   3. per item, one warp: the loads of its first batch of pieces (O_k and lse_k: they do not need the row's lse),
//      the row's lse (lanes read the pieces' lse strided, warp max, warp sum of exp(lse_k - max)), the weighted
//      sum over the lane's pieces, the groups' sums (xor shuffles), the sink, the stores of out and lse.
// Deterministic: every sum has a fixed order (a lane's pieces in order, xor-shuffle trees), whichever warp runs
// an item; no atomics. Semantics kept from the split kernel: a row with no key in any piece gets out 0, lse -inf;
// a NaN lse_k makes the row's lse and out NaN (never mistaken for "no key").
// Split results are read with ld.global.cg: each O element is read once, from L2, where the split kernel's
// writes are; L1 would only hold lines this kernel never reads again.
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <atomic>

#include "params.h"

namespace flash_mla {
namespace {

constexpr int kCombineWarps = 8;
constexpr int kCombineThreads = kCombineWarps * 32;
constexpr int kCombineMinCtasPerSm = 2;  // 16 warps per SM, 8 float4 in flight per lane: 64 KiB of loads per SM
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxSplitSeqs = 1024;     // >= num_sm_parts - 1 for any get_mla_metadata plan (<= 1024 parts)
constexpr int kLaneLoadBytes = 8 * 16;  // 8 float4 in flight per lane per round
constexpr int kMinSliceCols = 8;        // 32 B of a piece's row: one sector, the smallest whole read

// Output columns one warp item covers for a sequence of n pieces: the widest power of two with
// n x cols x 4 B <= 32 lanes x kLaneLoadBytes (one round of loads), between kMinSliceCols and all 512.
__host__ __device__ constexpr int slice_cols(int num_pieces) {
  int cols = kHeadDimV;
  while (cols > kMinSliceCols && num_pieces * cols * 4 > kWarpSize * kLaneLoadBytes) cols /= 2;
  return cols;
}
static_assert(slice_cols(2) == 512 && slice_cols(3) == 256 && slice_cols(16) == 64 && slice_cols(128) == 8 &&
              slice_cols(133) == 8, "the widths the design comment names");

// How a warp's lanes cover a slice of kCols columns.
template <int kCols_>
struct SliceShape {
  static constexpr int kCols = kCols_;
  static constexpr int kColLanes = kCols / 4 < kWarpSize ? kCols / 4 : kWarpSize;   // lanes across the columns
  static constexpr int kGroups = kWarpSize / kColLanes;                             // piece groups
  static constexpr int kVecs = kCols / 4 / kColLanes;                               // float4 per lane per piece
  static constexpr int kBatch = kLaneLoadBytes / 16 / kVecs;                        // pieces per lane per round
  static constexpr int kSlices = kHeadDimV / kCols;                                 // items across one row
  static_assert(kHeadDimV % kCols == 0 && kColLanes * kGroups == kWarpSize && kBatch >= 1, "lanes tile the slice");
};

// Items of one sequence with `num_pieces` pieces: every packed row of every KV head, in slices.
__host__ __device__ inline int items_of(int num_pieces, int rows, int num_heads_k) {
  return num_heads_k * rows * (kHeadDimV / slice_cols(num_pieces));
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

__device__ __forceinline__ float finish_lse(LseState state) {
  return state.sum == 0.f ? -INFINITY : lse_base(state.max) + __logf(state.sum);
}

// The row's lse over its pieces, on every lane with the same bits: lane l reads pieces l, l + 32, ...
// (piece_lse[k * piece_stride] is piece k's lse), then a warp max and a warp sum of exp(lse_k - max).
__device__ float warp_row_lse(const float* piece_lse, int64_t piece_stride, int num_pieces, int lane) {
  // The first kHeld rounds are loaded before any is used and kept in registers for the second pass; more pieces
  // than that (more SM parts than an H100 has) are read again.
  constexpr int kHeld = 4;
  float held[kHeld];
#pragma unroll
  for (int i = 0; i < kHeld; ++i) {
    const int k = lane + i * kWarpSize;
    held[i] = k < num_pieces ? __ldcg(piece_lse + k * piece_stride) : -INFINITY;
  }
  const int rest = lane + kHeld * kWarpSize;
  float max = -INFINITY;
#pragma unroll
  for (int i = 0; i < kHeld; ++i) max = fmaxf(max, held[i]);
#pragma unroll 1
  for (int k = rest; k < num_pieces; k += kWarpSize) max = fmaxf(max, __ldcg(piece_lse + k * piece_stride));
  max = warp_max(max);

  const float base = lse_base(max);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kHeld; ++i) sum += __expf(held[i] - base);   // -inf (absent, or no key) adds 0
#pragma unroll 1
  for (int k = rest; k < num_pieces; k += kWarpSize) sum += __expf(__ldcg(piece_lse + k * piece_stride) - base);
  return finish_lse({max, warp_sum(sum)});
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

// One warp item: `local_item` of the sequence's items (KV-head major, then packed row, then column slice).
template <class Element, int kCols>
__device__ void combine_slice(const DecodeParams& p, int seq, int first_slot, int num_pieces, int local_item,
                              int lane) {
  using Shape = SliceShape<kCols>;
  const int col_lane = lane % Shape::kColLanes;
  const int group = lane / Shape::kColLanes;
  const int per_head = p.rows_per_kv * Shape::kSlices;
  const int kv_head = local_item / per_head;
  const int row = local_item % per_head / Shape::kSlices;            // packed query row
  const int slice = local_item % Shape::kSlices;
  const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;

  // Partial row `row` of piece k: ((first_slot + k) * h_kv + kv_head) * rows_per_kv + row.
  const int64_t piece_stride = int64_t(p.num_heads_k) * p.rows_per_kv;
  const int64_t first_partial_row = (int64_t(first_slot) * p.num_heads_k + kv_head) * p.rows_per_kv + row;
  const float* piece_lse = p.lse_partial + first_partial_row;                                  // [k * piece_stride]
  const float4* piece_o = reinterpret_cast<const float4*>(p.o_partial + first_partial_row * kHeadDimV +
                                                          slice * kCols) + col_lane;
  const int64_t piece_o_stride = piece_stride * (kHeadDimV / 4);                               // in float4s

  // ---- first batch of this lane's pieces, O_k and lse_k, before the row's lse is known -------------------------
  float4 o[Shape::kBatch][Shape::kVecs];     // (PIECE, VEC): pieces group + i * kGroups, float4 columns v * kColLanes
  float o_lse[Shape::kBatch];
  // A piece index past the end re-reads the last piece (its weight is never applied): the arrays are then always
  // fully written, which keeps the next batch's loads from needing registers of their own.
  auto load_batch = [&](int first) {
#pragma unroll
    for (int i = 0; i < Shape::kBatch; ++i) {
      const int k = min(first + i * Shape::kGroups, num_pieces - 1);
      o_lse[i] = __ldcg(piece_lse + k * piece_stride);
#pragma unroll
      for (int v = 0; v < Shape::kVecs; ++v) o[i][v] = __ldcg(piece_o + k * piece_o_stride + v * Shape::kColLanes);
    }
  };
  load_batch(group);
  const float sink = p.attn_sink != nullptr ? p.attn_sink[head] : -INFINITY;    // -inf: no sink

  // ---- the row's lse over all its pieces (every lane gets the same bits) -------------------------------------------
  const float lse = warp_row_lse(piece_lse, piece_stride, num_pieces, lane);
  const bool saw_key = lse != -INFINITY;           // NaN counts as seen: it must reach out

  // ---- out = sum_k exp(lse_k - lse) O_k: this lane's pieces in order, then the groups (xor tree) ----------------
  float4 acc[Shape::kVecs];
#pragma unroll
  for (int v = 0; v < Shape::kVecs; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (saw_key) {
#pragma unroll 1
    for (int first = group; first < num_pieces; first += Shape::kBatch * Shape::kGroups) {
      if (first != group) load_batch(first);
#pragma unroll
      for (int i = 0; i < Shape::kBatch; ++i) {
        if (first + i * Shape::kGroups < num_pieces) {
          const float w = __expf(o_lse[i] - lse);
#pragma unroll
          for (int v = 0; v < Shape::kVecs; ++v) {
            acc[v].x = fmaf(w, o[i][v].x, acc[v].x); acc[v].y = fmaf(w, o[i][v].y, acc[v].y);
            acc[v].z = fmaf(w, o[i][v].z, acc[v].z); acc[v].w = fmaf(w, o[i][v].w, acc[v].w);
          }
        }
      }
    }
  }
#pragma unroll
  for (int offset = Shape::kColLanes; offset < kWarpSize; offset *= 2) {
#pragma unroll
    for (int v = 0; v < Shape::kVecs; ++v) {
      acc[v].x += __shfl_xor_sync(kFullMask, acc[v].x, offset); acc[v].y += __shfl_xor_sync(kFullMask, acc[v].y, offset);
      acc[v].z += __shfl_xor_sync(kFullMask, acc[v].z, offset); acc[v].w += __shfl_xor_sync(kFullMask, acc[v].w, offset);
    }
  }

  // ---- sink, convert, store (group 0's lanes; lane 0 of slice 0 writes the lse) ---------------------------------
  if (group == 0) {
    // Attention sink, as the split kernel's epilogue does for unsplit rows. A row with no key keeps out 0 (its
    // acc is 0; the factor is not even computed, so a -inf sink cannot turn it into NaN).
    const float sink_scale = saw_key && sink != -INFINITY ? 1.f / (1.f + __expf(sink - lse)) : 1.f;
    Element* out = static_cast<Element*>(p.out) +
                   ((int64_t(seq) * p.seqlen_q + token) * p.num_heads_q + head) * kHeadDimV + slice * kCols;
    struct alignas(8) Quad { Element v[4]; };
#pragma unroll
    for (int v = 0; v < Shape::kVecs; ++v) {
      const float4 x = acc[v];
      reinterpret_cast<Quad*>(out)[v * Shape::kColLanes + col_lane] =
          Quad{{static_cast<Element>(x.x * sink_scale), static_cast<Element>(x.y * sink_scale),
                static_cast<Element>(x.z * sink_scale), static_cast<Element>(x.w * sink_scale)}};
    }
    if (slice == 0 && lane == 0) p.lse[(int64_t(seq) * p.num_heads_q + head) * p.seqlen_q + token] = lse;
  }
}

template <class Element>
__global__ void __launch_bounds__(kCombineThreads, kCombineMinCtasPerSm)
mla_combine_kernel(const __grid_constant__ DecodeParams p) {
  __shared__ WorkList list;

  // ---- 1. prologue: only data of kernels that finished before the split kernel started -------------------------
  if (threadIdx.x < kWarpSize) list_split_sequences(p, list, threadIdx.x);
  __syncthreads();

  // ---- 2. the split kernel's results are complete from here on --------------------------------------------------
  wait_for_split_kernel();

  // ---- 3. warp items, grid-strided; every branch below is uniform across the warp -------------------------------
  const int lane = threadIdx.x % kWarpSize;
  const int total_warps = gridDim.x * kCombineWarps;
#pragma unroll 1
  for (int item = blockIdx.x * kCombineWarps + threadIdx.x / kWarpSize; item < list.total_items; item += total_warps) {
    const int entry = entry_of_item(list, item);
    const int seq = list.seq[entry], first_slot = list.first_slot[entry], num_pieces = list.num_pieces[entry];
    const int local_item = item - list.first_item[entry];
    switch (slice_cols(num_pieces)) {
      case 512: combine_slice<Element, 512>(p, seq, first_slot, num_pieces, local_item, lane); break;
      case 256: combine_slice<Element, 256>(p, seq, first_slot, num_pieces, local_item, lane); break;
      case 128: combine_slice<Element, 128>(p, seq, first_slot, num_pieces, local_item, lane); break;
      case 64: combine_slice<Element, 64>(p, seq, first_slot, num_pieces, local_item, lane); break;
      case 32: combine_slice<Element, 32>(p, seq, first_slot, num_pieces, local_item, lane); break;
      case 16: combine_slice<Element, 16>(p, seq, first_slot, num_pieces, local_item, lane); break;
      default: combine_slice<Element, kMinSliceCols>(p, seq, first_slot, num_pieces, local_item, lane); break;
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
  // Items are counted on the device; bound them here to size the grid. A sequence of n pieces has
  // rows * 512 / slice_cols(n) <= rows * n items per KV head (slice_cols(n) >= 512 / n), and the split
  // sequences' pieces number at most 2 * num_sm_parts (a part holds at most two pieces of split sequences: its
  // first and its last), hence the bound below.
  const int64_t max_items = int64_t(p.num_heads_k) * p.rows_per_kv * 2 * p.num_sm_parts;
  const int64_t max_ctas = (max_items + kCombineWarps - 1) / kCombineWarps;
  const int ctas = static_cast<int>(std::min<int64_t>(max_ctas, resident_ctas<Element>()));

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
