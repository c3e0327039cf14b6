"""FP8 KV cache conventions, in one place: the storage dtype, the scale convention and the quantisation helpers.

Layout: k_cache is float8_e4m3fn (num_blocks, 64, h_kv, 576), one byte per element, latent and RoPE columns alike
(576 bytes per token per KV head); V is its first 512 columns, as for a bf16 cache. q is float8_e4m3fn
(b, s_q, h_q, 576) with a descale_q, or bf16 / fp16 (then unscaled, and only descale_k is given).

Scales: per tensor. descale_q and descale_k are float32 tensors of shape (1,) on q's device, and
``true value = stored value * descale``. They stay on the device (the kernels read them; nothing synchronises with
the host), so a CUDA graph replays with new scales written into the same tensors.

Output: bf16 for an fp8 q (fp16 q gives fp16, bf16 q gives bf16); lse float32, as for half-precision caches.
"""
from __future__ import annotations

from typing import Tuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                          # the largest finite float8_e4m3fn value (1.75 * 2^8)
# The smallest descale the helpers return: float32's smallest normal number. An all-zero tensor (amax 0) gets it,
# so x / descale never divides by zero, and every finite input still maps into [-448, 448].
MIN_DESCALE = torch.finfo(torch.float32).tiny
QUANTIZABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def decode_out_dtype(q_dtype: torch.dtype) -> torch.dtype:
    """The dtype of `out` for a q of this dtype: bf16 for an fp8 q, else q's own (bf16 or fp16)."""
    return torch.bfloat16 if q_dtype == FP8_DTYPE else q_dtype


def _quantize_per_tensor(x: torch.Tensor, fn: str, arg: str) -> Tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {arg}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in QUANTIZABLE_DTYPES:
        names = " or ".join(str(d) for d in QUANTIZABLE_DTYPES)
        raise TypeError(f"{fn}: {arg}: expected dtype {names}, got {x.dtype}")
    finite_abs = torch.where(torch.isfinite(x), x.abs(), 0)
    amax = finite_abs.amax().float() if x.numel() else torch.zeros((), device=x.device)
    descale = (amax / FP8_MAX).clamp_min(MIN_DESCALE).reshape(1)
    # x (half or float) / descale (float32, 1-D) is computed in float32; clamp saturates +-inf (NaN stays NaN),
    # and the cast rounds to the nearest float8_e4m3fn value (ties to even)
    stored = (x / descale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return stored, descale


def quantize_kv_cache_fp8(k_cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise a KV cache to float8_e4m3fn with one per-tensor scale.

    ``descale = max(amax / 448, MIN_DESCALE)`` with ``amax`` the largest |x| over the tensor's finite values, and
    ``stored = round_to_nearest_even(clamp(x / descale, -448, 448))`` in float8_e4m3fn, so that
    ``stored * descale`` approximates x (relative error <= 2^-4 for values above 2^-6 * descale) and the largest
    finite |x| maps to 448.

    Args:
        k_cache: a bf16, fp16 or float32 tensor of any shape, normally the (num_blocks, 64, num_heads_k, 576) pool
            (the scale covers every element, unused blocks included).

    Returns:
        (k_fp8, descale): k_fp8 float8_e4m3fn of k_cache's shape and device; descale float32 of shape (1,) on that
        device, the ``descale_k`` to pass to flash_mla_with_kvcache_fp8.

    Edge cases: an all-zero (or empty) tensor gets descale = MIN_DESCALE (float32's smallest normal number, never 0)
    and stores zeros. Non-finite values do not enter amax: NaN is stored as NaN (the slots past a sequence's end
    may hold anything; the kernels never read them) and +-inf saturate to +-448 (i.e. +-amax after dequantising).
    Runs on k_cache's device without a host synchronisation (it can be captured in a CUDA graph).
    """
    return _quantize_per_tensor(k_cache, "quantize_kv_cache_fp8", "k_cache")


def quantize_q_fp8(q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantise queries to float8_e4m3fn with one per-tensor scale, exactly as quantize_kv_cache_fp8 does.

    Args:
        q: a bf16, fp16 or float32 tensor, normally (batch_size, seqlen_q, num_heads_q, 576).

    Returns:
        (q_fp8, descale): float8_e4m3fn of q's shape and float32 (1,), the ``descale_q`` for
        flash_mla_with_kvcache_fp8. descale = max(amax / 448, MIN_DESCALE) over the finite values;
        stored = clamp(q / descale, -448, 448) rounded to nearest even; NaN stays NaN, +-inf saturate to +-448,
        all-zero input gives zeros and descale = MIN_DESCALE. No host synchronisation.
    """
    return _quantize_per_tensor(q, "quantize_q_fp8", "q")
