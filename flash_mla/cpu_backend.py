"""CPU execution of the split-KV algorithm the GPU runs: scheduler -> per-piece partial attention -> combine.

This is the executable specification of the CUDA kernels. Every SM part of the scheduler's metadata walks its
sequence pieces page by page (64 tokens) with an online softmax in float32, exactly like a CTA does; unsplit
sequences are written straight to `out`/`lse`, split pieces go to a float32 workspace (one slot per piece)
and a combine step merges them with a log-sum-exp. Results therefore match the reference to float32 rounding
for any metadata `get_mla_metadata` produces. An attention sink scales a row's output where its final result is
written (the split step for unsplit sequences, the combine step for split ones), as the kernels do.
An FP8 cache (float8_e4m3fn with descale_k; q float8_e4m3fn with descale_q, or bf16 / fp16) is dequantised as it
is read (true value = stored value * descale, in float32), then computed as above; out is bf16 for an fp8 q.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._geometry import PAGE_BLOCK_SIZE
from .fp8 import decode_out_dtype
from .scheduler import pieces_of_part

LOG2E = math.log2(math.e)


def _partial_attention(q_rows: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, seq: int,
                       kv_head: int, begin: int, end: int, length: int, last_visible: torch.Tensor,
                       head_dim_v: int, scale_log2: float,
                       k_descale: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Online softmax over keys [begin, end) of one sequence, one page at a time. k_descale: an fp8 cache's scale
    ((1,) float32), which dequantises each page as it is read.

    Returns the normalised partial output (rows, head_dim_v) and its natural-log lse (rows,); rows that saw
    no key in the range get 0 and -inf.
    """
    rows = q_rows.shape[0]
    row_max = torch.full((rows,), -math.inf)            # running max of the raw scores, log2 domain
    row_sum = torch.zeros(rows)
    acc = torch.zeros(rows, head_dim_v)
    for page_start in range(begin, end, PAGE_BLOCK_SIZE):
        page = int(block_table[seq, page_start // PAGE_BLOCK_SIZE])
        kv = k_cache[page, :, kv_head].float()                                   # (64, d)
        if k_descale is not None:
            kv = kv * k_descale                                                   # dequantise: stored * descale
        token = page_start + torch.arange(PAGE_BLOCK_SIZE)
        in_range = token < min(end, length)
        kv = torch.where(in_range[:, None], kv, 0.0)                              # slots past L may hold NaN
        s = (q_rows @ kv.T) * scale_log2                                          # S = Q K^T, log2 domain
        visible = in_range[None, :] & (token[None, :] <= last_visible[:, None])
        s = s.masked_fill(~visible, -math.inf)
        new_max = torch.maximum(row_max, s.max(dim=1).values)
        base = torch.where(torch.isfinite(new_max), new_max, 0.0)                 # no key yet: avoid inf - inf
        p = torch.exp2(s - base[:, None])
        rescale = torch.exp2(row_max - base)
        row_sum = row_sum * rescale + p.sum(dim=1)
        acc = acc * rescale[:, None] + p @ kv[:, :head_dim_v]                     # O += P V
        row_max = new_max
    seen = row_sum != 0          # NaN (a NaN q or visible key) stays NaN in out and lse, as in the kernels
    out = torch.where(seen[:, None], acc / torch.where(seen, row_sum, 1.0)[:, None], 0.0)
    lse = torch.where(seen, (row_max + torch.log2(torch.where(seen, row_sum, 1.0))) / LOG2E, -math.inf)
    return out, lse


def sink_scale(sink_rows: torch.Tensor, lse_rows: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(sink - lse)) per row (exp2 with log2 units, like the kernels); 1 for rows with lse = -inf,
    whose output is 0 and stays 0. lse 0 stands in for their -inf inside the formula, so that a -inf sink gives
    exp(-inf) = 0 there rather than exp(-inf + inf) = NaN."""
    no_key = torch.isneginf(lse_rows)
    scale = 1.0 / (1.0 + torch.exp2((sink_rows - torch.where(no_key, 0.0, lse_rows)) * LOG2E))
    return torch.where(no_key, 1.0, scale)


def combine_pieces(o_pieces: torch.Tensor, lse_pieces: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merge n partial results: lse = logsumexp_k lse_k, out = sum_k exp(lse_k - lse) O_k.

    o_pieces (n, rows, dv), lse_pieces (n, rows). Rows with no key in any piece keep out 0, lse -inf.
    """
    lse = torch.logsumexp(lse_pieces, dim=0)
    no_key = torch.isneginf(lse)                 # a NaN piece makes the row NaN, out and lse alike
    weights = torch.exp(lse_pieces - torch.where(no_key, 0.0, lse)[None])
    out = (weights[..., None] * o_pieces).sum(dim=0)
    return torch.where(no_key[:, None], 0.0, out), lse


def mla_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   head_dim_v: int, tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor,
                   softmax_scale: float, causal: bool, attn_sink: Optional[torch.Tensor] = None,
                   descale_q: Optional[torch.Tensor] = None,
                   descale_k: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split-KV MLA decoding on the CPU. Inputs are validated by the caller. descale_q / descale_k: the (1,)
    float32 scales of an fp8 q / cache (None otherwise)."""
    b, s_q, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    group = h_q // h_kv
    rows = s_q * group
    scale_log2 = softmax_scale * LOG2E
    seqlens = cache_seqlens.tolist()
    splits = num_splits.tolist()

    out_dtype = decode_out_dtype(q.dtype)
    out = torch.empty(b, s_q, h_q, head_dim_v, dtype=out_dtype)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32)
    num_slots = splits[-1]
    o_workspace = torch.full((num_slots, h_kv, rows, head_dim_v), math.nan)
    lse_workspace = torch.full((num_slots, h_kv, rows), math.nan)

    def write_final(seq: int, kv_head: int, o_rows: torch.Tensor, lse_rows: torch.Tensor) -> None:
        heads = slice(kv_head * group, (kv_head + 1) * group)
        if attn_sink is not None:   # row r is token r // group of head kv_head * group + r % group
            o_rows = o_rows * sink_scale(attn_sink[heads].float().repeat(s_q), lse_rows)[:, None]
        out[seq, :, heads] = o_rows.reshape(s_q, group, head_dim_v).to(out_dtype)
        lse[seq, heads] = lse_rows.reshape(s_q, group).T

    # ---- split kernel: every SM part walks its pieces ------------------------------------------------------
    for part in tile_scheduler_metadata.tolist():
        for piece in pieces_of_part(part, seqlens, splits):
            length = seqlens[piece.seq]
            token_of_row = torch.arange(rows) // group
            last_visible = (length - s_q + token_of_row) if causal else torch.full((rows,), length - 1)
            for kv_head in range(h_kv):
                q_rows = q[piece.seq, :, kv_head * group:(kv_head + 1) * group].reshape(rows, d).float()
                if descale_q is not None:
                    q_rows = q_rows * descale_q
                o_rows, lse_rows = _partial_attention(q_rows, k_cache, block_table, piece.seq, kv_head,
                                                      piece.begin_token, piece.end_token, length, last_visible,
                                                      head_dim_v, scale_log2, descale_k)
                if piece.num_pieces == 1:
                    write_final(piece.seq, kv_head, o_rows, lse_rows)
                else:
                    o_workspace[piece.slot, kv_head] = o_rows
                    lse_workspace[piece.slot, kv_head] = lse_rows

    # ---- combine kernel: merge the pieces of split sequences -----------------------------------------------
    for seq in range(b):
        first, last = splits[seq], splits[seq + 1]
        if last - first <= 1:
            continue
        for kv_head in range(h_kv):
            o_rows, lse_rows = combine_pieces(o_workspace[first:last, kv_head], lse_workspace[first:last, kv_head])
            write_final(seq, kv_head, o_rows, lse_rows)
    return out, lse
