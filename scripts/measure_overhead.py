"""Host-side overhead of one flash_mla_with_kvcache / get_mla_metadata call: validation + dispatch only.

The CPU backend's compute (and the scheduler twin) are replaced by stubs that return preallocated tensors, so the
figure is what the Python wrapper costs per call (on the GPU the same code runs before the kernel launch).

    python scripts/measure_overhead.py [--calls 20000] [--debug]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

# this checkout's flash_mla when the package is not installed (the script's own directory is scripts/)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def per_call_us(fn, calls: int, reps: int = 7) -> float:
    from flash_mla.testing import cpu_median_seconds

    return cpu_median_seconds(fn, reps=reps, calls_per_rep=calls, warmup=calls // 10) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--debug", action="store_true", help="also time with FLASH_MLA_DEBUG=1")
    args = parser.parse_args()
    import flash_mla
    import flash_mla.backends
    import flash_mla.cpu_backend
    import flash_mla.scheduler
    from flash_mla import interface

    os.environ.pop("FLASH_MLA_BACKEND", None)
    os.environ.pop("FLASH_MLA_DEBUG", None)
    torch.set_num_threads(1)

    b, s_q, h_q, h_kv, pages = 128, 1, 128, 1, 64
    q = torch.zeros(b, s_q, h_q, 576, dtype=torch.bfloat16)
    k_cache = torch.zeros(b * pages, 64, h_kv, 576, dtype=torch.bfloat16)
    block_table = torch.arange(b * pages, dtype=torch.int32).view(b, pages)
    seqlens = torch.full((b,), pages * 64, dtype=torch.int32)
    md, ns = flash_mla.get_mla_metadata(seqlens, s_q * h_q // h_kv, h_kv)
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.bfloat16)
    lse = torch.zeros(b, h_q, s_q)

    # stubs: no compute, just the outputs
    flash_mla.cpu_backend.mla_decode_cpu = lambda *a, **k: (out, lse)
    flash_mla.scheduler.get_mla_metadata_twin = lambda *a, **k: (md, ns)
    for module in (interface, flash_mla.backends):   # wherever the API looks the twin up
        if hasattr(module, "get_mla_metadata_twin"):
            module.get_mla_metadata_twin = flash_mla.scheduler.get_mla_metadata_twin

    def decode():
        return flash_mla.flash_mla_with_kvcache(q, k_cache, block_table, seqlens, 512, md, ns, causal=True)

    def metadata():
        return flash_mla.get_mla_metadata(seqlens, s_q * h_q // h_kv, h_kv)

    print(f"torch {torch.__version__}; b={b} s_q={s_q} h_q={h_q}; stubs replace the compute")
    print(f"flash_mla_with_kvcache: {per_call_us(decode, args.calls):.2f} us/call (validation + dispatch)")
    print(f"get_mla_metadata:       {per_call_us(metadata, args.calls):.2f} us/call (validation + dispatch)")
    if args.debug:
        os.environ["FLASH_MLA_DEBUG"] = "1"
        print(f"flash_mla_with_kvcache, FLASH_MLA_DEBUG=1: {per_call_us(decode, max(args.calls // 100, 10)):.1f} "
              "us/call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
