"""python -m flash_mla: run one realistic decoding step end to end and check it.

Builds a paged-KV decoding batch, plans it with get_mla_metadata, runs flash_mla_with_kvcache on the best
available backend (or the one asked for), compares the result with the float32 reference and times the decode
call (metadata outside). Exit status: 0 when the result matches the reference, 1 when it does not, 2 when the
requested device or backend cannot run.

Defaults: on CUDA upstream FlashMLA's benchmark shape (b = 128, lengths ~ N(4096, 2048), h_q = 128, s_q = 1,
causal); on the CPU a small batch (b = 4, lengths ~ N(512, 256), h_q = 16, s_q = 2) that finishes in seconds.
"""
from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from typing import List, Optional

import torch

from . import __version__
from ._geometry import HEAD_DIM_V
from .backends import BACKENDS, select_backend
from .backends import _unavailable_reason as unavailable_reason
from .interface import flash_mla_with_kvcache, get_mla_metadata
from .testing import (COS_TOLERANCE, TOLERANCE, compare, cuda_median_seconds, decode_flops_and_bytes,
                      make_decode_batch, random_seqlens, reference_for)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULTS = {  # per device: batch, mean length, h_q, s_q, timed runs
    "cuda": dict(batch=128, seqlen=4096, heads=128, seqlen_q=1, runs=20),
    "cpu": dict(batch=4, seqlen=512, heads=16, seqlen_q=2, runs=3),
}


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flash_mla", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the tensors live (default: cuda if available, cpu when --backend cpu)")
    p.add_argument("--backend", choices=BACKENDS, default=None,
                   help="force a backend (default: $FLASH_MLA_BACKEND, else the best for the device)")
    p.add_argument("--batch", type=int, default=None, help="batch size b (default: 128 on cuda, 4 on cpu)")
    p.add_argument("--seqlen", type=int, default=None, help="mean cache length (default: 4096 on cuda, 512 on cpu)")
    p.add_argument("--fixed", action="store_true",
                   help="every sequence exactly --seqlen long (default: lengths ~ N(mean, mean/2), at least s_q)")
    p.add_argument("--heads", type=int, default=None, help="query heads h_q (default: 128 on cuda, 16 on cpu)")
    p.add_argument("--kv-heads", type=int, default=1, help="KV heads h_kv (default: 1)")
    p.add_argument("--seqlen-q", type=int, default=None,
                   help="query tokens per sequence s_q (default: 1 on cuda, 2 on cpu)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="dtype of q and k_cache (default: bf16)")
    p.add_argument("--no-causal", dest="causal", action="store_false", help="every query token sees all keys")
    p.add_argument("--runs", type=int, default=None, help="timed runs (default: 20 on cuda, 3 on cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths and data (default: 0)")
    args = p.parse_args(argv)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and args.backend != "cpu" else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.exit(2, "error: --device cuda: no CUDA device is available (torch.cuda.is_available() is False)\n")
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("batch", "seqlen", "heads", "kv_heads", "seqlen_q", "runs"):
        if getattr(args, key) < (0 if key == "seqlen" else 1):
            p.error(f"--{key.replace('_', '-')}: must be positive, got {getattr(args, key)}")
    if args.heads % args.kv_heads:
        p.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    return args


def time_decode(fn, device: torch.device, runs: int) -> float:
    """Median seconds per fn() call: CUDA events around back-to-back calls, or perf_counter on the CPU."""
    if device.type == "cuda":
        return cuda_median_seconds(fn, reps=runs)
    fn()                                                  # warm-up: allocator, caches
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    try:
        backend = select_backend(device, args.backend)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    gen = torch.Generator().manual_seed(args.seed)
    seqlens = random_seqlens(args.batch, args.seqlen, args.seqlen_q, varlen=not args.fixed, generator=gen)
    batch = make_decode_batch(seqlens, s_q=args.seqlen_q, h_q=args.heads, h_kv=args.kv_heads, dtype=dtype,
                              device=device, causal=args.causal, generator=gen)
    rows = args.seqlen_q * args.heads // args.kv_heads
    metadata, num_splits = get_mla_metadata(batch.cache_seqlens, rows, args.kv_heads)

    def decode():
        return flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V,
                                      metadata, num_splits, causal=args.causal, backend=backend)

    out, lse = decode()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if device.type == "cuda" and "on_device" in inspect.signature(reference_for).parameters:
        ref_out, ref_lse = reference_for(batch, on_device=True)
    else:
        ref_out, ref_lse = reference_for(batch)
    m = compare(out, lse, ref_out, ref_lse)
    tol = TOLERANCE[dtype]
    failures = [name for name, bad in (
        ("NaN in output", m["nan"] > 0),
        ("lse -inf pattern", m["inf_mismatch"] > 0),
        ("out error", not m["out_rel_l2"] < tol),
        ("lse error", not m["lse_rel_l2"] < tol),
        ("cosine", not m["cos_diff"] < COS_TOLERANCE),
    ) if bad]

    seconds = time_decode(decode, device, args.runs)

    total = sum(seqlens)
    b, s_q, h_q, h_kv = args.batch, args.seqlen_q, args.heads, args.kv_heads
    flops, nbytes = decode_flops_and_bytes(seqlens, s_q, h_q, h_kv)
    pieces = (num_splits[1:] - num_splits[:-1]).cpu()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    print(f"flash_mla {__version__}  backend: {backend}  device: {where}  (torch {torch.__version__})")
    if backend != "cuda":
        try:
            why = unavailable_reason("cuda", torch.device("cuda"))
        except (RuntimeError, AssertionError) as e:   # no CUDA driver / device at all
            why = str(e)
        if why:
            print(f"note      cuda backend unavailable: {why}")
    print(f"shapes    q {tuple(batch.q.shape)}  k_cache {tuple(batch.k_cache.shape)}  "
          f"out {tuple(out.shape)}  {args.dtype}  {'causal' if args.causal else 'non-causal'}")
    print(f"lengths   b={b} {'fixed' if args.fixed else 'varlen'} mean {total / b:.0f}  "
          f"min {min(seqlens)}  max {max(seqlens)}")
    print(f"plan      {metadata.shape[0]} SM parts, {int(num_splits[-1])} pieces, "
          f"{int((pieces > 1).sum())} of {b} sequences split")
    print(f"errors    out rel L2 {m['out_rel_l2']:.2e}  lse rel L2 {m['lse_rel_l2']:.2e}  "
          f"cos diff {m['cos_diff']:.2e}  NaN {m['nan']}  lse -inf mismatches {m['inf_mismatch']}  (tol {tol:g})")
    print(f"time      median {seconds * 1e3:.3f} ms over {args.runs} runs  "
          f"{flops / seconds / 1e12:.2f} TFLOP/s  {nbytes / seconds / 1e9:.1f} GB/s")
    if failures:
        print(f"check     FAIL: {', '.join(failures)}")
        return 1
    print("check     PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
