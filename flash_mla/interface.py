"""Public API: get_mla_metadata (plan) and flash_mla_with_kvcache (run), drop-in compatible with upstream
FlashMLA's dense decoding API. Validation happens here, before any backend is chosen or any kernel launched.

Eager calls go straight to the backend (validation + dispatch cost a few microseconds per call). While
torch.compile traces a call, it goes through the torch.library ops of flash_mla.ops instead, so a decoding
step compiles into one graph (fullgraph=True works).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _validation
from . import ops as _ops
from .backends import DEFAULT_CPU_NUM_SMS, default_num_sms, run_decode, run_metadata  # noqa: F401


if _ops.AVAILABLE and hasattr(torch, "compiler") and hasattr(torch.compiler, "is_compiling"):
    _is_compiling = torch.compiler.is_compiling
else:  # torch < 2.4: no custom ops; torch.compile then traces (or breaks on) the eager path
    def _is_compiling() -> bool:
        return False


def get_mla_metadata(cache_seqlens: torch.Tensor, num_heads_per_head_k: int, num_heads_k: int,
                     num_sms: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plan one decoding step: split the batch's KV caches into balanced pieces, one list per SM part.

    Args:
        cache_seqlens: (batch_size,) int32, tokens in each sequence's cache (new tokens included); 0 is legal.
        num_heads_per_head_k: query rows sharing one KV head, seqlen_q * num_heads_q // num_heads_k.
        num_heads_k: number of KV heads (1 for DeepSeek MLA).
        num_sms: multiprocessors to plan for; default: the GPU's count, or 132 (an H100) for CPU tensors.

    Returns:
        tile_scheduler_metadata: (num_sm_parts, 8) int32, one row
            [begin_seq, begin_token, end_seq, end_token, begin_split_idx, 0, 0, 0] per SM part.
        num_splits: (batch_size + 1,) int32, prefix sums of the pieces each sequence was cut into.
    Both live on cache_seqlens' device. On a GPU with the CUDA extension they are computed on the device,
    with no host synchronisation (CUDA-graph safe).
    """
    if _is_compiling():
        return _ops.metadata_for_compile(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms)
    _validation.check_metadata_args(cache_seqlens, num_heads_per_head_k, num_heads_k)
    if num_sms is None:
        num_sms = default_num_sms(cache_seqlens.device)
    else:
        _validation._Checker("get_mla_metadata").integer("num_sms", num_sms, 1)
    return run_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms)


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: torch.Tensor,
                           num_splits: torch.Tensor, softmax_scale: Optional[float] = None, causal: bool = False,
                           backend: Optional[str] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA decoding attention over a paged KV cache.

    Args:
        q: (batch_size, seqlen_q, num_heads_q, 576) bf16 or fp16, last dimension contiguous.
        k_cache: (num_blocks, 64, num_heads_k, 576), dtype of q; V is k_cache[..., :head_dim_v].
        block_table: (batch_size, max_blocks_per_seq) int32, physical block of each 64-token page; entries past
            a sequence's pages are never read (may be -1).
        cache_seqlens: (batch_size,) int32, tokens in each cache; 0 gives out 0 and lse -inf.
        head_dim_v: 512.
        tile_scheduler_metadata, num_splits: from get_mla_metadata on the same cache_seqlens.
        softmax_scale: default 576 ** -0.5.
        causal: query token i of a sequence of length L sees keys [0, L - seqlen_q + i]; otherwise all L keys.
        backend: force "cuda", "triton" or "cpu" (default: environment variable FLASH_MLA_BACKEND, else automatic).

    Returns:
        out: (batch_size, seqlen_q, num_heads_q, head_dim_v), dtype of q.
        softmax_lse: (batch_size, num_heads_q, seqlen_q) float32, natural log of the softmax denominator.

    No host synchronisation (CUDA-graph safe). With FLASH_MLA_DEBUG=1 the call first checks the tensors' values
    (lengths, block-table entries, metadata, finite q), which does synchronise; see docs/HARDENING.md.
    """
    if _is_compiling():
        return _ops.decode_for_compile(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                       num_splits, softmax_scale, causal, backend)
    _validation.check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                  num_splits, softmax_scale, causal)
    softmax_scale = _validation.DEFAULT_SOFTMAX_SCALE if softmax_scale is None else float(softmax_scale)
    return run_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                      softmax_scale, causal, backend)
