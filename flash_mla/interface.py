"""Public API: get_mla_metadata (plan) and flash_mla_with_kvcache (run), drop-in compatible with the ways serving
engines call upstream FlashMLA's dense decoding. Validation happens here, before any backend is chosen or any
kernel launched.

Three call forms (README.md "API"):
  * classic: ``md, ns = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)``, then
    ``flash_mla_with_kvcache(..., md, ns, ...)`` in every layer;
  * upstream's current form: ``schedule, _ = get_mla_metadata()`` (no cache_seqlens; other keywords are
    accepted and ignored), then ``flash_mla_with_kvcache(..., schedule, None, ...)``: the first call plans (on the
    device with the CUDA extension, without a host sync) and stores the plan in the schedule, later calls reuse
    it. (Code written for that form that still passes cache_seqlens gets the classic pair back, which it hands
    on to flash_mla_with_kvcache unchanged, so it works too);
  * the keyword arguments engines pass (num_heads_q, is_fp8_kvcache, topk, indices, attn_sink, topk_length, ...):
    supported values work, unsupported ones (extra_k_cache, extra_indices_in_kvcache, extra_topk_length) raise
    NotImplementedError naming the argument.

FP8 KV cache (flash_mla/fp8.py): ``flash_mla_with_kvcache_fp8(q, k_cache, ..., descale_q=..., descale_k=...)``
(vLLM's call), or ``flash_mla_with_kvcache(..., is_fp8_kvcache=True, descale_q=..., descale_k=...)``; both take
the classic plan or a lazy schedule (the plan does not depend on the cache's dtype, so get_mla_metadata accepts
is_fp8_kvcache=True and plans as usual). Backends: see flash_mla/backends.py (the triton backend runs fp8 calls on
a GPU; "cpu" dequantises).

Sparse FP8 decoding (DeepSeek-V3.2, flash_mla/sparse_fp8.py): ``flash_mla_with_kvcache(q, k_cache, None, None,
512, md_or_schedule, ns_or_None, scale, False, is_fp8_kvcache=True, indices=indices, topk_length=...)`` on the
656-byte cache of quantize_kv_cache_v32. Plan: batch row i is one "sequence" whose keys are its index slots; its
length for the scheduler is topk_length[i] (or topk), its query rows are its s_q * h_q (token, head) pairs, so the
plan is the dense scheduler's with num_heads_per_head_k = s_q * h_q and num_heads_k = 1, the smallest payload that
covers the batch and a floor on it, SPARSE_MIN_PAYLOAD (room for a pair of pages): SPARSE_PLAN, whose reasons
flash_mla/_geometry.py gives. The classic
``get_mla_metadata(cache_seqlens, s_q * h_q, 1, num_heads_q=h_q, is_fp8_kvcache=True, topk=topk)`` cannot know
topk_length and plans on full(topk) (torch.full_like(cache_seqlens, topk): on cache_seqlens' device, no host
sync); a lazy schedule plans on its first call's topk_length (or full(topk)). Either plan gives the same answer: a
piece is a range of slot numbers, clipped to topk_length by the backends (flash_mla/cpu_sparse.py). Backends: "cpu"
for CPU tensors; on a GPU "cuda" (Hopper, bf16 q, h_q a multiple of 64), else "triton" (flash_mla/backends.py,
run_sparse_decode).

Eager calls go straight to the backend (validation + dispatch cost a few microseconds per call). While
torch.compile traces a call, it goes through the torch.library ops of flash_mla.ops instead, so a decoding
step compiles into one graph (fullgraph=True works, for the lazy schedule too).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import _sparse_validation, _validation
from . import ops as _ops
from ._geometry import DEFAULT_SOFTMAX_SCALE, SPARSE_PLAN
from .backends import DEFAULT_CPU_NUM_SMS, default_num_sms, run_decode, run_metadata, run_sparse_decode  # noqa: F401

if _ops.AVAILABLE and hasattr(torch, "compiler") and hasattr(torch.compiler, "is_compiling"):
    _is_compiling = torch.compiler.is_compiling
else:  # torch < 2.4: no custom ops; torch.compile then traces (or breaks on) the eager path
    def _is_compiling() -> bool:
        return False


class MLASchedule:
    """The plan of one decoding step in upstream's current calling form, filled in by its first use.

    ``get_mla_metadata()`` returns ``(MLASchedule(), None)``. The first ``flash_mla_with_kvcache(..., schedule,
    None)`` plans for that call's ``cache_seqlens`` and shapes and stores the result here; every later call with
    this schedule (the other layers of the step) reuses it, so all of them must pass the same batch: the same
    lengths and the same batch size, seqlen_q, num_heads_q and num_heads_k (a different shape raises ValueError;
    different lengths cannot be seen without a host sync, except in debug mode). Take a new schedule for every
    decoding step.

    Attributes: ``tile_scheduler_metadata`` and ``num_splits`` (None until planned, then the classic form's
    tensors), ``shape`` (None, then the planning call's (batch_size, seqlen_q, num_heads_q, num_heads_k)),
    ``topk`` (None, or the topk of a sparse planning call, ``indices.shape[2]``: a schedule serves dense or sparse
    calls, not both) and ``num_sms`` (None: the device's multiprocessor count, as in the classic form).

    A sparse call (``indices=...``) plans on its rows' lengths: ``topk_length`` when given, else topk for every row
    (see flash_mla/cpu_sparse.py for what the plan means there); later calls must have the same shapes and topk.
    """

    def __init__(self, num_sms: Optional[int] = None):
        self.num_sms = num_sms
        self.tile_scheduler_metadata: Optional[torch.Tensor] = None
        self.num_splits: Optional[torch.Tensor] = None
        self.shape: Optional[Tuple[int, int, int, int]] = None
        self.topk: Optional[int] = None

    @property
    def have_initialized(self) -> bool:
        """Upstream's name for "planned". Setting it to False drops the plan (the next call plans again)."""
        return self.tile_scheduler_metadata is not None

    @have_initialized.setter
    def have_initialized(self, value: bool) -> None:
        if value and self.tile_scheduler_metadata is None:
            raise ValueError("MLASchedule: have_initialized: expected False (a schedule is planned by its first "
                             "flash_mla_with_kvcache call, not by setting the flag), got True")
        if not value:
            self.tile_scheduler_metadata = self.num_splits = self.shape = self.topk = None

    def __repr__(self) -> str:
        if self.tile_scheduler_metadata is None:
            return "MLASchedule(not planned yet)"
        b, s_q, h_q, h_kv = self.shape
        topk = "" if self.topk is None else f", topk={self.topk}"
        return (f"MLASchedule(batch_size={b}, seqlen_q={s_q}, num_heads_q={h_q}, num_heads_k={h_kv}{topk}, "
                f"num_sm_parts={self.tile_scheduler_metadata.shape[0]})")


FlashMLASchedMeta = MLASchedule   # upstream's name for the same object


def _not_implemented(fn: str, arg: str, what: str, expected: str, got: object) -> None:
    raise NotImplementedError(f"{fn}: {arg}: {what} is not supported; expected {expected}, got {got!r}")


def get_mla_metadata(cache_seqlens: Optional[torch.Tensor] = None, num_heads_per_head_k: Optional[int] = None,
                     num_heads_k: Optional[int] = None, num_heads_q: Optional[int] = None,
                     is_fp8_kvcache: bool = False, topk: Optional[int] = None, *, num_sms: Optional[int] = None,
                     **kwargs):
    """Plan one decoding step: split the batch's KV caches into balanced pieces, one list per SM part.

    Classic form, ``get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k)``:

    Args:
        cache_seqlens: (batch_size,) int32, tokens in each sequence's cache (new tokens included); 0 is legal.
        num_heads_per_head_k: query rows sharing one KV head, seqlen_q * num_heads_q // num_heads_k (upstream's
            later name ``num_q_tokens_per_head_k`` is accepted as a keyword too).
        num_heads_k: number of KV heads (1 for DeepSeek MLA).
        num_heads_q: optional, the number of query heads (upstream passes it; checked, not needed).
        is_fp8_kvcache: accepted, True or False: the plan of an FP8 KV cache is the same as a bf16 one's (the
            scheduler counts pages, not bytes).
        topk: None for dense decoding; an int >= 1 for sparse FP8 decoding (flash_mla_with_kvcache(...,
            indices=...) with indices of shape (batch_size, seqlen_q, topk)): then num_heads_k must be 1,
            num_heads_per_head_k is seqlen_q * num_heads_q, and the plan is made for a length of topk in every batch
            row (torch.full_like(cache_seqlens, topk); the lengths in cache_seqlens are not used, only its size and
            device), with the sparse plan's payload rules SPARSE_PLAN (docs/PERF.md "Scheduler").
        num_sms: multiprocessors to plan for; default: the GPU's count, or 132 (an H100) for CPU tensors.

    Returns:
        tile_scheduler_metadata: (num_sm_parts, 8) int32, one row
            [begin_seq, begin_token, end_seq, end_token, begin_split_idx, 0, 0, 0] per SM part.
        num_splits: (batch_size + 1,) int32, prefix sums of the pieces each sequence was cut into.
    Both live on cache_seqlens' device. On a GPU with the CUDA extension they are computed on the device,
    with no host synchronisation (CUDA-graph safe).

    Upstream's current form, ``get_mla_metadata()`` (no cache_seqlens; other keywords are accepted and ignored,
    except that topk is checked and num_sms is kept): returns ``(MLASchedule(), None)``,
    a schedule the first flash_mla_with_kvcache call fills in (see MLASchedule); a sparse first call plans on its
    topk_length (or topk).
    """
    _sparse_validation.check_topk(topk)
    if cache_seqlens is None:
        if num_sms is not None:
            _validation._Checker("get_mla_metadata").integer("num_sms", num_sms, 1)
        return MLASchedule(num_sms), None
    if "num_q_tokens_per_head_k" in kwargs:
        if num_heads_per_head_k is not None:
            raise TypeError("get_mla_metadata: got both num_heads_per_head_k and num_q_tokens_per_head_k "
                            "(two names of the same argument)")
        num_heads_per_head_k = kwargs.pop("num_q_tokens_per_head_k")
    if kwargs:
        raise TypeError(f"get_mla_metadata: unexpected keyword argument(s) {sorted(kwargs)}")
    if num_heads_per_head_k is None or num_heads_k is None:
        missing = [n for n, v in (("num_heads_per_head_k", num_heads_per_head_k), ("num_heads_k", num_heads_k))
                   if v is None]
        raise TypeError(f"get_mla_metadata: with cache_seqlens, expected num_heads_per_head_k and num_heads_k too; "
                        f"missing {', '.join(missing)} (call get_mla_metadata() with no cache_seqlens for a lazy "
                        "schedule)")
    plan = {}               # dense: SPEC.md's rule
    if topk is not None:    # sparse: every batch row plans as topk long (the call's topk_length is not known here)
        _validation.check_metadata_args(cache_seqlens, num_heads_per_head_k, num_heads_k, num_heads_q)
        _sparse_validation.check_sparse_metadata_args(num_heads_k, topk)
        cache_seqlens = torch.full_like(cache_seqlens, topk)
        plan = SPARSE_PLAN
    return _metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, num_heads_q, num_sms, plan)


def _metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, num_heads_q, num_sms,
              plan: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """The classic form's plan (and a lazy schedule's): check the arguments, then plan on the device or with the
    twin, through the metadata op while torch.compile traces. plan: the scheduler's keyword arguments, {} for dense
    plans (SPEC.md's rule), SPARSE_PLAN for sparse ones (flash_mla/_geometry.py says why)."""
    _validation.check_metadata_args(cache_seqlens, num_heads_per_head_k, num_heads_k, num_heads_q)
    if _is_compiling():
        return _ops.metadata_for_compile(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms, **plan)
    if num_sms is None:
        num_sms = default_num_sms(cache_seqlens.device)
    else:
        _validation._Checker("get_mla_metadata").integer("num_sms", num_sms, 1)
    return run_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms, **plan)


def _plan(fn: str, schedule: MLASchedule, q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
          attn_sink, descale_q, descale_k, is_fp8_kvcache) -> Tuple[torch.Tensor, torch.Tensor]:
    """The plan of a lazy schedule: made (and stored) by its first call, checked against the shapes of later ones."""
    if schedule.topk is not None:
        raise ValueError(f"{fn}: tile_scheduler_metadata: expected a schedule for dense decoding, got one planned "
                         f"by a sparse call (indices, topk={schedule.topk}); take a new one from get_mla_metadata()")
    if schedule.tile_scheduler_metadata is None:
        # every argument but the plan, with the classic form's messages, before planning from their shapes
        _validation.check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, None, None,
                                      softmax_scale, causal, attn_sink=attn_sink, pointers=not _is_compiling(),
                                      planned_here=True, descale_q=descale_q, descale_k=descale_k,
                                      is_fp8_kvcache=is_fp8_kvcache, fn=fn)
        if not _is_compiling() and _validation.bounds_checked(q.device):
            # the lengths and pages, before planning from them: a bad call leaves the schedule unplanned
            _validation.check_cache_bounds(k_cache, block_table, cache_seqlens, fn)
        b, s_q, h_q, _ = q.shape
        h_kv = k_cache.shape[2]
        md, ns = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv, num_sms=schedule.num_sms)
        schedule.tile_scheduler_metadata, schedule.num_splits = md, ns
        schedule.shape = (b, s_q, h_q, h_kv)
    elif isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) and q.dim() == 4 and k_cache.dim() == 4:
        b, s_q, h_q, _ = q.shape
        shape = (b, s_q, h_q, k_cache.shape[2])
        if shape != schedule.shape:
            names = ("batch_size", "seqlen_q", "num_heads_q", "num_heads_k")
            planned = ", ".join(f"{n}={v}" for n, v in zip(names, schedule.shape))
            given = ", ".join(f"{n}={v}" for n, v in zip(names, shape))
            raise ValueError(f"{fn}: tile_scheduler_metadata: expected the shapes the schedule was "
                             f"planned for on its first call ({planned}), got {given}; a schedule from "
                             "get_mla_metadata() serves one batch (one decoding step): take a new one")
    # (malformed q or k_cache on a later call: the classic checks below name them)
    return schedule.tile_scheduler_metadata, schedule.num_splits


def flash_mla_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                           cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata,
                           num_splits: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                           causal: bool = False, is_fp8_kvcache: bool = False, indices: Optional[torch.Tensor] = None,
                           attn_sink: Optional[torch.Tensor] = None, extra_k_cache: Optional[torch.Tensor] = None,
                           extra_indices_in_kvcache: Optional[torch.Tensor] = None,
                           topk_length: Optional[torch.Tensor] = None,
                           extra_topk_length: Optional[torch.Tensor] = None, *,
                           backend: Optional[str] = None, descale_q: Optional[torch.Tensor] = None,
                           descale_k: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA decoding attention over a paged KV cache.

    Args:
        q: (batch_size, seqlen_q, num_heads_q, 576) bf16 or fp16, last dimension contiguous; with an fp8 cache
            also float8_e4m3fn (then with descale_q).
        k_cache: (num_blocks, 64, num_heads_k, 576), dtype of q, or float8_e4m3fn with is_fp8_kvcache=True and
            descale_k; V is k_cache[..., :head_dim_v].
        block_table: (batch_size, max_blocks_per_seq) int32, physical block of each 64-token page; entries past
            a sequence's pages are never read (may be -1).
        cache_seqlens: (batch_size,) int32, tokens in each cache; 0 gives out 0 and lse -inf.
        head_dim_v: 512.
        tile_scheduler_metadata, num_splits: from get_mla_metadata on the same cache_seqlens (classic form), or
            the schedule from get_mla_metadata() and None (upstream's current form, planned by the first call).
        softmax_scale: default 576 ** -0.5.
        causal: query token i of a sequence of length L sees keys [0, L - seqlen_q + i]; otherwise all L keys.
        is_fp8_kvcache: True for a float8_e4m3fn k_cache (FP8 KV cache, with descale_k), False (default) for a
            bf16 / fp16 one; a flag that disagrees with k_cache's dtype raises TypeError naming k_cache.
        indices: None (dense decoding), or (batch_size, seqlen_q, topk) int32 for sparse FP8 decoding
            (DeepSeek-V3.2): token numbers block * page_block_size + offset into a k_cache of shape
            (num_blocks, page_block_size, 1, 656), uint8 or float8_e4m3fn (flash_mla.quantize_kv_cache_v32's
            layout), -1 for an unused slot. Then is_fp8_kvcache must be True (TypeError), causal False
            (ValueError), descale_q / descale_k None (the cache holds its scales), q bf16 or fp16; block_table and
            cache_seqlens are not used (None or any tensor); the plan is get_mla_metadata(..., topk=topk)'s or a
            lazy schedule (planned on topk_length, or topk). A row with no valid slot gives out 0, lse -inf.
            Backends: "cpu" (CPU tensors), "triton" (CUDA tensors); no "cuda" kernel yet (RuntimeError).
        topk_length: optional with indices, (batch_size,) int32 on q's device: only the first topk_length[i]
            slots of row i count (0 <= topk_length[i] <= topk); a tensor without indices raises TypeError.
        extra_k_cache, extra_indices_in_kvcache, extra_topk_length: upstream's second sparse cache; only None is
            supported, other values raise NotImplementedError.
        attn_sink: optional (num_heads_q,) float32 on q's device, one attention-sink logit per query head: each
            row's out is scaled by 1 / (1 + exp(attn_sink[head] - lse)); lse is returned unchanged. Rows that see
            no key keep out 0 (lse -inf); a sink of +inf gives out 0, -inf leaves out as without a sink.
        backend: keyword only; force "cuda", "triton" or "cpu" (default: environment variable FLASH_MLA_BACKEND,
            else automatic). "triton" runs CPU tensors in Triton's interpreter when TRITON_INTERPRET=1 was set
            before triton was imported. FP8 calls take the same rule: "cuda" is the Hopper fp8 kernel, "triton"
            needs compute capability 8.9+ (flash_mla/backends.py).
        descale_q, descale_k: keyword only; the FP8 scales, float32 tensors of shape (1,) on q's device with
            true value = stored value * descale: descale_k is required with an fp8 k_cache, descale_q with an fp8
            q, and both must be None otherwise (TypeError). flash_mla.quantize_kv_cache_fp8 / quantize_q_fp8
            make them.

    Returns:
        out: (batch_size, seqlen_q, num_heads_q, head_dim_v), dtype of q (bf16 for an fp8 q).
        softmax_lse: (batch_size, num_heads_q, seqlen_q) float32, natural log of the softmax denominator
            (-inf for rows that see no key; upstream's current release returns +inf there).

    No host synchronisation (CUDA-graph safe). With CPU tensors every call first checks the lengths and the
    block-table entries they reach (ValueError naming the entry); with FLASH_MLA_DEBUG=1 the call checks the
    tensors' values on any device (lengths, block-table entries, metadata, finite q), which on a GPU does
    synchronise; see docs/HARDENING.md.
    """
    fn = "flash_mla_with_kvcache"
    for arg, value in (("extra_k_cache", extra_k_cache), ("extra_indices_in_kvcache", extra_indices_in_kvcache),
                       ("extra_topk_length", extra_topk_length)):
        if value is not None:
            _not_implemented(fn, arg, "a second sparse KV cache", "None", type(value).__name__)
    if indices is not None:
        return _sparse_decode(fn, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                              num_splits, softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, topk_length,
                              backend, descale_q, descale_k)
    if topk_length is not None:
        raise TypeError(f"{fn}: topk_length: expected None without indices (it counts the index slots of sparse "
                        f"decoding), got {type(topk_length).__name__}")
    return _decode(fn, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                   softmax_scale, causal, attn_sink, backend, descale_q, descale_k, bool(is_fp8_kvcache))


def flash_mla_with_kvcache_fp8(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                               cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata,
                               num_splits: Optional[torch.Tensor] = None, softmax_scale: Optional[float] = None,
                               causal: bool = False, descale_q: Optional[torch.Tensor] = None,
                               descale_k: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA decoding attention over a paged FP8 KV cache (the call vLLM makes).

    The same as ``flash_mla_with_kvcache(..., is_fp8_kvcache=True, descale_q=descale_q, descale_k=descale_k)``:

    Args:
        q: (batch_size, seqlen_q, num_heads_q, 576) float8_e4m3fn with descale_q, or bf16 / fp16 (unscaled, and
            descale_q None).
        k_cache: (num_blocks, 64, num_heads_k, 576) float8_e4m3fn, 576 bytes per token and KV head (latent and
            RoPE columns alike); V is k_cache[..., :head_dim_v].
        block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, softmax_scale, causal: as for
            flash_mla_with_kvcache (classic plan, or the schedule from get_mla_metadata() and None).
        descale_q, descale_k: float32 tensors of shape (1,) on q's device; true value = stored value * descale.
            descale_k is required; descale_q is required for an fp8 q and must be None otherwise.

    Returns:
        out: (batch_size, seqlen_q, num_heads_q, head_dim_v), bf16 (fp16 for an fp16 q).
        softmax_lse: (batch_size, num_heads_q, seqlen_q) float32, of the true (descaled) scores; -inf for rows
            that see no key, whose out is 0.

    Every rule of flash_mla_with_kvcache holds (empty sequences, causal masking, determinism, independence of
    the split layout, no host synchronisation, errors raised before any kernel runs). The backend is chosen
    automatically (on a Hopper GPU "cuda", on other GPUs "triton") or by FLASH_MLA_BACKEND.
    """
    return _decode("flash_mla_with_kvcache_fp8", q, k_cache, block_table, cache_seqlens, head_dim_v,
                   tile_scheduler_metadata, num_splits, softmax_scale, causal, None, None, descale_q, descale_k,
                   True)


def _decode(fn: str, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
            softmax_scale, causal, attn_sink, backend, descale_q, descale_k,
            is_fp8_kvcache: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Both public decode functions: plan a lazy schedule, validate (messages name `fn`), run."""
    if isinstance(tile_scheduler_metadata, MLASchedule):
        if num_splits is not None:
            raise TypeError(f"{fn}: num_splits: expected None with a schedule from get_mla_metadata(), got "
                            f"{type(num_splits).__name__}")
        tile_scheduler_metadata, num_splits = _plan(fn, tile_scheduler_metadata, q, k_cache, block_table,
                                                    cache_seqlens, head_dim_v, softmax_scale, causal, attn_sink,
                                                    descale_q, descale_k, is_fp8_kvcache)
    if _is_compiling():
        return _ops.decode_for_compile(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                       num_splits, softmax_scale, causal, backend, attn_sink, descale_q, descale_k,
                                       is_fp8_kvcache, fn)
    _validation.check_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                  num_splits, softmax_scale, causal, attn_sink=attn_sink, descale_q=descale_q,
                                  descale_k=descale_k, is_fp8_kvcache=is_fp8_kvcache, fn=fn)
    softmax_scale = DEFAULT_SOFTMAX_SCALE if softmax_scale is None else float(softmax_scale)
    return run_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                      softmax_scale, causal, backend, attn_sink, descale_q, descale_k, fn=fn)


# ---- sparse FP8 decoding ---------------------------------------------------------------------------------------

def _plan_sparse(fn: str, schedule: MLASchedule, q, indices, topk_length) -> Tuple[torch.Tensor, torch.Tensor]:
    """A lazy schedule's plan for sparse calls (arguments already checked): the first call plans on topk_length
    (or full(topk)) with num_heads_per_head_k = s_q * h_q and one KV head; later calls must match its shapes."""
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[2]
    if schedule.tile_scheduler_metadata is None:
        lengths = (topk_length.contiguous() if topk_length is not None
                   else torch.full((b,), topk, dtype=torch.int32, device=q.device))
        md, ns = _metadata(lengths, s_q * h_q, 1, None, schedule.num_sms, SPARSE_PLAN)
        schedule.tile_scheduler_metadata, schedule.num_splits = md, ns
        schedule.shape, schedule.topk = (b, s_q, h_q, 1), topk
    elif schedule.topk is None or (b, s_q, h_q, 1, topk) != (*schedule.shape, schedule.topk):
        names = ("batch_size", "seqlen_q", "num_heads_q", "num_heads_k", "topk")
        planned = ", ".join(f"{n}={v}" for n, v in zip(names, (*schedule.shape, schedule.topk)))
        given = ", ".join(f"{n}={v}" for n, v in zip(names, (b, s_q, h_q, 1, topk)))
        dense = " (topk=None: a dense call planned it)" if schedule.topk is None else ""
        raise ValueError(f"{fn}: tile_scheduler_metadata: expected the shapes the schedule was planned for on its "
                         f"first call ({planned}){dense}, got {given}; a schedule from get_mla_metadata() serves "
                         "one batch (one decoding step): take a new one")
    return schedule.tile_scheduler_metadata, schedule.num_splits


def _sparse_decode(fn: str, q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits,
                   softmax_scale, causal, is_fp8_kvcache, indices, attn_sink, topk_length, backend, descale_q,
                   descale_k) -> Tuple[torch.Tensor, torch.Tensor]:
    """flash_mla_with_kvcache(..., indices=...): every check first (arguments; values for CPU tensors or in debug
    mode), then the lazy schedule's plan, then the backend (flash_mla/backends.py, run_sparse_decode)."""
    compiling = _is_compiling()
    lazy = isinstance(tile_scheduler_metadata, MLASchedule)
    if lazy and num_splits is not None:
        raise TypeError(f"{fn}: num_splits: expected None with a schedule from get_mla_metadata(), got "
                        f"{type(num_splits).__name__}")
    _sparse_validation.check_sparse_decode_args(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                                None if lazy else tile_scheduler_metadata, num_splits, softmax_scale,
                                                causal, is_fp8_kvcache, indices, attn_sink, topk_length, descale_q,
                                                descale_k, pointers=not compiling, planned_here=lazy, fn=fn)
    if not compiling and _validation.bounds_checked(q.device):      # CPU tensors, or debug mode
        _sparse_validation.check_sparse_decode_values(k_cache, indices, topk_length, fn)
    if lazy:
        tile_scheduler_metadata, num_splits = _plan_sparse(fn, tile_scheduler_metadata, q, indices, topk_length)
    if compiling:
        return _ops.sparse_decode_for_compile(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                              tile_scheduler_metadata, num_splits, softmax_scale, causal,
                                              is_fp8_kvcache, indices, attn_sink, topk_length, backend, fn=fn)
    softmax_scale = DEFAULT_SOFTMAX_SCALE if softmax_scale is None else float(softmax_scale)
    return run_sparse_decode(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits, softmax_scale,
                             attn_sink, backend)
