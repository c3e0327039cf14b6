"""Speed of the Triton backend on SPEC.md's reference table (and the CUDA backend, when it is built).

    python benchmarks/bench_triton.py [--means 4096 8192] [--h-q 16 64 128] [--s-q 1 2] [--fixed]

Prints per row: time (median of CUDA-event timings), GB/s and TFLOP/s as SPEC.md defines them.
benchmarks/tune_triton.py sweeps the Triton kernel's tuning constants.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import flash_mla.triton_backend as tb
from flash_mla import flash_mla_with_kvcache, get_mla_metadata
from flash_mla.testing import HEAD_DIM_QK, HEAD_DIM_V, make_decode_batch, random_seqlens


def time_ms(fn, iters: int = 30, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=128)
    ap.add_argument("--means", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--h-q", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--s-q", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--fixed", action="store_true", help="all lengths equal the mean (default: variable)")
    ap.add_argument("--backends", nargs="+", default=["triton", "cuda"])
    args = ap.parse_args()

    dtype = torch.bfloat16
    backends = list(args.backends)
    print(f"device: {torch.cuda.get_device_name()}  triton {tb.triton.__version__}")
    print(f"{'backend':>7} {'mean':>6} {'h_q':>4} {'s_q':>3} {'ms':>8} {'GB/s':>7} {'TFLOP/s':>8}")
    for mean in args.means:
        for h_q in args.h_q:
            for s_q in args.s_q:
                g = torch.Generator().manual_seed(mean + h_q + s_q)
                lengths = random_seqlens(args.b, mean, s_q, varlen=not args.fixed, generator=g)
                batch = make_decode_batch(lengths, s_q=s_q, h_q=h_q, dtype=dtype, device="cuda", causal=True,
                                          generator=g, shuffle_pages=True)
                metadata, num_splits = get_mla_metadata(batch.cache_seqlens, s_q * h_q, 1)
                total = sum(lengths)
                flops = 2 * s_q * total * h_q * (HEAD_DIM_QK + HEAD_DIM_V)
                nbytes = 2 * (total * HEAD_DIM_QK + args.b * s_q * h_q * HEAD_DIM_QK + args.b * s_q * h_q * HEAD_DIM_V)
                for backend in list(backends):
                    def step():
                        return flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table,
                                                      batch.cache_seqlens, HEAD_DIM_V, metadata, num_splits,
                                                      causal=True, backend=backend)
                    try:
                        ms = time_ms(step)
                    except RuntimeError as e:   # backend unavailable here: say so once, then leave it out
                        print(f"{backend:>7} skipped: {e}")
                        backends.remove(backend)
                        continue
                    print(f"{backend:>7} {mean:>6} {h_q:>4} {s_q:>3} {ms:>8.3f} {nbytes / ms / 1e6:>7.0f} "
                          f"{flops / ms / 1e9:>8.1f}", flush=True)
                del batch


if __name__ == "__main__":
    main()
