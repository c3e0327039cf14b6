// The tile scheduler (get_mla_metadata) on the device: SPEC.md "Scheduler", bit for bit the rules of
// flash_mla/scheduler.py (with its payload floor, min_payload, and tight_payload: 0 and false for dense plans,
// SPARSE_MIN_PAYLOAD and true for sparse ones). One CTA, no host synchronisation, any batch size.
//
// The greedy walk is sequential by nature, but each SM part only ever (a) finishes the sequence the previous
// part cut, (b) takes a run of whole sequences, (c) cuts the next one. With an exclusive prefix sum of the
// per-sequence costs, (b) is one binary search, so the walk costs O(num_sm_parts * log(batch)) on one thread
// instead of O(batch); the prefix sum and the final num_splits pass are spread over the whole CTA.
#include <cuda_runtime.h>
#include <cub/block/block_scan.cuh>

#include "params.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN
namespace {

constexpr int kThreads = 1024;
constexpr int kMaxSmParts = 1024;    // more parts than any GPU has multiprocessors

__device__ __forceinline__ int pages_of(int seqlen) { return (seqlen + kPageBlockSize - 1) / kPageBlockSize; }

// The greedy walk of SPEC.md over all SM parts with the given payload. Returns the sequences it covers (the plan is
// valid only if that is p.batch). With kWrite it also writes the metadata rows and records each cut sequence (in
// increasing order) with the inclusive prefix of its extra pieces; without, it only walks (a candidate payload).
template <bool kWrite>
__device__ int walk(const MetadataParams& p, const int* prefix, int payload, int* split_seq, int* split_extra,
                    int* num_split_seqs) {
  int seq = 0, block = 0, split_idx = 0;     // walk position: sequence, first untaken page, pieces cut so far
  int n_split = 0, extra = 0;
  if (kWrite) split_extra[0] = 0;
  for (int part = 0; part < p.num_sm_parts; ++part) {
    const int begin_seq = seq, begin_block = block, begin_split = split_idx;
    int remaining = payload;
    if (seq < p.batch) {
      const int pages = prefix[seq + 1] - prefix[seq] - kFixedOverhead;
      const int cost_to_close = pages - block + kFixedOverhead;
      if (cost_to_close <= remaining) {
        remaining -= cost_to_close;
        if (kWrite && split_idx > 0) {     // the sequence ends here after being cut: record its pieces
          split_seq[n_split] = seq;
          extra += split_idx;
          split_extra[++n_split] = extra;
        }
        seq += 1; block = 0; split_idx = 0;
        // Whole sequences [seq, last) fit: the largest `last` with prefix[last] - prefix[seq] <= remaining.
        int lo = seq, hi = p.batch;
        const int limit = prefix[seq] + remaining;
        while (lo < hi) {
          const int mid = (lo + hi + 1) / 2;
          if (prefix[mid] <= limit) lo = mid; else hi = mid - 1;
        }
        remaining -= prefix[lo] - prefix[seq];
        seq = lo;
      }
      if (seq < p.batch && remaining > kFixedOverhead) {   // room for a piece: cut the sequence here
        block += remaining - kFixedOverhead;
        split_idx += 1;
      }
    }
    if (kWrite) {
      int end_seq, end_token;
      if (block > 0) {
        end_seq = seq; end_token = block * kPageBlockSize;
      } else {
        end_seq = seq - 1; end_token = end_seq >= 0 ? p.seqlens[end_seq] : 0;
      }
      int32_t* row = p.metadata + part * kMetadataWidth;
      row[kBeginSeq] = begin_seq;
      row[kBeginToken] = begin_block * kPageBlockSize;
      row[kEndSeq] = end_seq;
      row[kEndToken] = end_token;
      row[kBeginSplit] = begin_split;
      row[5] = row[6] = row[7] = 0;
    }
  }
  if (kWrite) *num_split_seqs = n_split;
  return seq;
}

__global__ void __launch_bounds__(kThreads) mla_metadata_kernel(const MetadataParams p) {
  using BlockScan = cub::BlockScan<int, kThreads>;
  __shared__ typename BlockScan::TempStorage scan_storage;
  __shared__ int split_seq[kMaxSmParts];        // sequences that were cut, in increasing order
  __shared__ int split_extra[kMaxSmParts + 1];  // inclusive prefix of (pieces - 1) over split_seq
  __shared__ int num_split_seqs;
  __shared__ bool candidate_covers[kFixedOverhead];

  // ---- cost_prefix[i] = sum_{j<i} (pages_j + FIXED_OVERHEAD) ------------------------------------------------
  int carry = 0;
  for (int base = 0; base < p.batch; base += kThreads) {
    const int i = base + threadIdx.x;
    const int cost = i < p.batch ? pages_of(p.seqlens[i]) + kFixedOverhead : 0;
    int prefix, chunk_total;
    BlockScan(scan_storage).ExclusiveSum(cost, prefix, chunk_total);
    if (i < p.batch) p.cost_prefix[i] = carry + prefix;
    carry += chunk_total;
    __syncthreads();  // scan_storage is reused by the next chunk
  }
  if (threadIdx.x == 0) p.cost_prefix[p.batch] = carry;
  __syncthreads();

  // ---- the payload: SPEC.md's (lowest + FIXED_OVERHEAD, which always covers), or with tight_payload the
  // smallest of the FIXED_OVERHEAD candidates below it, from ceil(total / parts) up, whose walk covers the batch
  // (one thread each) ------------------------------------------------------------------------------------------
  const int* prefix = p.cost_prefix;
  const int lowest = (prefix[p.batch] + p.num_sm_parts - 1) / p.num_sm_parts;
  if (p.tight_payload && threadIdx.x < kFixedOverhead)
    candidate_covers[threadIdx.x] = walk<false>(p, prefix, lowest + threadIdx.x, nullptr, nullptr, nullptr) == p.batch;
  __syncthreads();

  // ---- the greedy walk over SM parts (one thread) ----------------------------------------------------------
  if (threadIdx.x == 0) {
    int payload = lowest + kFixedOverhead;
    if (p.tight_payload) {
      for (int c = 0; c < kFixedOverhead; ++c) {
        if (candidate_covers[c]) { payload = lowest + c; break; }
      }
    }
    walk<true>(p, prefix, max(payload, p.min_payload), split_seq, split_extra, &num_split_seqs);
  }
  __syncthreads();

  // ---- num_splits[i + 1] = (i + 1) + sum of (pieces - 1) over cut sequences <= i ---------------------------
  const int n_split = num_split_seqs;
  if (threadIdx.x == 0) p.num_splits[0] = 0;
  for (int i = threadIdx.x; i < p.batch; i += kThreads) {
    int lo = 0, hi = n_split;                 // count of cut sequences <= i
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (split_seq[mid] <= i) lo = mid + 1; else hi = mid;
    }
    p.num_splits[i + 1] = i + 1 + split_extra[lo];
  }
}

}  // namespace

void launch_mla_metadata(const MetadataParams& params, void* stream) {
  mla_metadata_kernel<<<1, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(params);
}

FLASH_MLA_NAMESPACE_END  // flash_mla
