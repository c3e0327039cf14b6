"""Where a split-kernel call's time goes per CTA: the %globaltimer timeline of csrc/kernels/probe.h, read back from
the last call of the referee's graph (calls back to back over fresh cache copies), summarised per event.

The kernels write it only when built with the probe (a diagnostic build; the product build has no probe code):

    NVCC_APPEND_FLAGS=-DFLASH_MLA_PROBE python3 setup.py build_ext --inplace
    python3 benchmarks/probe_timeline.py --anchors .anchors --mean 4096 --h-q 128 --s-q 1 [--fp8] [--raw F.npy]

Printed per row (us; medians, p10, p90, max over CTAs or pieces): q_landed_after_entry (the first Q tile waited for,
from the CTA's entry), first_s_after_q (S of a piece's first page complete, from its Q), pace_us_per_page (a piece's
pairs, first S to the last pair's end, per page), epilogue (normalisation and stores, kPageA / kPageB; split pieces
write fp32 partials, the others out), gap_prev_epi_to_q (a piece's Q waited for, from the previous epilogue's end),
overhead (a CTA's time outside its pieces' page loops: start, epilogues, boundaries, end) and the exit times' spread;
then, in clock64 cycles per page of the CTA (kPageA / kPageB; CTAs with at most 7 pieces), the time each warpgroup's
thread 0 spent in the pair loop's waits: *_unit_waits (S waiting for page units to land; with an e4m3 q also P V
waiting for the V halves to be widened), *_mailbox_waits (for the other warpgroup's post), *_pv_waits (for its own
P V WGMMAs to complete). Last, the pair timeline: for pairs 4..7 of each CTA's first piece with at least 16 pages, the
clock64 cycle of each event of each warpgroup (probe.h ProbePairEvent) from kPageA's start of the pair, medians over
those pairs of all CTAs, and the pair's length (kPageA's start to its next start); with several row tiles a KV head,
the same per row tile (pages' landings, page a's V refill issue, the pairs' ends).
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SLOTS = 128                                  # kProbeSlots (probe.h)
ENTRY, SM, ROLE_START, EXIT, PIECE_COUNT, FIRST_PIECE, PER_PIECE, MAX_PIECES = 0, 1, 2, 3, 4, 8, 8, 7
UNIT_WAITS, MAILBOX_WAITS, PV_WAITS = 5, 6, 7          # cycles, summed over the CTA's pieces (values)
WAITS = (("unit_waits", UNIT_WAITS), ("mailbox_waits", MAILBOX_WAITS), ("pv_waits", PV_WAITS))
Q_LANDED, FIRST_S, MAINLOOP_END, EPILOGUE_END, PAGES, SEQ, SPLIT = range(7)
FIRST_PAIR_SLOT, PAIR_EVENTS, TIMED_PAIRS = 64, 13, 4    # kProbeFirstPairSlot, kProbePairEvents, kProbePairs
# ProbePairEvent, in slot order, and each warpgroup's events in the order its schedule reaches them (mainloop.h)
PAIR_EVENT_NAMES = ("start", "units_landed", "s_done", "probs_ready", "taken", "posted", "pv_issued", "end",
                    "v_refill_issued", "pava_issuing", "pava_issued", "pava_done", "pbvb_issuing")
ROLE_EVENTS = {"a": ("units_landed", "s_done", "probs_ready", "posted", "pava_issuing", "pava_issued", "taken",
                     "pava_done", "pbvb_issuing", "pv_issued", "v_refill_issued", "end"),
               "b": ("units_landed", "s_done", "probs_ready", "taken", "posted", "pava_issuing", "pava_issued",
                     "pbvb_issuing", "pv_issued", "pava_done", "v_refill_issued", "end")}


def has_work(cta):
    """A CTA's stamps count when kPageA stamped its entry and its exit (SM parts with no work stamp neither)."""
    return cta[0][ENTRY] > 0 and cta[0][EXIT] > 0


def pair_timeline(kept):
    """{(role, event): [cycles from kPageA's start of the pair]} over the timed pairs of the CTAs kept, and the
    pairs' lengths in cycles (kPageA's start to its next start, within the window)."""
    events = {(role, name): [] for role in ("a", "b") for name in ROLE_EVENTS[role]}
    lengths = []
    for s in kept:
        a = s[0]
        for j in range(TIMED_PAIRS):
            base = FIRST_PAIR_SLOT + PAIR_EVENTS * j
            start = int(a[base])
            if start == 0:
                continue
            for role, w in (("a", 0), ("b", 1)):
                for name in ROLE_EVENTS[role]:
                    t = int(s[w][base + PAIR_EVENT_NAMES.index(name)])
                    if t:
                        events[(role, name)].append(t - start)
            if j + 1 < TIMED_PAIRS and int(a[base + PAIR_EVENTS]):
                lengths.append(int(a[base + PAIR_EVENTS]) - start)
    return events, lengths


def pair_timeline_by_tile(stamps, tiles):
    """pair_timeline per row tile: {m_tile: (events, lengths)}. stamps: (ctas, 3, SLOTS) in the linear block index's
    order, the grid being (row tiles, KV heads, SM parts), so a CTA's row tile is its index mod `tiles`. The row tiles
    of one KV head read the same pages: whether they share the pages' fetches or all wait on the same misses shows in
    each tile's landing times."""
    out = {}
    for t in range(tiles):
        kept = [s for s in stamps[t::tiles] if has_work(s)]
        events, lengths = pair_timeline(kept)
        if lengths:
            out[t] = (events, lengths)
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def summarise(stamps):
    """stamps: (ctas, 3 warpgroups, SLOTS) integers as the kernel wrote them. CTAs without an exit stamp of kPageA
    (SM parts with no work) are left out. Returns (figures by name: lists of us, exits in us from the first entry,
    the CTAs kept)."""
    kept = [s for s in stamps if has_work(s)]
    if not kept:
        return {}, [], []
    t0 = min(int(s[w][ENTRY]) for s in kept for w in range(3) if s[w][ENTRY] > 0)

    def us(t):
        return (int(t) - t0) / 1000.0

    figures = {name: [] for name in ("q_landed_after_entry", "first_s_after_q", "first_s_after_q_b",
                                     "pace_us_per_page", "epilogue_a", "epilogue_b", "epilogue_a_out",
                                     "epilogue_a_partials", "gap_prev_epi_to_q", "overhead")}
    cycles = {f"{role}_{name}_cycles_per_page": [] for name, _ in WAITS for role in ("a", "b")}
    exits = []
    for s in kept:
        a, b = s[0], s[1]
        end = max(us(s[w][EXIT]) for w in range(3) if s[w][EXIT] > 0)
        exits.append(end)
        in_loops = 0.0
        pieces, cta_pages = int(a[PIECE_COUNT]), 0
        for k in range(min(pieces, MAX_PIECES)):
            base = FIRST_PIECE + PER_PIECE * k
            landed, first_s, loop_end = us(a[base + Q_LANDED]), us(a[base + FIRST_S]), us(a[base + MAINLOOP_END])
            epilogue = us(a[base + EPILOGUE_END]) - loop_end
            pages = int(a[base + PAGES])
            cta_pages += pages
            if k == 0:
                figures["q_landed_after_entry"].append(landed - us(a[ENTRY]))
            else:
                figures["gap_prev_epi_to_q"].append(landed - us(a[base - PER_PIECE + EPILOGUE_END]))
            figures["first_s_after_q"].append(first_s - landed)
            figures["first_s_after_q_b"].append(us(b[base + FIRST_S]) - us(b[base + Q_LANDED]))
            if pages > 1:
                figures["pace_us_per_page"].append((loop_end - first_s) / (pages - 1))
            figures["epilogue_a"].append(epilogue)
            figures["epilogue_a_partials" if a[base + SPLIT] else "epilogue_a_out"].append(epilogue)
            figures["epilogue_b"].append(us(b[base + EPILOGUE_END]) - us(b[base + MAINLOOP_END]))
            in_loops += loop_end - landed
        figures["overhead"].append(end - us(a[ENTRY]) - in_loops)
        if 0 < pieces <= MAX_PIECES and cta_pages > 0:
            for name, slot in WAITS:
                for role, w in (("a", a), ("b", b)):
                    cycles[f"{role}_{name}_cycles_per_page"].append(int(w[slot]) / cta_pages)
    figures.update(cycles)
    return figures, exits, kept


def main():
    from row_workload import add_row_arguments, capture_graph, row_label, row_workload
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_row_arguments(ap)
    ap.add_argument("--raw", default=None, help="save the stamps (numpy, (ctas, 3, 128)) here")
    args = ap.parse_args()
    args.impls = "flash_mla"
    import numpy as np
    import torch
    import flash_mla._cuda as ext
    q, ks, bt, seqlens, causal, impls = row_workload(args)
    # The kernel writes without a bound: size the buffer for its grid, (row tiles, KV heads, SM parts), at most
    # max(SMs, row tiles x KV heads) CTAs since the plan's SM parts are SMs // (row tiles x KV heads) or 1.
    h_kv = ks[0].shape[2]
    tiles = -(-(q.shape[1] * q.shape[2] // h_kv) // 64)
    ctas = max(torch.cuda.get_device_properties(0).multi_processor_count, tiles * h_kv)
    buf = torch.zeros(ctas * 3 * SLOTS, dtype=torch.int64, device="cuda")
    ext.set_probe(buf)
    graph, _calls, outs = capture_graph(impls["flash_mla"], q, ks, bt, seqlens, causal)
    buf.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ext.set_probe(None)
    stamps = buf.view(-1, 3, SLOTS).cpu().numpy()
    if args.raw:
        np.save(args.raw, stamps[stamps[:, 0, ENTRY] > 0])
    figures, exits, kept = summarise(stamps)
    if not kept:
        raise SystemExit("no stamps: build the kernels with NVCC_APPEND_FLAGS=-DFLASH_MLA_PROBE")
    print(f"# {torch.cuda.get_device_name()}: {row_label(args)}; {len(kept)} CTAs with work; us")
    print(f"exit (from the first entry): min {min(exits):.1f} median {pct(exits, .5):.1f} p90 {pct(exits, .9):.1f} "
          f"max {max(exits):.1f}")
    for name, xs in figures.items():
        if xs:
            print(f"{name}: median {pct(xs, .5):.2f} p10 {pct(xs, .1):.2f} p90 {pct(xs, .9):.2f} max {max(xs):.2f} "
                  f"n {len(xs)}")
    events, lengths = pair_timeline(kept)
    if lengths:
        print(f"pair timeline (clock64 cycles from kPageA's start of the pair; medians over {len(lengths)} pairs): "
              f"pair length {pct(lengths, .5):.0f} (p10 {pct(lengths, .1):.0f}, p90 {pct(lengths, .9):.0f})")
        for role in ("a", "b"):
            print(f"  kPage{role.upper()}: " + ", ".join(
                f"{name} {pct(events[(role, name)], .5):.0f}" for name in ROLE_EVENTS[role] if events[(role, name)]))
    if tiles > 1:
        for t, (events, lengths) in pair_timeline_by_tile(stamps, tiles).items():
            print(f"row tile {t} ({len(lengths)} pairs): pair length {pct(lengths, .5):.0f}; " + "; ".join(
                f"kPage{role.upper()} units_landed {pct(events[(role, 'units_landed')], .5):.0f} v_refill_issued "
                f"{pct(events[(role, 'v_refill_issued')], .5):.0f} end {pct(events[(role, 'end')], .5):.0f}"
                for role in ("a", "b") if events[(role, "units_landed")] and events[(role, "v_refill_issued")]))
    del outs, graph


if __name__ == "__main__":
    main()
