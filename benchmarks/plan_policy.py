"""Plan policy for small batches: how long should the shortest piece be?

    python benchmarks/plan_policy.py [--min-payloads 0,9,13,17,21,29,37] [--csv out.csv]

The scheduler gives every SM part ceil(total / parts) + FIXED_OVERHEAD blocks of work. On a small batch that
cuts a sequence into ~132 short pieces: many parallel readers, but each piece pays a Q load, a first-page
latency, an fp32 partial write and a share of the combine. A floor on the payload (`min_payload`, in blocks,
FIXED_OVERHEAD included) leaves the trailing parts empty instead. This script times every workload under every
floor, timed like the referee (one CUDA graph of N calls walking N copies of the cache so L2 does not serve it,
metadata from the scheduler twin outside the timed region, median of replays), after checking each policy's
result against the float32 reference. One row per (workload, floor): pieces of the longest-cut sequence, median
time, GB/s and the time relative to the current policy (floor 0).
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flash_mla
from flash_mla.scheduler import num_sm_parts_for, schedule
from flash_mla.testing import (assert_close, compare, cuda_graph_median_seconds, decode_flops_and_bytes,
                               make_decode_batch, reference_for)

# (name, seqlens, s_q, h_q): the referee's beyond-table rows where the payload is small enough for a floor to bite
WORKLOADS = [
    ("b=1 L=32768 h=16", [32768], 1, 16),
    ("b=1 L=32768 h=128", [32768], 1, 128),
    ("b=1 L=65536 h=16", [65536], 1, 16),
    ("b=1 L=65536 h=128", [65536], 1, 128),
    ("b=1 L=131072 h=16", [131072], 1, 16),
    ("b=1 L=131072 h=128", [131072], 1, 128),
    ("b=4 L=32768 h=16", [32768] * 4, 1, 16),
    ("b=4 L=32768 h=128", [32768] * 4, 1, 128),
    ("b=4 skewed s=4 h=16", [4641, 45118, 1730, 1696], 4, 16),
    ("b=32 L=4096 h=16 s=1", [4096] * 32, 1, 16),
    ("b=32 L=4096 h=16 s=4", [4096] * 32, 4, 16),
    ("b=32 L=4096 h=16 s=8", [4096] * 32, 8, 16),
]
COPIES_BYTES = 256 * 1024 ** 2     # as the referee: enough cache copies that L2 cannot hold them


def time_workload(name, lens, s_q, h_q, floors, num_sms):
    """[(name, floor, pieces, seconds)] of one workload under each payload floor, each checked first."""
    batch = make_decode_batch(lens, s_q=s_q, h_q=h_q, device="cuda", causal=True,
                              generator=torch.Generator().manual_seed(sum(lens) + h_q))
    ref = reference_for(batch, on_device=True)
    page_bytes = batch.k_cache[0].numel() * batch.k_cache.element_size()
    copies = max(1, min(8, math.ceil(COPIES_BYTES / (batch.k_cache.shape[0] * page_bytes))))
    caches = [batch.k_cache] + [batch.k_cache.clone() for _ in range(copies - 1)]
    _, nbytes = decode_flops_and_bytes(lens, s_q, h_q, 1)
    parts = num_sm_parts_for(num_sms, s_q * h_q, 1)
    rows, base = [], None
    for floor in floors:
        meta, splits = schedule(lens, parts, min_payload=floor)
        md = torch.tensor(meta, dtype=torch.int32, device="cuda")
        ns = torch.tensor(splits, dtype=torch.int32, device="cuda")
        pieces = max(splits[i + 1] - splits[i] for i in range(len(lens)))

        def call(k_cache, md=md, ns=ns):
            return flash_mla.flash_mla_with_kvcache(batch.q, k_cache, batch.block_table, batch.cache_seqlens,
                                                    512, md, ns, causal=True)

        assert_close(compare(*call(batch.k_cache), *ref), torch.bfloat16, f"{name} floor={floor}")
        seconds = cuda_graph_median_seconds([lambda k=k: call(k) for k in caches * max(1, 8 // copies)], reps=12)
        base = base or seconds
        rows.append((name, floor, pieces, seconds))
        print(f"{name:<22} {floor:>5} {pieces:>6} {seconds * 1e6:>8.1f} {nbytes / seconds / 1e9:>6.0f} "
              f"{seconds / base:>6.3f}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-payloads", default="0,9,13,17,21,29,37")
    ap.add_argument("--only", default=None, help="substring of the workload names to run")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: plan_policy.py times GPU kernels and needs a CUDA GPU (none is visible)")
        return 0
    floors = [int(x) for x in args.min_payloads.split(",")]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device: {torch.cuda.get_device_name()}  bf16 causal h_kv=1  num_sms={num_sms}")
    print(f"{'workload':<22} {'floor':>5} {'pieces':>6} {'time_us':>8} {'GB/s':>6} {'vs_0':>6}")
    rows = []
    for name, lens, s_q, h_q in WORKLOADS:
        if not args.only or args.only in name:
            rows += time_workload(name, lens, s_q, h_q, floors, num_sms)
            torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("workload,min_payload,pieces,time_us\n")
            for name, floor, pieces, seconds in rows:
                f.write(f"{name},{floor},{pieces},{seconds * 1e6:.2f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
