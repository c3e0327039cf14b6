"""Sweep the Triton backend's tuning constants (flash_mla/triton_backend.py) on a GPU.

    python benchmarks/tune_triton.py [--mean 8192] [--rows 16x1 128x1] [--block-m 16 64] [--block-n 32 64]
                                     [--warps 4 8] [--stages 1 2 3]

For every (h_q x s_q) row kind and configuration: median time, GB/s, TFLOP/s and the split kernel's
registers / spills. Pick the winners and write them into the constants at the top of triton_backend.py.
"""
from __future__ import annotations

import argparse
import collections
import itertools

import torch

import flash_mla.triton_backend as tb
from flash_mla import get_mla_metadata
from flash_mla.testing import (HEAD_DIM_QK, HEAD_DIM_V, cuda_median_seconds, decode_flops_and_bytes,
                               make_decode_batch, random_seqlens)



def compiled_split_kernels() -> list:
    """Every compiled variant of the split kernel, oldest first (Triton 3.x cache layout)."""
    return [k for cache in tb._split_kv_kernel.device_caches.values() for k in cache[0].values()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--b", type=int, default=128)
    ap.add_argument("--mean", type=int, default=8192)
    ap.add_argument("--rows", nargs="+", default=["16x1", "128x1"], help="h_q x s_q row kinds")
    ap.add_argument("--block-m", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    args = ap.parse_args()

    print(f"device: {torch.cuda.get_device_name()}  triton {tb.triton.__version__}")
    resources = {}   # (BLOCK_M, BLOCK_N, warps, stages) -> "regs spills" of its compiled split kernel
    for kind in args.rows:
        h_q, s_q = (int(x) for x in kind.split("x"))
        g = torch.Generator().manual_seed(h_q * 10 + s_q)
        lengths = random_seqlens(args.b, args.mean, s_q, varlen=False, generator=g)
        batch = make_decode_batch(lengths, s_q=s_q, h_q=h_q, device="cuda", causal=True, generator=g)
        metadata, num_splits = get_mla_metadata(batch.cache_seqlens, s_q * h_q, 1)
        flops, nbytes = decode_flops_and_bytes(lengths, s_q, h_q, 1)
        print(f"\nh_q={h_q} s_q={s_q} b={args.b} L={args.mean}")
        print(f"{'BM':>3} {'BN':>3} {'warps':>5} {'stages':>6} {'ms':>8} {'GB/s':>7} {'TFLOP/s':>8}  regs spills")
        for bm, bn, warps, stages in itertools.product(args.block_m, args.block_n, args.warps, args.stages):
            if bm > max(16, s_q * h_q):
                continue
            tb.MIN_BLOCK_M = tb.MAX_BLOCK_M = bm
            tb.BLOCK_N = bn
            tb.SPLIT_NUM_WARPS = collections.defaultdict(lambda w=warps: w)
            tb.SPLIT_NUM_STAGES = stages

            def step(batch=batch, metadata=metadata, num_splits=num_splits):
                return tb.mla_decode_triton(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens,
                                            HEAD_DIM_V, metadata, num_splits, HEAD_DIM_QK ** -0.5, True)
            try:
                before = len(compiled_split_kernels())
                step()
                compiled = compiled_split_kernels()
                if len(compiled) > before:            # this configuration compiled a new variant: record it
                    resources[bm, bn, warps, stages] = f"{compiled[-1].n_regs:>4} {compiled[-1].n_spills:>6}"
                ms = cuda_median_seconds(step, reps=20) * 1e3
            except Exception as e:  # noqa: BLE001  (a configuration the compiler rejects: shared memory, ...)
                print(f"{bm:>3} {bn:>3} {warps:>5} {stages:>6}  failed: {type(e).__name__}: {str(e)[:80]}")
                continue
            print(f"{bm:>3} {bn:>3} {warps:>5} {stages:>6} {ms:>8.3f} {nbytes / ms / 1e6:>7.0f} "
                  f"{flops / ms / 1e9:>8.1f}  {resources.get((bm, bn, warps, stages), '?')}", flush=True)
        del batch


if __name__ == "__main__":
    main()
