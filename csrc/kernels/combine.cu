// Combine kernel: merges the fp32 partial results of split sequences, SPEC.md "Kernels" (3):
//   lse = log sum_k exp(lse_k),   out = sum_k exp(lse_k - lse) * O_k      (k over the sequence's pieces)
// and, with an attention sink, scales out by 1 / (1 + exp(attn_sink[head] - lse)) (lse itself is unchanged).
//
// Design goal: the time must not grow with the number of pieces (b = 1 is cut into ~num_SMs pieces) nor with the
// number of split rows (b = 128, h_q = 128: 16k rows of two pieces), whatever else is in the batch (a CUDA-graph
// batch padded to b = 32 around one long sequence included). The kernel is latency-bound: each item should cost
// one round of loads, and independent items should not wait for each other.
//
// Which rows. Only sequences cut into two or more pieces (num_splits[s + 1] - num_splits[s] >= 2, the split
// kernel's own test). Unsplit sequences (L = 0 ones included: they are never cut) were written by the split kernel
// and are not touched. A split sequence has one SM part starting with its piece 1, so at most
// min(batch, num_sm_parts - 1) sequences are split, and the items are bounded by the plan, not the batch size.
//
// Two kinds of items, chosen per sequence from its piece count n, on the device (the host cannot know n without
// a sync); measured on the H100 (docs/PERF.md "Combine kernel"):
//   warp items (n <= kWarpItemMaxPieces = 32; many rows, few pieces: b = 128 with 2 pieces, b = 4 with 16-32):
//      one warp = (packed query row, slice of kCols columns), kCols = the widest power of two with
//      n x kCols x 4 B <= 4 KiB, i.e. 8 float4 per lane, one round of loads: n = 2: 512 columns (4 float4 x 2
//      pieces per lane); n = 16: 64 columns, 2 piece groups of 16 lanes; n = 32: 32 columns, 4 groups of 8.
//      Lanes are (piece group) x (column lane), group g takes pieces g, g + groups, ...; every load of the item is
//      issued at once (O_k with lse_k), each lane forms the lse state of its own pieces and merges it across the
//      groups with xor shuffles (log2(groups) steps), and the same tree sums the weighted O. No barrier: a CTA's
//      warps run unrelated items. n = 2 (the split rows of large batches) has a lean item of its own
//      (combine_two_pieces: each lane holds both lse values, no shuffles). The combine is bound by instruction issue
//      (docs/PERF.md "Combine"): the lean items took b = 128, h_q 128 from 17.0 to 14.1 us after the split kernel,
//      b = 4, L = 32k (16-32 pieces) from 10.2 to 6.8 us.
//   CTA items (n > 32; few rows, many pieces: b = 1 cut ~128 ways): one CTA = (packed row, 64, 128 or 256
//      columns: cta_item_cols, by the rows and the grid); its piece groups (16, 8 or 4) of columns / 4 threads (a
//      float4 each) take pieces g, g + groups, ..., 8 loads in flight per thread per round; the 8 warps' lse
//      partial states and the groups' sums meet in shared memory. The width counts the rows of every
//      many-piece sequence of the batch, which share the grid. 64 columns give b = 1, h_q 16 (16 rows) 128
//      items, one per CTA; at h_q 128 (128 rows) they gave 1024 items, 4 after one another on each CTA, and 256
//      columns give 256 items of two rounds each. Narrow warp items here would make every 8-column slice re-read
//      the row's n lse values (measured slower).
//
// Grid: (CTAs, 1, 1) of kCombineWarps warps, at most the resident CTAs (two per SM). Order inside a CTA:
//   1. prologue (may run while the split kernel is still running: programmatic dependent launch): warp 0 lists
//      the split sequences, their slots, pieces and item widths, and each one's first CTA item and first warp
//      item (warp scans), into shared memory: one round of loads for up to 1024 sequences (split
//      CTAs leave first, so on a small batch this prologue is on the critical path). It reads only num_splits,
//      written by the metadata kernel, which had finished before any split CTA passed its griddepcontrol.wait;
//      the split kernel lets this grid launch only after that wait.
//   2. griddepcontrol.wait, by every CTA: from here on the split kernel's results are complete and visible, and
//      this grid cannot complete before the split kernel.
//   3. CTA items i = blockIdx.x, + gridDim.x, ...; then warp items w = global warp index, + all warps, ... Each
//      item: the loads of its (first batch of) pieces (O_k and lse_k: they do not need the row's lse), the row's
//      lse, the weighted sum over the thread's pieces, the groups' sums, the sink, the stores of out and lse.
// Deterministic: every sum has a fixed order (a thread's pieces in order, xor-shuffle trees, warp order, group
// order), whichever CTA or warp runs an item; no atomics. Semantics kept from the split kernel: a row with no key
// in any piece gets out 0, lse -inf; a NaN lse_k makes the row's lse and out NaN (never mistaken for "no key").
// Split results are read with ld.global.cg: each O element is read once, from L2, where the split kernel's
// writes are; L1 would only hold lines this kernel never reads again. Each partial line is then discarded from L2
// (drop_if_line_start): dead data is not written back to DRAM.
#include <cuda_runtime.h>
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <atomic>

#include "launch.h"
#include "params.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN
namespace {

constexpr int kCombineWarps = 8;
constexpr int kCombineThreads = kCombineWarps * 32;
constexpr int kCombineMinCtasPerSm = 2;  // 16 warps per SM, 8 float4 in flight per thread: 64 KiB of loads per SM
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxSplitSeqs = 1024;     // >= num_sm_parts - 1 for any get_mla_metadata plan (<= 1024 parts)
constexpr int kLaneLoadBytes = 8 * 16;  // 8 float4 in flight per thread per round
constexpr int kWarpItemMaxPieces = 32;  // more pieces: CTA items

__host__ __device__ constexpr bool uses_warp_items(int num_pieces) { return num_pieces <= kWarpItemMaxPieces; }

// Output columns of one warp item for a sequence of n <= kWarpItemMaxPieces pieces: the widest power of two with
// n x cols x 4 B <= 32 lanes x kLaneLoadBytes (one round of loads).
__host__ __device__ constexpr int slice_cols(int num_pieces) {
  int cols = kHeadDimV;
  while (num_pieces * cols * 4 > kWarpSize * kLaneLoadBytes) cols /= 2;
  return cols;
}
static_assert(slice_cols(2) == 512 && slice_cols(3) == 256 && slice_cols(16) == 64 &&
              slice_cols(kWarpItemMaxPieces) == 32, "the widths the design comment names");

// A CTA item: one packed row x kCols columns; kGroups piece groups of kCols / 4 threads, one float4 column each.
template <int kCols_>
struct CtaTile {
  static constexpr int kCols = kCols_;
  static constexpr int kChunks = kHeadDimV / kCols;          // items across one row
  static constexpr int kColThreads = kCols / 4;
  static constexpr int kGroups = kCombineThreads / kColThreads;
  static constexpr int kBatch = kLaneLoadBytes / 16;         // pieces per thread per round
  static_assert(kColThreads * kGroups == kCombineThreads && kGroups >= 2, "threads tile the item");
};
constexpr int kCtaItemMinCols = 64;
constexpr int kCtaItemMaxCols = 256;

__host__ __device__ constexpr int ceil_div(int a, int b) { return (a + b - 1) / b; }

// Columns of one CTA item of a sequence of n > kWarpItemMaxPieces pieces, when the CTA items of every such
// sequence of the batch cover `rows` packed rows (all their KV heads), on a grid of `grid` CTAs. A CTA runs its
// items one after another, and an item costs about one latency for its lse and barriers plus one per round of
// loads (a thread's pieces, kBatch at a time): wider items are fewer per CTA but give each thread more pieces.
// The fewest latencies per CTA win, the narrower item on a tie (more CTAs read at once). On 264 CTAs: 16 rows
// (b = 1, h_q 16) 64 columns, 64 rows 128 (b = 1, h_q 64, or b = 4, h_q 16 at 33-34 pieces each: one item per
// CTA, not two), 128 rows 256.
__host__ __device__ constexpr int cta_item_cols(int num_pieces, int rows, int grid) {
  int best_cols = kCtaItemMinCols, best_cost = 1 << 30;
  for (int cols = kCtaItemMinCols; cols <= kCtaItemMaxCols; cols *= 2) {
    const int groups = kCombineThreads / (cols / 4);
    const int rounds = ceil_div(ceil_div(num_pieces, groups), kLaneLoadBytes / 16);
    const int cost = ceil_div(rows * (kHeadDimV / cols), grid) * (1 + rounds);
    if (cost < best_cost) {
      best_cost = cost;
      best_cols = cols;
    }
  }
  return best_cols;
}
static_assert(cta_item_cols(128, 16, 264) == 64 && cta_item_cols(33, 16, 264) == 64 &&
              cta_item_cols(34, 64, 264) == 128 && cta_item_cols(64, 64, 264) == 128 &&
              cta_item_cols(64, 128, 264) == 256 && cta_item_cols(129, 128, 264) == 256,
              "the widths the comment names (tests/test_flash_mla.py mirrors)");

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

// The split sequences, listed by warp 0 in the prologue (shared memory).
struct WorkList {
  int seq[kMaxSplitSeqs];
  int first_slot[kMaxSplitSeqs];        // workspace slot of piece 0
  int num_pieces[kMaxSplitSeqs];        // >= 2, or 0 for an entry that failed the slot guard (no items)
  int item_cols[kMaxSplitSeqs];         // columns of each of its items (slice_cols or cta_item_cols)
  int first_cta_item[kMaxSplitSeqs];    // exclusive prefix of the entries' CTA item counts
  int first_warp_item[kMaxSplitSeqs];   // exclusive prefix of the entries' warp item counts
  int count;
  int total_cta_items;
  int total_warp_items;
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

// gridDim.x read where it is used: held across the warp-item loop, ptxas spilled it (a value it could reload).
__device__ __forceinline__ int grid_ctas() {
  int ctas;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(ctas));
  return ctas;
}

// The lane index read where it is used: values derived from it in one item kind were hoisted to the kernel's top
// and spilled across the other kinds' peaks.
__device__ __forceinline__ int lane_here() {
  int lane;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(lane));
  return lane;
}

__device__ __forceinline__ float lse_base(float max) { return max == -INFINITY ? 0.f : max; }

__device__ __forceinline__ float finish_lse(LseState state) {
  return state.sum == 0.f ? -INFINITY : lse_base(state.max) + __logf(state.sum);
}

// `state`'s sum relative to base `max` (>= state.max, finite).
__device__ __forceinline__ float rebased_sum(LseState state, float max) {
  return state.max == -INFINITY ? state.sum : state.sum * __expf(state.max - max);
}

__device__ __forceinline__ LseState merge(LseState a, LseState b) {
  const float max = fmaxf(a.max, b.max);
  if (max == -INFINITY) return {max, a.sum + b.sum};
  return {max, rebased_sum(a, max) + rebased_sum(b, max)};
}

// LseState of pieces first + lane, first + lane + step, ... (< num_pieces) of one row, reduced over the warp (one
// warp of a CTA item); every lane returns the same bits. piece_lse[k * piece_stride] is piece k's lse.
__device__ LseState warp_lse_state(const float* piece_lse, int64_t piece_stride, int num_pieces, int first, int step,
                                   int lane) {
  // The first piece of each lane is loaded once and kept for the second pass; more pieces than one per lane (more
  // than 256 for a CTA item) are read again.
  const int k0 = first + lane;
  const float held = k0 < num_pieces ? __ldcg(piece_lse + k0 * piece_stride) : -INFINITY;
  float max = held;
#pragma unroll 1
  for (int k = k0 + step; k < num_pieces; k += step) max = fmaxf(max, __ldcg(piece_lse + k * piece_stride));
  max = warp_max(max);

  const float base = lse_base(max);
  float sum = __expf(held - base);   // -inf (absent, or no key) adds 0
#pragma unroll 1
  for (int k = k0 + step; k < num_pieces; k += step) sum += __expf(__ldcg(piece_lse + k * piece_stride) - base);
  return {max, warp_sum(sum)};
}

// A partial is dead once the combine has used it, but its lines are dirty in L2 and would be written back to DRAM
// while the next split kernel streams the cache (H100: up to 35 MB a call at b = 1, h_q 128, as much as the cache
// read). The thread whose float4 starts a 128-byte line discards the line (no write-back). The discard must not
// overtake the load: it is predicated on a compare of the loaded value (x == x), so it waits for that load, and
// the line's other 7 float4 came with the same warp-wide load. (A NaN value skips the discard: harmless.)
// Measured: beyond rows -1.6 %, table rows -1.3 % (time, geomean; docs/PERF.md "Combine"). The workspace is the
// call's own (caching allocator), so nothing reads these lines afterwards.
__device__ __forceinline__ void drop_if_line_start(const float4* partial, const float4& loaded) {
  if ((reinterpret_cast<uintptr_t>(partial) & 127) == 0) {
    asm volatile(
        "{\n"
        "  .reg .pred loaded;\n"
        "  setp.eq.f32 loaded, %1, %1;\n"
        "  @loaded discard.global.L2 [%0], 128;\n"
        "}\n" ::"l"(partial), "f"(loaded.x)
        : "memory");
  }
}

__device__ __forceinline__ void add_weighted(float4& acc, float w, const float4& o) {
  acc.x = fmaf(w, o.x, acc.x); acc.y = fmaf(w, o.y, acc.y); acc.z = fmaf(w, o.z, acc.z); acc.w = fmaf(w, o.w, acc.w);
}

// One CTA item thread's share of one packed row's partials: pieces group, group + kGroups, ... and one float4
// column (col0 / 4 + col_lane) of each, read kBatch pieces at a time. (Warp items load all their pieces at once
// themselves: combine_warp_item.)
template <int kBatch, int kGroups>
struct PieceReader {
  const float* piece_lse;       // [k * piece_stride]: piece k's lse of the row
  const float4* piece_o;        // [k * piece_o_stride]: this thread's float4 of piece k
  int64_t piece_stride, piece_o_stride;
  int num_pieces, group;
  float4 o[kBatch];             // (PIECE): the batch in flight
  float o_lse[kBatch];

  // Partial row `row` of piece k is row ((first_slot + k) * h_kv + kv_head) * rows_per_kv + row of the workspace.
  __device__ PieceReader(const DecodeParams& p, int first_slot, int num_pieces_, int kv_head, int row, int col0,
                         int col_lane, int group_)
      : piece_stride(int64_t(p.num_heads_k) * p.rows_per_kv), num_pieces(num_pieces_), group(group_) {
    const int64_t first_partial_row = (int64_t(first_slot) * p.num_heads_k + kv_head) * p.rows_per_kv + row;
    piece_lse = p.lse_partial + first_partial_row;
    piece_o = reinterpret_cast<const float4*>(p.o_partial + first_partial_row * kHeadDimV + col0) + col_lane;
    piece_o_stride = piece_stride * (kHeadDimV / 4);
  }

  // The batch of pieces first + i * kGroups. A piece index past the end re-reads the last piece (its weight is
  // never applied): the arrays are then always fully written, which keeps the next batch's loads from needing
  // registers of their own.
  __device__ void load(int first) {
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int k = min(first + i * kGroups, num_pieces - 1);
      o_lse[i] = __ldcg(piece_lse + k * piece_stride);
      o[i] = __ldcg(piece_o + k * piece_o_stride);
    }
  }

  // acc = sum over this thread's pieces, in order, of exp(lse_k - lse) O_k; the first batch (load(group)) was
  // issued before the row's lse was known. A row with no key (lse -inf) keeps acc 0.
  __device__ void accumulate(float lse, float4& acc) {
    acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (lse == -INFINITY) return;
#pragma unroll 1
    for (int first = group; first < num_pieces; first += kBatch * kGroups) {
      if (first != group) load(first);
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int k = first + i * kGroups;
        if (k < num_pieces) {
          add_weighted(acc, __expf(o_lse[i] - lse), o[i]);
          drop_if_line_start(piece_o + k * piece_o_stride, o[i]);
        }
      }
    }
  }
};

// Warp 0 fills `list` (prologue: num_splits only), in two passes.
//   1. Which sequences are split: sequence s is listed when num_splits gives it two or more pieces, in sequence
//      order (the split kernel's own test for writing partials, so the two kernels agree on which rows the
//      combine owns whatever plan they are given). Lane l holds num_splits[base + l + 32 i] for a round of up to
//      1024 sequences, all loaded before any is used (a sequence's end is its right neighbour's value); an entry's
//      position is a ballot count, so a step costs two shuffles and a ballot, not a scan.
//   2. The items, over the listed entries only (32 a step): each entry's item width and the two exclusive scans
//      of the item counts. The CTA items of all many-piece sequences share the grid, so their width counts all
//      their rows, known only after pass 1.
// b = 1024 at h_q 16 (no split sequence) so costs the loads and 32 steps of two shuffles and a ballot, no scan; the
// single pass before it ran two warp scans per 32 sequences, on the critical path whenever the combine's CTAs
// start after the split ones (H100: b = 1024, L = 512 -2.0 to -2.6 %, docs/PERF.md "Combine").
__device__ void list_split_sequences(const DecodeParams& p, WorkList& list, int lane) {
  constexpr int kPerLane = 32;
  constexpr int kSeqsPerRound = kPerLane * kWarpSize;        // 1024
  const int num_slots = p.batch + p.num_sm_parts;            // workspace slots [0, num_slots)
  int count = 0, cta_seqs = 0;
  for (int base = 0; base < p.batch; base += kSeqsPerRound) {
    int bound[kPerLane + 1];       // num_splits[base + lane + 32 i]; i = kPerLane: the round's last end
#pragma unroll
    for (int i = 0; i <= kPerLane; ++i) {
      const int j = base + i * kWarpSize + lane;
      bound[i] = j <= p.batch && (i < kPerLane || lane == 0) ? p.num_splits[j] : 0;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (base + i * kWarpSize >= p.batch) break;            // uniform across the warp
      const int seq = base + i * kWarpSize + lane;
      const int first = bound[i];
      // Both shuffles run on every lane (a shuffle of the full mask is a warp-wide rendezvous).
      const int right_neighbour = __shfl_down_sync(kFullMask, first, 1);
      const int next_first = __shfl_sync(kFullMask, bound[i + 1], 0);
      const int end = lane < kWarpSize - 1 ? right_neighbour : next_first;
      const bool split = seq < p.batch && end - first >= 2;
      const unsigned hits = __ballot_sync(kFullMask, split);
      if (hits == 0) continue;                               // uniform
      const int position = count + __popc(hits & ((1u << lane) - 1u));
      if (split && position < kMaxSplitSeqs) {    // more split sequences than any plan makes: dropped
        // Workspace slots exist for [0, num_slots): num_splits of another plan must not lead past them.
        const int pieces = first >= 0 && end <= num_slots ? end - first : 0;
        list.seq[position] = seq;
        list.first_slot[position] = first;
        list.num_pieces[position] = pieces;
      }
      count += __popc(hits);
      cta_seqs += __popc(__ballot_sync(kFullMask, split && !uses_warp_items(end - first)));
    }
  }
  count = min(count, kMaxSplitSeqs);
  __syncwarp();    // pass 2 reads entries other lanes wrote

  const int cta_rows = p.num_heads_k * p.rows_per_kv * cta_seqs;
  int cta_items_before = 0, warp_items_before = 0;
  for (int first_entry = 0; first_entry < count; first_entry += kWarpSize) {
    const int entry = first_entry + lane;
    const int n = entry < count ? list.num_pieces[entry] : 0;
    const int cols = n == 0 ? 0 : uses_warp_items(n) ? slice_cols(n) : cta_item_cols(n, cta_rows, gridDim.x);
    const int items = n == 0 ? 0 : p.num_heads_k * p.rows_per_kv * (kHeadDimV / cols);
    const int cta_items = uses_warp_items(n) ? 0 : items, warp_items = uses_warp_items(n) ? items : 0;
    const int cta_inclusive = warp_inclusive_scan(cta_items, lane);
    const int warp_inclusive = warp_inclusive_scan(warp_items, lane);
    if (entry < count) {
      list.item_cols[entry] = cols;
      list.first_cta_item[entry] = cta_items_before + cta_inclusive - cta_items;
      list.first_warp_item[entry] = warp_items_before + warp_inclusive - warp_items;
    }
    cta_items_before += __shfl_sync(kFullMask, cta_inclusive, kWarpSize - 1);
    warp_items_before += __shfl_sync(kFullMask, warp_inclusive, kWarpSize - 1);
  }
  if (lane == 0) {
    list.count = count;
    list.total_cta_items = cta_items_before;
    list.total_warp_items = warp_items_before;
  }
}

// The list entry that owns `item` of one item space (first_item: that space's prefix array): the last entry whose
// first item is <= item (entries without items share their first item with the next one, which then wins).
__device__ int entry_of_item(const WorkList& list, const int* first_item, int item) {
  int lo = 0, hi = list.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_item[mid] <= item) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Shared memory of the CTA items: the warps' lse states and the piece groups' sums, group g >= 1 at
// [(g - 1) * kColThreads, + kColThreads): (kGroups - 1) x kColThreads = 256 - kCols / 4 float4, most at 64 columns.
struct CtaItemShared {
  LseState warp_states[kCombineWarps];
  float4 group_sums[kCombineThreads - kCtaItemMinCols / 4];
};

// Out (and lse) of one packed row's converted, sink-scaled columns [col0, col0 + 4 * kVecs * stride) where this
// thread holds float4 v at column col0 + 4 * (v * stride + col_lane).
template <class Element, int kVecs>
__device__ __forceinline__ void store_row(const DecodeParams& p, int seq, int kv_head, int row, int col0, int stride,
                                          int col_lane, const float4 (&acc)[kVecs], float lse, float sink,
                                          bool write_lse) {
  const bool saw_key = lse != -INFINITY;           // NaN counts as seen: it must reach out
  // Attention sink, as the split kernel's epilogue does for unsplit rows. A row with no key keeps out 0 (its
  // acc is 0; the factor is not even computed, so a -inf sink cannot turn it into NaN).
  const float sink_scale = saw_key && sink != -INFINITY ? 1.f / (1.f + __expf(sink - lse)) : 1.f;
  const int token = row / p.heads_per_kv, head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
  Element* out = static_cast<Element*>(p.out) +
                 ((int64_t(seq) * p.seqlen_q + token) * p.num_heads_q + head) * kHeadDimV + col0;
  struct alignas(8) Quad { Element v[4]; };
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    const float4 x = acc[v];
    reinterpret_cast<Quad*>(out)[v * stride + col_lane] =
        Quad{{static_cast<Element>(x.x * sink_scale), static_cast<Element>(x.y * sink_scale),
              static_cast<Element>(x.z * sink_scale), static_cast<Element>(x.w * sink_scale)}};
  }
  if (write_lse) p.lse[(int64_t(seq) * p.num_heads_q + head) * p.seqlen_q + token] = lse;
}

// One CTA item: `local_item` of the sequence's CTA items (KV-head major, then packed row, then kCols-column chunk).
template <class Element, int kCols>
__device__ void combine_cta_item(const DecodeParams& p, int seq, int first_slot, int num_pieces, int local_item,
                                 CtaItemShared& shared) {
  using Tile = CtaTile<kCols>;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int group = threadIdx.x / Tile::kColThreads, col_thread = threadIdx.x % Tile::kColThreads;
  const int per_head = p.rows_per_kv * Tile::kChunks;
  const int kv_head = local_item / per_head;
  const int row = local_item % per_head / Tile::kChunks;             // packed query row
  const int chunk = local_item % Tile::kChunks;

  // ---- first batch of this thread's pieces, before the row's lse is known ---------------------------------------
  PieceReader<Tile::kBatch, Tile::kGroups> reader(p, first_slot, num_pieces, kv_head, row, chunk * kCols, col_thread,
                                                  group);
  reader.load(group);
  const int head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
  const float sink = p.attn_sink != nullptr ? p.attn_sink[head] : -INFINITY;    // -inf: no sink

  // ---- the row's lse: each warp over pieces warp * 32 + lane, + 256, ...; the warps' states in warp order -------
  const LseState mine = warp_lse_state(reader.piece_lse, reader.piece_stride, num_pieces, warp * kWarpSize,
                                       kCombineThreads, lane);
  if (lane == 0) shared.warp_states[warp] = mine;
  __syncthreads();
  LseState state = shared.warp_states[0];
#pragma unroll
  for (int w = 1; w < kCombineWarps; ++w) state = merge(state, shared.warp_states[w]);
  const float lse = finish_lse(state);

  // ---- out = sum_k exp(lse_k - lse) O_k over this thread's pieces, then the groups in group order --------------
  float4 acc[1];    // store_row's one float4 a thread
  reader.accumulate(lse, acc[0]);
  if (group > 0) shared.group_sums[(group - 1) * Tile::kColThreads + col_thread] = acc[0];
  __syncthreads();
  if (group == 0) {
#pragma unroll
    for (int g = 1; g < Tile::kGroups; ++g) {
      const float4 x = shared.group_sums[(g - 1) * Tile::kColThreads + col_thread];
      acc[0].x += x.x; acc[0].y += x.y; acc[0].z += x.z; acc[0].w += x.w;
    }
    store_row<Element, 1>(p, seq, kv_head, row, chunk * kCols, 0, col_thread, acc, lse, sink,
                          chunk == 0 && col_thread == 0);
  }
  __syncthreads();    // the next item reuses the shared memory
}

// One warp item: `local_item` of the sequence's items (KV-head major, then packed row, then column slice). A warp item
// always takes one round of loads (slice_cols: n <= kBatch x kGroups), so every lane loads its pieces group, group +
// kGroups, ... (< n) at once, forms the lse state of its pieces itself and merges it across the groups, which the
// same xor tree then does for the weighted sums; once every lane has used its loads, lane l discards line l of the
// item's n x kCols x 4 / 128 <= 32 partial lines.
template <class Element, int kCols>
__device__ void combine_warp_item(const DecodeParams& p, int seq, int first_slot, int num_pieces, int local_item) {
  using Shape = SliceShape<kCols>;
  const int lane = lane_here();
  constexpr int kBatch = Shape::kBatch, kVecs = Shape::kVecs, kGroups = Shape::kGroups;
  const int col_lane = lane % Shape::kColLanes;
  const int group = lane / Shape::kColLanes;
  const int per_head = p.rows_per_kv * Shape::kSlices;
  const int kv_head = local_item / per_head;
  const int row = local_item % per_head / Shape::kSlices;            // packed query row
  const int slice = local_item % Shape::kSlices;
  const int head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
  const int64_t piece_rows = int64_t(p.num_heads_k) * p.rows_per_kv;           // workspace rows between pieces
  const int64_t row0 = (int64_t(first_slot) * p.num_heads_k + kv_head) * p.rows_per_kv + row;
  const float* slice0 = p.o_partial + row0 * kHeadDimV + slice * kCols;        // (kCols) piece 0's slice
  constexpr int kLinesPerPiece = kCols * 4 / 128;
  const bool drops_line = lane < num_pieces * kLinesPerPiece;                  // line l of the item is lane l's
  const float* dead_line = slice0 + (drops_line ? lane / kLinesPerPiece * piece_rows * kHeadDimV : 0) +
                           lane % kLinesPerPiece * 32;

  // ---- every load of the item at once: this lane's pieces k = group + i * kGroups < n ---------------------------
  float o_lse[kBatch];                                                         // (PIECE)
  float4 o[kBatch][kVecs];                                                     // (PIECE, VEC): float4 v * lanes + col
  {
    const int64_t step = kGroups * piece_rows;                                 // rows from one of my pieces to the next
    const float* lse_k = p.lse_partial + row0 + group * piece_rows;
    const float4* o_k = reinterpret_cast<const float4*>(slice0 + group * piece_rows * kHeadDimV) + col_lane;
#pragma unroll
    for (int i = 0; i < kBatch; ++i, lse_k += step, o_k += step * (kHeadDimV / 4)) {
      const bool present = group + i * kGroups < num_pieces;
      o_lse[i] = present ? __ldcg(lse_k) : -INFINITY;
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        o[i][v] = present ? __ldcg(o_k + v * Shape::kColLanes) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
  const float sink = p.attn_sink != nullptr ? p.attn_sink[head] : -INFINITY;    // -inf: no sink

  // ---- the row's lse: this lane's pieces, then the groups (every lane ends with the same bits) -----------------
  float max = o_lse[0];
#pragma unroll
  for (int i = 1; i < kBatch; ++i) max = fmaxf(max, o_lse[i]);                // NaN ignored here, kept by the sum
#pragma unroll
  for (int offset = Shape::kColLanes; offset < kWarpSize; offset *= 2) {
    max = fmaxf(max, __shfl_xor_sync(kFullMask, max, offset));
  }
  const float base = lse_base(max);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kBatch; ++i) sum += __expf(o_lse[i] - base);            // absent pieces (-inf) add 0
#pragma unroll
  for (int offset = Shape::kColLanes; offset < kWarpSize; offset *= 2) sum += __shfl_xor_sync(kFullMask, sum, offset);
  const float lse = finish_lse({max, sum});

  // ---- out = sum_k exp(lse_k - lse) O_k: this lane's pieces in order, then the groups (xor tree) ----------------
  float4 acc[kVecs];
#pragma unroll
  for (int v = 0; v < kVecs; ++v) acc[v] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (lse != -INFINITY) {                                                      // no key in any piece: out 0
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const float w = __expf(o_lse[i] - lse);                                  // absent pieces: 0 x 0
#pragma unroll
      for (int v = 0; v < kVecs; ++v) add_weighted(acc[v], w, o[i][v]);
    }
  }
#pragma unroll
  for (int offset = Shape::kColLanes; offset < kWarpSize; offset *= 2) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      acc[v].x += __shfl_xor_sync(kFullMask, acc[v].x, offset); acc[v].y += __shfl_xor_sync(kFullMask, acc[v].y, offset);
      acc[v].z += __shfl_xor_sync(kFullMask, acc[v].z, offset); acc[v].w += __shfl_xor_sync(kFullMask, acc[v].w, offset);
    }
  }

  // ---- dead partial lines out of L2 (drop_if_line_start's reason): every lane has used its loads -----------------
  __syncwarp();
  if (drops_line && (reinterpret_cast<uintptr_t>(dead_line) & 127) == 0) {
    asm volatile("discard.global.L2 [%0], 128;" ::"l"(dead_line) : "memory");
  }

  // ---- sink, convert, store (group 0's lanes; lane 0 of slice 0 writes the lse) ---------------------------------
  if (group == 0) {
    store_row<Element, kVecs>(p, seq, kv_head, row, slice * kCols, Shape::kColLanes, col_lane, acc, lse, sink,
                              slice == 0 && lane == 0);
  }
}
static_assert(kWarpItemMaxPieces * slice_cols(kWarpItemMaxPieces) * 4 <= kWarpSize * 128 &&
              SliceShape<32>::kBatch * SliceShape<32>::kGroups >= kWarpItemMaxPieces,
              "a warp item's pieces fit one round of loads and 32 partial lines");

// The warp item of a sequence cut into two pieces (one whole row: slice_cols(2) = 512), what the split rows of large
// batches are. The combine is bound by instruction issue, not by bytes (H100, b = 128, h_q 128: ~585 instructions
// an item before the lean items, IPC 1.2, the same time at 1, 2 or 3 CTAs an SM and with twice the bytes in flight;
// docs/PERF.md "Combine"), and two pieces need no piece groups: each lane loads both lse values and its four float4
// of each piece at once and computes the row's lse itself, with no shuffles; once every lane has used its loads,
// lane l discards line l of the item's 32 partial lines.
template <class Element>
__device__ void combine_two_pieces(const DecodeParams& p, int seq, int first_slot, int local_item, int lane) {
  constexpr int kVecs = kHeadDimV / 4 / kWarpSize;                           // 4 float4 a lane and piece
  const int kv_head = p.num_heads_k == 1 ? 0 : local_item / p.rows_per_kv;
  const int row = local_item - kv_head * p.rows_per_kv;                      // packed query row
  const int head = kv_head * p.heads_per_kv + row % p.heads_per_kv;
  const int64_t piece_rows = int64_t(p.num_heads_k) * p.rows_per_kv;        // workspace rows from piece 0 to 1
  const int64_t row0 = (int64_t(first_slot) * p.num_heads_k + kv_head) * p.rows_per_kv + row;
  const float* partial0 = p.o_partial + row0 * kHeadDimV;                    // (512) piece 0's row
  const float* partial1 = partial0 + piece_rows * kHeadDimV;                 // (512) piece 1's row

  // ---- every load of the item at once ----------------------------------------------------------------------------
  const float lse0 = __ldcg(p.lse_partial + row0), lse1 = __ldcg(p.lse_partial + row0 + piece_rows);
  float4 o0[kVecs], o1[kVecs];                                               // (VEC): float4 v * 32 + lane
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    o0[v] = __ldcg(reinterpret_cast<const float4*>(partial0) + v * kWarpSize + lane);
    o1[v] = __ldcg(reinterpret_cast<const float4*>(partial1) + v * kWarpSize + lane);
  }
  const float sink = p.attn_sink != nullptr ? p.attn_sink[head] : -INFINITY;    // -inf: no sink

  // ---- lse = log(e^lse0 + e^lse1); out = e^(lse0 - lse) O_0 + e^(lse1 - lse) O_1 ---------------------------------
  const float max = fmaxf(lse0, lse1);                                       // NaN ignored here, kept by the sum
  const float base = lse_base(max);
  const float lse = finish_lse({max, __expf(lse0 - base) + __expf(lse1 - base)});
  // acc = w1 O_1 + w0 O_0, into o0's registers; a row with no key in either piece keeps out 0
  const bool saw_key = lse != -INFINITY;
  const float w0 = saw_key ? __expf(lse0 - lse) : 0.f, w1 = saw_key ? __expf(lse1 - lse) : 0.f;
#pragma unroll
  for (int v = 0; v < kVecs; ++v) {
    o0[v].x = fmaf(w1, o1[v].x, w0 * o0[v].x); o0[v].y = fmaf(w1, o1[v].y, w0 * o0[v].y);
    o0[v].z = fmaf(w1, o1[v].z, w0 * o0[v].z); o0[v].w = fmaf(w1, o1[v].w, w0 * o0[v].w);
  }

  // ---- dead partial lines out of L2 (drop_if_line_start's reason): every lane has used its loads -----------------
  __syncwarp();
  const float* line = (lane < kWarpSize / 2 ? partial0 : partial1) + lane % (kWarpSize / 2) * 32;
  if ((reinterpret_cast<uintptr_t>(line) & 127) == 0) asm volatile("discard.global.L2 [%0], 128;" ::"l"(line) : "memory");

  store_row<Element, kVecs>(p, seq, kv_head, row, 0, kWarpSize, lane, o0, lse, sink, lane == 0);
}
static_assert(slice_cols(2) == kHeadDimV && slice_cols(3) < kHeadDimV, "two pieces, and only two, make 512-column items");

template <class Element>
__global__ void __launch_bounds__(kCombineThreads, kCombineMinCtasPerSm)
mla_combine_kernel(const __grid_constant__ DecodeParams p) {
  __shared__ WorkList list;
  __shared__ CtaItemShared cta_shared;

  // The next call's split kernel (our programmatic dependent) may be scheduled now: it waits for this grid to
  // complete before it reads anything, and its CTAs only take SMs this kernel's resident CTAs leave free.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

  // ---- 1. prologue: only data of kernels that finished before the split kernel passed its wait -----------------
  if (threadIdx.x < kWarpSize) list_split_sequences(p, list, threadIdx.x);
  __syncthreads();

  // ---- 2. the split kernel's results are complete from here on --------------------------------------------------
  wait_for_split_kernel();

  // ---- 3a. CTA items (sequences of many pieces), grid-strided over CTAs; branches uniform across the CTA -------
#pragma unroll 1
  for (int item = blockIdx.x; item < list.total_cta_items; item += gridDim.x) {
    const int entry = entry_of_item(list, list.first_cta_item, item);
    const int seq = list.seq[entry], first_slot = list.first_slot[entry], num_pieces = list.num_pieces[entry];
    const int local_item = item - list.first_cta_item[entry];
    switch (list.item_cols[entry]) {
      case 256: combine_cta_item<Element, 256>(p, seq, first_slot, num_pieces, local_item, cta_shared); break;
      case 128: combine_cta_item<Element, 128>(p, seq, first_slot, num_pieces, local_item, cta_shared); break;
      default: combine_cta_item<Element, 64>(p, seq, first_slot, num_pieces, local_item, cta_shared); break;
    }
  }

  // ---- 3b. warp items (sequences of few pieces), grid-strided over warps; branches uniform across the warp -----
  const int lane = threadIdx.x % kWarpSize;
#pragma unroll 1
  for (int item = blockIdx.x * kCombineWarps + threadIdx.x / kWarpSize; item < list.total_warp_items;
       item += grid_ctas() * kCombineWarps) {
    const int entry = entry_of_item(list, list.first_warp_item, item);
    const int seq = list.seq[entry], first_slot = list.first_slot[entry], num_pieces = list.num_pieces[entry];
    const int local_item = item - list.first_warp_item[entry];
    switch (list.item_cols[entry]) {
      case 512: combine_two_pieces<Element>(p, seq, first_slot, local_item, lane); break;
      case 256: combine_warp_item<Element, 256>(p, seq, first_slot, num_pieces, local_item); break;
      case 128: combine_warp_item<Element, 128>(p, seq, first_slot, num_pieces, local_item); break;
      case 64: combine_warp_item<Element, 64>(p, seq, first_slot, num_pieces, local_item); break;
      default: combine_warp_item<Element, 32>(p, seq, first_slot, num_pieces, local_item); break;
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
  // Items are counted on the device; bound them here to size the grid. A sequence of n <= kWarpItemMaxPieces
  // pieces has rows * 512 / slice_cols(n) <= rows * n warp items per KV head (slice_cols(n) >= 512 / n), and the
  // split sequences' pieces number at most 2 * num_sm_parts (a part holds at most two pieces of split sequences:
  // its first and its last). A sequence with n > kWarpItemMaxPieces pieces starts n - 1 >= kWarpItemMaxPieces
  // parts with a piece k >= 1, so at most (num_sm_parts - 1) / kWarpItemMaxPieces sequences have CTA items.
  const int64_t rows = int64_t(p.num_heads_k) * p.rows_per_kv;
  const int64_t max_warp_items = rows * 2 * p.num_sm_parts;
  const int64_t max_cta_items =
      rows * CtaTile<kCtaItemMinCols>::kChunks * ((p.num_sm_parts - 1) / kWarpItemMaxPieces);    // narrowest items
  const int64_t max_ctas = std::max((max_warp_items + kCombineWarps - 1) / kCombineWarps, max_cta_items);
  const int ctas = static_cast<int>(std::min<int64_t>(max_ctas, resident_ctas<Element>()));

  // Programmatic dependent launch: the CTAs may be scheduled once every split CTA has passed its own wait (the
  // split kernel triggers right after it), run the prologue, and wait in griddepcontrol.wait. Captured into a CUDA
  // graph this becomes a programmatic edge. Measured on the H100 (docs/PERF.md): 1-6% faster end to end than a
  // plain launch on b = 1 long contexts, so there is no switch.
  launch_kernel(mla_combine_kernel<Element>, dim3(ctas), dim3(kCombineThreads), 0, stream, /*programmatic=*/true,
                /*cluster_x=*/1, p);
}

}  // namespace

void launch_mla_combine_bf16(const DecodeParams& params, void* stream) {
  launch_combine<cutlass::bfloat16_t>(params, static_cast<cudaStream_t>(stream));
}
void launch_mla_combine_fp16(const DecodeParams& params, void* stream) {
  launch_combine<cutlass::half_t>(params, static_cast<cudaStream_t>(stream));
}

FLASH_MLA_NAMESPACE_END  // flash_mla
