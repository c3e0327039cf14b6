// Where a split kernel's results for one packed query row go (SPEC.md's out, lse and workspace layouts), for the
// split-KV kernel's epilogue (epilogue.h) and the transposed FP8 kernel's (transposed_epilogue.h). A KV head's
// packed row r is query token r / heads_per_kv and query head kv_head * heads_per_kv + r % heads_per_kv.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"
#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

struct ResultRow {
  int token, head;

  __device__ __forceinline__ ResultRow(const DecodeParams& p, int kv_head, int row)
      : token(row / p.heads_per_kv), head(kv_head * p.heads_per_kv + row % p.heads_per_kv) {}

  // The row's first element in out (batch, seqlen_q, num_heads_q, 512), sequence `seq`; within the sequence's
  // block of out (seq_out_offset), which is the same for every sequence (32-bit: the transposed kernel's row table,
  // whose rows have seqlen_q x num_heads_q x 512 far below 2^31).
  __device__ __forceinline__ int out_offset_in_seq(const DecodeParams& p) const {
    return (token * p.num_heads_q + head) * kHeadDimV;
  }
  __device__ __forceinline__ int64_t out_offset(const DecodeParams& p, int seq) const {
    return seq_out_offset(p, seq) + int64_t(token * p.num_heads_q + head) * kHeadDimV;
  }
  __device__ __forceinline__ static int64_t seq_out_offset(const DecodeParams& p, int seq) {
    return int64_t(seq) * p.seqlen_q * p.num_heads_q * kHeadDimV;
  }

  // The row's element in lse (batch, num_heads_q, seqlen_q), sequence `seq`; likewise within the sequence's block.
  __device__ __forceinline__ int lse_offset_in_seq(const DecodeParams& p) const { return head * p.seqlen_q + token; }
  __device__ __forceinline__ int64_t lse_offset(const DecodeParams& p, int seq) const {
    return seq_lse_offset(p, seq) + lse_offset_in_seq(p);
  }
  __device__ __forceinline__ static int64_t seq_lse_offset(const DecodeParams& p, int seq) {
    return int64_t(seq) * p.num_heads_q * p.seqlen_q;
  }
};

// The workspace row (o_partial, lse_partial) of packed row `row` of KV head `kv_head` in piece slot `slot`.
__device__ __forceinline__ int64_t partial_row(const DecodeParams& p, int slot, int kv_head, int row) {
  return (int64_t(slot) * p.num_heads_k + kv_head) * p.rows_per_kv + row;
}

FLASH_MLA_NAMESPACE_END  // flash_mla
