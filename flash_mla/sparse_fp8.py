"""Sparse FP8 decoding (DeepSeek-V3.2): the 656-byte token layout, its quantiser, and the float32 reference.

Cache layout (upstream's public interface): k_cache (num_blocks, page_block_size, 1, 656), uint8 or float8_e4m3fn
(a byte view of the same memory). Each token is 656 bytes:

    bytes [0, 512)    512 float8_e4m3fn latent ("NoPE") values
    bytes [512, 528)  4 float32 scales, one per 128 latent values: true value = stored value * scale
    bytes [528, 656)  64 bf16 RoPE values (not quantised)

Token `t` of the cache is block t // page_block_size, slot t % page_block_size; indices (b, s_q, topk) int32 hold
such token numbers (page id * page_block_size + offset), -1 for an unused slot. topk_length (b,) int32, optional:
only the first topk_length[i] indices of batch row i count. A query row with no valid index gives out 0 and
lse -inf (as dense rows with L = 0 do). A repeated index counts as many times as it appears (it is one more key).

The reference here is the executable specification the backends are tested against: it dequantises the gathered
tokens to float32 and runs plain softmax attention in float32 (float64 on request).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._geometry import HEAD_DIM_QK, HEAD_DIM_V
from .fp8 import FP8_DTYPE, FP8_MAX

LATENT_DIM = HEAD_DIM_V                      # 512 quantised latent values per token
ROPE_DIM = HEAD_DIM_QK - HEAD_DIM_V          # 64 bf16 RoPE values per token
SCALE_GROUP = 128                            # latent values per float32 scale
NUM_SCALES = LATENT_DIM // SCALE_GROUP       # 4
SCALES_OFFSET = LATENT_DIM                   # byte offset of the scales in a token
ROPE_OFFSET = SCALES_OFFSET + 4 * NUM_SCALES  # 528: byte offset of the RoPE values
TOKEN_BYTES = ROPE_OFFSET + 2 * ROPE_DIM     # 656
CACHE_DTYPES = (torch.uint8, FP8_DTYPE)      # the cache's dtype: bytes, or an fp8 view of the same bytes
# The smallest scale the quantiser writes (a group of zeros gets it, so stored = x / scale never divides by 0).
MIN_SCALE = torch.finfo(torch.float32).tiny


def as_bytes(k_cache: torch.Tensor) -> torch.Tensor:
    """The cache as uint8 (a view; an fp8 view of the bytes is accepted too)."""
    return k_cache if k_cache.dtype == torch.uint8 else k_cache.view(torch.uint8)


def quantize_kv_cache_v32(latent_and_rope: torch.Tensor) -> torch.Tensor:
    """Turn a (num_blocks, page_block_size, 1, 576) cache into the 656-byte sparse FP8 layout.

    Each token's 512 latent values are quantised in 4 groups of 128: ``scale = max(amax / 448, MIN_SCALE)`` over
    the group's finite values, ``stored = clamp(x / scale, -448, 448)`` rounded to nearest even in float8_e4m3fn
    (NaN stays NaN, +-inf saturate). The 64 RoPE values are rounded to bf16.

    Args:
        latent_and_rope: bf16, fp16 or float32, (num_blocks, page_block_size, 1, 576) (any leading shape works;
            the last dimension must be 576).

    Returns:
        uint8 tensor of shape (..., 656) on the input's device (view it as float8_e4m3fn if you like).
        No host synchronisation.
    """
    fn = "quantize_kv_cache_v32"
    if not isinstance(latent_and_rope, torch.Tensor):
        raise TypeError(f"{fn}: latent_and_rope: expected a torch.Tensor, got {type(latent_and_rope).__name__}")
    if latent_and_rope.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{fn}: latent_and_rope: expected dtype torch.bfloat16, torch.float16 or torch.float32, "
                        f"got {latent_and_rope.dtype}")
    if latent_and_rope.dim() < 1 or latent_and_rope.shape[-1] != HEAD_DIM_QK:
        raise ValueError(f"{fn}: latent_and_rope: expected last dimension {HEAD_DIM_QK} (512 latent + 64 RoPE), "
                         f"got shape {tuple(latent_and_rope.shape)}")
    lead = latent_and_rope.shape[:-1]
    x = latent_and_rope.float()
    groups = x[..., :LATENT_DIM].reshape(*lead, NUM_SCALES, SCALE_GROUP)
    amax = torch.where(torch.isfinite(groups), groups.abs(), 0).amax(-1, keepdim=True)
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)                                    # (..., 4, 1)
    stored = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(*lead, LATENT_DIM)
    out = torch.empty(*lead, TOKEN_BYTES, dtype=torch.uint8, device=latent_and_rope.device)
    out[..., :SCALES_OFFSET] = stored.view(torch.uint8)
    out[..., SCALES_OFFSET:ROPE_OFFSET] = scale.reshape(*lead, NUM_SCALES).contiguous().view(torch.uint8)
    out[..., ROPE_OFFSET:] = x[..., LATENT_DIM:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def dequantize_kv_cache_v32(k_cache: torch.Tensor) -> torch.Tensor:
    """The float32 tokens (..., 576) of a 656-byte cache (uint8 or its fp8 view): latent * scale, then RoPE."""
    raw = as_bytes(k_cache)
    lead = raw.shape[:-1]
    latent = raw[..., :SCALES_OFFSET].contiguous().view(FP8_DTYPE).float().reshape(*lead, NUM_SCALES, SCALE_GROUP)
    scale = raw[..., SCALES_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32).reshape(*lead, NUM_SCALES, 1)
    rope = raw[..., ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(latent * scale).reshape(*lead, LATENT_DIM), rope], dim=-1)


def num_cache_tokens(k_cache: torch.Tensor) -> int:
    """Tokens a (num_blocks, page_block_size, 1, 656) cache holds: valid token numbers are [0, this)."""
    return k_cache.shape[0] * k_cache.shape[1]


def gather_tokens(k_cache: torch.Tensor, token_ids: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The float32 tokens (..., 576) numbered `token_ids` (any shape), dequantised; 0 where `valid` is False.

    Only the tokens of valid slots are read: an invalid slot's id (-1, a slot past topk_length, anything) is
    never used as an address, and its row is 0 whatever the cache holds (NaN included).
    """
    raw = as_bytes(k_cache).reshape(-1, TOKEN_BYTES)
    tokens = torch.zeros(*token_ids.shape, HEAD_DIM_QK, dtype=torch.float32, device=raw.device)
    tokens[valid] = dequantize_kv_cache_v32(raw[token_ids[valid].long()])
    return tokens


def valid_index_mask(indices: torch.Tensor, topk_length: Optional[torch.Tensor]) -> torch.Tensor:
    """(b, s_q, topk) bool: the slots that count (not -1, and within topk_length[i] when it is given)."""
    valid = indices >= 0
    if topk_length is not None:
        slot = torch.arange(indices.shape[-1], device=indices.device)
        valid &= slot.view(1, 1, -1) < topk_length.to(indices.device).view(-1, 1, 1)
    return valid


def sparse_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                            topk_length: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                            attn_sink: Optional[torch.Tensor] = None,
                            compute_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse FP8 decoding in plain float32 (or float64) on the dequantised tokens; the executable specification.

    Args:
        q: (b, s_q, h_q, 576), any float dtype.
        k_cache: (num_blocks, page_block_size, 1, 656) uint8 or float8_e4m3fn, the layout above.
        indices: (b, s_q, topk) int32 token numbers, -1 = unused.
        topk_length: optional (b,) int32.
        softmax_scale: default 576 ** -0.5.
        attn_sink: optional (h_q,) float32; out is scaled by 1 / (1 + exp(attn_sink[h] - lse)), lse unchanged.

    Returns:
        out (b, s_q, h_q, 512) and lse (b, h_q, s_q) in compute_dtype; rows with no valid index: out 0, lse -inf.
    """
    scale = HEAD_DIM_QK ** -0.5 if softmax_scale is None else float(softmax_scale)
    h_q = q.shape[2]
    tokens = dequantize_kv_cache_v32(k_cache).reshape(-1, HEAD_DIM_QK).to(compute_dtype)   # (num_tokens, 576)
    valid = valid_index_mask(indices, topk_length)                                          # (b, s_q, topk)
    keys = tokens[torch.where(valid, indices, 0).long()]                                    # (b, s_q, topk, 576)
    keys = torch.where(valid.unsqueeze(-1), keys, 0)          # unused slots may point at anything (NaN too)
    scores = torch.einsum("bshd,bskd->bshk", q.to(compute_dtype), keys) * scale             # (b, s_q, h_q, topk)
    scores = scores.masked_fill(~valid.unsqueeze(2), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                                   # (b, s_q, h_q)
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0).unsqueeze(-1))
    probs = torch.where(valid.unsqueeze(2), probs, 0)
    out = torch.einsum("bshk,bskd->bshd", probs, keys[..., :HEAD_DIM_V])                    # (b, s_q, h_q, 512)
    if attn_sink is not None:
        sink = attn_sink.to(compute_dtype).view(1, 1, h_q)
        factor = torch.sigmoid(lse - sink)                    # 1 / (1 + exp(sink - lse))
        factor = torch.where(sink == float("-inf"), 1.0, factor)          # a sink of -inf changes nothing
        factor = torch.where(lse == float("-inf"), 0.0, factor)           # rows with no key stay 0
        out = out * factor.unsqueeze(-1)
    return out, lse.permute(0, 2, 1).contiguous()
