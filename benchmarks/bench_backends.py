"""The SPEC reference sweep for each GPU backend side by side (b = 128, causal, h_kv = 1, bf16).

    python benchmarks/bench_backends.py [--backends cuda,triton] [--quick] [--csv out.csv]

One row per (config, backend): median µs per call (10 calls back to back per timed rep, 15 reps), TFLOP/s,
GB/s, and the triton/cuda ratio of the row's figure of merit (GB/s when h_q * s_q <= 64, else TFLOP/s).
Each backend's result is checked against the CUDA backend (or the reference) before it is timed.
"""
import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import flash_mla
from flash_mla.testing import (assert_close, compare, decode_flops_and_bytes, make_decode_batch,
                               random_seqlens)
from test_flash_mla import reference_sweep, time_decode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="cuda,triton")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    backends = args.backends.split(",")
    print(f"device: {torch.cuda.get_device_name()}  bf16 causal h_kv=1 b=128; median of 15 reps x 10 calls")
    print(f"{'mean':>6} {'h_q':>4} {'s_q':>3} {'varlen':>6} {'backend':>7} {'time_us':>9} {'TFLOP/s':>8} "
          f"{'GB/s':>7} {'vs cuda':>8}")
    rows = []
    for i, row in enumerate(reference_sweep(args.quick)):
        seqlens = random_seqlens(row["b"], row["mean"], row["s_q"], row["varlen"],
                                 generator=torch.Generator().manual_seed(i))
        batch = make_decode_batch(seqlens, s_q=row["s_q"], h_q=row["h_q"], device="cuda", causal=True,
                                  generator=torch.Generator().manual_seed(i))
        md, ns = flash_mla.get_mla_metadata(batch.cache_seqlens, row["s_q"] * row["h_q"], 1)
        flops, nbytes = decode_flops_and_bytes(seqlens, row["s_q"], row["h_q"], 1)
        memory_bound = row["h_q"] * row["s_q"] <= 64
        base, first = None, None
        for backend in backends:
            out, lse = flash_mla.flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens,
                                                        512, md, ns, causal=True, backend=backend)
            if first is None:
                first = (out.float(), lse)
            else:
                assert_close(compare(out, lse, *first), torch.bfloat16, f"{backend} vs {backends[0]}")
            t = time_decode(batch, md, ns, backend=backend)
            merit = nbytes / t / 1e9 if memory_bound else flops / t / 1e12
            base = merit if base is None else base
            rows.append(dict(row, backend=backend, time_us=t * 1e6, tflops=flops / t / 1e12, gbps=nbytes / t / 1e9,
                             ratio=merit / base))
            r = rows[-1]
            print(f"{row['mean']:>6} {row['h_q']:>4} {row['s_q']:>3} {row['varlen']!s:>6} {backend:>7} "
                  f"{r['time_us']:>9.1f} {r['tflops']:>8.1f} {r['gbps']:>7.0f} {r['ratio']:>8.2f}", flush=True)
        del batch
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
