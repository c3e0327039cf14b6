"""Public API: get_mla_metadata (plan) and flash_mla_with_kvcache (run), drop-in compatible with upstream
FlashMLA's dense decoding API. Validation happens here, before any backend is chosen or any kernel launched.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _validation
from .backends import cuda_extension, select_backend
from .scheduler import get_mla_metadata_twin

DEFAULT_CPU_NUM_SMS = 132   # the H100 SXM's multiprocessors: the CPU path then cuts work like the GPU does


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_CPU_NUM_SMS


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
    _validation.check_metadata_args(cache_seqlens, num_heads_per_head_k, num_heads_k)
    if num_sms is None:
        num_sms = _num_sms(cache_seqlens.device)
    else:
        _validation._Checker("get_mla_metadata").integer("num_sms", num_sms, 1)
    ext = cuda_extension()
    if cache_seqlens.is_cuda and ext is not None:
        return ext.get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms)
    return get_mla_metadata_twin(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms)


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
    """
    _validation.check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                  num_splits, softmax_scale, causal)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    softmax_scale = float(softmax_scale)
    name = select_backend(q.device, backend)
    if name == "cuda":
        return cuda_extension().mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                           tile_scheduler_metadata, num_splits, softmax_scale, causal)
    if name == "triton":
        from .triton_backend import mla_decode_triton
        return mla_decode_triton(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                 num_splits, softmax_scale, causal)
    from .cpu_backend import mla_decode_cpu
    return mla_decode_cpu(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                          num_splits, softmax_scale, causal)
