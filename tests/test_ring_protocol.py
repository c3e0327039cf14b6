"""The transposed FP8 kernel's page ring (csrc/kernels/splitkv_fp8_transposed.cu), modelled on the CPU.

A producer warp copies the CTA's stream of pages n = 0, 1, 2, ... into a ring of kRing buffers (page n into buffer
n % kRing, after page n - kRing's release on page_empty); two computing warpgroups take the pages in turn (n = w,
w + 2, ...), each waiting on page_full with the parity of page n's phase. An mbarrier's parity wait only says that
the phase of that parity completed last, so a waiter that skips a phase can pass on a stale one. With an odd ring
the warpgroups share every buffer in turn, and a warpgroup's wait for page n skips page n - kRing's phase (the
other's): if page n - kRing's copy is still in flight (copies land in any order), its wait passes at once on page
n - 2 kRing's phase, and it reads the buffer early and arrives on page_empty out of turn (timing-diagnostic builds
with faster pages faulted within 1-30 calls, H200, 2026-11-29). The kernel therefore first waits for page n -
kRing's release on page_empty, which is never more than one phase behind that wait.

The model replays the protocol under random interleavings with the mbarrier semantics of the PTX ISA (a phase
completes when its arrivals and its transaction bytes are all in; `try_wait.parity p` passes iff the phase parity
differs from p) and checks every read: the buffer holds page n, landed, and nothing overwrites it before the
release; every release completes exactly page n's phase of page_empty; nothing deadlocks.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

KERNEL = Path(__file__).resolve().parents[1] / "csrc" / "kernels" / "splitkv_fp8_transposed.cu"


class MBarrier:
    def __init__(self, arrivals: int):
        self.arrivals, self.pending, self.tx, self.phases = arrivals, arrivals, 0, 0

    def arrive(self, tx: int = 0):
        assert self.pending > 0
        self.pending -= 1
        self.tx += tx
        self._complete()

    def land(self, tx: int):
        self.tx -= tx
        assert self.tx >= 0, "more bytes landed than expected: a copy completed on the wrong phase"
        self._complete()

    def _complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phases += 1
            self.pending = self.arrivals

    def passes(self, parity: int) -> bool:
        return (self.phases & 1) != parity


class Violation(AssertionError):
    pass


def run_ring(ring: int, pages: int, guarded: bool, seed: int) -> None:
    """One random interleaving of the producer, the copies in flight and the two warpgroups; raises Violation."""
    rng = random.Random(seed)
    full = [MBarrier(1) for _ in range(ring)]
    empty = [MBarrier(1) for _ in range(ring)]      # the consuming warpgroup, as one arrival
    content = [None] * ring                          # the page a buffer holds (landed)
    in_flight = []                                   # (page, buffer) copies issued, not landed

    def producer():
        for n in range(pages):
            b = n % ring
            if n >= ring:
                while not empty[b].passes(((n // ring) & 1) ^ 1):
                    yield
            full[b].arrive(tx=1)                     # arrive_and_expect_tx, then the copy
            in_flight.append((n, b))
            yield

    def consumer(w):
        for n in range(w, pages, 2):
            b = n % ring
            if guarded and ring % 2 == 1 and n >= ring:
                while not empty[b].passes(((n // ring) & 1) ^ 1):
                    yield
            while not full[b].passes((n // ring) & 1):
                yield
            if content[b] != n or any(buf == b for _, buf in in_flight):
                raise Violation(f"warpgroup {w} read buffer {b} for page {n}: it holds {content[b]}, "
                                f"copies in flight {in_flight}")
            yield                                    # S^T, softmax, O^T on the page
            if content[b] != n:
                raise Violation(f"page {n} in buffer {b} overwritten by page {content[b]} while warpgroup {w} read it")
            if empty[b].phases != n // ring:
                raise Violation(f"warpgroup {w}'s release of page {n} lands on phase {empty[b].phases} of "
                                f"page_empty[{b}], not {n // ring}")
            empty[b].arrive()
            yield

    agents = {"producer": producer(), 0: consumer(0), 1: consumer(1)}
    while agents or in_flight:
        choices = list(agents) + (["land"] if in_flight else [])
        pick = rng.choice(choices)
        if pick == "land":
            n, b = in_flight.pop(rng.randrange(len(in_flight)))     # copies land in any order
            content[b] = n
            full[b].land(1)
            continue
        try:
            next(agents[pick])
        except StopIteration:
            del agents[pick]
    # every page consumed and released: each buffer's barriers went through one phase per page it held
    for b in range(ring):
        uses = len(range(b, pages, ring))
        assert full[b].phases == uses and empty[b].phases == uses


def violations(ring: int, guarded: bool, seeds: int = 400, pages: int = 24) -> int:
    found = 0
    for seed in range(seeds):
        try:
            run_ring(ring, pages, guarded, seed)
        except Violation:
            found += 1
    return found


@pytest.mark.parametrize("ring", [2, 3, 4, 5])
def test_guarded_ring_is_sound(ring):
    """The kernel's protocol: every read sees its own page, every release its own phase, for odd and even rings."""
    assert violations(ring, guarded=True) == 0


@pytest.mark.parametrize("ring", [3, 5])
def test_unguarded_odd_ring_reads_early(ring):
    """Without the release wait an odd ring's warpgroup passes a stale parity: the model finds it (the check has
    teeth), as the timing-diagnostic builds did on the H200."""
    assert violations(ring, guarded=False) > 0


@pytest.mark.parametrize("ring", [2, 4])
def test_unguarded_even_ring_is_sound(ring):
    """An even ring gives each buffer to one warpgroup only, whose waits see every phase: no guard needed there
    (the 16-row e4m3 tile's ring of 4)."""
    assert violations(ring, guarded=False) == 0


def test_kernel_waits_for_the_release_before_an_odd_rings_page():
    """The kernel carries the guarded protocol the model checks: in the computing warpgroups' page loop, an odd ring
    waits on page_empty[buffer] (page n - kRing's release) before the parity wait on page_full[buffer]."""
    source = KERNEL.read_text()
    loop = source[source.index("for (int page = (stream_page + warpgroup) % 2"):]
    guard = re.search(r"if constexpr \(Traits::kRing % 2 == 1\) \{\s*if \(n >= Traits::kRing\) "
                      r"Barrier::wait\(&smem\.page_empty\[buffer\], \(\(n / Traits::kRing\) & 1\) \^ 1\);", loop)
    full_wait = loop.index("Barrier::wait(&smem.page_full[buffer], (n / Traits::kRing) & 1);")
    assert guard is not None and guard.start() < full_wait
