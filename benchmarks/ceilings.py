"""The two hardware ceilings every kernel figure is compared with, measured on the current GPU:
device-to-device copy bandwidth (bytes read + written) and bf16 8192^3 matmul throughput (random data).

    python benchmarks/ceilings.py
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from flash_mla.testing import cuda_median_seconds


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_median_seconds(lambda: dst.copy_(src), reps=20, calls_per_rep=1)
    return 2 * nbytes / t / 1e9


def matmul_tflops(n: int = 8192) -> float:
    """TFLOP/s of a bf16 n x n x n matmul on random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    t = cuda_median_seconds(lambda: a @ b, reps=20, calls_per_rep=1)
    return 2 * n ** 3 / t / 1e12


def measure() -> dict:
    return {"copy_GBps": copy_bandwidth(), "matmul_TFLOPs": matmul_tflops()}


if __name__ == "__main__":
    c = measure()
    print(f"{torch.cuda.get_device_name()}: copy {c['copy_GBps']:.0f} GB/s (read + write), "
          f"bf16 8192^3 matmul {c['matmul_TFLOPs']:.0f} TFLOP/s (medians of 20)")
