"""Exact reference for MLA decoding over a paged KV cache: plain attention per sequence, in float32/64.

Semantics (SPEC.md): query token i of a sequence of length L sees keys [0, L - s_q + i] when causal, all L
keys otherwise; a row that sees no key gives out = 0 and lse = -inf. lse is the natural log of
sum_j exp(scale * q . k_j). With an attention sink s_h per query head, out is scaled by 1 / (1 + exp(s_h - lse))
(the sink is one more logit in the softmax's denominator, with a zero value vector); lse is unchanged and rows
that see no key keep out = 0. Slow and obvious on purpose: every backend is checked against it.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def gather_sequence_cache(k_cache: torch.Tensor, block_table: torch.Tensor, seq: int, length: int) -> torch.Tensor:
    """The first `length` tokens of sequence `seq`, in order: (length, h_kv, d)."""
    page = k_cache.shape[1]
    num_pages = -(-length // page)
    pages = block_table[seq, :num_pages].long()
    return k_cache[pages].reshape(num_pages * page, *k_cache.shape[2:])[:length]


def visible_keys(length: int, s_q: int, causal: bool) -> torch.Tensor:
    """(s_q,) number of keys each query token sees (keys [0, n) are visible)."""
    i = torch.arange(s_q)
    if causal:
        return (length - s_q + 1 + i).clamp(min=0)
    return torch.full((s_q,), length)


def mla_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                         cache_seqlens: torch.Tensor, head_dim_v: int, softmax_scale: Optional[float] = None,
                         causal: bool = False, dtype: torch.dtype = torch.float32,
                         attn_sink: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference attention. Returns out (b, s_q, h_q, head_dim_v) and lse (b, h_q, s_q), both in `dtype`.
    attn_sink: optional (h_q,) sink logits, one per query head."""
    b, s_q, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    group = h_q // h_kv
    out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=dtype, device=q.device)
    lse = torch.full((b, h_q, s_q), -math.inf, dtype=dtype, device=q.device)
    seqlens = cache_seqlens.tolist()
    for seq in range(b):
        length = int(seqlens[seq])
        if length == 0:
            continue
        kv = gather_sequence_cache(k_cache, block_table, seq, length).to(dtype)       # (L, h_kv, d)
        n_visible = visible_keys(length, s_q, causal).to(q.device)
        key_idx = torch.arange(length, device=q.device)
        mask = key_idx[None, :] < n_visible[:, None]                                   # (s_q, L)
        for kvh in range(h_kv):
            qh = q[seq, :, kvh * group:(kvh + 1) * group].to(dtype)                   # (s_q, group, d)
            k = kv[:, kvh]                                                              # (L, d)
            scores = torch.einsum("sgd,ld->sgl", qh, k) * softmax_scale
            scores = scores.masked_fill(~mask[:, None, :], -math.inf)
            row_lse = torch.logsumexp(scores, dim=-1)                                   # (s_q, group)
            seen = torch.isfinite(row_lse)
            probs = torch.exp(scores - torch.where(seen, row_lse, 0.0)[..., None])
            o = torch.einsum("sgl,lv->sgv", probs, k[:, :head_dim_v])
            out[seq, :, kvh * group:(kvh + 1) * group] = torch.where(seen[..., None], o, 0.0)
            lse[seq, kvh * group:(kvh + 1) * group] = row_lse.transpose(0, 1)
    if attn_sink is not None:
        sink = attn_sink.to(device=q.device, dtype=dtype)[None, :, None]                  # (1, h_q, 1)
        # the softmax over [keys..., sink]: the keys' weights shrink by sum / (sum + exp(sink)); rows that see no
        # key have out 0 already (and lse -inf, where the formula is undefined for a -inf sink)
        scale = torch.where(torch.isneginf(lse), 1.0, 1.0 / (1.0 + torch.exp(sink - lse)))   # (b, h_q, s_q)
        out = out * scale.transpose(1, 2)[..., None]
    return out, lse
