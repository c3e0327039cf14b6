"""The two hardware ceilings every kernel figure is compared with, measured on the current GPU:
device-to-device copy bandwidth (bytes read + written) and bf16 8192^3 matmul throughput (random data).

    python benchmarks/ceilings.py
"""
from __future__ import annotations

import statistics

import torch


def median_time(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() over `reps` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src))
    return 2 * nbytes / t / 1e9


def matmul_tflops(n: int = 8192) -> float:
    """TFLOP/s of a bf16 n x n x n matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = median_time(lambda: a @ b)
    return 2 * n ** 3 / t / 1e12


def measure() -> dict:
    return {"copy_GBps": copy_bandwidth(), "matmul_TFLOPs": matmul_tflops()}


if __name__ == "__main__":
    c = measure()
    print(f"{torch.cuda.get_device_name()}: copy {c['copy_GBps']:.0f} GB/s (read + write), "
          f"bf16 8192^3 matmul {c['matmul_TFLOPs']:.0f} TFLOP/s (medians of 20)")
