"""CPU execution of sparse FP8 decoding (DeepSeek-V3.2) on the scheduler's plan, as a GPU kernel would run it.

The plan (flash_mla/interface.py makes it; README.md "Sparse FP8 decoding"): batch row i is one "sequence" whose
keys are its index slots indices[i, :, 0:topk]; its length for the scheduler is topk_length[i] when given, else
topk; the query rows of the KV head are its s_q * h_q (token, head) pairs, packed as in dense decoding (row
s * h_q + h). So the plan is the dense scheduler's on those lengths with num_heads_per_head_k = s_q * h_q and
num_heads_k = 1: a piece [begin, end) of row i is a range of its slot numbers, cut at multiples of 64.

What a piece computes: for every query row (s, h), attention over the slots j in [begin, end) with
j < topk_length[i] (when given) and indices[i, s, j] >= 0, the keys and values being the dequantised tokens
those slots name (query tokens of one row have their own index lists). It walks the range 64 slots at a time
with an online softmax in float32, exactly like the dense CPU backend walks pages. Unsplit rows are written to
out / lse; pieces of split rows go to a float32 workspace slot (num_splits[i] + split index) and the combine step
merges them by log-sum-exp. An attention sink scales a row's output where its final result is written.

The plan's own lengths are never needed: a piece that reaches the end of a row's range covers [begin, topk) and
is clipped to topk_length[i], so a plan made for full(topk) (the classic form, which cannot know topk_length) and
one made for topk_length (the lazy form) both give the same answer up to float rounding.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._geometry import HEAD_DIM_V
from .cpu_backend import LOG2E, combine_pieces, sink_scale
from .scheduler import pieces_of_part
from .sparse_fp8 import gather_tokens

SLOTS_PER_STEP = 64    # index slots per online-softmax step (the scheduler's unit: one "page" of slots)


def _partial_attention(q_tokens: torch.Tensor, k_cache: torch.Tensor, slot_ids: torch.Tensor, begin: int,
                       end: int, scale_log2: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Online softmax of one batch row over its index slots [begin, end).

    q_tokens (s_q, h_q, 576) float32; slot_ids (s_q, topk) int32, the row's indices. Returns the normalised
    partial output (s_q * h_q, 512) and its natural-log lse (s_q * h_q,); rows that saw no valid slot get 0, -inf.
    """
    s_q, h_q, _ = q_tokens.shape
    row_max = torch.full((s_q, h_q), -math.inf)          # running max of the raw scores, log2 domain
    row_sum = torch.zeros(s_q, h_q)
    acc = torch.zeros(s_q, h_q, HEAD_DIM_V)
    for lo in range(begin, end, SLOTS_PER_STEP):
        ids = slot_ids[:, lo:min(lo + SLOTS_PER_STEP, end)]                       # (s_q, n)
        valid = ids >= 0
        kv = gather_tokens(k_cache, ids, valid)                                   # (s_q, n, 576), 0 if unused
        s = torch.bmm(q_tokens, kv.transpose(1, 2)) * scale_log2                  # (s_q, h_q, n), log2 domain
        s = s.masked_fill(~valid[:, None, :], -math.inf)
        new_max = torch.maximum(row_max, s.amax(dim=2))
        base = torch.where(torch.isfinite(new_max), new_max, 0.0)                 # no key yet: avoid inf - inf
        p = torch.exp2(s - base[..., None])
        rescale = torch.exp2(row_max - base)
        row_sum = row_sum * rescale + p.sum(dim=2)
        acc = acc * rescale[..., None] + torch.bmm(p, kv[..., :HEAD_DIM_V])       # O += P V
        row_max = new_max
    seen = row_sum != 0          # NaN (a NaN q or counted key) stays NaN in out and lse, as in the kernels
    out = torch.where(seen[..., None], acc / torch.where(seen, row_sum, 1.0)[..., None], 0.0)
    lse = torch.where(seen, (row_max + torch.log2(torch.where(seen, row_sum, 1.0))) / LOG2E, -math.inf)
    return out.reshape(s_q * h_q, HEAD_DIM_V), lse.reshape(s_q * h_q)


def sparse_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                      topk_length: Optional[torch.Tensor], tile_scheduler_metadata: torch.Tensor,
                      num_splits: torch.Tensor, softmax_scale: float,
                      attn_sink: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse FP8 decoding on the CPU (arguments validated by the caller).

    Args:
        q: (b, s_q, h_q, 576) bf16 or fp16.
        k_cache: (num_blocks, page_block_size, 1, 656) uint8 or float8_e4m3fn (flash_mla/sparse_fp8.py layout).
        indices: (b, s_q, topk) int32 token numbers (block * page_block_size + offset), -1 = unused slot.
        topk_length: optional (b,) int32, 0 <= topk_length[i] <= topk: only the first topk_length[i] slots count.
        tile_scheduler_metadata, num_splits: a plan of the batch rows' slot ranges (module docstring).
        softmax_scale: the scale of q . k.
        attn_sink: optional (h_q,) float32; out scaled by 1 / (1 + exp(sink - lse)), lse unchanged.

    Returns:
        out (b, s_q, h_q, 512) in q's dtype and lse (b, h_q, s_q) float32; rows with no valid slot: 0 and -inf.
    """
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[2]
    rows = s_q * h_q
    scale_log2 = softmax_scale * LOG2E
    counted = topk_length.tolist() if topk_length is not None else [topk] * b
    splits = num_splits.tolist()
    whole_rows = [topk] * b          # what a piece reaching the end of a row covers (then clipped to `counted`)

    out = torch.empty(b, s_q, h_q, HEAD_DIM_V, dtype=q.dtype)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32)
    o_workspace = torch.full((splits[-1], rows, HEAD_DIM_V), math.nan)
    lse_workspace = torch.full((splits[-1], rows), math.nan)
    sink_rows = None if attn_sink is None else attn_sink.float().repeat(s_q)    # row s * h_q + h has head h

    def write_final(seq: int, o_rows: torch.Tensor, lse_rows: torch.Tensor) -> None:
        if sink_rows is not None:
            o_rows = o_rows * sink_scale(sink_rows, lse_rows)[:, None]
        out[seq] = o_rows.reshape(s_q, h_q, HEAD_DIM_V).to(out.dtype)
        lse[seq] = lse_rows.reshape(s_q, h_q).T

    # ---- split step: every SM part walks its pieces ---------------------------------------------------------
    for part in tile_scheduler_metadata.tolist():
        for piece in pieces_of_part(part, whole_rows, splits):
            end = min(piece.end_token, counted[piece.seq])
            o_rows, lse_rows = _partial_attention(q[piece.seq].float(), k_cache, indices[piece.seq],
                                                  piece.begin_token, end, scale_log2)
            if piece.num_pieces == 1:
                write_final(piece.seq, o_rows, lse_rows)
            else:
                o_workspace[piece.slot] = o_rows
                lse_workspace[piece.slot] = lse_rows

    # ---- combine step: merge the pieces of split rows -------------------------------------------------------
    for seq in range(b):
        first, last = splits[seq], splits[seq + 1]
        if last - first > 1:
            write_final(seq, *combine_pieces(o_workspace[first:last], lse_workspace[first:last]))
    return out, lse
