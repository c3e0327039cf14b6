"""What benchmarks/bench_flash_mla.py reports: the table's lines, the per-group summary, and the CSV (its columns,
writing it, and reading it back for --plot-from)."""
from __future__ import annotations

import csv
import os
import statistics
from collections.abc import Sequence

from .workloads import GROUPS

CSV_FIELDS = ["group", "workload", "backend", "status", "b", "s_q", "h_q", "h_kv", "mean_L", "sum_L", "max_L",
              "varlen", "causal", "time_us", "GBps", "TFLOPs", "pct_copy", "pct_matmul", "floor_us", "t_over_floor",
              "roof_us", "t_over_roof", "speedup_vs_next", "x_vs_best", "target", "target_met", "out_rel_l2",
              "lse_rel_l2", "cos_diff", "checked_against", "reps", "calls_per_rep", "input_copies", "copy_GBps",
              "matmul_TFLOPs", "note"]

HEADER = (f"{'workload':<30} {'backend':<10} {'status':<6} {'us':>9} {'GB/s':>6} {'TFLOP/s':>7} {'%copy':>6} "
          f"{'%mm':>5} {'t/floor':>7} {'speedup':>7}  target")


def format_row(r: dict) -> str:
    if r["status"] != "OK":
        return f"{r['workload']:<30} {r['backend']:<10} {r['status']:<6} {r.get('note', '')}"
    sp = f"{r['speedup_vs_next']:.2f}x" if r.get("speedup_vs_next") else "-"
    tgt = ""
    if r.get("target"):
        tgt = f"{r['target']} {'met' if r['target_met'] else 'MISSED'}"
    gbps = f"{r['GBps']:>6.0f}" if r["GBps"] >= 100 else f"{r['GBps']:>6.2f}"
    tflops = f"{r['TFLOPs']:>7.1f}" if r["TFLOPs"] >= 10 else f"{r['TFLOPs']:>7.3f}"
    return (f"{r['workload']:<30} {r['backend']:<10} {r['status']:<6} {r['time_us']:>9.1f} {gbps} "
            f"{tflops} {r['pct_copy']:>5.1f}% {r['pct_matmul']:>4.1f}% {r['t_over_floor']:>7.2f} "
            f"{sp:>7}  {tgt}")


def write_csv(path: str, rows: list[dict]):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def summarize(rows: list[dict], backends: Sequence[str]) -> list[str]:
    lines = [("summary (per group and backend: rows timed / failed, targets met, median time/floor, "
             "median slowdown vs the fastest backend):")]
    groups = [g for g in GROUPS if any(r["group"] == g for r in rows)]
    for g in groups:
        for be in backends:
            rs = [r for r in rows if r["group"] == g and r["backend"] == be]
            if not rs:
                continue
            ok = [r for r in rs if r["status"] == "OK"]
            bad = [r for r in rs if r["status"] != "OK"]
            if ok:
                met = sum(bool(r["target_met"]) for r in ok)
                fl = statistics.median(r["t_over_floor"] for r in ok)
                xb = statistics.median(r["x_vs_best"] for r in ok)
                lines.append(f"  {g:<10} {be:<10} {len(ok):>3} ok {len(bad):>3} not   "
                             f"targets met {met:>3}/{len(ok):<3} t/floor {fl:5.2f}   x vs best {xb:5.2f}")
            else:
                kinds = sorted({r["status"] for r in bad})
                lines.append(f"  {g:<10} {be:<10}   0 ok {len(bad):>3} not   ({', '.join(kinds)})")
    return lines


def read_csv(path: str) -> list[dict]:
    """Rows of a CSV this script wrote, numbers and booleans parsed back (for --plot-from)."""
    def parse(v: str):
        if v in ("True", "False"):
            return v == "True"
        for kind in (int, float):
            try:
                return kind(v)
            except ValueError:
                pass
        return v
    with open(path, newline="") as f:
        return [{k: parse(v) for k, v in r.items()} for r in csv.DictReader(f)]
