"""Argument checks of sparse FP8 decoding (flash_mla_with_kvcache(..., indices=...), DeepSeek-V3.2).

They run before any planning or dispatch, with the messages of flash_mla/_validation.py ("fn: arg: expected ...,
got ..."): TypeError for a wrong type or dtype (and for is_fp8_kvcache=False, or a descale, with indices: the
scales live in the cache), ValueError for a wrong shape, device, stride or value (causal=True included).

`check_sparse_decode_args` reads no tensor data (no host sync). The value checks read it:
`check_sparse_decode_values` (indices within the cache or -1, 0 <= topk_length[i] <= topk) runs on every call with
CPU tensors and, for CUDA tensors, only in debug mode (FLASH_MLA_DEBUG=1), as does `check_sparse_plan_values`
(the plan is get_mla_metadata's for full(topk) or for topk_length, with the sparse payload floor).
"""
from __future__ import annotations


import torch

from ._geometry import HEAD_DIM_V, METADATA_WIDTH, SPARSE_PLAN
from ._validation import SUPPORTED_DTYPES, _check_plan, _Checker, check_q, check_scale_causal_sink
from .scheduler import schedule
from .sparse_fp8 import CACHE_DTYPES, TOKEN_BYTES, num_cache_tokens

INDEX_DTYPE = torch.int32


def check_sparse_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                             num_splits, softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, topk_length,
                             descale_q=None, descale_k=None, pointers: bool = True, planned_here: bool = False,
                             fn: str = "flash_mla_with_kvcache") -> None:
    """Raise the documented exception for the first bad argument of a sparse call (shapes, dtypes, devices,
    strides, flags; no tensor values). `pointers=False` skips the data-pointer alignment (fake tensors under
    torch.compile); `planned_here=True` skips the plan (a lazy schedule's first call plans after these checks).
    block_table and cache_seqlens are not used by sparse decoding: None or any tensor."""
    c = _Checker(fn)
    check_q(c, q, SUPPORTED_DTYPES, "(batch_size, seqlen_q, num_heads_q, 576)", "head_dim: 512 latent + 64 RoPE",
            pointers)
    b, s_q, h_q, _ = q.shape

    if is_fp8_kvcache is not True:
        c.fail(TypeError, "is_fp8_kvcache", "True with indices (sparse decoding reads the 656-byte FP8 cache of "
               "flash_mla.quantize_kv_cache_v32)", repr(is_fp8_kvcache))
    c.tensor("k_cache", k_cache)
    c.rank("k_cache", k_cache, 4, f"(num_blocks, page_block_size, 1, {TOKEN_BYTES})")
    c.dtype("k_cache", k_cache, CACHE_DTYPES)
    c.device("k_cache", k_cache, q.device)
    if k_cache.shape[0] == 0 or k_cache.shape[1] == 0:
        c.fail(ValueError, "k_cache", "num_blocks and page_block_size >= 1", f"shape {tuple(k_cache.shape)}")
    c.dim("k_cache", k_cache, 2, 1, "num_heads_k: sparse decoding has one KV head")
    c.dim("k_cache", k_cache, 3, TOKEN_BYTES, "bytes per token: 512 fp8 latent values, 4 float32 scales, "
          "64 bf16 RoPE values")
    c.vector_strides("k_cache", k_cache, pointers)
    for arg, t in (("descale_q", descale_q), ("descale_k", descale_k)):
        if t is not None:
            c.fail(TypeError, arg, "None with indices (the sparse cache holds its own scales)", type(t).__name__)

    c.tensor("indices", indices)
    c.dtype("indices", indices, INDEX_DTYPE)
    c.rank("indices", indices, 3, "(batch_size, seqlen_q, topk)")
    c.device("indices", indices, q.device)
    if indices.shape[0] != b or indices.shape[1] != s_q:
        c.fail(ValueError, "indices", f"shape (batch_size, seqlen_q, topk) = ({b}, {s_q}, topk), q's batch_size "
               "and seqlen_q", f"shape {tuple(indices.shape)}")
    if indices.shape[2] == 0:
        c.fail(ValueError, "indices", "topk (dimension 2) >= 1", f"shape {tuple(indices.shape)}")
    if indices.stride(2) != 1:
        c.fail(ValueError, "indices", "a contiguous last dimension (stride 1)", f"strides {indices.stride()}")

    if topk_length is not None:
        c.tensor("topk_length", topk_length)
        c.dtype("topk_length", topk_length, INDEX_DTYPE)
        c.rank("topk_length", topk_length, 1, "(batch_size,)")
        c.device("topk_length", topk_length, q.device)
        c.dim("topk_length", topk_length, 0, b, "batch_size, equal to q's")

    for arg, t in (("block_table", block_table), ("cache_seqlens", cache_seqlens)):
        if t is not None and not isinstance(t, torch.Tensor):
            c.fail(TypeError, arg, "None or a torch.Tensor (not used with indices)", type(t).__name__)

    c.integer("head_dim_v", head_dim_v, 1)
    if head_dim_v != HEAD_DIM_V:
        c.fail(ValueError, "head_dim_v", f"{HEAD_DIM_V}", head_dim_v)
    if not planned_here:
        _check_plan(c, tile_scheduler_metadata, num_splits, q.device, b)
    check_scale_causal_sink(c, softmax_scale, causal, attn_sink, h_q, q.device)
    if causal:
        c.fail(ValueError, "causal", "False with indices (each query row attends to exactly its indexed tokens)",
               causal)


def check_sparse_metadata_args(num_heads_k, topk) -> None:
    """get_mla_metadata(..., topk=topk) (classic form): topk an int >= 1, one KV head."""
    c = _Checker("get_mla_metadata")
    c.integer("topk", topk, 1)
    if num_heads_k != 1:
        c.fail(ValueError, "num_heads_k", "1 with topk (sparse decoding has one KV head)", num_heads_k)


def check_topk(topk) -> None:
    """get_mla_metadata(topk=...) without cache_seqlens (lazy form): topk, if given, an int >= 1."""
    if topk is not None:
        _Checker("get_mla_metadata").integer("topk", topk, 1)


def check_sparse_decode_values(k_cache, indices, topk_length, fn: str = "flash_mla_with_kvcache") -> None:
    """Reads the tensors (a host sync on a GPU): 0 <= topk_length[i] <= topk, and every counted slot (j <
    topk_length[i]) of indices is -1 or a token of the cache, [0, num_blocks * page_block_size). Slots past
    topk_length[i] are not read by the kernels and may hold anything."""
    c = _Checker(fn)
    topk = indices.shape[2]
    counted = None
    if topk_length is not None:
        bad = (topk_length < 0) | (topk_length > topk)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            c.fail(ValueError, f"topk_length[{i}]", f"a count in [0, topk = {topk}]", int(topk_length[i]))
        slot = torch.arange(topk, device=indices.device)
        counted = (slot.view(1, 1, -1) < topk_length.view(-1, 1, 1)).expand(indices.shape)
    tokens = num_cache_tokens(k_cache)
    bad = (indices < -1) | (indices >= tokens)
    if counted is not None:
        bad &= counted
    if bool(bad.any()):
        i, s, j = (int(x) for x in bad.nonzero()[0].tolist())
        c.fail(ValueError, f"indices[{i}, {s}, {j}]", f"-1 (unused) or a token number in [0, {tokens}) "
               f"(num_blocks * page_block_size = {k_cache.shape[0]} * {k_cache.shape[1]})", int(indices[i, s, j]))


def check_sparse_plan_values(indices, topk_length, tile_scheduler_metadata, num_splits,
                             fn: str = "flash_mla_with_kvcache") -> None:
    """Debug mode: the plan is what get_mla_metadata gives for these rows (same number of SM parts, the sparse
    plan's rules SPARSE_PLAN), planned on full(topk) (the classic form) or on topk_length (the lazy form).
    Reads the tensors."""
    b, _, topk = indices.shape
    parts = tile_scheduler_metadata.shape[0]
    got = (tile_scheduler_metadata.tolist(), num_splits.tolist())
    candidates = [[topk] * b] + ([topk_length.tolist()] if topk_length is not None else [])
    for lengths in candidates:
        if got == tuple(schedule(lengths, parts, **SPARSE_PLAN)):
            return
    _, expected_ns = schedule(candidates[-1], parts, **SPARSE_PLAN)
    what = "topk_length" if topk_length is not None else f"full(topk = {topk})"
    _Checker(fn).fail(ValueError, "tile_scheduler_metadata", f"the get_mla_metadata plan of these rows "
                      f"({what}: num_splits {expected_ns}, {parts} x {METADATA_WIDTH} metadata; from another step "
                      "or batch?)", f"num_splits {got[1]}")
