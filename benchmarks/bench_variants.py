"""Side-by-side timing of the CUDA kernel's schedule variants on the SPEC reference table (Hopper only).

Variants are chosen per call through environment variables the binding reads on every call:
  FLASH_MLA_SPLITKV_PIPELINE  refill_behind_s (default) | refill_first (kernel v1's order) | s_owner (one
                              warpgroup computes all of S per page, alternating; experimental)
  FLASH_MLA_COMBINE_PDL       1 (default, programmatic dependent launch of the combine kernel) | 0
Each row is checked against the float32 reference under every variant before it is timed, and the variants
are timed interleaved (A B C A B C ...) so clock drift hits all of them alike; the figure is the median.

  python benchmarks/bench_variants.py [--quick] [--csv out.csv]
"""
from __future__ import annotations

import argparse
import csv
import itertools
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flash_mla  # noqa: E402
from flash_mla.testing import (assert_close, compare, cuda_median_seconds, decode_flops_and_bytes,  # noqa: E402
                               make_decode_batch, random_seqlens, reference_for)

VARIANTS = {
    "v1": {"FLASH_MLA_SPLITKV_PIPELINE": "refill_first", "FLASH_MLA_COMBINE_PDL": "0"},
    "v1+pdl": {"FLASH_MLA_SPLITKV_PIPELINE": "refill_first", "FLASH_MLA_COMBINE_PDL": "1"},
    "v2": {"FLASH_MLA_SPLITKV_PIPELINE": "refill_behind_s", "FLASH_MLA_COMBINE_PDL": "1"},
    "s_owner": {"FLASH_MLA_SPLITKV_PIPELINE": "s_owner", "FLASH_MLA_COMBINE_PDL": "1"},
}


def rows(quick: bool):
    means = [4096, 8192] if quick else [4096, 8192, 16384]
    heads = [16, 128] if quick else [16, 32, 64, 128]
    for mean, h_q, s_q, varlen in itertools.product(means, heads, [1, 2], [False, True]):
        yield dict(b=128, mean=mean, h_q=h_q, s_q=s_q, varlen=varlen)


def set_variant(name: str) -> None:
    os.environ.update(VARIANTS[name])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per variant")
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() or flash_mla.backends.cuda_extension() is None:
        print("skipped: needs a Hopper GPU and the CUDA extension")
        return 0
    names = list(VARIANTS)
    print(f"device: {torch.cuda.get_device_name()}; median of {args.rounds} interleaved rounds "
          f"(each itself a median of 15 x 10 back-to-back calls); bf16, causal, b = 128, h_kv = 1")
    header = f"{'mean':>6} {'h_q':>4} {'s_q':>3} {'varlen':>6} | " + " | ".join(
        f"{n:>8} us {'TF/s':>6} {'GB/s':>5}" for n in names) + " | v1/v2 v1/s_owner"
    print(header)
    records, failures = [], 0
    for i, row in enumerate(rows(args.quick)):
        gen = torch.Generator().manual_seed(i)
        seqlens = random_seqlens(row["b"], row["mean"], row["s_q"], row["varlen"], generator=gen)
        batch = make_decode_batch(seqlens, s_q=row["s_q"], h_q=row["h_q"], device="cuda", causal=True,
                                  generator=gen)
        md, ns = flash_mla.get_mla_metadata(batch.cache_seqlens, row["s_q"] * row["h_q"], 1)
        call_args = (batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512, md, ns)
        ref_out, ref_lse = reference_for(batch, on_device=True)
        for name in names:
            set_variant(name)
            out, lse = flash_mla.flash_mla_with_kvcache(*call_args, causal=True)
            try:
                assert_close(compare(out, lse, ref_out, ref_lse), batch.q.dtype, f"{name} {row}")
            except AssertionError as e:
                print(f"FAIL {e}")
                failures += 1
        del ref_out, ref_lse
        samples = {n: [] for n in names}
        for _ in range(args.rounds):
            for name in names:
                set_variant(name)
                samples[name].append(cuda_median_seconds(
                    lambda args=call_args: flash_mla.flash_mla_with_kvcache(*args, causal=True)))
        flops, nbytes = decode_flops_and_bytes(seqlens, row["s_q"], row["h_q"], 1)
        med = {n: statistics.median(v) for n, v in samples.items()}
        cells = " | ".join(f"{med[n] * 1e6:>11.1f} {flops / med[n] / 1e12:>6.1f} {nbytes / med[n] / 1e9:>5.0f}"
                           for n in names)
        print(f"{row['mean']:>6} {row['h_q']:>4} {row['s_q']:>3} {str(row['varlen']):>6} | {cells} | "
              f"{med['v1'] / med['v2']:.3f} {med['v1'] / med['s_owner']:.3f}", flush=True)
        records.append({**row, **{f"{n}_us": med[n] * 1e6 for n in names},
                        **{f"{n}_tflops": flops / med[n] / 1e12 for n in names},
                        **{f"{n}_gbps": nbytes / med[n] / 1e9 for n in names}})
        del batch
        torch.cuda.empty_cache()
    for var in VARIANTS["v2"]:
        os.environ.pop(var, None)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(records[0]))
            writer.writeheader()
            writer.writerows(records)
    print("ALL VARIANTS CORRECT" if failures == 0 else f"{failures} FAILURES")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
