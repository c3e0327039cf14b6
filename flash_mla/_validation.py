"""Argument checks shared by every backend. They run before any dispatch, so no kernel ever sees bad input.

Every message names the function, the argument, what was expected and what was given.

`check_decode_args` runs once per layer per decoding step, so it first tries one flat expression that holds for
every valid call (a few microseconds); only when that fails does it walk the detailed checks that say what is
wrong. It reads no tensor values, so nothing synchronises with the GPU.

Value checks read the tensors. For CPU tensors reading them costs nothing, so every decoding call on the CPU
(any backend: "cpu", or "triton" in Triton's interpreter) checks the cache bounds (`check_cache_bounds`, a few
vectorised torch ops): every length >= 0 and at most block_table.shape[1] * 64, and every block-table entry a
length reaches in [0, num_blocks). For CUDA tensors they would need a host synchronisation, so they run only in
the opt-in debug mode (environment variable FLASH_MLA_DEBUG=1, read at every call), which on any device also
checks that the metadata matches the lengths, that the queries are finite and that the FP8 descales are finite
and positive (`check_decode_values`, `check_metadata_values`); debug mode runs the same `check_cache_bounds`
first.

FP8 KV cache (flash_mla/fp8.py): k_cache float8_e4m3fn with descale_k, and q either float8_e4m3fn with descale_q or
bf16 / fp16 without one. A descale is a float32 tensor of shape (1,) on q's device. Missing or superfluous
descales, and an fp8 q with a half-precision cache, are TypeErrors (a wrong type of argument); a descale of the
wrong shape or device is a ValueError. `is_fp8_kvcache` (from flash_mla_with_kvcache) must agree with the cache's
dtype: True with a bf16/fp16 cache, or False with an fp8 cache, is a TypeError naming k_cache.
"""
from __future__ import annotations

import math
import os

import torch

from ._geometry import HEAD_DIM_QK, HEAD_DIM_V, METADATA_WIDTH, PAGE_BLOCK_SIZE
from .fp8 import FP8_DTYPE
from .scheduler import schedule  # the Python twin of the device scheduler (debug mode compares the plan with it)

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
Q_DTYPES = (*SUPPORTED_DTYPES, FP8_DTYPE)      # an fp8 q needs an fp8 cache
VECTOR_BYTES = 16          # kernels move 16-byte vectors: strides in multiples of 8 half (16 fp8) elements
DEBUG_ENV_VAR = "FLASH_MLA_DEBUG"
INT32_MAX = 2 ** 31 - 1
MAX_SM_PARTS = 1024        # the CUDA metadata kernel keeps per-part state in shared memory (csrc/kernels/metadata.cu)


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

    def integer(self, arg: str, v: object, minimum: int, maximum: int = INT32_MAX) -> int:
        # torch.SymInt: a size traced symbolically by torch.compile (dynamic shapes), e.g. s_q * h_q // h_kv
        if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
            self.fail(TypeError, arg, "a Python int", type(v).__name__)
        if v < minimum:
            self.fail(ValueError, arg, f"an int >= {minimum}", v)
        if v > maximum:      # the kernels take int32: a larger value would wrap (and divide by zero)
            self.fail(ValueError, arg, f"an int <= {maximum}", v)
        return v

    def vector_strides(self, arg: str, t: torch.Tensor, pointers: bool = True) -> None:
        if t.stride(-1) != 1:
            self.fail(ValueError, arg, "a contiguous last dimension (stride 1)", f"strides {t.stride()}")
        elems = VECTOR_BYTES // t.element_size()
        if any(s % elems for s in t.stride()[:-1]) or (pointers and t.data_ptr() % VECTOR_BYTES):
            self.fail(ValueError, arg, f"16-byte aligned rows (strides multiples of {elems} elements)",
                      f"strides {t.stride()}, data_ptr % 16 = {t.data_ptr() % VECTOR_BYTES}")


def check_metadata_args(cache_seqlens, num_heads_per_head_k, num_heads_k, num_heads_q=None,
                        min_payload=0, tight_payload=False) -> None:
    c = _Checker("get_mla_metadata")
    c.tensor("cache_seqlens", cache_seqlens)
    c.dtype("cache_seqlens", cache_seqlens, torch.int32)
    c.rank("cache_seqlens", cache_seqlens, 1, "(batch_size,)")
    if cache_seqlens.shape[0] == 0:
        c.fail(ValueError, "cache_seqlens", "at least one sequence", "an empty tensor")
    if cache_seqlens.device.type not in ("cpu", "cuda"):
        c.fail(ValueError, "cache_seqlens", "a tensor on a CUDA device or the CPU",
               f"a tensor on {cache_seqlens.device}")
    c.integer("num_heads_per_head_k", num_heads_per_head_k, 1)
    c.integer("num_heads_k", num_heads_k, 1)
    c.integer("min_payload", min_payload, 0)      # the payload floor (the op's argument; sparse plans set it)
    if type(tight_payload) is not bool:            # the payload rule (the op's argument; sparse plans set it)
        c.fail(TypeError, "tight_payload", "a bool", f"{type(tight_payload).__name__} {tight_payload!r}")
    if num_heads_q is not None:   # optional (upstream's engines pass it); the plan does not need it
        c.integer("num_heads_q", num_heads_q, 1)
        if num_heads_q % num_heads_k or (num_heads_per_head_k * num_heads_k) % num_heads_q:
            c.fail(ValueError, "num_heads_q", f"a multiple of num_heads_k = {num_heads_k} that divides "
                   f"num_heads_per_head_k * num_heads_k = {num_heads_per_head_k * num_heads_k} (seqlen_q * "
                   "num_heads_q)", num_heads_q)


def _descale_ok(t, device) -> bool:
    return (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 1 and t.shape[0] == 1
            and t.device == device)


def _dtypes_ok(q, k_cache, descale_q, descale_k, is_fp8_kvcache) -> bool:
    """The dtype rules of q and k_cache and the presence of the FP8 descales (see the module docstring)."""
    if k_cache.dtype != FP8_DTYPE:
        return (q.dtype in SUPPORTED_DTYPES and k_cache.dtype == q.dtype and descale_q is None and descale_k is None
                and not is_fp8_kvcache)
    return ((is_fp8_kvcache is None or is_fp8_kvcache is True) and _descale_ok(descale_k, q.device)
            and (_descale_ok(descale_q, q.device) if q.dtype == FP8_DTYPE
                 else (q.dtype in SUPPORTED_DTYPES and descale_q is None)))


def _decode_args_ok(q, k_cache, block_table, cache_seqlens, head_dim_v, md, ns, softmax_scale, causal, attn_sink,
                    pointers: bool, descale_q=None, descale_k=None, is_fp8_kvcache=None) -> bool:
    """True only if every check of `_check_decode_args` passes (it may be False when they would all pass too:
    then the detailed checks simply run). One flat expression, because it runs on every call."""
    T = torch.Tensor
    if not (isinstance(q, T) and isinstance(k_cache, T) and isinstance(block_table, T)
            and isinstance(cache_seqlens, T) and isinstance(md, T) and isinstance(ns, T)):
        return False
    if q.dim() != 4 or k_cache.dim() != 4 or block_table.dim() != 2 or cache_seqlens.dim() != 1 \
            or md.dim() != 2 or ns.dim() != 1:
        return False
    if not _dtypes_ok(q, k_cache, descale_q, descale_k, is_fp8_kvcache):
        return False
    b, s_q, h_q, d = q.shape
    _, page, h_kv, d_k = k_cache.shape
    qs, ks = q.stride(), k_cache.stride()
    vq, vk = VECTOR_BYTES // q.element_size(), VECTOR_BYTES // k_cache.element_size()   # elements per vector
    dev = q.device
    i32 = torch.int32
    return (b > 0 and s_q > 0 and h_q > 0 and d == HEAD_DIM_QK
            and qs[3] == 1 and qs[0] % vq == 0 and qs[1] % vq == 0 and qs[2] % vq == 0
            and k_cache.shape[0] > 0 and page == PAGE_BLOCK_SIZE and d_k == HEAD_DIM_QK
            and h_kv > 0 and h_q % h_kv == 0
            and ks[3] == 1 and ks[0] % vk == 0 and ks[1] % vk == 0 and ks[2] % vk == 0
            and type(head_dim_v) is int and head_dim_v == HEAD_DIM_V
            and block_table.dtype == i32 and block_table.shape[0] == b
            and (block_table.shape[1] == 0 or block_table.stride(1) == 1)
            and cache_seqlens.dtype == i32 and cache_seqlens.shape[0] == b
            and md.dtype == i32 and md.shape[1] == METADATA_WIDTH and md.shape[0] > 0 and md.is_contiguous()
            and ns.dtype == i32 and ns.shape[0] == b + 1
            and k_cache.device == dev and block_table.device == dev and cache_seqlens.device == dev
            and md.device == dev and ns.device == dev
            and (softmax_scale is None or (type(softmax_scale) in (float, int) and math.isfinite(softmax_scale)
                                           and softmax_scale > 0))
            and type(causal) is bool
            and (attn_sink is None or (isinstance(attn_sink, T) and attn_sink.dtype == torch.float32
                                       and attn_sink.dim() == 1 and attn_sink.shape[0] == h_q
                                       and attn_sink.device == dev))
            and (not pointers or (q.data_ptr() % VECTOR_BYTES == 0 and k_cache.data_ptr() % VECTOR_BYTES == 0)))


def check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                      softmax_scale: float | None, causal, attn_sink=None, pointers: bool = True,
                      planned_here: bool = False, descale_q=None, descale_k=None, is_fp8_kvcache=None,
                      fn: str = "flash_mla_with_kvcache") -> None:
    """Raise the documented exception for the first bad argument. `pointers=False` skips the 16-byte alignment
    of data pointers (fake tensors under torch.compile have none; the real call checks it again).
    `planned_here=True`: the plan does not exist yet (a lazy schedule's first call checks everything else before
    planning from these shapes), so tile_scheduler_metadata and num_splits are not checked.
    `descale_q`, `descale_k`: the FP8 scales (see the module docstring). `is_fp8_kvcache`: the caller's flag, which
    must agree with k_cache's dtype; None (the torch.library op, which has no such flag) takes the dtype's word.
    `fn`: the public function named in messages."""
    if not planned_here and _decode_args_ok(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                            tile_scheduler_metadata, num_splits, softmax_scale, causal, attn_sink,
                                            pointers, descale_q, descale_k, is_fp8_kvcache):
        return
    _check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                       softmax_scale, causal, attn_sink, pointers, planned_here, descale_q, descale_k,
                       is_fp8_kvcache, fn)


def _check_cache_dtype(c: _Checker, q: torch.Tensor, k_cache: torch.Tensor, is_fp8_kvcache) -> None:
    """k_cache's dtype against q's and against the is_fp8_kvcache flag."""
    fp8 = str(FP8_DTYPE)
    as_uint8 = (" (a cache stored as uint8 bytes: pass k_cache.view(torch.float8_e4m3fn))"
                if k_cache.dtype == torch.uint8 else "")
    if k_cache.dtype == FP8_DTYPE:
        if is_fp8_kvcache is False:
            c.fail(TypeError, "k_cache", "a bf16 or fp16 cache, since is_fp8_kvcache=False (for a float8_e4m3fn "
                   "cache pass is_fp8_kvcache=True and descale_k, or call flash_mla_with_kvcache_fp8)", k_cache.dtype)
        return
    if is_fp8_kvcache:
        c.fail(TypeError, "k_cache", f"dtype {fp8}, since is_fp8_kvcache=True{as_uint8}", k_cache.dtype)
    if q.dtype == FP8_DTYPE:
        c.fail(TypeError, "k_cache", f"dtype {fp8} (q is {fp8}: an fp8 q needs an fp8 cache){as_uint8}",
               k_cache.dtype)
    if k_cache.dtype != q.dtype:
        c.fail(TypeError, "k_cache", f"the dtype of q ({q.dtype}), or {fp8} with descale_k{as_uint8}",
               k_cache.dtype)


def _check_descale(c: _Checker, arg: str, t, wanted: bool, why: str, device: torch.device) -> None:
    """A descale is given exactly when its tensor is fp8, as a float32 tensor of shape (1,) on q's device."""
    if not wanted:
        if t is not None:
            c.fail(TypeError, arg, f"None ({why})", type(t).__name__)
        return
    if t is None:
        c.fail(TypeError, arg, f"a float32 tensor of shape (1,) on q's device ({why})", "None")
    c.tensor(arg, t)
    c.dtype(arg, t, torch.float32)
    if t.dim() != 1 or t.shape[0] != 1:
        c.fail(ValueError, arg, "shape (1,): one per-tensor scale (a 0-d scale: .reshape(1))",
               f"shape {tuple(t.shape)}")
    c.device(arg, t, device)


def check_q(c: _Checker, q, dtypes, shape_doc: str, head_dim_doc: str, pointers: bool) -> None:
    """q of every decode call (dense and sparse): a 4-D tensor of `dtypes` with no empty dimension and a last
    dimension of 576, vector strides (and, with `pointers`, a 16-byte aligned data pointer)."""
    c.tensor("q", q)
    c.rank("q", q, 4, shape_doc)
    c.dtype("q", q, dtypes)
    if 0 in q.shape[:3]:
        c.fail(ValueError, "q", "batch_size, seqlen_q and num_heads_q >= 1", f"shape {tuple(q.shape)}")
    c.dim("q", q, 3, HEAD_DIM_QK, head_dim_doc)
    c.vector_strides("q", q, pointers)


def check_scale_causal_sink(c: _Checker, softmax_scale, causal, attn_sink, h_q: int, device: torch.device) -> None:
    """softmax_scale (None or a finite positive float), causal (a bool) and attn_sink (None or (h_q,) float32 on q's
    device) of every decode call (dense and sparse)."""
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            c.fail(TypeError, "softmax_scale", "a float or None", type(softmax_scale).__name__)
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            c.fail(ValueError, "softmax_scale", "a finite positive float", softmax_scale)
    if not isinstance(causal, bool):
        c.fail(TypeError, "causal", "a bool", type(causal).__name__)
    if attn_sink is not None:
        c.tensor("attn_sink", attn_sink)
        c.dtype("attn_sink", attn_sink, torch.float32)
        c.rank("attn_sink", attn_sink, 1, "(num_heads_q,), one sink logit per query head")
        c.device("attn_sink", attn_sink, device)
        c.dim("attn_sink", attn_sink, 0, h_q, "num_heads_q, equal to q's")


def _check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                       softmax_scale: float | None, causal, attn_sink, pointers: bool, planned_here: bool,
                       descale_q=None, descale_k=None, is_fp8_kvcache=None,
                       fn: str = "flash_mla_with_kvcache") -> None:
    c = _Checker(fn)
    check_q(c, q, Q_DTYPES, "(batch_size, seqlen_q, num_heads_q, head_dim)", "head_dim", pointers)
    b, _, h_q, d = q.shape

    c.tensor("k_cache", k_cache)
    c.rank("k_cache", k_cache, 4, "(num_blocks, page_block_size, num_heads_k, head_dim)")
    _check_cache_dtype(c, q, k_cache, is_fp8_kvcache)
    c.device("k_cache", k_cache, q.device)
    if k_cache.shape[0] == 0:
        c.fail(ValueError, "k_cache", "at least one block", f"shape {tuple(k_cache.shape)}")
    c.dim("k_cache", k_cache, 1, PAGE_BLOCK_SIZE, "page_block_size")
    c.dim("k_cache", k_cache, 3, d, "head_dim, equal to q's")
    h_kv = k_cache.shape[2]
    if h_kv == 0 or h_q % h_kv:
        c.fail(ValueError, "k_cache", f"num_heads_k (dimension 2) >= 1 dividing num_heads_q = {h_q}",
               f"num_heads_k = {h_kv}")
    c.vector_strides("k_cache", k_cache, pointers)

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

    if not planned_here:
        _check_plan(c, tile_scheduler_metadata, num_splits, q.device, b)

    check_scale_causal_sink(c, softmax_scale, causal, attn_sink, h_q, q.device)

    fp8_cache = k_cache.dtype == FP8_DTYPE
    _check_descale(c, "descale_k", descale_k, fp8_cache,
                   "true cache value = stored value * descale_k" if fp8_cache
                   else f"k_cache is {k_cache.dtype}, not fp8: only an fp8 cache is scaled", q.device)
    _check_descale(c, "descale_q", descale_q, q.dtype == FP8_DTYPE,
                   "true query value = stored value * descale_q" if q.dtype == FP8_DTYPE
                   else f"q is {q.dtype}, not fp8: only an fp8 q is scaled", q.device)


def _check_plan(c: _Checker, tile_scheduler_metadata, num_splits, device: torch.device, b: int) -> None:
    if tile_scheduler_metadata is None and num_splits is None:
        c.fail(TypeError, "tile_scheduler_metadata", "the tensors from get_mla_metadata(cache_seqlens, ...) or the "
               "schedule from get_mla_metadata()", "None")
    c.tensor("tile_scheduler_metadata", tile_scheduler_metadata)
    c.dtype("tile_scheduler_metadata", tile_scheduler_metadata, torch.int32)
    c.rank("tile_scheduler_metadata", tile_scheduler_metadata, 2, "(num_sm_parts, 8) from get_mla_metadata")
    c.device("tile_scheduler_metadata", tile_scheduler_metadata, device)
    c.dim("tile_scheduler_metadata", tile_scheduler_metadata, 1, METADATA_WIDTH, "metadata words per SM part")
    if tile_scheduler_metadata.shape[0] == 0:
        c.fail(ValueError, "tile_scheduler_metadata", "at least one SM part", "shape (0, 8)")
    if not tile_scheduler_metadata.is_contiguous():
        c.fail(ValueError, "tile_scheduler_metadata", "a contiguous tensor",
               f"strides {tile_scheduler_metadata.stride()}")

    c.tensor("num_splits", num_splits)
    c.dtype("num_splits", num_splits, torch.int32)
    c.rank("num_splits", num_splits, 1, "(batch_size + 1,) from get_mla_metadata")
    c.device("num_splits", num_splits, device)
    c.dim("num_splits", num_splits, 0, b + 1, "batch_size + 1; metadata from a different batch?")


# ---- value checks: every call on CPU tensors, debug mode on CUDA tensors (a host synchronisation) --------------

def debug_enabled() -> bool:
    """FLASH_MLA_DEBUG set to anything but "" or "0", read at every call (tests monkeypatch it)."""
    return os.environ.get(DEBUG_ENV_VAR, "0") not in ("", "0")


def bounds_checked(device: torch.device) -> bool:
    """Whether a decoding call on `device` runs `check_cache_bounds`: always for CPU tensors (reading them costs
    nothing), in debug mode for CUDA ones (a host synchronisation)."""
    return device.type == "cpu" or debug_enabled()


def _check_lengths(c: _Checker, cache_seqlens: torch.Tensor, max_tokens: int | None) -> None:
    """0 <= cache_seqlens[i] (<= max_tokens): vectorised; only a failing call looks for the first bad row."""
    bad = cache_seqlens < 0
    if max_tokens is not None:
        bad |= cache_seqlens > max_tokens
    if not bool(bad.any()):
        return
    i = int(bad.nonzero()[0])
    length = int(cache_seqlens[i])
    if length < 0:
        c.fail(ValueError, f"cache_seqlens[{i}]", "a length >= 0", length)
    c.fail(ValueError, f"cache_seqlens[{i}]",
           f"at most block_table.shape[1] * {PAGE_BLOCK_SIZE} = {max_tokens} tokens (sequence {i} is longer than "
           "its pages)", length)


def check_metadata_values(cache_seqlens: torch.Tensor) -> None:
    """Debug mode, get_mla_metadata: every length >= 0 (reads cache_seqlens: a host sync)."""
    _check_lengths(_Checker("get_mla_metadata"), cache_seqlens, None)


def check_cache_bounds(k_cache, block_table, cache_seqlens, fn: str = "flash_mla_with_kvcache") -> None:
    """The values that keep a call inside its KV cache (arguments already passed `check_decode_args`):

    * 0 <= cache_seqlens[i] <= block_table.shape[1] * 64;
    * every block_table entry sequence i reads (its first ceil(L_i / 64) pages) lies in [0, num_blocks); entries
      past a sequence's last page are never read and may hold anything (-1 padding).
    Raises ValueError naming `fn`, the sequence and the bad entry. A handful of vectorised torch ops; run on every
    call for CPU tensors and in debug mode for CUDA ones (where reading the result is a host sync).
    """
    c = _Checker(fn)
    num_blocks, max_pages = k_cache.shape[0], block_table.shape[1]
    _check_lengths(c, cache_seqlens, max_pages * PAGE_BLOCK_SIZE)
    if max_pages == 0:          # then every length is 0: no page is read
        return
    # page j of sequence i is read iff j * 64 < L_i (int64: no overflow however wide the table)
    first_token = torch.arange(0, max_pages * PAGE_BLOCK_SIZE, PAGE_BLOCK_SIZE, device=block_table.device)
    needed = first_token[None, :] < cache_seqlens[:, None]
    bad = needed & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        i, j = (int(x) for x in bad.nonzero()[0].tolist())
        c.fail(ValueError, f"block_table[{i}, {j}]",
               f"a block index in [0, {num_blocks}) (num_blocks of k_cache) for page {j} of sequence {i}, "
               f"which has {int(cache_seqlens[i])} tokens", int(block_table[i, j]))


def check_decode_values(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                        descale_q=None, descale_k=None, fn: str = "flash_mla_with_kvcache") -> None:
    """Debug mode, flash_mla_with_kvcache (arguments already passed `check_decode_args`); reads the tensors.

    * `check_cache_bounds`: lengths within the block table, block-table entries a length reaches in range;
    * tile_scheduler_metadata and num_splits are exactly what get_mla_metadata gives for these lengths (with
      tile_scheduler_metadata.shape[0] SM parts): metadata from another step or another batch is caught here;
    * q is finite in every sequence with L > 0 (padding rows with L = 0 may hold anything);
    * the FP8 descales, when given, are finite and > 0.
    Raises ValueError naming `fn`, the sequence and the bad entry.
    """
    check_cache_bounds(k_cache, block_table, cache_seqlens, fn)
    c = _Checker(fn)
    seqlens = cache_seqlens.tolist()

    expected_md, expected_ns = schedule(seqlens, tile_scheduler_metadata.shape[0])
    got_ns = num_splits.tolist()
    if got_ns != expected_ns:
        k = next(k for k, (x, y) in enumerate(zip(got_ns, expected_ns)) if x != y)
        c.fail(ValueError, "num_splits", "the get_mla_metadata result for these cache_seqlens (metadata from "
               f"another step or batch?): num_splits[{k}] = {expected_ns[k]}", f"num_splits[{k}] = {got_ns[k]}")
    got_md = tile_scheduler_metadata.tolist()
    if got_md != expected_md:
        p = next(p for p, (x, y) in enumerate(zip(got_md, expected_md)) if x != y)
        c.fail(ValueError, "tile_scheduler_metadata", "the get_mla_metadata result for these cache_seqlens "
               f"(metadata from another step or batch?): row {p} = {expected_md[p]}", f"row {p} = {got_md[p]}")

    for arg, descale in (("descale_q", descale_q), ("descale_k", descale_k)):
        if descale is not None:
            value = float(descale[0])
            if not math.isfinite(value) or value <= 0:
                c.fail(ValueError, arg, "a finite scale > 0", value)

    live = cache_seqlens > 0
    if bool(live.any()):
        values = q.float() if q.dtype == FP8_DTYPE else q      # (isfinite has no float8 kernel)
        finite = torch.isfinite(values).flatten(1).all(dim=1) | ~live
        if not bool(finite.all()):
            i = int((~finite).nonzero()[0])
            c.fail(ValueError, f"q[{i}]", f"finite values (sequence {i} has {seqlens[i]} tokens)", "NaN or Inf")
