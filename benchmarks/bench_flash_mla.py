"""flash_mla against the alternatives, every figure also as a fraction of the GPU's own ceilings.

    python benchmarks/bench_flash_mla.py                        # full sweep on a Hopper GPU (~5 min on an H100)
    python benchmarks/bench_flash_mla.py --quick                # 4 reference rows + the skewed batch (CI)
    python benchmarks/bench_flash_mla.py --device cpu --smoke   # tiny shapes, cpu backend + torch baseline

Steps:
1. Ceilings, measured first in the same process: device-to-device copy GB/s (bytes read + written) and bf16
   8192^3 matmul TFLOP/s (benchmarks/ceilings.py; on the CPU, small stand-ins).
2. Workload groups (--workloads), all bf16, h_kv = 1, causal:
   reference  SPEC "Targets" table: b = 128, mean L in {4096, 8192, 16384}, h_q in {16, 32, 64, 128}, s_q in
              {1, 2}, fixed and variable lengths (~N(mean, mean/2), at least s_q); same lengths and data seeds as
              `python tests/test_flash_mla.py`.
   long       long contexts at small batch: b in {1, 4, 16} x L in {32k, 64k, 128k}, s_q = 1, h_q = 16
              (DeepSeek-V3 at tensor-parallel 8: memory-bound, the bytes floor is the bound) and h_q = 128 (one
              GPU holds all 128 heads: ~240 FLOP per byte, so these rows are compute-bound and the bytes floor
              is out of reach below ~450 TFLOP/s; `roof_us` in the CSV accounts for compute).
   skewed     b = 4, lengths 4641 / 45118 / 1730 / 1696, s_q = 4, h_q = 16.
   specdec    speculative decoding: b = 32, L = 8192, h_q = 16 (DeepSeek-V3 at tensor-parallel 8), s_q = 1..8.
   short      many short sequences: b = 1024, L = 512, s_q = 1, h_q = 16 and 128.
3. Backends (--backends): cuda (flash_mla's Hopper kernels), triton (flash_mla's portable backend), torch
   (benchmarks/baselines.py: paged gather + matmul/softmax, gather included in the timed call), flashinfer
   (flashinfer.mla.BatchMLAPagedAttentionWrapper, when importable), cpu (flash_mla's CPU backend, --device cpu).
4. Correctness before timing: flash_mla (cuda, or cpu on --device cpu) against the float32 reference, every other
   backend against flash_mla's output (or the reference when flash_mla is not run), with the test suite's
   tolerances; one that misses against flash_mla is checked against the reference too (two bf16 results may
   each be within tolerance of it yet twice that apart) and passes with a note if it is within tolerance there.
   A backend that fails is reported FAIL and not timed; out of memory is reported OOM, other errors ERROR.
5. Timing: flash_mla.testing.cuda_median_seconds (median over reps; calls back to back per event pair, 15 x 10
   like the test suite's sweep, fewer for slow backends to keep the run short), metadata/plans outside the timed
   region. No L2 flush (as in tests/test_flash_mla.py), but a workload whose bytes fit in a few L2s is cycled over
   several copies of q and the cache, so back-to-back calls cannot hit in L2.

Figures per row (SPEC.md "Targets"): FLOPs = 2 s_q sum(L) h_q (576 + 512); bytes = 2 (sum(L) h_kv 576 +
b s_q h_q 576 + b s_q h_q 512); floor = bytes / measured copy GB/s. Reference rows are judged against the SPEC
targets (memory-bound h_q s_q <= 64: 2900 GB/s at mean >= 8192, 2750 at 4096; compute-bound: 560 / 520 TFLOP/s),
the other groups against time <= 1.6 x floor. "speedup" is how much faster a backend is than the next slower one
on the same workload.

Output: a table on stdout, a CSV (--csv, default <out-dir>/bench_flash_mla.csv, rewritten after every workload)
and two PNG plots in --out-dir (needs matplotlib: pip install -e ".[bench]"; --plot-from CSV draws them later on
another machine). Exit status 1 when a flash_mla backend fails a correctness check or raises, else 0.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository: flash_mla
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                    # benchmarks/: baselines, bench
from baselines import score_mode

# The parts, one module per concern (benchmarks/bench/__init__.py lists them); their names are also this script's,
# as before the split (tests/test_bench_flash_mla.py uses them).
from bench.backends import (
    HEAD_DIM_V,
    Backend,
    FlashInferBackend,
    FlashMLABackend,
    Inputs,
    TorchBackend,
    make_backend,
)
from bench.checks import device_compare, verdict
from bench.measure import OOM_ERRORS, free_device, run_workload
from bench.plots import make_plots, plot_from_csv
from bench.progress import Progress
from bench.report import CSV_FIELDS, HEADER, format_row, read_csv, summarize, write_csv
from bench.timing import ROTATE_MIN_BYTES, Runner, choose_reps, measure_ceilings, rotation_copies, time_runner
from bench.workloads import (
    FLOOR_LIMIT,
    GROUPS,
    SKEWED_LENGTHS,
    Workload,
    build_workloads,
    long_context_workloads,
    reference_workloads,
    short_workloads,
    skewed_workloads,
    spec_target,
    specdec_workloads,
)

__all__ = [
    # bench.workloads
    "FLOOR_LIMIT", "GROUPS", "SKEWED_LENGTHS", "Workload", "build_workloads", "long_context_workloads",
    "reference_workloads", "short_workloads", "skewed_workloads", "spec_target", "specdec_workloads",
    # bench.timing
    "ROTATE_MIN_BYTES", "Runner", "choose_reps", "measure_ceilings", "rotation_copies", "time_runner",
    # bench.backends
    "HEAD_DIM_V", "Backend", "FlashInferBackend", "FlashMLABackend", "Inputs", "TorchBackend", "make_backend",
    # bench.checks, bench.progress, bench.measure
    "device_compare", "verdict", "Progress", "OOM_ERRORS", "free_device", "run_workload",
    # bench.report, bench.plots
    "CSV_FIELDS", "HEADER", "format_row", "read_csv", "summarize", "write_csv", "make_plots", "plot_from_csv",
    # this script
    "HERE", "main", "parse_args",
]

HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (with --device cpu: runs anywhere in ~10 s)")
    ap.add_argument("--quick", action="store_true", help="4 reference rows + the skewed batch")
    ap.add_argument("--workloads", default=None,
                    help=f"comma-separated groups from {','.join(GROUPS)} (default: all; --quick: reference,skewed)")
    ap.add_argument("--backends", default=None,
                    help="comma-separated from cuda,triton,torch,flashinfer,cpu "
                         "(default: cuda,triton,torch,flashinfer on --device cuda; cpu,torch on --device cpu)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--csv", default=None, help="CSV path (default: <out-dir>/bench_flash_mla.csv)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds of timed calls per (workload, backend); default 0.75 (CUDA), 0.2 (CPU)")
    ap.add_argument("--torch-chunk-gb", type=float, default=4.0,
                    help="memory budget per chunk of the torch baseline (GiB)")
    ap.add_argument("--no-reference", action="store_true", help="skip the float32 reference check")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="start no new workload after this many minutes (the CSV is written after each one)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--plot-from", default=None, metavar="CSV",
                    help="only draw the plots of an earlier run's CSV into --out-dir (no GPU needed)")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    t_start = time.time()
    args = parse_args(argv)
    if args.plot_from:
        paths = plot_from_csv(args.plot_from, args.out_dir)
        for p in paths:
            print(f"plot: {p}")
        return 0 if paths else 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_flash_mla: --device cuda but no CUDA GPU is visible (try --device cpu --smoke)")
        return 2
    device = torch.device(args.device)
    if args.budget_s is None:
        args.budget_s = 0.75 if device.type == "cuda" else 0.2
    groups = args.workloads.split(",") if args.workloads else (["reference", "skewed"] if args.quick else list(GROUPS))
    names = args.backends.split(",") if args.backends else (
        ["cuda", "triton", "torch", "flashinfer"] if device.type == "cuda" else ["cpu", "torch"])
    workloads = build_workloads(groups, args.quick, args.smoke)

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"bench_flash_mla: {dev_name}, torch {torch.__version__}, {len(workloads)} workloads "
          f"({', '.join(groups)}), bf16, h_kv = 1, causal")
    backends: list[Backend] = []
    for n in names:
        be = make_backend(n, args)
        why = be.unavailable(device)
        if why is not None:
            print(f"  backend {n}: skipped: {why}")
        else:
            if n == "triton" and device.type == "cpu":
                print("  backend triton: runs in Triton's interpreter (TRITON_INTERPRET=1): its results are "
                      "checked, its times are the interpreter's, not a kernel's")
            backends.append(be)
    if not backends:
        print("no backend can run here")
        return 2
    # flash_mla's own backend goes first: the others are checked against it
    backends.sort(key=lambda be: 0 if be.name in ("cuda", "cpu") else 1)
    print(f"  backends: {', '.join(be.name for be in backends)}"
          + (f"  (torch baseline: S in fp32 via {score_mode(device, torch.bfloat16)})"
             if any(be.name == "torch" for be in backends) else ""))

    ceil = measure_ceilings(device, args.smoke)
    print(f"  ceilings: copy {ceil['copy_GBps']:.0f} GB/s (read + write), matmul {ceil['matmul_TFLOPs']:.1f} TFLOP/s"
          f"  [{ceil['what']}]")
    print(f"  timing: median per call, up to 15 reps x 10 back-to-back calls, about {args.budget_s:.2f} s of calls "
          f"per row and backend; metadata/plans outside; inputs cycled over copies when they fit in L2")
    print(f"  floor = bytes / copy ceiling; reference rows vs SPEC targets, other rows vs <= {FLOOR_LIMIT}x floor")
    print(HEADER, flush=True)

    csv_path = args.csv or os.path.join(args.out_dir, "bench_flash_mla.csv")
    progress = Progress(len(workloads), enabled=not args.no_progress)
    rows: list[dict] = []
    skipped = 0
    try:
        for k, wl in enumerate(workloads):
            if args.max_minutes is not None and time.time() - t_start > 60 * args.max_minutes:
                skipped = len(workloads) - k
                break
            res = run_workload(wl, backends, ceil, args, device, progress)
            for r in res:
                progress.write(format_row(r))
            rows += res
            write_csv(csv_path, rows)     # after every workload: a run cut short keeps what it measured
            progress.update()
    finally:
        progress.close()
    if skipped:
        print(f"--max-minutes {args.max_minutes} reached: {skipped} workloads not run")

    for line in summarize(rows, [be.name for be in backends]):
        print(line)
    write_csv(csv_path, rows)
    print(f"csv: {csv_path}")
    if not args.no_plots:
        os.makedirs(args.out_dir, exist_ok=True)
        for p in make_plots(rows, args.out_dir, ceil, [be.name for be in backends]):
            print(f"plot: {p}")
    print(f"total elapsed: {time.time() - t_start:.1f} s")
    broken = [r for r in rows if r["backend"] in ("cuda", "triton", "cpu") and r["status"] in ("FAIL", "ERROR")]
    if broken:   # flash_mla itself wrong or crashing: a failure for CI (baselines' failures are only reported)
        print(f"{len(broken)} flash_mla rows FAILED or raised: "
              + ", ".join(f"{r['workload']} [{r['backend']}]" for r in broken[:10]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
