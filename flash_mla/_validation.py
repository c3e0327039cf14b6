"""Argument checks shared by every backend. They run before any dispatch, so no kernel ever sees bad input.

Every message names the function, the argument, what was expected and what was given.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

HEAD_DIM_QK = 576          # 512 latent ("NoPE") + 64 RoPE columns
HEAD_DIM_V = 512           # V is the first 512 columns of the cache
PAGE_BLOCK_SIZE = 64
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
VECTOR_ELEMS = 8           # kernels move 16-byte vectors: strides must be multiples of 8 half-precision elements


class _Checker:
    def __init__(self, fn: str):
        self.fn = fn

    def fail(self, exc: type, arg: str, expected: str, got: object) -> None:
        raise exc(f"{self.fn}: {arg}: expected {expected}, got {got}")

    def tensor(self, arg: str, t: object) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            self.fail(TypeError, arg, "a torch.Tensor", type(t).__name__)
        return t

    def dtype(self, arg: str, t: torch.Tensor, allowed) -> None:
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        if t.dtype not in allowed:
            names = " or ".join(str(a) for a in allowed)
            self.fail(TypeError, arg, f"dtype {names}", t.dtype)

    def rank(self, arg: str, t: torch.Tensor, dims: int, shape_doc: str) -> None:
        if t.dim() != dims:
            self.fail(ValueError, arg, f"a {dims}-D tensor {shape_doc}", f"shape {tuple(t.shape)}")

    def dim(self, arg: str, t: torch.Tensor, axis: int, size: int, what: str) -> None:
        if t.shape[axis] != size:
            self.fail(ValueError, arg, f"size {size} in dimension {axis} ({what})", f"shape {tuple(t.shape)}")

    def device(self, arg: str, t: torch.Tensor, device: torch.device) -> None:
        if t.device != device:
            self.fail(ValueError, arg, f"a tensor on {device} (the device of q)", f"a tensor on {t.device}")

    def integer(self, arg: str, v: object, minimum: int) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(TypeError, arg, "a Python int", type(v).__name__)
        if v < minimum:
            self.fail(ValueError, arg, f"an int >= {minimum}", v)
        return v

    def vector_strides(self, arg: str, t: torch.Tensor) -> None:
        if t.stride(-1) != 1:
            self.fail(ValueError, arg, "a contiguous last dimension (stride 1)", f"strides {t.stride()}")
        if any(s % VECTOR_ELEMS for s in t.stride()[:-1]) or t.data_ptr() % 16:
            self.fail(ValueError, arg, f"16-byte aligned rows (strides multiples of {VECTOR_ELEMS} elements)",
                      f"strides {t.stride()}, data_ptr % 16 = {t.data_ptr() % 16}")


def check_metadata_args(cache_seqlens, num_heads_per_head_k, num_heads_k) -> None:
    c = _Checker("get_mla_metadata")
    c.tensor("cache_seqlens", cache_seqlens)
    c.dtype("cache_seqlens", cache_seqlens, torch.int32)
    c.rank("cache_seqlens", cache_seqlens, 1, "(batch_size,)")
    if cache_seqlens.shape[0] == 0:
        c.fail(ValueError, "cache_seqlens", "at least one sequence", "an empty tensor")
    c.integer("num_heads_per_head_k", num_heads_per_head_k, 1)
    c.integer("num_heads_k", num_heads_k, 1)


def check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                      softmax_scale: Optional[float], causal) -> None:
    c = _Checker("flash_mla_with_kvcache")
    c.tensor("q", q)
    c.rank("q", q, 4, "(batch_size, seqlen_q, num_heads_q, head_dim)")
    c.dtype("q", q, SUPPORTED_DTYPES)
    b, s_q, h_q, d = q.shape
    if b == 0 or s_q == 0 or h_q == 0:
        c.fail(ValueError, "q", "batch_size, seqlen_q and num_heads_q >= 1", f"shape {tuple(q.shape)}")
    c.dim("q", q, 3, HEAD_DIM_QK, "head_dim")
    c.vector_strides("q", q)

    c.tensor("k_cache", k_cache)
    c.rank("k_cache", k_cache, 4, "(num_blocks, page_block_size, num_heads_k, head_dim)")
    if k_cache.dtype != q.dtype:
        c.fail(TypeError, "k_cache", f"the dtype of q ({q.dtype})", k_cache.dtype)
    c.device("k_cache", k_cache, q.device)
    if k_cache.shape[0] == 0:
        c.fail(ValueError, "k_cache", "at least one block", f"shape {tuple(k_cache.shape)}")
    c.dim("k_cache", k_cache, 1, PAGE_BLOCK_SIZE, "page_block_size")
    c.dim("k_cache", k_cache, 3, d, "head_dim, equal to q's")
    h_kv = k_cache.shape[2]
    if h_kv == 0 or h_q % h_kv:
        c.fail(ValueError, "k_cache", f"num_heads_k (dimension 2) >= 1 dividing num_heads_q = {h_q}",
               f"num_heads_k = {h_kv}")
    c.vector_strides("k_cache", k_cache)

    c.integer("head_dim_v", head_dim_v, 1)
    if head_dim_v != HEAD_DIM_V:
        c.fail(ValueError, "head_dim_v", f"{HEAD_DIM_V}", head_dim_v)

    c.tensor("block_table", block_table)
    c.dtype("block_table", block_table, torch.int32)
    c.rank("block_table", block_table, 2, "(batch_size, max_blocks_per_seq)")
    c.device("block_table", block_table, q.device)
    c.dim("block_table", block_table, 0, b, "batch_size, equal to q's")
    if block_table.shape[1] > 0 and block_table.stride(1) != 1:
        c.fail(ValueError, "block_table", "a contiguous last dimension (stride 1)", f"strides {block_table.stride()}")

    c.tensor("cache_seqlens", cache_seqlens)
    c.dtype("cache_seqlens", cache_seqlens, torch.int32)
    c.rank("cache_seqlens", cache_seqlens, 1, "(batch_size,)")
    c.device("cache_seqlens", cache_seqlens, q.device)
    c.dim("cache_seqlens", cache_seqlens, 0, b, "batch_size, equal to q's")

    c.tensor("tile_scheduler_metadata", tile_scheduler_metadata)
    c.dtype("tile_scheduler_metadata", tile_scheduler_metadata, torch.int32)
    c.rank("tile_scheduler_metadata", tile_scheduler_metadata, 2, "(num_sm_parts, 8) from get_mla_metadata")
    c.device("tile_scheduler_metadata", tile_scheduler_metadata, q.device)
    c.dim("tile_scheduler_metadata", tile_scheduler_metadata, 1, 8, "metadata words per SM part")
    if tile_scheduler_metadata.shape[0] == 0:
        c.fail(ValueError, "tile_scheduler_metadata", "at least one SM part", "shape (0, 8)")
    if not tile_scheduler_metadata.is_contiguous():
        c.fail(ValueError, "tile_scheduler_metadata", "a contiguous tensor", f"strides {tile_scheduler_metadata.stride()}")

    c.tensor("num_splits", num_splits)
    c.dtype("num_splits", num_splits, torch.int32)
    c.rank("num_splits", num_splits, 1, "(batch_size + 1,) from get_mla_metadata")
    c.device("num_splits", num_splits, q.device)
    c.dim("num_splits", num_splits, 0, b + 1, "batch_size + 1; metadata from a different batch?")

    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            c.fail(TypeError, "softmax_scale", "a float or None", type(softmax_scale).__name__)
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            c.fail(ValueError, "softmax_scale", "a finite positive float", softmax_scale)
    if not isinstance(causal, bool):
        c.fail(TypeError, "causal", "a bool", type(causal).__name__)
