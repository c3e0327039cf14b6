"""One decoding row of flash_mla and of the referee's anchors under ncu, metrics side by side.

Runs each implementation on the same inputs (the referee's workload: pages in random order), one warm-up call
outside the profiled range and one call inside it, then prints one column per kernel of each implementation:

    python benchmarks/ncu_row.py --anchors .anchors --b 128 --mean 8192 --h-q 128 --s-q 2
    python benchmarks/ncu_row.py --anchors .anchors --sparse --b 128 --topk 2048 --h-q 64 --s-q 1
    python benchmarks/ncu_row.py --anchors .anchors --fp8 --b 128 --mean 8192 --h-q 128 --s-q 2
    python benchmarks/ncu_row.py --anchors .anchors --smem --impls flash_mla,head     # shared-memory banks
    python benchmarks/ncu_row.py --anchors .anchors --l2 --impls flash_mla,head       # L2 load, crossbar bytes
    python benchmarks/ncu_row.py --anchors .anchors --sparse --launch --pipes          # launch shape, pipes
    python benchmarks/ncu_row.py --anchors .anchors --balance --h-q 32 --mean 4096     # how evenly the SMs end

The script re-runs itself under ncu (metrics only: durations, DRAM / L2 traffic, instruction counts, stall
reasons; never the anchors' source or SASS; caches flushed before each kernel unless `--warm-caches`), so it
needs ncu on PATH and the referee's folder (sxs.py and the compressed anchors). `--fp8` runs flash_mla's FP8 path
(q and cache quantised per tensor, as `sxs.py --fp8`) against the anchors' bf16; byte and sector ratios are then per
fp8 cache byte (576 per token), so a bf16 kernel reading its cache once shows 2. `--raw FILE` keeps ncu's CSV.
"""
import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from row_workload import add_row_arguments, kinds_for, row_workload

# Per label: the ncu metric and how a value is shown: a factor, or relative to the cache the call must read.
PER_CACHE_BYTE, PER_CACHE_SECTOR = "per cache byte", "per cache sector"
METRICS = {
    "duration (us)": ("gpu__time_duration.sum", 1e-3),
    "DRAM bytes read / cache bytes": ("dram__bytes_read.sum", PER_CACHE_BYTE),
    "L2 sectors read by the SMs / cache sectors": ("lts__t_sectors_srcunit_tex_op_read.sum", PER_CACHE_SECTOR),
    "instructions executed (M)": ("smsp__inst_executed.sum", 1e-6),
    "IPC (active)": ("sm__inst_executed.avg.per_cycle_active", 1.0),
    "SM throughput (%)": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    "stall gmma / issued": ("smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio", 1.0),
    "stall wait / issued": ("smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", 1.0),
    "stall barrier / issued": ("smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", 1.0),
    "stall long scoreboard / issued": ("smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
                                       1.0),
    "grid size (CTAs)": ("launch__grid_size", 1.0),
}
# `--stalls`: the other stall reasons of the same family, per issued instruction (where the split kernel's warps
# wait besides WGMMA and mbarriers: instruction fetch, fixed-latency dependencies, pipe throttles).
STALL_METRICS = {
    f"stall {reason.replace('_', ' ')} / issued": (f"smsp__average_warps_issue_stalled_{reason}_per_issue_active.ratio",
                                                   1.0)
    for reason in ("no_instruction", "short_scoreboard", "math_pipe_throttle", "mio_throttle", "branch_resolving",
                   "dispatch_stall", "selected", "not_selected")
}

# `--smem`: the shared-memory data banks (every operand a WGMMA reads from shared memory, TMA's writes, the
# mailbox's loads and stores) beside the WGMMA count and how busy the tensor pipe is: S at N = 64 reads 4 KiB of
# operands per 32 tensor cycles, the banks' nominal rate, so the split kernel could be bound by the banks rather
# than by the tensor pipe.
SMEM_METRICS = {
    "WGMMA instructions (M, per warp)": ("sm__inst_executed_pipe_tensor_op_gmma.sum", 1e-6),
    "shared bank reads (% of peak, elapsed)": ("l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed", 1.0),
    "shared bank writes (% of peak, elapsed)": ("l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed", 1.0),
    "shared bank reads (M)": ("l1tex__data_bank_reads.sum", 1e-6),
    "shared bank writes (M)": ("l1tex__data_bank_writes.sum", 1e-6),
    "LSU shared wavefronts (M)": ("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", 1e-6),
    "tensor pipe (WGMMA) active (% of peak, elapsed)": (
        "sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_elapsed", 1.0),
    "tensor pipe (WGMMA) active (% of peak, active)": (
        "sm__pipe_tensor_op_hmma_type_hmma_hgmma_qgmma_cycles_active.avg.pct_of_peak_sustained_active", 1.0),
}

# `--l2`: every L2 read (TMA copies included, whatever unit asked), the bytes L2 sends the SMs over the crossbar,
# and how busy L2 is: whether the row tiles that each read every page of their KV head are bound by L2 bandwidth.
L2_METRICS = {
    "L2 sectors read, all units / cache sectors": ("lts__t_sectors_op_read.sum", PER_CACHE_SECTOR),
    "crossbar bytes L2 -> SMs / cache bytes": ("l1tex__m_xbar2l1tex_read_bytes.sum", PER_CACHE_BYTE),
    "L2 throughput (% of peak, elapsed)": ("lts__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    "L2 sectors (% of peak, elapsed)": ("lts__t_sectors.avg.pct_of_peak_sustained_elapsed", 1.0),
    "DRAM throughput (% of peak, elapsed)": ("dram__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
    "L2 hit rate of the SMs' reads (%)": ("lts__t_sector_op_read_hit_rate.pct", 1.0),
    "DRAM bytes written / cache bytes": ("dram__bytes_write.sum", PER_CACHE_BYTE),
}

# `--launch`: the launch shape (threads, cluster, registers, shared memory), which a kernel's design shows.
LAUNCH_METRICS = {
    "threads per CTA": ("launch__block_size", 1.0),
    "cluster size (CTAs)": ("launch__cluster_size", 1.0),
    "registers per thread": ("launch__registers_per_thread", 1.0),
    "shared memory per CTA (KiB, dynamic + static)": ("launch__shared_mem_per_block", 1 / 1024),
}

# `--balance`: how evenly the SMs' work ends (one CTA an SM: an SM's active cycles are its CTA's life). The spread
# of the active cycles over the SMs is what a grid loses to its slowest SMs, whatever made them slow.
BALANCE_METRICS = {
    f"SM active cycles, {stat} (k)": (f"sm__cycles_active.{stat}", 1e-3) for stat in ("min", "avg", "max")
}
BALANCE_METRICS["SM elapsed cycles (k)"] = ("sm__cycles_elapsed.max", 1e-3)

# `--pipes`: instructions by the pipe that executes them (M), where an instruction budget goes: integer and logic
# (alu), fp32 and packed 16-bit (fma; fmaheavy: its multiply-heavy half), transcendentals (xu), memory (lsu),
# uniform datapath, branches and barrier polls (cbu).
PIPE_METRICS = {
    f"instructions, {pipe} pipe (M)": (f"smsp__inst_executed_pipe_{pipe}.sum", 1e-6)
    for pipe in ("alu", "fma", "fmaheavy", "xu", "lsu", "uniform", "cbu", "adu")
}
# ... and how busy the integer and fp32 pipes are (the alu pipe takes a warp instruction in two cycles): whether
# warpgroups that dequantise at the same time on one SM sub-partition queue for it.
PIPE_METRICS.update({
    f"{pipe} pipe active (% of peak, active cycles)":
        (f"sm__pipe_{pipe}_cycles_active.avg.pct_of_peak_sustained_active", 1.0)
    for pipe in ("alu", "fma", "shared")
})


def child(args):
    """Inside ncu: build the workload, run each implementation once warm, once profiled."""
    import torch
    q, ks, bt, seqlens, causal, impls = row_workload(args, prepared_copies=1)
    for impl in impls.values():
        plan = impl.plan(q, ks[0], bt, seqlens, causal)
        impl.decode(q, ks[0], bt, seqlens, plan, causal)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        impl.decode(q, ks[0], bt, seqlens, plan, causal)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def known_metrics(shown, known):
    """The rows whose metric this ncu knows (names differ between versions: `known` is `ncu --query-metrics`'s
    words; the launch attributes are not listed there but always present), and the labels of the others."""
    dropped = [label for label, (m, _) in shown.items()
               if not m.startswith("launch__") and m.split(".")[0] not in known]
    return {label: v for label, v in shown.items() if label not in dropped}, dropped


def parent(args):
    ncu = shutil.which("ncu")
    if ncu is None:
        sys.exit("ncu_row: ncu is not on PATH")
    shown = {**METRICS, **(STALL_METRICS if args.stalls else {}), **(SMEM_METRICS if args.smem else {}),
             **(L2_METRICS if args.l2 else {}), **(LAUNCH_METRICS if args.launch else {}),
             **(PIPE_METRICS if args.pipes else {}), **(BALANCE_METRICS if args.balance else {})}
    known = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout.split()
    shown, dropped = known_metrics(shown, known)
    if dropped:
        print(f"# not known to this ncu: {', '.join(dropped)}")
    metrics = ",".join(m for m, _ in shown.values())
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--metrics", metrics, "--csv",
           "--cache-control", "none" if args.warm_caches else "all",
           "--page", "raw", sys.executable, os.path.abspath(__file__), "--child"] + sys.argv[1:]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if args.raw:
        with open(args.raw, "w") as f:
            f.write(res.stdout)
    if res.returncode != 0:
        sys.exit(f"ncu_row: ncu failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    lines = res.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    rows = [r for r in rows if r.get("ID", "").isdigit()]
    # the bytes the call must read: the cache (dense), or the tokens the indices name (sparse)
    cache_bytes = (args.b * args.s_q * args.topk * 656 if args.sparse else
                   args.b * args.mean * 576 * (1 if args.fp8 else 2))
    names = [f"{r['ID']}:{r['Kernel Name'][:28]}" for r in rows]
    shape = f"topk {args.topk} (sparse)" if args.sparse else f"L = {args.mean}" + (" (fp8 cache)" if args.fp8 else "")
    print(f"# b = {args.b}, {shape}, h_q {args.h_q}, s_q {args.s_q}; cache {cache_bytes / 1e9:.3f} GB; "
          f"implementations in order: {args.impls}")
    print("| metric | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, (metric, scale) in shown.items():
        cells = []
        for r in rows:
            raw = r.get(metric, "").replace(",", "")
            try:
                v = float(raw)
            except ValueError:
                cells.append(raw or "-")
                continue
            if scale == PER_CACHE_BYTE:
                v /= cache_bytes
            elif scale == PER_CACHE_SECTOR:
                v /= cache_bytes / 32                    # 32-byte sectors
            else:
                v *= scale
            cells.append(f"{v:.3g}" if v < 1000 else f"{v:.0f}")
        print(f"| {label} | " + " | ".join(cells) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_row_arguments(ap)
    ap.add_argument("--raw", default=None, help="write ncu's raw CSV here")
    ap.add_argument("--stalls", action="store_true", help="also the other stall reasons (STALL_METRICS)")
    ap.add_argument("--smem", action="store_true", help="also the shared-memory banks, WGMMA count")
    ap.add_argument("--l2", action="store_true", help="also all L2 reads, crossbar bytes to the SMs, L2 and DRAM load")
    ap.add_argument("--launch", action="store_true", help="also the launch shape (threads, cluster, registers, smem)")
    ap.add_argument("--pipes", action="store_true", help="also the instructions per execution pipe")
    ap.add_argument("--balance", action="store_true", help="also the SMs' active cycles (min / avg / max)")
    ap.add_argument("--warm-caches", action="store_true",
                    help="keep L2 as the kernel before left it (ncu flushes it by default): a combine then finds the "
                         "partial results its split kernel left in L2")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    kinds_for(args)    # a wrong --impls or flag combination fails before ncu starts
    (child if args.child else parent)(args)


if __name__ == "__main__":
    main()
