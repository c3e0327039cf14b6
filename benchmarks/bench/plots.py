"""The two PNG plots of benchmarks/bench_flash_mla.py (matplotlib, Agg): GB/s against context length
(gbps_vs_context.png) and TFLOP/s against query rows per KV head (tflops_vs_rows.png), with the measured ceilings;
also drawn from an earlier run's CSV (--plot-from), e.g. one from a GPU machine without matplotlib."""
from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

from .report import read_csv


def _values(rows: list[dict], group: str, key: str) -> str:
    return "/".join(str(v) for v in sorted({r[key] for r in rows if r["group"] == group})) or "-"


def make_plots(rows: list[dict], out_dir: str, ceil: dict[str, float], backends: Sequence[str]) -> list[str]:
    """Two PNGs; returns their paths ([] with a note when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib, or pip install -e \".[bench]\")")
        return []
    ok = [r for r in rows if r["status"] == "OK"]
    colors = {be: f"C{i}" for i, be in enumerate(backends)}
    paths = []

    def scatter_with_means(ax, pts, color, label):
        """Every (x, y) point faintly, and a line through the mean y at each x."""
        groups: dict[float, list[float]] = {}
        for x, y in pts:
            groups.setdefault(x, []).append(y)
        xs = sorted(groups)
        ax.scatter(*zip(*pts), color=color, alpha=0.35, s=14)
        ax.plot(xs, [statistics.mean(groups[x]) for x in xs], color=color, marker="o", label=label)

    def finish_axes(ax, ceiling, ceiling_label, xlabel, ylabel):
        ax.axhline(ceiling, color="gray", linestyle="--", linewidth=1, label=ceiling_label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    def save(fig, name):
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    for be in backends:
        pts = [(r["mean_L"], r["GBps"]) for r in ok
               if r["backend"] == be and r["group"] == "reference" and r["s_q"] * r["h_q"] <= 64]
        if pts:
            scatter_with_means(ax, pts, colors[be], be)
    ax.set_title(f"reference rows, memory-bound (h_q*s_q <= 64), b = {_values(ok, 'reference', 'b')}")
    ax = axes[1]
    styles = ["-", "--", ":", "-."]
    for be in backends:
        bs = sorted({r["b"] for r in ok if r["backend"] == be and r["group"] == "long"})
        for k, bsz in enumerate(bs):
            pts = sorted((r["mean_L"], r["GBps"]) for r in ok
                         if r["backend"] == be and r["group"] == "long" and r["b"] == bsz)
            ax.plot(*zip(*pts), color=colors[be], linestyle=styles[k % len(styles)], marker="o",
                    label=f"{be} b={bsz}")
    ax.set_title(f"long contexts at small batch (h_q = {_values(ok, 'long', 'h_q')}, s_q = 1)")
    for ax in axes:
        finish_axes(ax, ceil["copy_GBps"], "copy ceiling", "context length (tokens; mean for variable lengths)",
                    "GB/s (SPEC bytes / time)")
    save(fig, "gbps_vs_context.png")

    fig, ax = plt.subplots(figsize=(8, 5))
    for be in backends:
        pts = [(r["s_q"] * r["h_q"], r["TFLOPs"]) for r in ok if r["backend"] == be and r["group"] == "reference"]
        if pts:
            scatter_with_means(ax, pts, colors[be], f"{be} reference (b={_values(ok, 'reference', 'b')})")
        pts = sorted((r["s_q"] * r["h_q"], r["TFLOPs"]) for r in ok if r["backend"] == be and r["group"] == "specdec")
        if pts:
            ax.plot(*zip(*pts), color=colors[be], marker="s", linestyle="--",
                    label=f"{be} specdec (h_q={_values(ok, 'specdec', 'h_q')})")
    finish_axes(ax, ceil["matmul_TFLOPs"], "bf16 matmul ceiling", "query rows per KV head (h_q * s_q)",
                "TFLOP/s (SPEC FLOPs / time)")
    save(fig, "tflops_vs_rows.png")
    return paths


def plot_from_csv(path: str, out_dir: str) -> list[str]:
    """The plots of an earlier run, e.g. one on a GPU machine without matplotlib."""
    rows = read_csv(path)
    if not rows:
        print(f"{path}: no rows")
        return []
    ceil = {"copy_GBps": rows[0]["copy_GBps"], "matmul_TFLOPs": rows[0]["matmul_TFLOPs"]}
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    os.makedirs(out_dir, exist_ok=True)
    return make_plots(rows, out_dir, ceil, backends)
