"""torch.library custom ops for both calls, so torch.compile traces a decoding step without graph breaks.

    torch.ops.flash_mla.get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms, min_payload=0,
                                         tight_payload=False)
        -> (tile_scheduler_metadata, num_splits)          num_sms = 0: the device's multiprocessor count
                                                          min_payload, tight_payload: the payload's floor and
                                                          rule (scheduler.schedule)
    torch.ops.flash_mla.mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                   num_splits, softmax_scale, causal, backend=None, attn_sink=None,
                                   descale_q=None, descale_k=None)
        -> (out, softmax_lse)

The FP8 KV cache goes through the same decode op: descale_q and descale_k (trailing optional arguments, so the
schema of earlier releases still binds every call it took) are the (1,) float32 scales of an fp8 q and an fp8
cache; the op takes the cache's dtype as the fp8 switch (flash_mla_with_kvcache checks its is_fp8_kvcache flag
against that dtype before calling it).

`flash_mla.get_mla_metadata` and `flash_mla.flash_mla_with_kvcache` call these ops only while torch.compile
traces them (`torch.compiler.is_compiling()`); in eager mode they call the backend directly, which skips the
dispatcher's per-call cost. Calling the ops directly works in eager mode too. The lazy schedule of upstream's
current form (interface.MLASchedule) is plain Python state: under torch.compile its first use traces the
metadata op and stores the traced tensors in it, so the ops never see it.

Sparse FP8 decoding (DeepSeek-V3.2, flash_mla/sparse_fp8.py) is an op of its own:

    torch.ops.flash_mla.sparse_decode(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits,
                                      softmax_scale, backend=None, attn_sink=None)
        -> (out, softmax_lse)

with the arguments of backends.run_sparse_decode (topk_length and attn_sink optional); its plan comes from the
metadata op on the rows' lengths (topk_length, or full(topk)) with the sparse plan's rules (SPARSE_PLAN), as
flash_mla.interface makes it.

The fake (meta) implementations give the output shapes without running anything:
  * metadata: (num_sm_parts, 8) and (b + 1,) int32, num_sm_parts = scheduler.num_sm_parts_for(num_sms, ...),
    which depends only on the SM count and the head counts, never on the lengths;
  * decode: out (b, s_q, h_q, head_dim_v) in q's dtype (bf16 for an fp8 q) and lse (b, h_q, s_q) float32, both
    contiguous; sparse decode: out (b, s_q, h_q, 512) in q's dtype and lse (b, h_q, s_q) float32.
Both implementations validate their arguments like the eager API (the fake one without the data-pointer
alignment check, since fake tensors have no data; the real one checks it again when the graph runs).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import _sparse_validation, _validation
from ._geometry import DEFAULT_SOFTMAX_SCALE, HEAD_DIM_V, METADATA_WIDTH
from .backends import default_num_sms, run_decode, run_metadata, run_sparse_decode
from .fp8 import decode_out_dtype
from .scheduler import num_sm_parts_for

AVAILABLE = hasattr(torch.library, "custom_op")   # torch >= 2.4


def _resolve_num_sms(num_sms: int, device: torch.device) -> int:
    """0 means "the device's count"; anything else must be a positive int."""
    if num_sms == 0:
        return default_num_sms(device)
    return _validation._Checker("get_mla_metadata").integer("num_sms", num_sms, 1)


if AVAILABLE:
    @torch.library.custom_op("flash_mla::get_mla_metadata", mutates_args=())
    def get_mla_metadata(cache_seqlens: torch.Tensor, num_heads_per_head_k: int, num_heads_k: int,
                         num_sms: int, min_payload: int = 0,
                         tight_payload: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        # min_payload, tight_payload: the payload's floor and rule (0 and False: dense plans; _geometry.SPARSE_PLAN:
        # sparse ones; scheduler.schedule)
        _validation.check_metadata_args(cache_seqlens, num_heads_per_head_k, num_heads_k, min_payload=min_payload,
                                        tight_payload=tight_payload)
        return run_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k,
                            _resolve_num_sms(num_sms, cache_seqlens.device), min_payload, tight_payload)

    @get_mla_metadata.register_fake
    def _get_mla_metadata_fake(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms, min_payload=0,
                               tight_payload=False):
        _validation.check_metadata_args(cache_seqlens, num_heads_per_head_k, num_heads_k, min_payload=min_payload,
                                        tight_payload=tight_payload)
        parts = num_sm_parts_for(_resolve_num_sms(num_sms, cache_seqlens.device), num_heads_per_head_k, num_heads_k)
        return (cache_seqlens.new_empty((parts, METADATA_WIDTH)),
                cache_seqlens.new_empty((cache_seqlens.shape[0] + 1,)))

    @torch.library.custom_op("flash_mla::mla_decode", mutates_args=())
    def mla_decode(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                   head_dim_v: int, tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor,
                   softmax_scale: float, causal: bool,
                   # Optional[...]: torch.library evaluates these annotations, also on Python 3.9
                   backend: Optional[str] = None,
                   attn_sink: Optional[torch.Tensor] = None,
                   descale_q: Optional[torch.Tensor] = None,
                   descale_k: Optional[torch.Tensor] = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        _validation.check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                      num_splits, softmax_scale, causal, attn_sink=attn_sink, descale_q=descale_q,
                                      descale_k=descale_k)
        return run_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                          softmax_scale, causal, backend, attn_sink, descale_q, descale_k)

    @mla_decode.register_fake
    def _mla_decode_fake(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                         softmax_scale, causal, backend=None, attn_sink=None, descale_q=None, descale_k=None):
        _validation.check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                      num_splits, softmax_scale, causal, attn_sink=attn_sink, pointers=False,
                                      descale_q=descale_q, descale_k=descale_k)
        b, s_q, h_q, _ = q.shape
        return (q.new_empty((b, s_q, h_q, head_dim_v), dtype=decode_out_dtype(q.dtype)),
                q.new_empty((b, h_q, s_q), dtype=torch.float32))

    @torch.library.custom_op("flash_mla::sparse_decode", mutates_args=())
    def sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                      topk_length: Optional[torch.Tensor], tile_scheduler_metadata: torch.Tensor,
                      num_splits: torch.Tensor, softmax_scale: float, backend: Optional[str] = None,
                      attn_sink: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        _check_sparse(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits, softmax_scale,
                      attn_sink, pointers=True)
        if _validation.bounds_checked(q.device):        # CPU tensors, or debug mode
            _sparse_validation.check_sparse_decode_values(k_cache, indices, topk_length)
        return run_sparse_decode(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits,
                                 softmax_scale, attn_sink, backend)

    @sparse_decode.register_fake
    def _sparse_decode_fake(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits, softmax_scale,
                            backend=None, attn_sink=None):
        _check_sparse(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits, softmax_scale,
                      attn_sink, pointers=False)
        b, s_q, h_q, _ = q.shape
        return (q.new_empty((b, s_q, h_q, HEAD_DIM_V)), q.new_empty((b, h_q, s_q), dtype=torch.float32))


def _check_sparse(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits, softmax_scale, attn_sink,
                  pointers: bool, fn: str = "flash_mla_with_kvcache") -> None:
    """The sparse call's argument checks with the op's arguments (no block table, no lengths, not causal)."""
    _sparse_validation.check_sparse_decode_args(q, k_cache, None, None, HEAD_DIM_V, tile_scheduler_metadata,
                                                num_splits, softmax_scale, False, True, indices, attn_sink,
                                                topk_length, pointers=pointers, fn=fn)


def metadata_for_compile(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms, min_payload=0,
                         tight_payload=False):
    """get_mla_metadata while torch.compile traces: validate (traced; no tensor data is read), call the op.
    min_payload, tight_payload: the payload's floor and rule (_geometry.SPARSE_PLAN for sparse plans, else the
    defaults)."""
    _validation.check_metadata_args(cache_seqlens, num_heads_per_head_k, num_heads_k, min_payload=min_payload,
                                    tight_payload=tight_payload)
    if num_sms is None:
        num_sms = 0
    else:
        _validation._Checker("get_mla_metadata").integer("num_sms", num_sms, 1)
    return torch.ops.flash_mla.get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms,
                                                min_payload, tight_payload)


def decode_for_compile(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                       softmax_scale, causal, backend, attn_sink=None, descale_q=None, descale_k=None,
                       is_fp8_kvcache=None, fn="flash_mla_with_kvcache"):
    """flash_mla_with_kvcache (or flash_mla_with_kvcache_fp8, `fn`) while torch.compile traces: validate shapes,
    dtypes, devices and strides (traced), then call the op (whose real implementation checks pointer alignment and,
    for CPU tensors or in debug mode, the values)."""
    _validation.check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                  num_splits, softmax_scale, causal, attn_sink=attn_sink, pointers=False,
                                  descale_q=descale_q, descale_k=descale_k, is_fp8_kvcache=is_fp8_kvcache, fn=fn)
    scale = DEFAULT_SOFTMAX_SCALE if softmax_scale is None else float(softmax_scale)
    return torch.ops.flash_mla.mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                          tile_scheduler_metadata, num_splits, scale, causal, backend, attn_sink,
                                          descale_q, descale_k)


def sparse_decode_for_compile(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                              num_splits, softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, topk_length,
                              backend, descale_q=None, descale_k=None, fn="flash_mla_with_kvcache"):
    """flash_mla_with_kvcache(..., indices=...) while torch.compile traces: validate everything but values and
    pointers (traced), then call the sparse op (whose real implementation checks them)."""
    _sparse_validation.check_sparse_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                tile_scheduler_metadata, num_splits, softmax_scale, causal,
                                                is_fp8_kvcache, indices, attn_sink, topk_length, descale_q,
                                                descale_k, pointers=False, fn=fn)
    scale = DEFAULT_SOFTMAX_SCALE if softmax_scale is None else float(softmax_scale)
    return torch.ops.flash_mla.sparse_decode(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits,
                                             scale, backend, attn_sink)
