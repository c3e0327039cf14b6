"""Timing for benchmarks/bench_flash_mla.py: the hardware ceilings every figure is compared with, how many
repetitions fit a row's budget, the timed calls themselves, and how many input copies keep them out of L2."""
from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from flash_mla.testing import cpu_median_seconds, cuda_median_seconds

ROTATE_MIN_BYTES = 256 << 20      # cycle input copies until one pass over them is at least this (and 4 L2s)

Runner = Callable[[int], tuple[torch.Tensor, torch.Tensor]]   # runner(i) runs on input copy i


# --------------------------------------------------------------------------------------------------------------
# ceilings
# --------------------------------------------------------------------------------------------------------------

def measure_ceilings(device: torch.device, smoke: bool) -> dict[str, float]:
    if device.type == "cuda":
        from ceilings import copy_bandwidth, matmul_tflops
        c = {"copy_GBps": copy_bandwidth(), "matmul_TFLOPs": matmul_tflops(),
             "what": "copy 2 GiB fp32 d2d, bf16 8192^3 matmul, medians of 20"}
        torch.cuda.empty_cache()
        return c
    nbytes, n = (16 << 20, 256) if smoke else (256 << 20, 2048)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    t_copy = cpu_median_seconds(lambda: dst.copy_(src), reps=5)
    a = torch.randn(n, n, dtype=torch.bfloat16)
    bm = torch.randn(n, n, dtype=torch.bfloat16)
    t_mm = cpu_median_seconds(lambda: a @ bm, reps=3)
    return {"copy_GBps": 2 * nbytes / t_copy / 1e9, "matmul_TFLOPs": 2 * n ** 3 / t_mm / 1e12,
            "what": f"CPU stand-ins: copy {nbytes >> 20} MiB fp32, bf16 {n}^3 matmul"}


# --------------------------------------------------------------------------------------------------------------
# timed calls
# --------------------------------------------------------------------------------------------------------------

def choose_reps(t_one: float, budget_s: float, reps: int = 15, calls: int = 10) -> tuple[int, int]:
    """(reps, calls_per_rep): the test suite's 15 x 10 when that fits `budget_s`, else fewer calls, then fewer reps
    (at least 5 x 1)."""
    if reps * calls * t_one > budget_s:
        calls = max(1, min(calls, int(budget_s / (reps * t_one))))
    if reps * calls * t_one > budget_s:
        reps = max(5, int(budget_s / (calls * t_one)))
    return reps, calls


def time_runner(runner: Runner, n_copies: int, device: torch.device, budget_s: float) -> tuple[float, int, int]:
    """(median seconds per call, reps, calls_per_rep), cycling over the input copies."""
    counter = itertools.count()

    def fn():
        return runner(next(counter) % n_copies)
    if device.type == "cuda":
        t_one = cuda_median_seconds(fn, reps=3, calls_per_rep=1, warmup=1)
        reps, calls = choose_reps(t_one, budget_s)
        return cuda_median_seconds(fn, reps=reps, calls_per_rep=calls, warmup=2), reps, calls
    t_one = cpu_median_seconds(fn, reps=1, warmup=0)
    reps = max(1, min(5, int(budget_s / t_one)))
    if reps < 3:   # slow (CPU smoke runs): the one call already made is the measurement
        return t_one, 1, 1
    return cpu_median_seconds(fn, reps=reps, warmup=0), reps, 1


def rotation_copies(nbytes: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
    want = max(ROTATE_MIN_BYTES, 4 * l2)
    return 1 if nbytes >= want else min(16, -(-want // nbytes))
