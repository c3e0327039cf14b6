"""Where one call's time goes, kernel by kernel, as the referee runs it: flash_mla and the anchors on one row.

    python benchmarks/kernel_times.py --anchors .anchors --b 128 --mean 8192 --h-q 128 --s-q 2
    python benchmarks/kernel_times.py --anchors .anchors --sparse --h-q 128 --s-q 1
    python benchmarks/kernel_times.py --anchors .anchors --fp8 --h-q 16 --s-q 1

Each implementation's CUDA graph (the referee's: N calls over N cache copies, so the pages come from DRAM while a
split kernel's partial results are still in L2 for its combine) is replayed under torch.profiler, and its kernels
are read back from CUPTI's records. Per kernel name, per call: how often it ran, its mean duration, and its mean
*exposed* time, the part of it that ends after every kernel started before it had ended. With programmatic
dependent launch a combine starts while its split kernel runs and waits for it, so its duration overstates it; the
exposed time is what it adds to the call. `idle` is the time between one kernel's end and the next one's start.
Unlike ncu (benchmarks/ncu_row.py), nothing is flushed or serialised. `--copies 1` runs every call of the graph on
the same cache copy (pages still from DRAM once the cache exceeds L2, but the same addresses every call): what the
referee's walk over fresh copies costs each implementation. `--gap-us G` puts a spin kernel of about G us after
each call (listed as its own kernel): the board then runs below its ~700 W cap, as under ncu, so the split kernels'
times at a high clock can be set beside their times at the cap (the referee's back-to-back calls). `--launch` runs
the same calls another way: `graph` (default) is the referee's graph, calls back to back; `graph-sync` a one-call
graph per cache copy, each replay followed by a synchronize (the GPU idle between calls); `eager` plain stream
launches from Python (the host's launch time between calls); docs/PERF.md has what each mode measured.
"""
import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from row_workload import FULL_CLOCK_MHZ, add_row_arguments, capture, capture_graph, row_label, row_workload


def exposed_times(kernels):
    """kernels: (name, start, end) sorted by start, one stream's. Per kernel (name, duration, exposed) and the idle
    time: exposed = how far its end passes the latest end before it; idle = the gaps where no kernel ran."""
    out, latest, idle = [], None, 0.0
    for name, start, end in kernels:
        if latest is None:
            exposed = end - start
        else:
            idle += max(0.0, start - latest)
            exposed = max(0.0, end - max(latest, start))
        out.append((name, end - start, exposed))
        latest = end if latest is None else max(latest, end)
    return out, idle


def summarise(kernels, calls):
    """Per kernel name: (launches per call, mean us, exposed us per call), and the idle us per call, in the order
    the names first ran."""
    rows, idle = exposed_times(kernels)
    per_name, order = defaultdict(lambda: [0, 0.0, 0.0]), []
    for name, duration, exposed in rows:
        if name not in per_name:
            order.append(name)
        entry = per_name[name]
        entry[0] += 1
        entry[1] += duration
        entry[2] += exposed
    return ([(name, per_name[name][0] / calls, per_name[name][1] / per_name[name][0], per_name[name][2] / calls)
             for name in order], idle / calls)


def short_name(name, width=60):
    """A kernel's name without template arguments and parameters, to fit a table."""
    base = name.replace("(anonymous namespace)::", "").split("(")[0]
    depth, kept = 0, []
    for ch in base:
        depth += ch == "<"
        if depth == 0:
            kept.append(ch)
        depth -= ch == ">"
    text = "".join(kept).replace("void ", "").strip()
    return text if len(text) <= width else "..." + text[-(width - 3):]


LAUNCH_MODES = ("graph", "graph-sync", "eager")


def call_runner(mode, impl, q, ks, bt, seqlens, causal, gap_cycles=0):
    """(run, calls, keep): run() issues `calls` decoding calls over the cache copies as `mode` says (LAUNCH_MODES);
    keep the third value alive while running."""
    import torch
    if mode == "graph":
        graph, calls, outs = capture_graph(impl, q, ks, bt, seqlens, causal, gap_cycles)
        return graph.replay, calls, (graph, outs)
    plan = impl.plan(q, ks[0], bt, seqlens, causal)
    if mode == "eager":
        def run():
            for k in ks:
                impl.decode(q, k, bt, seqlens, plan, causal)
        return run, len(ks), None
    impl.decode(q, ks[0], bt, seqlens, plan, causal)       # warm-up outside the capture
    torch.cuda.synchronize()
    graphs = [capture(lambda k=k: impl.decode(q, k, bt, seqlens, plan, causal)) for k in ks]

    def run():
        for graph, _ in graphs:
            graph.replay()
            torch.cuda.synchronize()
    return run, len(ks), graphs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_row_arguments(ap)
    ap.add_argument("--replays", type=int, default=4,
                    help="rounds profiled per implementation (graph replays, or rounds of --launch's calls)")
    ap.add_argument("--gap-us", type=float, default=0.0,
                    help="a spin of about this many us (at the full clock) after each call: the board below its cap")
    ap.add_argument("--copies", type=int, default=None,
                    help="cache copies the graph's calls walk (default: all, as the referee; 1: the same every call)")
    ap.add_argument("--launch", choices=LAUNCH_MODES, default="graph",
                    help="graph: the referee's graph (calls back to back); graph-sync: a one-call graph per copy, "
                         "synchronised after each replay; eager: stream launches")
    args = ap.parse_args()
    if args.launch != "graph" and args.gap_us:
        ap.error("--gap-us applies to --launch graph only")

    import torch
    from torch.profiler import ProfilerActivity, profile
    q, ks, bt, seqlens, causal, impls = row_workload(args)
    rounds = {"graph": "graph replays", "graph-sync": "rounds of one-call graphs", "eager": "rounds of calls"}
    print(f"# {torch.cuda.get_device_name()}: {row_label(args)}; {args.replays} {rounds[args.launch]} per "
          "implementation; us per call" + (f"; calls over {args.copies} cache copies" if args.copies else "")
          + (f"; a {args.gap_us:g} us spin after each call" if args.gap_us else "")
          + (f"; launched {args.launch}" if args.launch != "graph" else ""))
    print("impl,kernel,launches_per_call,mean_us,exposed_us_per_call")
    for name, impl in impls.items():
        run, calls, keep = call_runner(args.launch, impl, q, ks[:args.copies] if args.copies else ks, bt, seqlens,
                                       causal, gap_cycles=int(args.gap_us * FULL_CLOCK_MHZ))
        for _ in range(2):
            run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.replays):
                run()
            torch.cuda.synchronize()
        kernels = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start),
                         key=lambda k: k[1])
        if not kernels:
            print(f"{name},no kernel records (CUPTI)")
            continue
        rows, idle = summarise(kernels, calls * args.replays)
        for kernel, launches, mean_us, exposed_us in rows:
            print(f"{name},{short_name(kernel)},{launches:.2f},{mean_us:.1f},{exposed_us:.1f}")
        total = sum(r[3] for r in rows) + idle
        print(f"{name},idle,,,{idle:.1f}")
        print(f"{name},total,,,{total:.1f}")
        del run, keep


if __name__ == "__main__":
    main()
