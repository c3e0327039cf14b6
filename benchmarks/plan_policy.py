"""Plan policy for small batches: how long should the shortest piece be?

    python benchmarks/plan_policy.py [--min-payloads 0,0t,9,13,17,21,29,37] [--csv out.csv]
    python benchmarks/plan_policy.py --sparse [--min-payloads 0,7,7t,9,13,21,37]   # sparse FP8 decoding, topk 2048

The scheduler gives every SM part ceil(total / parts) + FIXED_OVERHEAD blocks of work. On a small batch that
cuts a sequence into ~132 short pieces: many parallel readers, but each piece pays a Q load, a first-page
latency, an fp32 partial write and a share of the combine. A floor on the payload (`min_payload`, in blocks,
FIXED_OVERHEAD included) leaves the trailing parts empty instead. This script times every workload under every
floor, timed like the referee (one CUDA graph of N calls walking N copies of the cache so L2 does not serve it,
metadata from the scheduler twin outside the timed region, median of replays), after checking each policy's
result against the float32 reference. One row per (workload, floor): pieces of the longest-cut sequence, median
time, GB/s and the time relative to floor 0 (SPEC.md's rule, the dense policy). A floor written with a trailing
"t" (7t) takes the smallest payload that still covers the batch instead of SPEC.md's before the floor
(scheduler.plan_payload's tight_payload): 16 rows of 32 pages over 66 parts then get 64 parts of 8 pages instead of
48 of 9 and 16 of 5.

--sparse does the same for sparse FP8 decoding (indices over a 656-byte-per-token cache; each batch row's length
for the plan is topk, 32 index pages of 64 slots): at b = 1, h_q 128, s_q 1 the SPEC rule gives each of 32 SM parts
a single page, floor 7 two pages to each of 16 parts. flash_mla's sparse plans use the tight payload and floor 7
(SPARSE_PLAN in flash_mla/_geometry.py; docs/PERF.md "Scheduler" has the measurement): its policy is the 7t row.
"""
import argparse
import math
import os
import re
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flash_mla
from flash_mla.scheduler import num_sm_parts_for, schedule
from flash_mla.sparse_fp8 import quantize_kv_cache_v32, sparse_decode_reference
from flash_mla.testing import (assert_close, assert_sparse_close, compare, cuda_graph_median_seconds,
                               decode_flops_and_bytes, make_decode_batch, reference_for, sparse_fp16_key_lse_bound)

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
# (name, b, s_q, h_q) of sparse FP8 decoding, topk SPARSE_TOPK: the referee's small rows and two larger ones
SPARSE_WORKLOADS = [
    ("sparse b=1 h=128 s=1", 1, 1, 128),
    ("sparse b=1 h=128 s=2", 1, 2, 128),
    ("sparse b=16 h=128 s=1", 16, 1, 128),
    ("sparse b=16 h=128 s=2", 16, 2, 128),
    ("sparse b=32 h=64 s=1", 32, 1, 64),
]
SPARSE_TOPK, SPARSE_POOL = 2048, 32768


def sparse_indices(b, s_q, topk, pool, generator):
    """(b, s_q, topk) int32: for each query token of row i, topk distinct tokens of row i's own pool of `pool`
    tokens (tokens i * pool .. (i + 1) * pool - 1), in random order; on the generator's device."""
    device = generator.device
    pos = torch.rand(b * s_q, pool, generator=generator, device=device).argsort(dim=-1)[:, :topk]
    rows = torch.arange(b, device=device).repeat_interleave(s_q).unsqueeze(-1)
    return (rows * pool + pos).view(b, s_q, topk).to(torch.int32)


def time_floors(name, lens, parts, floors, cache, nbytes, decode, check):
    """[(name, floor, pieces, seconds)] of one workload under each payload floor: the scheduler twin's plan for
    `lens` over `parts` SM parts, `decode(k_cache, md, ns)` checked first by `check(out, lse, what)`, then timed
    over enough copies of `cache` that L2 cannot hold them (`nbytes`: the bytes a call reads, for GB/s)."""
    copies = max(1, min(8, math.ceil(COPIES_BYTES / (cache.numel() * cache.element_size()))))
    caches = [cache] + [cache.clone() for _ in range(copies - 1)]
    rows, base = [], None
    for floor in floors:
        meta, splits = schedule(lens, parts, min_payload=int(floor.rstrip("t")), tight_payload=floor.endswith("t"))
        md = torch.tensor(meta, dtype=torch.int32, device="cuda")
        ns = torch.tensor(splits, dtype=torch.int32, device="cuda")
        pieces = max(splits[i + 1] - splits[i] for i in range(len(lens)))
        check(*decode(cache, md, ns), f"{name} floor={floor}")
        seconds = cuda_graph_median_seconds([lambda k=k, md=md, ns=ns: decode(k, md, ns)
                                             for k in caches * max(1, 8 // copies)], reps=12)
        base = base or seconds
        rows.append((name, floor, pieces, seconds))
        print(f"{name:<22} {floor:>5} {pieces:>6} {seconds * 1e6:>8.1f} {nbytes / seconds / 1e9:>6.0f} "
              f"{seconds / base:>6.3f}", flush=True)
    return rows


def time_workload(name, lens, s_q, h_q, floors, num_sms):
    """[(name, floor, pieces, seconds)] of one bf16 workload under each payload floor, each checked first."""
    batch = make_decode_batch(lens, s_q=s_q, h_q=h_q, device="cuda", causal=True,
                              generator=torch.Generator().manual_seed(sum(lens) + h_q))
    ref = reference_for(batch, on_device=True)
    _, nbytes = decode_flops_and_bytes(lens, s_q, h_q, 1)

    def decode(k_cache, md, ns):
        return flash_mla.flash_mla_with_kvcache(batch.q, k_cache, batch.block_table, batch.cache_seqlens, 512, md,
                                                ns, causal=True)

    def check(out, lse, what):
        assert_close(compare(out, lse, *ref), torch.bfloat16, what)

    return time_floors(name, lens, num_sm_parts_for(num_sms, s_q * h_q, 1), floors, batch.k_cache, nbytes, decode,
                       check)


def time_sparse_workload(name, b, s_q, h_q, floors, num_sms):
    """[(name, floor, pieces, seconds)] of one sparse workload under each payload floor, each checked first."""
    g = torch.Generator(device="cuda").manual_seed(1000 * b + 10 * s_q + h_q)
    pages = b * SPARSE_POOL // 64
    cache = quantize_kv_cache_v32((torch.randn(pages, 64, 1, 576, generator=g, device="cuda") / 10).clamp_(-1, 1))
    idx = sparse_indices(b, s_q, SPARSE_TOPK, SPARSE_POOL, g)
    q = (torch.randn(b, s_q, h_q, 576, generator=g, device="cuda") / 4).to(torch.bfloat16)
    ref = sparse_decode_reference(q, cache, idx)
    bound = sparse_fp16_key_lse_bound(q, cache, idx)
    nbytes = b * s_q * SPARSE_TOPK * 656

    def decode(k_cache, md, ns):
        return flash_mla.flash_mla_with_kvcache(q, k_cache, None, None, 512, md, ns, is_fp8_kvcache=True,
                                                indices=idx)

    def check(out, lse, what):
        assert_sparse_close(out, lse, *ref, what, lse_bound=bound)

    return time_floors(name, [SPARSE_TOPK] * b, num_sm_parts_for(num_sms, s_q * h_q, 1), floors, cache, nbytes,
                       decode, check)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-payloads", default=None, help="floors, comma-separated, a trailing t for the tight "
                                                         "payload (default 0,0t,9,13,17,21,29,37; --sparse: "
                                                         "0,7,7t,9,13,21,37)")
    ap.add_argument("--sparse", action="store_true", help="sparse FP8 decoding workloads instead of bf16 ones")
    ap.add_argument("--only", default=None, help="substring of the workload names to run")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    default = "0,7,7t,9,13,21,37" if args.sparse else "0,0t,9,13,17,21,29,37"
    floors = (args.min_payloads or default).split(",")
    for floor in floors:
        if not re.fullmatch(r"\d+t?", floor):
            ap.error(f"--min-payloads: expected integers, each maybe followed by t, got {floor!r}")
    if not torch.cuda.is_available():
        print("skipped: plan_policy.py times GPU kernels and needs a CUDA GPU (none is visible)")
        return 0
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    kind = f"sparse FP8 topk={SPARSE_TOPK}" if args.sparse else "bf16 causal"
    print(f"device: {torch.cuda.get_device_name()}  {kind} h_kv=1  num_sms={num_sms}")
    print(f"{'workload':<22} {'floor':>5} {'pieces':>6} {'time_us':>8} {'GB/s':>6} {'vs_0':>6}")
    rows = []
    timer, workloads = (time_sparse_workload, SPARSE_WORKLOADS) if args.sparse else (time_workload, WORKLOADS)
    for name, lens_or_b, s_q, h_q in workloads:
        if not args.only or args.only in name:
            rows += timer(name, lens_or_b, s_q, h_q, floors, num_sms)
            torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("workload,min_payload,pieces,time_us\n")
            for name, floor, pieces, seconds in rows:
                f.write(f"{name},{floor},{pieces},{seconds * 1e6:.2f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
