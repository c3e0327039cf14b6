"""CPU checks of benchmarks/probe_timeline.py's accounting of the kernel's timeline stamps (csrc/kernels/probe.h)."""
import importlib.util
import os
import re

import numpy as np
import pytest

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_spec = importlib.util.spec_from_file_location("probe_timeline",
                                               os.path.join(_ROOT, "benchmarks", "probe_timeline.py"))
probe_timeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe_timeline)
P = probe_timeline


def _cta(entry, pieces, exit_, waits=((0, 0, 0), (0, 0, 0))):
    """One CTA's stamps (ns): pieces = [(q_landed, first_s, loop_end, epilogue_end, pages, split)], the same for
    both computing warpgroups; waits = per warpgroup (unit, mailbox, P V) wait cycles."""
    s = np.zeros((3, P.SLOTS), dtype=np.int64)
    for w in (0, 1):
        s[w, P.ENTRY], s[w, P.EXIT], s[w, P.PIECE_COUNT] = entry, exit_, len(pieces)
        s[w, P.UNIT_WAITS], s[w, P.MAILBOX_WAITS], s[w, P.PV_WAITS] = waits[w]
        for k, (landed, first_s, loop_end, epi_end, pages, split) in enumerate(pieces):
            base = P.FIRST_PIECE + P.PER_PIECE * k
            s[w, base + P.Q_LANDED], s[w, base + P.FIRST_S] = landed, first_s
            s[w, base + P.MAINLOOP_END], s[w, base + P.EPILOGUE_END] = loop_end, epi_end
            s[w, base + P.PAGES], s[w, base + P.SPLIT] = pages, split
    return s


def test_piece_figures_and_overhead():
    # entry at 1000 ns; piece 0: Q at 6 us, first S 8 us, 11 pages to 28 us, epilogue to 31 us (out);
    # piece 1: Q at 32 us, first S 34 us, 5 pages to 42 us, epilogue to 44 us (partials); exit 44.5 us
    cta = _cta(1000, [(6000 + 1000, 8000 + 1000, 28000 + 1000, 31000 + 1000, 11, 0),
                      (32000 + 1000, 34000 + 1000, 42000 + 1000, 44000 + 1000, 5, 1)], 44500 + 1000,
               waits=((1600, 3200, 800), (160, 16, 0)))
    idle = np.zeros((3, P.SLOTS), dtype=np.int64)
    idle[0, P.ENTRY] = 500        # an SM part with no work: entry, no exit
    figures, exits, kept = P.summarise(np.stack([cta, idle]))
    assert len(kept) == 1 and exits == [pytest.approx(44.5)]
    assert figures["q_landed_after_entry"] == [pytest.approx(6.0)]
    assert figures["first_s_after_q"] == [pytest.approx(2.0), pytest.approx(2.0)]
    assert figures["pace_us_per_page"] == [pytest.approx(20.0 / 10), pytest.approx(8.0 / 4)]
    assert figures["epilogue_a_out"] == [pytest.approx(3.0)] and figures["epilogue_a_partials"] == [pytest.approx(2.0)]
    assert figures["gap_prev_epi_to_q"] == [pytest.approx(1.0)]
    # outside the page loops: 44.5 us - (22 + 10) us
    assert figures["overhead"] == [pytest.approx(12.5)]
    # wait cycles per page of the CTA (16 pages)
    assert figures["a_unit_waits_cycles_per_page"] == [pytest.approx(100)]
    assert figures["a_mailbox_waits_cycles_per_page"] == [pytest.approx(200)]
    assert figures["a_pv_waits_cycles_per_page"] == [pytest.approx(50)]
    assert figures["b_unit_waits_cycles_per_page"] == [pytest.approx(10)]
    assert figures["b_mailbox_waits_cycles_per_page"] == [pytest.approx(1)]
    assert figures["b_pv_waits_cycles_per_page"] == [pytest.approx(0)]


def test_no_stamps_keeps_nothing():
    figures, exits, kept = P.summarise(np.zeros((4, 3, P.SLOTS), dtype=np.int64))
    assert figures == {} and exits == [] and kept == []


def test_slot_numbers_match_the_kernel_header():
    with open(os.path.join(_ROOT, "csrc", "kernels", "probe.h")) as f:
        header = f.read()
    values = {name: int(v) for name, v in re.findall(r"(kProbe\w+) = (\d+)", header)}
    assert values["kProbeEntry"] == P.ENTRY and values["kProbeSm"] == P.SM and values["kProbeExit"] == P.EXIT
    assert values["kProbeRoleStart"] == P.ROLE_START and values["kProbePieceCount"] == P.PIECE_COUNT
    assert values["kProbeFirstPiece"] == P.FIRST_PIECE
    assert (values["kProbeUnitWaits"], values["kProbeMailboxWaits"], values["kProbePvWaits"]) == (
        P.UNIT_WAITS, P.MAILBOX_WAITS, P.PV_WAITS)
    assert (values["kProbeQLanded"], values["kProbeFirstS"], values["kProbeMainloopEnd"], values["kProbeEpilogueEnd"],
            values["kProbePages"], values["kProbeSeq"], values["kProbeSplit"]) == (
        P.Q_LANDED, P.FIRST_S, P.MAINLOOP_END, P.EPILOGUE_END, P.PAGES, P.SEQ, P.SPLIT)
    per_piece = re.search(r"kProbeSlotsPerPiece = (\d+)", header)
    assert int(per_piece.group(1)) == P.PER_PIECE
    constants = {name: int(v) for name, v in re.findall(r"constexpr int (kProbe\w+) = (\d+);", header)}
    assert constants["kProbeSlots"] == P.SLOTS and constants["kProbePairEvents"] == P.PAIR_EVENTS
    assert constants["kProbePairs"] == P.TIMED_PAIRS
    # kProbeFirstPairSlot = kProbeFirstPiece + kProbeSlotsPerPiece * kProbeMaxPieces
    assert values["kProbeFirstPiece"] + P.PER_PIECE * constants["kProbeMaxPieces"] == P.FIRST_PAIR_SLOT
    names = ["kProbePairStart", "kProbeUnitsLanded", "kProbeSDone", "kProbeProbsReady", "kProbeTaken", "kProbePosted",
             "kProbePvIssued", "kProbePairEnd", "kProbeVRefillIssued", "kProbePaVaIssuing", "kProbePaVaIssued",
             "kProbePaVaDone", "kProbePbVbIssuing"]
    events = dict(re.findall(r"(" + "|".join(names) + r") = (\d+)", header))
    assert [int(events[n]) for n in names] == list(range(len(P.PAIR_EVENT_NAMES)))


def test_pair_timeline():
    # two timed pairs of one CTA: kPageA starts them at cycles 1000 and 7000, events relative to those starts
    cta = _cta(1000, [(6000, 8000, 28000, 31000, 24, 0)], 44500)
    for j, start in enumerate((1000, 7000)):
        base = P.FIRST_PAIR_SLOT + P.PAIR_EVENTS * j
        for w, offsets in ((0, (0, 1600, 2100, 3000, 4400, 3100, 4900, 5800, 5000, 3150, 3200, 4500, 4600)),
                           (1, (10, 2400, 2700, 3800, 3900, 4300, 5400, 6400, 5900, 4350, 4400, 5600, 4450))):
            for event, offset in enumerate(offsets):
                cta[w, base + event] = start + offset
    events, lengths = P.pair_timeline([cta])
    assert lengths == [6000]
    assert events[("a", "units_landed")] == [1600, 1600] and events[("a", "taken")] == [4400, 4400]
    assert events[("b", "posted")] == [4300, 4300] and events[("b", "end")] == [6400, 6400]
    assert events[("a", "v_refill_issued")] == [5000, 5000] and events[("b", "v_refill_issued")] == [5900, 5900]
    assert events[("a", "pava_done")] == [4500, 4500] and events[("b", "pbvb_issuing")] == [4450, 4450]


def test_pair_timeline_by_tile():
    # four CTAs of a two-tile grid (index mod 2 = row tile); tile 1's pages land 500 cycles later
    ctas = []
    for i in range(4):
        cta = _cta(1000, [(6000, 8000, 28000, 31000, 24, 0)], 44500)
        late = 500 * (i % 2)
        for j, start in enumerate((1000, 7000)):
            base = P.FIRST_PAIR_SLOT + P.PAIR_EVENTS * j
            for w, offsets in ((0, (0, 1600 + late, 2100, 3000, 4400, 3100, 4900, 5800, 5000, 3150, 3200, 4500,
                                    4600)),
                               (1, (10, 2400 + late, 2700, 3800, 3900, 4300, 5400, 6400, 5900, 4350, 4400, 5600,
                                    4450))):
                for event, offset in enumerate(offsets):
                    cta[w, base + event] = start + offset
        ctas.append(cta)
    by_tile = P.pair_timeline_by_tile(np.stack(ctas), 2)
    assert sorted(by_tile) == [0, 1]
    assert by_tile[0][0][("a", "units_landed")] == [1600] * 4 and by_tile[1][0][("a", "units_landed")] == [2100] * 4
    assert by_tile[1][0][("b", "units_landed")] == [2900] * 4 and by_tile[0][1] == [6000, 6000]
