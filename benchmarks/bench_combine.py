"""Small-batch, long-context decoding, where the split sequence's combine step matters.

    python benchmarks/bench_combine.py [--dtype bf16] [--lengths 32768,131072] [--heads 16,128] [--num-sms N]
    ncu -k regex:mla_combine python benchmarks/bench_combine.py --reps 1   # the combine kernel alone

One row per config (b = 1, s_q = 1, causal): the pieces the plan cut the sequence into, the median time per
flash_mla_with_kvcache call (metadata outside; 20 calls captured in one CUDA graph, 15 timed replays), GB/s
(SPEC.md's byte count) and the time over the floor (those bytes at PERF.md's 3.0 TB/s copy ceiling). Each config
is checked against the float32 reference before it is timed.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flash_mla
from flash_mla.backends import select_backend
from flash_mla.testing import (assert_close, compare, cuda_graph_median_seconds, decode_flops_and_bytes,
                               make_decode_batch, reference_for)

COPY_BYTES_PER_S = 3.0e12     # device-to-device copy ceiling on the H100 (docs/PERF.md "Ceilings")


def bench_one(length, h_q, dtype, num_sms, backend, reps):
    """(pieces, median seconds per call) of one b = 1 config, after checking it against the reference."""
    batch = make_decode_batch([length], s_q=1, h_q=h_q, dtype=dtype, device="cuda", causal=True,
                              generator=torch.Generator().manual_seed(length + h_q))
    md, ns = flash_mla.get_mla_metadata(batch.cache_seqlens, h_q, 1, num_sms=num_sms)

    def call():
        return flash_mla.flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512,
                                                md, ns, causal=True, backend=backend)

    assert_close(compare(*call(), *reference_for(batch, on_device=True)), dtype, f"L={length} h_q={h_q}")
    return int(ns[1] - ns[0]), cuda_graph_median_seconds([call] * 20, reps=reps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--heads", default="16,128")
    ap.add_argument("--num-sms", type=int, default=None, help="what get_mla_metadata plans for (default: the GPU's)")
    ap.add_argument("--backend", default=None, help="cuda | triton (default: automatic)")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: bench_combine.py times GPU kernels and needs a CUDA GPU (none is visible)")
        return 0
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    backend = select_backend(torch.device("cuda"), args.backend)
    print(f"device: {torch.cuda.get_device_name()}  backend: {backend}  {args.dtype}  b=1 s_q=1 causal")
    print(f"{'L':>7} {'h_q':>4} {'pieces':>6} {'time_us':>8} {'GB/s':>6} {'floor_us':>8} {'floor_x':>7}")
    for length in (int(x) for x in args.lengths.split(",")):
        for h_q in (int(x) for x in args.heads.split(",")):
            pieces, seconds = bench_one(length, h_q, dtype, args.num_sms, backend, args.reps)
            _, nbytes = decode_flops_and_bytes([length], 1, h_q, 1)
            floor = nbytes / COPY_BYTES_PER_S
            print(f"{length:>7} {h_q:>4} {pieces:>6} {seconds * 1e6:>8.1f} {nbytes / seconds / 1e9:>6.0f} "
                  f"{floor * 1e6:>8.1f} {seconds / floor:>7.2f}", flush=True)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
