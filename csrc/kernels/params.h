// Plain-C++ parameter structs shared by the torch binding (host .cpp) and the kernels (.cu).
// No CUDA or CuTe headers here: the binding is compiled by the host compiler.
#pragma once

#include <cstdint>

#include "variant.h"

FLASH_MLA_NAMESPACE_BEGIN

// Fixed problem geometry of DeepSeek MLA after weight absorption.
constexpr int kHeadDimQK = 576;       // 512 latent ("NoPE") + 64 RoPE columns
constexpr int kHeadDimV = 512;        // V = first 512 columns of the cache
constexpr int kPageBlockSize = 64;    // tokens per KV-cache page
constexpr int kRowsPerTile = 64;      // query rows per CTA (WGMMA M)
constexpr int kFixedOverhead = 5;     // scheduler cost of one sequence piece, in pages
constexpr int kMetadataWidth = 8;     // int32 words per SM part
// An e4m3 cache with at most this many packed query rows per KV head goes to the transposed FP8 kernel (query rows
// as WGMMA's N: transposed_traits.h), with an e4m3 q or a bf16 / fp16 one (its Q tiles quantised to three e4m3
// terms); more rows to the split-KV kernel's e4m3-scores form (an e4m3 q) or whole-page widening form (16-bit q).
constexpr int kTransposedMaxRows = 32;

// Byte layout of a token of the sparse FP8 cache (DeepSeek-V3.2, flash_mla/sparse_fp8.py): 512 e4m3 latent values,
// 4 float32 group scales, 64 bf16 RoPE values.
struct SparseTokenLayout {
  static constexpr int kScalesOffset = 512;
  static constexpr int kRopeOffset = 528;
  static constexpr int kTokenBytes = 656;
  static_assert(kTokenBytes % 16 == 0 && kRopeOffset % 16 == 0, "16-byte copies of every token's parts");
};

// Column indices of one tile_scheduler_metadata row.
enum MetadataField : int { kBeginSeq = 0, kBeginToken = 1, kEndSeq = 2, kEndToken = 3, kBeginSplit = 4 };

struct MetadataParams {
  const int32_t* seqlens;        // (batch,)
  int32_t* metadata;             // (num_sm_parts, 8)
  int32_t* num_splits;           // (batch + 1,)
  int32_t* cost_prefix;          // (batch + 1,) scratch: exclusive prefix sum of per-sequence costs
  int batch;
  int num_sm_parts;
  // Floor on each part's payload, in pages (FIXED_OVERHEAD included): payload = max(ceil(total / num_sm_parts) +
  // FIXED_OVERHEAD, min_payload). 0 for dense plans (SPEC.md's rule); sparse plans pass SPARSE_MIN_PAYLOAD of
  // flash_mla/_geometry.py (pairs of pages for the sparse kernel's two computing warpgroups).
  int min_payload;
  // The smallest payload >= ceil(total / num_sm_parts) whose walk covers the batch instead of SPEC.md's (false for
  // dense plans, true for sparse ones: flash_mla/scheduler.py plan_payload).
  bool tight_payload;
};

// How q is stored relative to the kernel's 16-bit math type. Only the FP8-cache kernels (fp16 math) see anything
// but kQAsMath: an e4m3 q goes to the kernel whose S runs on e4m3 (launch_mla_splitkv_fp8_e4m3_scores), a bf16 q
// is rounded to fp16 in shared memory (mainloop.h).
enum QFormat : int { kQAsMath = 0, kQFp8 = 1, kQBf16 = 2 };

struct DecodeParams {
  // Shapes.
  int batch, seqlen_q, num_heads_q, num_heads_k;
  int heads_per_kv;              // num_heads_q / num_heads_k
  int rows_per_kv;               // seqlen_q * heads_per_kv: packed query rows of one KV head
  int num_row_tiles;             // ceil(rows_per_kv / 64)
  int num_sm_parts;
  float scale_log2;              // softmax_scale * log2(e): scores go straight into exp2
  bool causal;
  int q_format;                  // QFormat
  bool out_bf16;                 // FP8-cache and sparse kernels: out is bf16 (else fp16); 16-bit kernels: their type

  // Inputs (element strides; the last dimension is contiguous).
  const void* q;                 // (batch, seqlen_q, num_heads_q, 576)
  int64_t q_batch_stride, q_token_stride, q_head_stride;
  const void* k_cache;           // (num_blocks, 64, num_heads_k, 576)
  int64_t k_block_stride, k_token_stride, k_head_stride;
  int64_t num_kv_blocks;         // k_cache.size(0)
  const int32_t* block_table;    // (batch, max_blocks_per_seq)
  int64_t block_table_stride;
  const int32_t* seqlens;        // (batch,)
  const int32_t* metadata;       // (num_sm_parts, 8)
  const int32_t* num_splits;     // (batch + 1,)
  // FP8 descales, float32 (1,) each, or nullptr (1): true value = stored value * descale. Read on the device
  // (a CUDA graph replays with new values); the split kernel folds descale_q * descale_k into the score scale and
  // descale_k into its normalisation of O (SplitKvScales).
  const float* descale_q;
  const float* descale_k;

  // Outputs (contiguous).
  void* out;                     // (batch, seqlen_q, num_heads_q, 512)
  float* lse;                    // (batch, num_heads_q, seqlen_q)

  // Optional attention sink per query head (nullptr: none). A row's out is scaled by
  // 1 / (1 + exp(attn_sink[head] - lse)); lse itself is returned unchanged. Applied where a row's final result
  // is written: the split kernel's epilogue for unsplit sequences, the combine kernel for split ones.
  const float* attn_sink;        // (num_heads_q,)

  // Workspace for split sequences, one slot per piece (slot = num_splits[seq] + split_idx).
  float* o_partial;              // (num_slots, num_heads_k, rows_per_kv, 512)
  float* lse_partial;            // (num_slots, num_heads_k, rows_per_kv)
  // Diagnostic builds (-DFLASH_MLA_PROBE, kernels/probe.h): the timeline buffer, or nullptr; unused otherwise.
  unsigned long long* probe;

  // Sparse FP8 decoding (launch_mla_splitkv_sparse; nullptr indices otherwise): k_cache holds num_tokens 656-byte
  // tokens back to back, token t at byte 656 t. seqlens is topk_length, or nullptr for topk slots in every row.
  const int32_t* indices;        // (batch, seqlen_q, topk), last dimension contiguous
  int64_t indices_batch_stride, indices_token_stride;
  int topk;
  int64_t num_tokens;

  // TMA descriptor (a CUtensorMap) of k_cache as (576, 64 tokens, num_heads_k, num_blocks), 64 x 64 boxes with
  // the 128-byte swizzle. Opaque bytes here (this header stays free of CUDA headers); the split kernel's
  // launcher fills it in, the binding leaves it alone.
  alignas(64) unsigned char k_cache_tma[128];
  // Sparse kernel: TMA descriptor of q as (576, num_heads_q, seqlen_q, batch), 64 x 64 boxes with the 128-byte
  // swizzle (a Q tile is 64 heads of one query token there); filled in by the sparse launcher (kv_cache_tma.h).
  alignas(64) unsigned char q_tma[128];
  // TMA descriptor of out as (512, rows_per_kv, batch), 64 x 64 boxes with the 128-byte swizzle, and whether the
  // split kernel stores unsplit pieces' results through shared memory with it (epilogue.h): with one KV head a row
  // tile of a sequence is 64 consecutive rows of out. Set by the launcher where it pays (encode_out_tma).
  alignas(64) unsigned char out_tma[128];
  bool out_by_tma;
};

// Launchers, one translation unit each (csrc/kernels/*.cu). All run on `stream` and never synchronise.
void launch_mla_metadata(const MetadataParams& params, void* stream);
void launch_mla_splitkv_bf16(const DecodeParams& params, void* stream);
void launch_mla_splitkv_fp16(const DecodeParams& params, void* stream);
void launch_mla_splitkv_fp8(const DecodeParams& params, void* stream);     // e4m3 cache; q bf16 or fp16
void launch_mla_splitkv_fp8_e4m3_scores(const DecodeParams& params, void* stream);    // e4m3 cache and q
void launch_mla_splitkv_fp8_transposed(const DecodeParams& params, void* stream);      // the same, rows_per_kv <= 32
void launch_mla_splitkv_sparse(const DecodeParams& params, void* stream);  // 656-byte token cache; bf16 q
void launch_mla_combine_bf16(const DecodeParams& params, void* stream);
void launch_mla_combine_fp16(const DecodeParams& params, void* stream);

FLASH_MLA_NAMESPACE_END  // flash_mla
