"""Backend selection, in one place.

Backends:
  "cuda"   - the compiled extension (flash_mla._cuda): WGMMA kernels for Hopper (sm_90a).
  "triton" - the portable Triton kernels (flash_mla.triton_backend): any CUDA GPU Triton supports.
  "cpu"    - the split-KV algorithm in PyTorch on the CPU (flash_mla.cpu_backend): tests and debugging.

Automatic choice by the device of q: CPU tensors -> "cpu"; CUDA tensors -> "cuda" on compute capability 9.0
when the extension is built, else "triton". A backend can be forced with the `backend=` keyword or the
FLASH_MLA_BACKEND environment variable (the keyword wins); forcing one that cannot run raises RuntimeError.
"triton" with CPU tensors runs the kernels in Triton's interpreter when TRITON_INTERPRET=1 was set before triton
was imported (slow; for debugging the kernels on a machine without a GPU).

FP8 KV caches (k_cache float8_e4m3fn, flash_mla/fp8.py) follow the same rule: "cuda" runs them on Hopper (with an
fp8 q, S on the fp8 tensor cores and V widened to fp16 in shared memory; with a 16-bit q the whole page widened),
"triton" elsewhere (it loads the fp8 cache directly and needs
compute capability 8.9+), "cpu" dequantises and computes. `_unavailable_reason(..., fp8=True)` says why a backend
cannot take them.

Sparse FP8 decoding (flash_mla_with_kvcache(..., indices=...), flash_mla/sparse_fp8.py layout) has its own entry,
`run_sparse_decode`: CPU tensors -> "cpu" (or "triton" in the interpreter when forced); CUDA tensors -> "cuda"
(csrc/kernels/sparse_gather.h) on Hopper for a bf16 q with h_q a multiple of 64, else "triton"
(flash_mla.triton_sparse, which also takes fp16 q and any h_q).
"""
from __future__ import annotations

import functools
import importlib
import os
from typing import Optional

import torch

from . import _sparse_validation, _validation
from .fp8 import FP8_DTYPE
from .scheduler import get_mla_metadata_twin, num_sm_parts_for

BACKENDS = ("cuda", "triton", "cpu")
ENV_VAR = "FLASH_MLA_BACKEND"
DEFAULT_CPU_NUM_SMS = 132   # the H100 SXM's multiprocessors: the CPU path then cuts work like the GPU does


@functools.cache
def _import(module: str):
    """(module, None) or (None, reason it failed to import)."""
    try:
        return importlib.import_module(module), None
    except ImportError as e:  # not built / not installed
        return None, str(e)


def _build_note() -> Optional[str]:
    """What setup.py recorded when it skipped the CUDA build, if it did."""
    try:
        with open(os.path.join(os.path.dirname(__file__), "_build_note.txt")) as f:
            return f.read().strip()
    except OSError:
        return None


def cuda_extension():
    """The compiled extension module, or None when the package was installed without it."""
    return _import("flash_mla._cuda")[0]


def triton_interpret_requested() -> bool:
    """TRITON_INTERPRET set to a value Triton reads as true (1, true, on, yes, y)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes", "y")


def _unavailable_reason(backend: str, device: torch.device, fp8: bool = False) -> Optional[str]:
    """Why `backend` cannot run on tensors of `device`, or None if it can. `fp8`: the call has an fp8 KV cache."""
    if backend == "cpu":
        return None if device.type == "cpu" else f"the cpu backend needs CPU tensors, q is on {device}"
    if backend == "triton" and device.type == "cpu":
        # Triton's interpreter runs the kernels on CPU tensors (debugging). Without TRITON_INTERPRET, triton is not
        # imported here at all: importing it compiled would keep a later TRITON_INTERPRET=1 from taking effect.
        if not triton_interpret_requested():
            return (f"the triton backend needs CUDA tensors, q is on {device} (to run its kernels on CPU tensors in "
                    "Triton's interpreter, set TRITON_INTERPRET=1 before triton is first imported)")
    elif device.type != "cuda":
        return f"the {backend} backend needs CUDA tensors, q is on {device}"
    if backend == "cuda":
        ext, why = _import("flash_mla._cuda")
        if ext is None:
            note = _build_note()
            return (f"the CUDA extension flash_mla._cuda is not available ({note or why}); "
                    "reinstall with nvcc and a CUDA build of PyTorch: pip install --no-build-isolation -e .")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) != (9, 0):
            return (f"the cuda backend needs a Hopper GPU (sm_90), {torch.cuda.get_device_name(device)} is "
                    f"sm_{major}{minor}")
        return None
    module, why = _import("flash_mla.triton_backend")
    if module is None:
        return f"the triton backend could not be imported ({why})"
    return module.unavailable_reason(device, fp8)


def select_backend(device: torch.device, requested: Optional[str] = None, fp8: bool = False) -> str:
    """Name of the backend that runs a call on `device` (see module docstring); `fp8`: an fp8 KV cache."""
    if requested is None:
        requested = os.environ.get(ENV_VAR) or None
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(f"flash_mla: backend: expected one of {BACKENDS} (keyword or ${ENV_VAR}), "
                             f"got {requested!r}")
        reason = _unavailable_reason(requested, device, fp8)
        if reason is not None:
            raise RuntimeError(f"flash_mla: backend {requested!r} was requested but is unavailable: {reason}")
        return requested
    if device.type == "cpu":
        return "cpu"
    if device.type == "cuda":
        for candidate in ("cuda", "triton"):
            if _unavailable_reason(candidate, device, fp8) is None:
                return candidate
        what = "an fp8 KV cache" if fp8 else "tensors"
        raise RuntimeError(f"flash_mla: no backend can run {what} on {device}: "
                           f"cuda: {_unavailable_reason('cuda', device, fp8)}; "
                           f"triton: {_unavailable_reason('triton', device, fp8)}")
    raise RuntimeError(f"flash_mla: no backend for tensors on {device}; supported: CUDA GPUs and the CPU")


# ---- running a call (arguments already validated); shared by the eager API and the torch.library ops ---------

@functools.cache
def default_num_sms(device: torch.device) -> int:
    """Multiprocessors get_mla_metadata plans for by default: the GPU's count, or 132 (an H100) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_CPU_NUM_SMS


def run_metadata(cache_seqlens: torch.Tensor, num_heads_per_head_k: int, num_heads_k: int,
                 num_sms: int, min_payload: int = 0, tight_payload: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheduler: the device kernel for CUDA tensors when the extension is built, else the Python twin.
    min_payload, tight_payload: the payload's floor and rule (0 and False for dense plans, _geometry.SPARSE_PLAN for
    sparse ones; scheduler.schedule)."""
    if _validation.debug_enabled():
        _validation.check_metadata_values(cache_seqlens)
    ext = cuda_extension()
    if cache_seqlens.is_cuda and ext is not None:
        if num_sm_parts_for(num_sms, num_heads_per_head_k, num_heads_k) > _validation.MAX_SM_PARTS:
            _validation._Checker("get_mla_metadata").fail(
                ValueError, "num_sms", f"at most {_validation.MAX_SM_PARTS} SM parts on the GPU (num_sms // "
                "num_heads_k // ceil(num_heads_per_head_k / 64))", num_sms)
        return ext.get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms, min_payload,
                                    tight_payload)
    if cache_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        # the twin reads the lengths on the host: a copy that capture forbids (CUDA's own error would not say why)
        raise RuntimeError("get_mla_metadata: cannot plan while a CUDA graph is being captured without the CUDA "
                           "extension (the Python scheduler reads cache_seqlens on the host); build the extension, "
                           "which plans on the device, or plan before the capture: the classic form "
                           "get_mla_metadata(cache_seqlens, ...), or a schedule's first call outside the graph")
    return get_mla_metadata_twin(cache_seqlens, num_heads_per_head_k, num_heads_k, num_sms, min_payload,
                                 tight_payload)


def run_decode(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
               head_dim_v: int, tile_scheduler_metadata: torch.Tensor, num_splits: torch.Tensor,
               softmax_scale: float, causal: bool, backend: str | None,
               attn_sink: torch.Tensor | None = None, descale_q: torch.Tensor | None = None,
               descale_k: torch.Tensor | None = None,
               fn: str = "flash_mla_with_kvcache") -> tuple[torch.Tensor, torch.Tensor]:
    """Decode on the selected backend (see `select_backend`), after the value checks: the cache bounds on every
    call with CPU tensors (whatever the backend), everything `check_decode_values` checks with FLASH_MLA_DEBUG=1
    (on any device). descale_q / descale_k: the FP8 scales (k_cache float8_e4m3fn), else None. `fn`: the public
    function named in messages."""
    if _validation.debug_enabled():
        _validation.check_decode_values(q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
                                        descale_q, descale_k, fn=fn)
    elif q.device.type == "cpu":
        _validation.check_cache_bounds(k_cache, block_table, cache_seqlens, fn)
    fp8 = k_cache.dtype == FP8_DTYPE
    name = select_backend(q.device, backend, fp8)
    if name == "cuda":
        # optional tensors only when given: an extension built before them still runs every call without them
        extra = (attn_sink, descale_q, descale_k) if fp8 else () if attn_sink is None else (attn_sink,)
        return cuda_extension().mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v,
                                           tile_scheduler_metadata, num_splits, softmax_scale, causal, *extra)
    if name == "triton":
        from .triton_backend import mla_decode_triton
        return mla_decode_triton(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                                 num_splits, softmax_scale, causal, attn_sink, descale_q, descale_k)
    from .cpu_backend import mla_decode_cpu
    return mla_decode_cpu(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata,
                          num_splits, softmax_scale, causal, attn_sink, descale_q, descale_k)


# ---- sparse FP8 decoding ---------------------------------------------------------------------------------------

def _sparse_cuda_reason(device: torch.device, q_dtype: Optional[torch.dtype], h_q: Optional[int]) -> Optional[str]:
    """Why the CUDA sparse kernel cannot take a call (None: it can). It needs what "cuda" needs (Hopper, the
    extension), a bf16 q and h_q a multiple of 64 (a 64-row tile holds heads of one query token)."""
    reason = _unavailable_reason("cuda", device, fp8=True)
    if reason is not None:
        return reason
    if q_dtype is not None and q_dtype != torch.bfloat16:
        return f"the cuda sparse kernel needs a bfloat16 q, got {q_dtype} (the triton backend takes float16)"
    if h_q is not None and h_q % 64 != 0:
        return f"the cuda sparse kernel needs num_heads_q a multiple of 64, got {h_q} (the triton backend takes any)"
    return None


def select_sparse_backend(device: torch.device, requested: Optional[str] = None,
                          q_dtype: Optional[torch.dtype] = None, h_q: Optional[int] = None) -> str:
    """The backend of a sparse FP8 call on `device` (requested: the keyword, else $FLASH_MLA_BACKEND): "cpu" for
    CPU tensors; for CUDA ones "cuda" when its kernel takes the call (Hopper, bf16 q, h_q a multiple of 64), else
    "triton" (and "triton" for CPU tensors in Triton's interpreter when forced). RuntimeError when the requested
    (or only) candidate cannot run, saying why."""
    if requested is None:
        requested = os.environ.get(ENV_VAR) or None
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"flash_mla: backend: expected one of {BACKENDS} (keyword or ${ENV_VAR}), got {requested!r}")
    if requested is None:
        if device.type == "cpu":
            return "cpu"
        if device.type != "cuda":
            raise RuntimeError(f"flash_mla: no backend for tensors on {device}; supported: CUDA GPUs and the CPU")
    if requested in (None, "cuda"):
        cuda_reason = _sparse_cuda_reason(device, q_dtype, h_q)
        if requested == "cuda" and cuda_reason is not None:
            raise RuntimeError(f"flash_mla: backend 'cuda' was requested but is unavailable: {cuda_reason}")
        if cuda_reason is None:
            return "cuda"
    name = requested or "triton"
    reason = _unavailable_reason(name, device, fp8=True)
    if reason is None and name == "triton":
        module, why = _import("flash_mla.triton_sparse")
        if module is None:
            reason = f"the Triton sparse kernel (flash_mla.triton_sparse) could not be imported ({why})"
        elif hasattr(module, "unavailable_reason"):
            reason = module.unavailable_reason(device)
    if reason is not None:
        if requested is not None:
            raise RuntimeError(f"flash_mla: backend {requested!r} was requested but is unavailable: {reason}")
        raise RuntimeError(f"flash_mla: no backend can run sparse FP8 decoding on {device}: cuda: {cuda_reason}; "
                           f"triton: {reason}")
    return name


def run_sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                      topk_length: torch.Tensor | None, tile_scheduler_metadata: torch.Tensor,
                      num_splits: torch.Tensor, softmax_scale: float, attn_sink: torch.Tensor | None,
                      backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse FP8 decoding on the selected backend (`select_sparse_backend`); arguments already validated (and
    their values, where the caller checks them: CPU tensors, or FLASH_MLA_DEBUG=1). In debug mode the plan is
    checked against the rows' lengths first. Both backends take the same arguments: flash_mla/cpu_sparse.py says
    what they mean."""
    if _validation.debug_enabled():
        _sparse_validation.check_sparse_plan_values(indices, topk_length, tile_scheduler_metadata, num_splits)
    name = select_sparse_backend(q.device, backend, q.dtype, q.shape[2])
    if name == "cuda":
        return cuda_extension().sparse_decode(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits,
                                              softmax_scale, attn_sink)
    if name == "triton":
        from .triton_sparse import sparse_decode_triton
        return sparse_decode_triton(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits,
                                    softmax_scale, attn_sink)
    from .cpu_sparse import sparse_decode_cpu
    return sparse_decode_cpu(q, k_cache, indices, topk_length, tile_scheduler_metadata, num_splits, softmax_scale,
                             attn_sink)
