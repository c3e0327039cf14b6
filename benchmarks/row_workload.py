"""The one decoding row that benchmarks/ncu_row.py, power_row.py and kernel_times.py run: its arguments, its label
and the referee's inputs and implementations for it (sxs.py in the anchors' folder builds them, as the referee
does)."""
import os
import sys

# The H100's full SM clock: power_row.py's cycles per call in us at it, kernel_times.py's spin gap in cycles.
FULL_CLOCK_MHZ = 1980.0

# Implementations by name: dense rows (flash_mla's FP8 path with --fp8) and sparse FP8 decoding.
DENSE_KINDS = {"flash_mla": "FlashMLA", "v1": "AnchorV1", "head": "AnchorHead"}
FP8_KINDS = {**DENSE_KINDS, "flash_mla": "FlashMLAFp8"}
SPARSE_KINDS = {"flash_mla": "FlashMLASparse", "head": "AnchorHeadSparse"}


def add_row_arguments(ap):
    """The row's arguments, shared by the scripts that run it."""
    ap.add_argument("--anchors", default=".anchors", help="folder with sxs.py and the anchors")
    ap.add_argument("--impls", default="flash_mla,head", help="comma-separated: flash_mla, v1, head")
    ap.add_argument("--b", type=int, default=128)
    ap.add_argument("--mean", type=int, default=8192, help="dense rows: every sequence's length")
    ap.add_argument("--varied", action="store_true",
                    help="dense rows: the referee's table row 'L=<mean>v' instead (b = 128, lengths ~ N(mean, mean/2))")
    ap.add_argument("--h-q", type=int, default=128)
    ap.add_argument("--s-q", type=int, default=2)
    ap.add_argument("--sparse", action="store_true", help="sparse FP8 decoding (the referee's --sparse workload)")
    ap.add_argument("--fp8", action="store_true", help="flash_mla's FP8 path against the anchors' bf16")
    ap.add_argument("--topk", type=int, default=2048, help="with --sparse: index slots per query token")


def row_label(args):
    if args.sparse:
        return f"sparse b={args.b} topk={args.topk} h={args.h_q} s={args.s_q}"
    return dense_table_label(args) + (" (flash_mla fp8)" if args.fp8 else "")


def dense_table_label(args):
    """The dense row's label in the referee's table form ('L=<mean>f' fixed lengths, 'L=<mean>v' varied)."""
    return f"b={args.b} L={args.mean}{'v' if args.varied else 'f'} h={args.h_q} s={args.s_q}"


def kinds_for(args):
    """Class names in sxs.py of the implementations the row can run, by name."""
    if args.sparse and args.fp8:
        raise SystemExit("--sparse and --fp8: the sparse cache is FP8 already; give one of them")
    if args.sparse and args.varied:
        raise SystemExit("--sparse and --varied: --varied picks a dense table row's lengths; a sparse row has topk")
    kinds = SPARSE_KINDS if args.sparse else FP8_KINDS if args.fp8 else DENSE_KINDS
    unknown = [name for name in args.impls.split(",") if name not in kinds]
    if unknown:
        raise SystemExit(f"--impls: {', '.join(unknown)} not known for this row (known: {', '.join(kinds)})")
    return kinds


def row_workload(args, prepared_copies=None):
    """(q, ks, bt, seqlens, causal, impls): the referee's inputs for the row (pages in random order, N cache copies;
    sparse: bt carries the indices, seqlens is None) and its implementations by name, in --impls order. flash_mla's
    FP8 path quantises q and the first `prepared_copies` cache copies (None: all) once, as the referee does."""
    kinds = kinds_for(args)
    sys.path.insert(0, os.path.abspath(args.anchors))
    import sxs
    if args.sparse:
        q, ks, bt = sxs.make_sparse_workload(args.b, args.s_q, args.h_q, args.topk, seed=1)
        seqlens, causal = None, False
    else:
        lens = [args.mean] * args.b
        if args.varied:
            label = dense_table_label(args)
            found = [w_lens for _group, w_label, w_lens, _s_q, _h_q in sxs.table_workloads() if w_label == label]
            if not found:
                raise SystemExit(f"--varied: the referee's table has no row {label!r} (b = 128; L 4096, 8192, 16384; "
                                 "h_q 16-128; s_q 1, 2)")
            lens = found[0]
        q, ks, bt, seqlens = sxs.make_workload(lens, args.s_q, args.h_q, 1, seed=1)
        causal = True
    impls = {}
    for name in args.impls.split(","):
        impl = getattr(sxs, kinds[name])()
        if args.fp8 and name == "flash_mla":
            impl.prepare(q, ks if prepared_copies is None else ks[:prepared_copies])
        impls[name] = impl
    return q, ks, bt, seqlens, causal, impls


def capture(record):
    """(graph, result): a CUDA graph of the work `record()` launches, captured on a side stream (as torch.cuda.graph
    wants), and what record() returned (its outputs: keep them alive while replaying)."""
    import torch
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        result = record()
    torch.cuda.current_stream().wait_stream(stream)
    return graph, result


def capture_graph(impl, q, ks, bt, seqlens, causal, gap_cycles=0):
    """(graph, calls, outs): the referee's graph for one implementation (sxs.time_graph: N calls over N cache
    copies), planned and captured just before its replays, since the anchors' plans share state between calls (a v1
    plan made before head's failed its split-count assert); replayed once. Keep `outs` alive while replaying.
    gap_cycles > 0 puts a one-thread spin kernel of that many clock cycles (`torch.cuda._sleep`) after each call: the
    board then runs below its power cap, at a higher clock, as under ncu's serialised replays."""
    import torch
    plan = impl.plan(q, ks[0], bt, seqlens, causal)
    calls = max(len(ks), 8)
    for i in range(2):
        impl.decode(q, ks[i % len(ks)], bt, seqlens, plan, causal)
    torch.cuda.synchronize()

    def record():
        outs = []
        for i in range(calls):
            outs.append(impl.decode(q, ks[i % len(ks)], bt, seqlens, plan, causal))
            if gap_cycles > 0:
                torch.cuda._sleep(gap_cycles)
        return outs
    graph, outs = capture(record)
    graph.replay()
    torch.cuda.synchronize()
    return graph, calls, outs
