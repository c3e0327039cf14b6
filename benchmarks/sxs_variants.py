"""Compile-time variants of the Hopper kernels against upstream's anchors, one process per variant.

A kernel experiment is a macro the kernels read (e.g. `#ifndef FLASH_MLA_EXP / #define FLASH_MLA_EXP 0` in
mainloop.h, branches as `if constexpr`), so that no variant costs the others a runtime branch (ptxas serialises
WGMMA around runtime-selected waits). Build one copy of the tree per value, then time them all against the
referee's anchors on its workloads:

    for e in 0 1; do
      mkdir -p /tmp/e$e && cp -r setup.py pyproject.toml README.md csrc flash_mla /tmp/e$e/
      (cd /tmp/e$e && NVCC_APPEND_FLAGS=-DFLASH_MLA_EXP=$e MAX_JOBS=8 python3 setup.py build_ext --inplace) &
    done; wait
    python3 benchmarks/sxs_variants.py --anchors .anchors --only table /tmp/e0 /tmp/e1
    python3 benchmarks/sxs_variants.py --anchors .anchors --rows "L=8192f h=128 s=2" /tmp/e0 /tmp/e1   # one row
    python3 benchmarks/sxs_variants.py --anchors .anchors --only table --repeat 2 /tmp/e0 /tmp/e1     # e0 e1 e0 e1
    python3 benchmarks/sxs_variants.py --anchors .anchors --sparse /tmp/e0 /tmp/e1     # the sparse FP8 rows
    python3 benchmarks/sxs_variants.py --anchors .anchors --only table --fp8 /tmp/e0 /tmp/e1   # FP8 cache vs bf16
    python3 benchmarks/sxs_variants.py --anchors .anchors --fp8 --bf16-q --rows "h=16 s=1" /tmp/e0 /tmp/e1  # bf16 q

Each variant runs in a process of its own by default: builds of one extension loaded into one process under one
module name are one module (pybind11 3 caches extension modules by name; on the H100 a build that copies nothing
gave bit-identical outputs to the baseline), so every earlier in-process comparison measured one kernel against
itself. Compute-bound rows drift by ~1.5 % (18-row geomean) between processes even for identical kernels. With
--same-process all variants share one process, timed in turn on each workload: the child loads each build under a
module name of its own, and each build must carry its own FLASH_MLA_VARIANT (csrc/kernels/variant.h puts every
symbol in flash_mla::<name>, so kernels differ by name in profiles too), which the child checks:

    (cd /tmp/e0 && FLASH_MLA_VARIANT=e0 MAX_JOBS=8 python3 setup.py build_ext --inplace)   # likewise e1
    python3 benchmarks/sxs_variants.py --anchors .anchors --only table --same-process --repeat 2 /tmp/e0 /tmp/e1

In its process, a variant's extension (flash_mla/_cuda*.so) is loaded directly and called through its binding
(no Python validation, the device plan for 132 SMs), timed exactly as the referee times flash_mla
(`sxs.time_graph`: N calls over N cache copies in one CUDA graph, best of two medians), interleaved per workload
with the anchors, so each ratio (best anchor / variant) comes from one process as the referee's do. Within a
process the variant timed first on each workload is the fastest: two identical builds measured 0.985 / 0.966 and, in
the other order, 0.988 / 0.973 (18 compute-bound rows' geomean; sparse rows ~1 %; H100, 2026-11-27). So each repeat
runs the variants in an order rotated by one: with --repeat equal to the number of variants every variant is first
once, and a variant's columns are compared by their mean over the repeats. Results of the variants must agree with
the first one (out rel-L2 < 1e-2 on every fourth element, the same -inf pattern of lse) unless --timing-only. A
timing process that fails (a kernel fault, a variant that does not build) leaves its columns out: the rest is still
printed, with a `# left out:` line per failed process, and the script exits 1. Prints one row per workload (times,
the first process's anchor time, ratios) and the geometric means per group (table rows split into memory-bound
h_q * s_q < 128 and compute-bound); with --repeat, each variant's mean (and range) of its repeats' geomeans per
group and per class of query rows a KV head (16, 32, 64, ...: where the FP8 kernels change tile). Variants are
compared with each other only inside one run of this script.
"""
import argparse
import glob
import importlib.machinery
import importlib.util
import json
import math
import os
import runpy
import subprocess
import sys
import tempfile


class RawExtension:
    """One build of flash_mla._cuda, called through its binding like the referee calls the anchors."""

    def __init__(self, folder: str, index: int):
        found = glob.glob(os.path.join(folder, "flash_mla", "_cuda*.so"))
        if not found:
            raise SystemExit(f"{folder}: no flash_mla/_cuda*.so (build it with setup.py build_ext --inplace)")
        # A module name of its own per build: pybind11 3 caches extension modules by their spec's name, so a
        # second "_cuda" would be the first build's module again. The last component stays "_cuda" (PyInit__cuda).
        name = f"flash_mla_variant{index}._cuda"
        loader = importlib.machinery.ExtensionFileLoader(name, found[0])
        spec = importlib.util.spec_from_file_location(name, found[0], loader=loader)
        self.mod = importlib.util.module_from_spec(spec)
        loader.exec_module(self.mod)
        self.name = os.path.basename(os.path.normpath(folder))

    def plan(self, q, k, bt, seqlens, causal):
        return self.mod.get_mla_metadata(seqlens, q.shape[1] * q.shape[2] // k.shape[2], k.shape[2], 132)

    def decode(self, q, k, bt, seqlens, plan, causal):
        md, ns = plan
        return tuple(self.mod.mla_decode(q, k, bt, seqlens, 512, md, ns, 576 ** -0.5, causal))


class RawFp8Extension(RawExtension):
    """The same build's FP8-cache path (--fp8): q and each cache copy quantised per tensor to e4m3 by the referee's
    own `sxs.FlashMLAFp8.prepare` (q8 / dq / k8), timed against the anchors' bf16 on the original tensors."""

    def prepare(self, q, ks):
        import sxs    # on sys.path in the child process
        sxs.FlashMLAFp8.prepare(self, q, ks)

    def decode(self, q, k, bt, seqlens, plan, causal):
        md, ns = plan
        k8, descale_k = self.k8[k.data_ptr()]
        return tuple(self.mod.mla_decode(self.q8, k8, bt, seqlens, 512, md, ns, 576 ** -0.5, causal,
                                         descale_q=self.dq, descale_k=descale_k))


class RawFp8Bf16QExtension(RawFp8Extension):
    """The FP8-cache path with a bf16 q (--fp8 --bf16-q, the form vLLM also calls): the cache copies quantised as
    with --fp8, q left in bf16, descale_k only."""

    def prepare(self, q, ks):
        super().prepare(q, ks)
        self.q8, self.dq = q, None


class RawSparseExtension(RawExtension):
    """The same build's sparse FP8 decoding (--sparse): `bt` carries the indices, `k` the 656-byte cache. Planned
    as that tree's flash_mla plans sparse calls: with its SPARSE_PLAN (flash_mla/_geometry.py), or in a tree from
    before it, its payload floor SPARSE_MIN_PAYLOAD (a tree from before the floor has none, and its binding takes
    four arguments)."""

    def __init__(self, folder: str, index: int):
        super().__init__(folder, index)
        geometry = runpy.run_path(os.path.join(folder, "flash_mla", "_geometry.py"))
        floor = geometry.get("SPARSE_MIN_PAYLOAD", 0)
        self.plan_kwargs = geometry.get("SPARSE_PLAN", {"min_payload": floor} if floor else {})

    def plan(self, q, k, bt, seqlens, causal):
        import torch
        full = torch.full((q.shape[0],), bt.shape[-1], dtype=torch.int32, device=q.device)
        return self.mod.get_mla_metadata(full, q.shape[1] * q.shape[2], 1, 132, **self.plan_kwargs)

    def decode(self, q, k, bt, seqlens, plan, causal):
        md, ns = plan
        return tuple(self.mod.sparse_decode(q, k, bt, None, md, ns, 576 ** -0.5))


def timing_runs(names, folders, repeat, same_process):
    """The timing processes, each a list of (column name, folder): one per (repeat, variant), or with
    `same_process` one per repeat holding every variant, repeat r in an order rotated by r (within a process the
    first variant is timed fastest: the module docstring), so that each variant is first equally often."""
    groups = [list(zip(names, folders))] if same_process else [[nf] for nf in zip(names, folders)]
    return [[(n if r == 0 else f"{n}#{r + 1}", f) for n, f in group[r % len(group):] + group[:r % len(group)]]
            for r in range(repeat) for group in groups]


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def repeat_summary(rows, names):
    """The '# mean over repeats' lines: per group of rows, and per table-row class of query rows a KV head (h_q x s_q:
    the FP8 kernels change tile at 16, 32 and 64), each variant's geomean in each repeat, then their mean and range
    over the repeats (repeat r of variant v is the column named v#r, or v for the first). rows: (group, rows a KV
    head, ratios in `names` order) per workload. With one repeat of each variant there is nothing to add: []."""
    bases = list(dict.fromkeys(n.split("#")[0] for n in names))
    if len(bases) == len(names):
        return []
    classes = {}
    for group, rows_per_kv, ratios in rows:
        classes.setdefault(group, []).append(ratios)
        if group in ("memory", "compute"):
            classes.setdefault(f"{rows_per_kv} query rows a KV head", []).append(ratios)
    lines = []
    for label, members in classes.items():
        columns = dict(zip(names, zip(*members)))
        cells = []
        for base in bases:
            means = [geomean(c) for n, c in columns.items() if n.split("#")[0] == base]
            cells.append(f"{base} {sum(means) / len(means):.3f} ({min(means):.3f}-{max(means):.3f}, {len(means)})")
        lines.append(f"# mean over repeats, {label} ({len(members)} rows): " + ", ".join(cells))
    return lines


def workloads(sxs, args):
    """(group, label, make_inputs, seqlens-or-None, causal, s_q, h_q) per referee workload, in its order."""
    if args.sparse:
        return [(group, label, (lambda wi, b=b, s_q=s_q, h_q=h_q, topk=topk:
                                sxs.make_sparse_workload(b, s_q, h_q, topk, seed=2000 + wi) + (None,)), False, s_q, h_q)
                for group, label, b, s_q, h_q, topk in sxs.sparse_workloads()]
    table = {"table": sxs.table_workloads(), "beyond": sxs.beyond_workloads(),
             "all": sxs.table_workloads() + sxs.beyond_workloads()}[args.only]
    wanted = [w.strip() for w in args.rows.split(",")] if args.rows else None
    return [(group, label, (lambda wi, lens=lens, s_q=s_q, h_q=h_q:
                            sxs.make_workload(lens, s_q, h_q, 1, seed=1000 + wi)), True, s_q, h_q)
            for group, label, lens, s_q, h_q in table if wanted is None or any(w in label for w in wanted)]


def child(args):
    """Times its variants (one, or all with --same-process) and the anchors on every workload, interleaved; one JSON
    line per workload, each variant's results into --save/<k>/."""
    sys.path.insert(0, os.path.abspath(args.anchors))
    import sxs
    import torch

    kind = (RawSparseExtension if args.sparse else RawFp8Bf16QExtension if args.fp8 and args.bf16_q else
            RawFp8Extension if args.fp8 else RawExtension)
    variants = [kind(folder, i) for i, folder in enumerate(args.folders)]
    tags = [getattr(v.mod, "variant", "build") for v in variants]
    if len(set(tags)) != len(tags):
        raise SystemExit(f"--same-process needs builds with distinct FLASH_MLA_VARIANT (setup.py), got {tags}: "
                         "without them the process cannot tell the builds (or their kernels in a profile) apart")
    anchors = [sxs.AnchorHeadSparse()] if args.sparse else [sxs.AnchorV1(), sxs.AnchorHead()]
    for wi, (_group, _label, make, causal, _s_q, _h_q) in enumerate(workloads(sxs, args)):
        q, ks, bt, seqlens = make(wi)
        # Keyed by position, not name: a variant folder may be called like an anchor ("v1", "head").
        impls = variants + anchors
        best, results = [math.inf] * len(impls), [None] * len(variants)
        for _ in range(2):
            for i, impl in enumerate(impls):
                t, res = sxs.time_graph(impl, q, ks, bt, seqlens, causal)
                best[i] = min(best[i], t)
                if i < len(variants):
                    results[i] = res
        for k, (out, lse) in enumerate(results):
            os.makedirs(os.path.join(args.save, str(k)), exist_ok=True)
            torch.save({"out": out.reshape(-1)[::4].float().cpu(), "lse_inf": torch.isinf(lse).cpu()},
                       os.path.join(args.save, str(k), f"{wi}.pt"))
        print(json.dumps({"wi": wi, "variants": best[:len(variants)], "anchor": min(best[len(variants):])}),
              flush=True)
        del q, ks, bt, seqlens, results
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", required=True, help="folder with the referee's sxs.py and compressed anchors")
    ap.add_argument("--only", default="all", choices=["table", "beyond", "all"])
    ap.add_argument("--sparse", action="store_true", help="the referee's sparse FP8 rows against upstream head")
    ap.add_argument("--fp8", action="store_true",
                    help="the variants' FP8-cache path (q and cache quantised per tensor) against the anchors' bf16")
    ap.add_argument("--bf16-q", action="store_true",
                    help="with --fp8: q left in bf16 (descale_k only), the FP8 cache's other form")
    ap.add_argument("--rows", help="comma-separated label substrings: only the dense workloads whose label "
                                   "contains one (e.g. 'L=8192f h=128 s=2,L=8192f h=16 s=1')")
    ap.add_argument("--timing-only", action="store_true",
                    help="skip the agreement check (variants that deliberately compute something else)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time the whole list of variants this many times, one process each, in order (A B A B ...): "
                         "compute-bound rows drift by a few %% between processes, so compare the repeats")
    ap.add_argument("--same-process", action="store_true",
                    help="time all variants in one process, interleaved per workload (each built with its own "
                         "FLASH_MLA_VARIANT=name, csrc/kernels/variant.h); --repeat then repeats that process")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--save", help=argparse.SUPPRESS)
    ap.add_argument("folders", nargs="+", help="one built tree per variant; the first is the baseline")
    args = ap.parse_args()
    if args.bf16_q and not args.fp8:
        ap.error("--bf16-q is a form of --fp8")
    if args.child:
        return child(args)
    sys.path.insert(0, os.path.abspath(args.anchors))
    import sxs
    import torch

    names = [os.path.basename(os.path.normpath(f)) for f in args.folders]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant folders need distinct names: {names}")
    runs = timing_runs(names, args.folders, args.repeat, args.same_process)
    work = workloads(sxs, args)
    times = {}   # name -> list of (variant seconds, anchor seconds) per workload
    saved = {}   # name -> folder of its results
    failed = []  # one line per timing process that failed: its columns are left out, the others still reported
    with tempfile.TemporaryDirectory() as tmp:
        for ri, run_variants in enumerate(runs):
            save = os.path.join(tmp, f"run{ri}")
            os.makedirs(save)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--anchors", args.anchors, "--save", save,
                   "--only", args.only] + (["--sparse"] if args.sparse else []) + (["--fp8"] if args.fp8 else []) + \
                  (["--bf16-q"] if args.bf16_q else []) + \
                  (["--rows", args.rows] if args.rows else []) + [f for _n, f in run_variants]
            run = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
            rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
            label = ", ".join(n for n, _f in run_variants)
            if run.returncode != 0 or len(rows) != len(work):
                failed.append(f"{label}: the timing process failed (exit {run.returncode}, {len(rows)} of "
                              f"{len(work)} rows)")
                print(failed[-1], file=sys.stderr, flush=True)
                continue
            for k, (name, _f) in enumerate(run_variants):
                times[name] = [(r["variants"][k], r["anchor"]) for r in rows]
                saved[name] = os.path.join(save, str(k))
        names = [n for run in runs for n, _f in run if n in times]
        if not names:
            raise SystemExit("every timing process failed:\n" + "\n".join(failed))
        for wi, (_group, label, *_rest) in enumerate(work):
            base = torch.load(os.path.join(saved[names[0]], f"{wi}.pt"))
            for name in names[1:] if not args.timing_only else []:
                other = torch.load(os.path.join(saved[name], f"{wi}.pt"))
                rel = ((other["out"] - base["out"]).norm() / base["out"].norm().clamp_min(1e-20)).item()
                if not rel < 1e-2 or not torch.equal(other["lse_inf"], base["lse_inf"]):
                    raise SystemExit(f"{label}: variant {name} disagrees with {names[0]} (out rel-L2 {rel:.1e})")

    print("workload," + ",".join(f"{n}_us" for n in names) + ",anchor_us," + ",".join(f"ratio_{n}" for n in names))
    classed = []    # (group, query rows a KV head, ratios) per workload
    for wi, (group, label, _make, _causal, s_q, h_q) in enumerate(work):
        ratios = [times[n][wi][1] / times[n][wi][0] for n in names]
        kind = group if group != "table" else ("compute" if s_q * h_q >= 128 else "memory")
        classed.append((kind, s_q * h_q, ratios))
        print(f"{group}: {label}," + ",".join(f"{times[n][wi][0] * 1e6:.1f}" for n in names) +
              f",{times[names[0]][wi][1] * 1e6:.1f}," + ",".join(f"{r:.3f}" for r in ratios), flush=True)
    groups = {}
    for kind, _rows_per_kv, ratios in classed:
        groups.setdefault(kind, []).append(ratios)
    for kind, rows in groups.items():
        columns = list(zip(*rows))
        print(f"# {kind} ({len(rows)} rows) geomean: " +
              ", ".join(f"{n} {geomean(c):.3f} (min {min(c):.3f})" for n, c in zip(names, columns)))
    for line in repeat_summary(classed, names):
        print(line)
    for line in failed:
        print(f"# left out: {line}")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
