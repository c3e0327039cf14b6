"""Compile-time variants of the Hopper kernels side by side with upstream's anchors, in one process.

A kernel experiment is a macro the kernels read (e.g. `#ifndef FLASH_MLA_EXP / #define FLASH_MLA_EXP 0` in
mainloop.h, branches as `if constexpr`), so that no variant costs the others a runtime branch (ptxas serialises
WGMMA around runtime-selected waits). Build one copy of the tree per value, then time them all against the
referee's anchors on its workloads:

    for e in 0 1; do
      mkdir -p /tmp/e$e && cp -r setup.py pyproject.toml README.md csrc flash_mla /tmp/e$e/
      (cd /tmp/e$e && NVCC_APPEND_FLAGS=-DFLASH_MLA_EXP=$e MAX_JOBS=8 python3 setup.py build_ext --inplace) &
    done; wait
    python3 benchmarks/sxs_variants.py --anchors .anchors --only table /tmp/e0 /tmp/e1
    python3 benchmarks/sxs_variants.py --anchors .anchors --sparse /tmp/e0 /tmp/e1     # the sparse FP8 rows

Each folder's extension (flash_mla/_cuda*.so) is loaded directly and called through its binding (no Python
validation, the device plan for 132 SMs), timed exactly as the referee times flash_mla (`sxs.time_graph`: N calls
over N cache copies in one CUDA graph, best of two medians, implementations interleaved per workload). Results of
the variants must agree with the first one (out rel-L2 < 1e-2, the same -inf pattern of lse). Prints one row per
workload (times, ratio = best anchor / variant) and the geometric means per group (table rows split into
memory-bound h_q * s_q < 128 and compute-bound); the variants are compared with each other only inside one run.
"""
import argparse
import glob
import importlib.machinery
import importlib.util
import math
import os
import sys


class RawExtension:
    """One build of flash_mla._cuda, called through its binding like the referee calls the anchors."""

    def __init__(self, folder: str):
        found = glob.glob(os.path.join(folder, "flash_mla", "_cuda*.so"))
        if not found:
            raise SystemExit(f"{folder}: no flash_mla/_cuda*.so (build it with setup.py build_ext --inplace)")
        loader = importlib.machinery.ExtensionFileLoader("_cuda", found[0])
        spec = importlib.util.spec_from_file_location("_cuda", found[0], loader=loader)
        self.mod = importlib.util.module_from_spec(spec)
        loader.exec_module(self.mod)
        self.name = os.path.basename(os.path.normpath(folder))

    def plan(self, q, k, bt, seqlens, causal):
        return self.mod.get_mla_metadata(seqlens, q.shape[1] * q.shape[2] // k.shape[2], k.shape[2], 132)

    def decode(self, q, k, bt, seqlens, plan, causal):
        md, ns = plan
        return tuple(self.mod.mla_decode(q, k, bt, seqlens, 512, md, ns, 576 ** -0.5, causal))


class RawSparseExtension(RawExtension):
    """The same build's sparse FP8 decoding (--sparse): `bt` carries the indices, `k` the 656-byte cache."""

    def plan(self, q, k, bt, seqlens, causal):
        import torch
        full = torch.full((q.shape[0],), bt.shape[-1], dtype=torch.int32, device=q.device)
        return self.mod.get_mla_metadata(full, q.shape[1] * q.shape[2], 1, 132)

    def decode(self, q, k, bt, seqlens, plan, causal):
        md, ns = plan
        return tuple(self.mod.sparse_decode(q, k, bt, None, md, ns, 576 ** -0.5))


def geomean(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", required=True, help="folder with the referee's sxs.py and compressed anchors")
    ap.add_argument("--only", default="all", choices=["table", "beyond", "all"])
    ap.add_argument("--sparse", action="store_true", help="the referee's sparse FP8 rows against upstream head")
    ap.add_argument("--timing-only", action="store_true",
                    help="skip the agreement check (variants that deliberately compute something else)")
    ap.add_argument("folders", nargs="+", help="one built tree per variant; the first is the baseline")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.anchors))
    import sxs
    import torch

    if args.sparse:
        variants = [RawSparseExtension(f) for f in args.folders]
        anchors = [sxs.AnchorHeadSparse()]
        work = [(group, label, (b, topk), s_q, h_q) for group, label, b, s_q, h_q, topk in sxs.sparse_workloads()]
    else:
        variants = [RawExtension(f) for f in args.folders]
        anchors = [sxs.AnchorV1(), sxs.AnchorHead()]
        work = {"table": sxs.table_workloads(), "beyond": sxs.beyond_workloads(),
                "all": sxs.table_workloads() + sxs.beyond_workloads()}[args.only]
    names = [v.name for v in variants]
    anchor_names = [a.name for a in anchors]
    print("workload," + ",".join(f"{n}_us" for n in names) + "," + ",".join(f"{a}_us" for a in anchor_names) + "," +
          ",".join(f"ratio_{n}" for n in names), flush=True)
    groups = {}
    for wi, (group, label, lens, s_q, h_q) in enumerate(work):
        if args.sparse:
            (b, topk) = lens
            q, ks, bt = sxs.make_sparse_workload(b, s_q, h_q, topk, seed=2000 + wi)
            seqlens, causal = None, False
        else:
            q, ks, bt, seqlens = sxs.make_workload(lens, s_q, h_q, 1, seed=1000 + wi)
            causal = True
        best, results = {}, {}
        for _ in range(2):
            for impl in variants + anchors:
                t, res = sxs.time_graph(impl, q, ks, bt, seqlens, causal)
                best[impl.name] = min(best.get(impl.name, math.inf), t)
                results[impl.name] = res
        out0, lse0 = results[names[0]]
        for n in names[1:] if not args.timing_only else []:
            out, lse = results[n]
            rel = ((out - out0).norm() / out0.norm().clamp_min(1e-20)).item()
            if rel >= 1e-2 or not torch.equal(torch.isinf(lse), torch.isinf(lse0)):
                raise SystemExit(f"{label}: variant {n} disagrees with {names[0]} (out rel-L2 {rel:.1e})")
        anchor = min(best[a] for a in anchor_names)
        ratios = [anchor / best[n] for n in names]
        kind = group if group != "table" else ("compute" if s_q * h_q >= 128 else "memory")
        groups.setdefault(kind, []).append(ratios)
        print(f"{group}: {label}," + ",".join(f"{best[n] * 1e6:.1f}" for n in names) + "," +
              ",".join(f"{best[a] * 1e6:.1f}" for a in anchor_names) + "," + ",".join(f"{r:.3f}" for r in ratios),
              flush=True)
        del q, ks, bt, seqlens, results
        torch.cuda.empty_cache()
    for kind, rows in groups.items():
        columns = list(zip(*rows))
        print(f"# {kind} ({len(rows)} rows) geomean: " +
              ", ".join(f"{n} {geomean(c):.3f} (min {min(c):.3f})" for n, c in zip(names, columns)))


if __name__ == "__main__":
    main()
