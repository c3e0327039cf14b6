"""CPU model check of the paired row tiles' page-copy protocol (split kernel: mainloop.h, splitkv_kernel.h).

Paired row tiles: two CTAs of a cluster (rank 0 the leader, rank 1 the follower) walk the same pages and share
every page copy by TMA multicast. Each CTA has two warpgroups (kPageA, kPageB) and two page buffers (page k of
a piece in buffer k % 2); a buffer's units form three copy groups (VLow, VHigh, Rope), each unit with its
`unit_full` transaction mbarrier. The last reader of a group refills it (`refill`): it arms the group's units in
its own CTA, then releases the group to the pair, and one CTA issues the copy into both. Two forms of the
release are modelled (the experiment of commit 39f5906, reverted by d65e45b; mainloop.h is unpaired now):
  * "leader_waits": the leader holds `group_free[stage][group]`, an mbarrier of count 2; the follower arrives
    on it and goes on; the leader arrives, waits for the phase of the page just released, then issues;
  * "second_issues" (the form committed): both CTAs add 1 to the leader's `group_releases[stage][group]` (an
    acq_rel DSMEM atomic); the one that finds an odd count (the second releaser) issues, nobody waits.

Modelled, step by step as in the source: the kernel shell (arm_first_pages, the cluster syncs), the prologue's
first copies, attend_piece's two warpgroup programs per pair (compute_s unit by unit in refill order, the
refills, the probs_posted mailbox, the V-half waits, issue_pv / warpgroup_wait<1> / wait_pv as WGMMA batches
that read until they are retired, the optional rescale wait, zero_tail_rows as a write on a piece's last page),
pieces with no pages, the walk of tile_scheduler.h (next_block, next_seq_using, first_block), q_full and which
piece's Q the tile holds, and, in FP8-cache runs (4.5-unit pages), the kQWidened rendezvous of both warpgroups.
mbarriers follow PTX: pending arrivals and a tx-count (which may go negative), a phase completing when both reach
zero, parity waits that pass while the current phase's parity differs from the one waited for. Each copy unit
lands in each CTA as a separate event the scheduler may fire at any time after the issue; the scheduler picks
any enabled step at random (per-run speeds per warpgroup and landing eagerness). Steps: each wait, each action
on shared state; a group's arming (local, unobservable) and a group's issue (its copies land one by one) are
one step each.

Not modelled: memory ordering inside a CTA (fences, proxies, release/acquire: a warpgroup is one sequential
program, as if its 128 threads moved together; refill's single thread is not separate from the others), the Q
tile's data and cp.async details (only q_full's ordering and the piece id it holds), the math (S, softmax,
P V values), the intra-warpgroup named barriers, the epilogue (no shared memory), and an SM part without pieces
(both CTAs return before any barrier).

Properties, over random interleavings of several page walks:
  1. no deadlock: every program finishes (all blocked with nothing in flight fails, listing the waits);
  2. no overwrite: a copy is issued or lands into a CTA's buffer group only after every warpgroup of that CTA
     that reads the group released its previous page (and no warpgroup releases a group that a WGMMA it has
     not retired still reads, nor reads a page it released, nor writes a unit (tail zeroing, fp8 widening)
     that a WGMMA of the other warpgroup still reads);
  3. no stale read: every read (S, P V, tail zeroing, Q, the mailbox) sees the page / piece / pair it expects,
     at issue and when its WGMMA retires;
  4. no phase aliasing: a parity wait passes only with its barrier exactly one phase past the one waited for,
     and no barrier runs two phases ahead of a waiter;
  5. a clean end: no copy in flight, no armed or half-arrived barrier, every buffer got exactly its pages.
Mutations of the protocol show that the checker fails them.
"""
from __future__ import annotations

import random

import pytest

A, B = 0, 1                          # WarpgroupRole::kPageA, kPageB
ROLE = ("kPageA", "kPageB")
LEADER = 0                           # kLeaderRank
VLOW, VHIGH, ROPE = 0, 1, 2          # CopyGroup
GROUP_NAME = ("VLow", "VHigh", "Rope")
UNIT_BYTES = 8192                    # Traits::kUnitBytes
# Readers of copy group g of buffer s: the warpgroup computing S on the buffer (every unit) and the owner of the
# V half (kPageA the low half of both pages, kPageB the high half).
READERS = ((frozenset({A}), frozenset({A, B}), frozenset({A})),
           (frozenset({A, B}), frozenset({B}), frozenset({B})))


class Layout:
    """The units of a page (SplitKvTraits): group_first_unit / group_units, and compute_s's unit order."""

    def __init__(self, units_per_half):
        self.units = 2 * units_per_half + 1                        # kUnits: 9 (16-bit cache) or 5 (fp8)
        rope = self.units - 1
        self.group_units = (tuple(range(units_per_half)), tuple(range(units_per_half, rope)), (rope,))
        self.unit_group = [VLOW] * units_per_half + [VHIGH] * units_per_half + [ROPE]
        self.s_order = tuple((i + rope) % self.units for i in range(self.units))    # RoPE first
        self.v_half = self.group_units[:2]                          # what kPageA / kPageB's P V read


BF16_LAYOUT, FP8_LAYOUT = Layout(4), Layout(2)


class Violation(AssertionError):
    def __init__(self, kind, message):
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


class MBarrier:
    """An mbarrier as PTX defines it: the current phase completes when its pending arrival count and its
    tx-count are both zero; then the phase advances and the arrival count is re-armed. `phase` counts the
    completed phases (its low bit is the parity a waiter compares with)."""

    __slots__ = ("count", "name", "pending", "phase", "tx")

    def __init__(self, name, count):
        self.name, self.count, self.pending, self.tx, self.phase = name, count, count, 0, 0

    def arrive(self, expect_tx=0):      # mbarrier.arrive (.expect_tx: the bytes are expected first)
        if self.pending == 0:
            raise Violation("phase", f"{self}: an arrival beyond the count of phase {self.phase}")
        self.tx += expect_tx
        self.pending -= 1
        self._advance()

    def complete_tx(self, nbytes):      # a copy's bytes landed (complete_tx::bytes)
        self.tx -= nbytes
        self._advance()

    def _advance(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.count

    def idle(self):
        return self.pending == self.count and self.tx == 0

    def __repr__(self):
        return f"{self.name}(phase {self.phase}, {self.pending} arrivals and {self.tx} bytes pending)"


class Wait:
    """mbarrier.try_wait.parity in a loop on `bar` with `parity` (the kernel's phase bit); `expect` is the
    phase (absolute) the model knows the waiter means, `what` what it waits for."""

    __slots__ = ("bar", "expect", "parity", "what")

    def __init__(self, bar, parity, expect, what):
        self.bar, self.parity, self.expect, self.what = bar, parity, expect, what

    def ready(self):
        bar = self.bar
        if (bar.phase & 1) != self.parity:
            return True
        if bar.phase > self.expect + 1:
            raise Violation("phase", f"{self}: the barrier ran two phases ahead of its waiter")
        return False

    def passed(self):
        if self.bar.phase != self.expect + 1:
            raise Violation("phase", f"wait ({self.what}) for phase {self.expect} (parity {self.parity}) passed "
                                     f"with {self.bar}")

    def __repr__(self):
        return f"wait ({self.what}) parity {self.parity} (phase {self.expect}) on {self.bar}"


class Until:
    """A wait on anything else (barrier.cluster, bar.sync): passes once `pred()` holds."""

    __slots__ = ("bar", "pred", "what")

    def __init__(self, pred, what):
        self.bar, self.pred, self.what = None, pred, what

    def ready(self):
        return self.pred()

    def passed(self):
        pass

    def __repr__(self):
        return f"wait {self.what}"


class Cta:
    def __init__(self, rank, layout, mutation):
        self.rank = rank
        units = layout.units
        self.unit_full = [[MBarrier(f"cta{rank}.unit_full[{s}][{u}]", 1) for u in range(units)] for s in (0, 1)]
        self.group_free = [[MBarrier(f"cta{rank}.group_free[{s}][{GROUP_NAME[g]}]",
                                     2 * len(layout.group_units[g]) if mutation == "per_unit_release" else 2)
                            for g in range(3)] for s in (0, 1)]
        self.probs_posted = [MBarrier(f"cta{rank}.probs_posted[{ROLE[wg]}]", 1) for wg in (A, B)]
        self.q_full = MBarrier(f"cta{rank}.q_full", 1)
        self.content = [[None] * units for _ in (0, 1)]     # the page (piece, page) each unit holds
        self.q_content = None                               # the piece whose Q tile the Q buffer holds
        self.mailbox = None                                 # (poster, pair) of the last post
        self.issued = [[0] * units for _ in (0, 1)]         # copies issued into each unit so far
        self.released = [[[0, 0] for _ in range(3)] for _ in (0, 1)]    # pages of each group each wg released
        self.wgmma = ([], [])                               # per warpgroup: WGMMA batches not yet retired
        self.widened = {}                                   # kQWidened arrivals per piece
        self.group_releases = [[0] * 3 for _ in (0, 1)]     # "second_issues": releases counted by the atomic


class PairModel:
    """One SM part's pieces (`pieces`: page counts) walked by a cluster of two CTAs, under one interleaving."""

    def __init__(self, pieces, seed, mutation=None, protocol="leader_waits"):
        self.pieces = list(pieces)
        self.mutation, self.protocol = mutation, protocol
        rng = self.rng = random.Random(seed)
        self.layout = FP8_LAYOUT if rng.random() < 0.5 else BF16_LAYOUT
        self.rendezvous = self.layout is FP8_LAYOUT and rng.random() < 0.7     # widen_q's kQWidened sync
        # Page k of a piece goes to buffer k % 2 (tile_scheduler.h): the pages each buffer holds, in order.
        self.walk = [[(p, k) for p, n in enumerate(self.pieces) for k in range(s, n, 2)] for s in (0, 1)]
        self.ctas = [Cta(rank, self.layout, mutation) for rank in (0, 1)]
        self.in_flight = []                                 # ("page", cta, stage, unit, page, index) / ("q", cta, seq)
        self.cluster_arrivals = [0, 0]                      # the two cluster_sync_all of the kernel shell
        self.where = {}

    # ---- tile_scheduler.h ---------------------------------------------------------------------------------
    def next_seq_using(self, seq, stage):
        for s in range(seq, len(self.pieces)):
            if self.pieces[s] > stage:
                return s
        return None

    def first_block(self, stage):
        seq = self.next_seq_using(0, stage)
        return None if seq is None else (seq, stage)

    def next_block(self, seq, page, stage):
        if page + 2 < self.pieces[seq]:
            return (seq, page + 2)
        nxt = self.next_seq_using(seq + 1, stage)
        return None if nxt is None else (nxt, stage)

    # ---- copies ---------------------------------------------------------------------------------------------
    def check_free(self, cta, stage, unit, index, page, verb):
        group = self.layout.unit_group[unit]
        for wg in READERS[stage][group]:
            if cta.released[stage][group][wg] < index:
                raise Violation("overwrite", f"copy of page {page} {verb} into cta{cta.rank} buffer {stage} unit "
                                             f"{unit} (its page #{index}) while {ROLE[wg]} of that CTA released only "
                                             f"{cta.released[stage][group][wg]} pages of group "
                                             f"{GROUP_NAME[group]}: it may still read page #{index - 1}")

    def arm(self, cta, stage, group):
        """arm_group: arrive_and_expect_tx on each unit's barrier. Local, and while no copy of the group can be in
        flight to this CTA (it has not released the group yet) nothing else observes it: not a step of its own."""
        for unit in self.layout.group_units[group]:
            cta.unit_full[stage][unit].arrive(expect_tx=UNIT_BYTES)

    def issue(self, stage, group, page, units=None):
        """issue_group by the leader: each unit one multicast copy into both CTAs, each landing later in each
        CTA on its own (one step: the copies land in any order anyway)."""
        for unit in units or self.layout.group_units[group]:
            for cta in self.ctas:
                index = cta.issued[stage][unit]
                cta.issued[stage][unit] += 1
                self.check_free(cta, stage, unit, index, page, "issued")     # its bytes may land from now on
                self.in_flight.append(("page", cta, stage, unit, page, index))
        yield

    def land(self, event):
        if event[0] == "q":
            _, cta, seq = event
            cta.q_content = seq
            cta.q_full.arrive()
            return
        _, cta, stage, unit, page, index = event
        self.check_free(cta, stage, unit, index, page, "landed")
        cta.content[stage][unit] = page
        cta.unit_full[stage][unit].complete_tx(UNIT_BYTES)

    # ---- reads, WGMMA batches, releases ---------------------------------------------------------------------
    def access(self, cta, wg, stage, unit, n, what, write=False):
        page = self.walk[stage][n]
        if cta.content[stage][unit] != page:
            raise Violation("stale", f"cta{cta.rank} {ROLE[wg]} {what} reads buffer {stage} unit {unit}: it holds "
                                     f"{cta.content[stage][unit]}, not {page} (the buffer's page #{n})")
        group = self.layout.unit_group[unit]
        if cta.released[stage][group][wg] != n:
            raise Violation("overwrite", f"cta{cta.rank} {ROLE[wg]} {what} reads buffer {stage} unit {unit} (page "
                                         f"#{n}) after releasing it")
        if write:
            for batch in cta.wgmma[1 - wg]:
                if (stage, unit, n) in batch:
                    raise Violation("overwrite", f"cta{cta.rank} {ROLE[wg]} {what} writes buffer {stage} unit {unit} "
                                                 f"while a WGMMA of {ROLE[1 - wg]} reads it")
        return (stage, unit, n)

    def q_access(self, cta, wg, seq):
        if cta.q_content != seq:
            raise Violation("stale", f"cta{cta.rank} {ROLE[wg]}'s S reads the Q tile of piece {cta.q_content}, "
                                     f"not {seq}")
        return ("q", seq)

    def retire(self, cta, wg, keep):
        """warpgroup_wait<keep>: the older batches are done; their reads must still have seen their page."""
        batches = cta.wgmma[wg]
        while len(batches) > keep:
            for read in batches.pop(0):
                if read[0] == "q":
                    self.q_access(cta, wg, read[1])
                else:
                    self.access(cta, wg, read[0], read[1], read[2], "WGMMA (at its end)")

    def release(self, cta, wg, stage, group, n):
        """`wg` is done with page #n of copy group `group` of buffer `stage`."""
        units = self.layout.group_units[group]
        for batch in cta.wgmma[wg]:
            for read in batch:
                if read[0] == stage and read[1] in units:
                    raise Violation("overwrite", f"cta{cta.rank} {ROLE[wg]} releases buffer {stage} group "
                                                 f"{GROUP_NAME[group]} while its WGMMA still reads unit {read[1]}")
        if cta.released[stage][group][wg] != n:
            raise Violation("model", f"cta{cta.rank} {ROLE[wg]} releases page #{n} of buffer {stage} group "
                                     f"{GROUP_NAME[group]} after {cta.released[stage][group][wg]} releases")
        cta.released[stage][group][wg] += 1

    def refill(self, cta, wg, stage, group, page, parity, n):
        """mainloop.h `refill(stage, group, block, free_phase)`, after the model's release."""
        self.release(cta, wg, stage, group, n)
        if page is None:                                    # !block.valid: nothing left for this buffer
            return
        leader = cta.rank == LEADER
        if self.protocol == "second_issues":
            self.arm(cta, stage, group)
            counts = self.ctas[LEADER].group_releases[stage]
            earlier = counts[group]                         # atomic_add_on_cta(group_releases, kLeaderRank, 1)
            counts[group] += 1
            yield
            if earlier % 2 == (0 if self.mutation == "first_releaser_issues" else 1):
                yield from self.issue(stage, group, page)
            return
        free = self.ctas[LEADER].group_free[stage][group]
        if self.mutation == "per_unit_release":             # release and wait unit by unit
            for unit in self.layout.group_units[group]:
                cta.unit_full[stage][unit].arrive(expect_tx=UNIT_BYTES)
                free.arrive()
                yield
                if leader:
                    yield Wait(free, parity, n, "release")
                    yield from self.issue(stage, group, page, (unit,))
            return
        if not (self.mutation == "follower_no_arm" and not leader):
            self.arm(cta, stage, group)
        free.arrive()                                       # the follower's is a remote arrive (arrive_on_cta)
        yield
        if not leader:
            return
        if self.mutation != "no_group_free_wait":
            yield Wait(free, parity, n, "release")
        yield from self.issue(stage, group, page)

    def compute_s(self, cta, wg, stage, parity, n, seq):
        """Each unit waited for (an fp8 one then widened in place: a write), then its WGMMAs issued (RoPE first);
        one batch, waited for at the end."""
        batch = [self.q_access(cta, wg, seq)]
        widen = self.layout is FP8_LAYOUT
        for unit in self.layout.s_order:
            yield Wait(cta.unit_full[stage][unit], parity, n, "S")
            batch.append(self.access(cta, wg, stage, unit, n, "S", write=widen))    # WGMMAs issued as it passes
        cta.wgmma[wg].append(batch)
        yield
        self.retire(cta, wg, 0)

    def zero_tail_rows(self, cta, wg, stage, n, last_page):
        if last_page and self.layout is BF16_LAYOUT:        # a piece's last page may be partial: a write
            for unit in self.layout.v_half[wg]:
                self.access(cta, wg, stage, unit, n, "zero_tail_rows", write=True)

    def issue_pv(self, cta, wg, stage, n):
        cta.wgmma[wg].append([self.access(cta, wg, stage, unit, n, "P V") for unit in self.layout.v_half[wg]])

    def take(self, cta, wg, pair):
        other = 1 - wg
        if cta.mailbox != (other, pair):
            raise Violation("stale", f"cta{cta.rank} {ROLE[wg]} takes {cta.mailbox} from the mailbox, not "
                                     f"{(other, pair)}")

    def post(self, cta, wg, pair):
        cta.mailbox = (wg, pair)
        cta.probs_posted[wg].arrive()

    def cluster_sync(self, k):
        self.cluster_arrivals[k] += 1
        yield Until(lambda: self.cluster_arrivals[k] == 4, f"cluster sync {k}")

    # ---- the programs ---------------------------------------------------------------------------------------
    def warpgroup(self, c, wg):
        cta = self.ctas[c]
        if wg == A:                                         # thread 0: arm_first_pages
            for stage in (0, 1):
                if self.first_block(stage) is not None:
                    for group in (VLOW, VHIGH, ROPE):
                        self.arm(cta, stage, group)
                        yield
        yield from self.cluster_sync(0)
        if wg == B:                                         # prologue: the first Q tile
            seq = self.next_seq_using(0, 0)
            if seq is not None:
                self.in_flight.append(("q", cta, seq))
                yield
        elif c == LEADER:                                   # prologue: every unit of both buffers' first pages
            for stage in (0, 1):
                page = self.first_block(stage)
                if page is not None:
                    for group in (ROPE, VLOW, VHIGH):
                        yield from self.issue(stage, group, page)
        bits = [0, 0]                                       # PipelinePhases (the kernel's bits)
        q_bit = mail_bit = 0
        n = [0, 0]                                          # the model's counts: pages consumed per buffer,
        pair = pieces_done = 0                              # pairs, pieces with pages
        for seq, num_pages in enumerate(self.pieces):
            if num_pages == 0:                              # L = 0: nothing read, not even Q
                continue
            yield Wait(cta.q_full, q_bit, pieces_done, "the Q tile")
            if self.rendezvous:
                cta.widened[seq] = cta.widened.get(seq, 0) + 1
                yield Until(lambda seq=seq: cta.widened[seq] == 2, f"cta{c} kQWidened (piece {seq})")
            for page in range(0, num_pages, 2):
                self.where[c, wg] = (seq, page)
                has_b = page + 1 < num_pages
                next_a = self.next_block(seq, page, 0)
                next_b = self.next_block(seq, page if self.mutation == "wrong_next_b" else page + 1, 1)
                body = self.pair_a if wg == A else self.pair_b
                yield from body(cta, seq, page, has_b, next_a, next_b, bits, n, mail_bit, pair)
                bits[0] ^= 1
                n[0] += 1
                if has_b or self.mutation == "page1_flips_without_b":
                    bits[1] ^= 1
                if has_b:
                    n[1] += 1
                mail_bit ^= 1
                pair += 1
            q_bit ^= 1
            pieces_done += 1
        self.where[c, wg] = "end"
        yield from self.cluster_sync(1)

    def pair_a(self, cta, seq, page, has_b, next_a, next_b, bits, n, mail_bit, pair):
        last_a, last_b = page + 1 == self.pieces[seq], page + 2 == self.pieces[seq]
        yield from self.compute_s(cta, A, 0, bits[0], n[0], seq)
        self.release(cta, A, 0, VHIGH, n[0])                # S_a was kPageA's last read of buffer 0's V high half
        yield from self.refill(cta, A, 0, ROPE, next_a, bits[0], n[0])
        self.post(cta, A, pair)
        yield
        self.zero_tail_rows(cta, A, 0, n[0], last_a)
        self.issue_pv(cta, A, 0, n[0])
        yield
        yield Wait(cta.probs_posted[B], mail_bit, pair, "P_b")
        self.take(cta, A, pair)
        if has_b:
            if self.rng.random() < 0.5:                     # a row maximum moved: wait_pv before the rescale
                self.retire(cta, A, 0)
                yield
            for unit in self.layout.v_half[A]:
                yield Wait(cta.unit_full[1][unit], bits[1], n[1], "V_b low")
            self.zero_tail_rows(cta, A, 1, n[1], last_b)
            self.issue_pv(cta, A, 1, n[1])
            yield
            self.retire(cta, A, 1)                          # warpgroup_wait<1>: P_a V_a done
            yield
            if self.mutation == "early_v_refill":           # both refills before wait_pv
                yield from self.refill(cta, A, 0, VLOW, next_a, bits[0], n[0])
                yield from self.refill(cta, A, 1, VLOW, next_b, bits[1], n[1])
                self.retire(cta, A, 0)
                yield
                return
            yield from self.refill(cta, A, 0, VLOW, next_a, bits[0], n[0])
            self.retire(cta, A, 0)                          # wait_pv
            yield
            yield from self.refill(cta, A, 1, VLOW, next_b, bits[1], n[1])
        else:
            self.retire(cta, A, 0)
            yield
            yield from self.refill(cta, A, 0, VLOW, next_a, bits[0], n[0])

    def pair_b(self, cta, seq, page, has_b, next_a, next_b, bits, n, mail_bit, pair):
        last_a, last_b = page + 1 == self.pieces[seq], page + 2 == self.pieces[seq]
        if has_b:
            yield from self.compute_s(cta, B, 1, bits[1], n[1], seq)
            self.release(cta, B, 1, VLOW, n[1])             # S_b was kPageB's last read of buffer 1's V low half
            yield from self.refill(cta, B, 1, ROPE, next_b, bits[1], n[1])
        early_tail = self.mutation == "early_tail_zeroing"
        if early_tail:                                      # page a's tail zeroed before P_a is taken
            for unit in self.layout.v_half[B]:
                yield Wait(cta.unit_full[0][unit], bits[0], n[0], "V_a high")
            self.zero_tail_rows(cta, B, 0, n[0], last_a)
            yield
        yield Wait(cta.probs_posted[A], mail_bit, pair, "P_a")
        self.take(cta, B, pair)
        self.post(cta, B, pair)
        yield
        if page + 2 >= self.pieces[seq]:                    # the next piece's Q tile
            nxt = self.next_seq_using(seq + 1, 0)
            if nxt is not None:
                self.in_flight.append(("q", cta, nxt))
                yield
        if not early_tail:
            for unit in self.layout.v_half[B]:
                yield Wait(cta.unit_full[0][unit], bits[0], n[0], "V_a high")
            self.zero_tail_rows(cta, B, 0, n[0], last_a)
        self.issue_pv(cta, B, 0, n[0])
        yield
        if has_b:
            self.zero_tail_rows(cta, B, 1, n[1], last_b)
            self.issue_pv(cta, B, 1, n[1])
            yield
            self.retire(cta, B, 1)                          # warpgroup_wait<1>: P_a V_a done
            yield
            yield from self.refill(cta, B, 0, VHIGH, next_a, bits[0], n[0])
            self.retire(cta, B, 0)                          # wait_pv
            yield
            yield from self.refill(cta, B, 1, VHIGH, next_b, bits[1], n[1])
        else:
            self.retire(cta, B, 0)
            yield
            yield from self.refill(cta, B, 0, VHIGH, next_a, bits[0], n[0])

    # ---- the scheduler --------------------------------------------------------------------------------------
    def run(self):
        rng = self.rng
        names = [(c, wg) for c in (0, 1) for wg in (A, B)]
        gens = [self.warpgroup(c, wg) for c, wg in names]
        pending = [None] * 4                                # None: runnable; else a Wait / Until
        live = [0, 1, 2, 3]                                 # programs not finished
        speed = [rng.choice((1, 1, 3, 12)) for _ in names]  # this run's relative speeds, landing eagerness
        land_p = rng.choice((0.02, 0.15, 0.5))
        in_flight, land, random_ = self.in_flight, self.land, rng.random
        steps = 0
        while live:
            if in_flight and random_() < land_p:
                enabled = None
            else:
                enabled, total = [], 0
                for i in live:
                    w = pending[i]
                    if w is None:
                        enabled.append(i)
                        total += speed[i]
                        continue
                    bar = w.bar
                    if bar is None:
                        if w.pred():
                            enabled.append(i)
                            total += speed[i]
                    elif (bar.phase & 1) != w.parity:
                        enabled.append(i)
                        total += speed[i]
                    elif bar.phase > w.expect + 1:
                        raise Violation("phase", f"{w}: the barrier ran two phases ahead of its waiter")
            if not enabled:
                if not in_flight:
                    blocked = "; ".join(f"cta{names[i][0]} {ROLE[names[i][1]]} at "
                                        f"{self.where.get(names[i], 'start')}: {pending[i]}" for i in live)
                    raise Violation("deadlock", f"every program is blocked, no copy in flight: {blocked}")
                k = int(random_() * len(in_flight))
                in_flight[k], in_flight[-1] = in_flight[-1], in_flight[k]
                land(in_flight.pop())
                continue
            r = random_() * total
            for i in enabled:
                r -= speed[i]
                if r < 0:
                    break
            w = pending[i]
            if w is not None and w.bar is not None and w.bar.phase != w.expect + 1:
                w.passed()                                  # raises: the wait passed on the wrong phase
            try:
                pending[i] = gens[i].send(None)
            except StopIteration:
                live.remove(i)
            steps += 1
        self.final_checks()
        return steps

    def final_checks(self):
        for cta in self.ctas:
            bars = [b for row in cta.unit_full + cta.group_free for b in row] + cta.probs_posted + [cta.q_full]
            for bar in bars:
                if not bar.idle():
                    raise Violation("end", f"at exit {bar}: an armed barrier without its copy, or a stray arrival")
            for stage in (0, 1):
                expected = len(self.walk[stage])
                for unit in range(self.layout.units):
                    if cta.issued[stage][unit] != expected:
                        raise Violation("end", f"cta{cta.rank} buffer {stage} unit {unit} received "
                                               f"{cta.issued[stage][unit]} copies, not {expected}")
                for group in range(3):
                    for wg in READERS[stage][group]:
                        if cta.released[stage][group][wg] != expected:
                            raise Violation("end", f"cta{cta.rank} {ROLE[wg]} released "
                                                   f"{cta.released[stage][group][wg]} pages of buffer {stage} group "
                                                   f"{GROUP_NAME[group]}, not {expected}")


# Page counts of the pieces of one SM part, back to back (0: L = 0, skipped).
SHAPES = [[1], [2], [3], [4], [5], [8], [0, 0], [1, 1, 1], [3, 0, 2, 1, 5], [0, 1, 0, 0, 4, 1]]
RUNS = 1500


def explore(pieces, runs, seed, mutation=None, kind=None, protocol="leader_waits"):
    """Runs up to `runs` random interleavings: the first violation (of kind `kind`, if given), or None; and how
    many violations of each kind were seen on the way."""
    seen = {}
    for run in range(runs):
        try:
            PairModel(pieces, seed * 1_000_003 + run, mutation, protocol).run()
        except Violation as violation:
            seen[violation.kind] = seen.get(violation.kind, 0) + 1
            if kind is None or violation.kind == kind:
                violation.run = run
                return violation, seen
    return None, seen


@pytest.mark.parametrize("pieces", SHAPES, ids=lambda p: "-".join(map(str, p)))
def test_protocol_holds(pieces):
    violation, _ = explore(pieces, RUNS, seed=sum(pieces) * 131 + len(pieces))
    assert violation is None, f"pieces {pieces}, run {violation.run}: {violation}"


@pytest.mark.parametrize("pieces", [[3], [8], [1, 1, 1], [3, 0, 2, 1, 5]], ids=lambda p: "-".join(map(str, p)))
def test_second_releaser_form_holds(pieces):
    violation, _ = explore(pieces, RUNS // 4, seed=sum(pieces) * 137 + len(pieces), protocol="second_issues")
    assert violation is None, f"pieces {pieces}, run {violation.run}: {violation}"


def test_first_releaser_issuing_is_caught():
    """The atomic's parity flipped: the first CTA to release issues, before the other CTA is done reading."""
    violation, seen = explore([4], 500, seed=7, mutation="first_releaser_issues", kind="overwrite",
                              protocol="second_issues")
    assert violation is not None, f"no overwrite in 500 interleavings (others: {seen})"


@pytest.mark.parametrize("mutation,pieces,kind", [
    ("no_group_free_wait", [5], "overwrite"),       # the leader issues without waiting for the follower's release
    ("follower_no_arm", [3], "deadlock"),           # the follower's barriers never expect the copies
    ("per_unit_release", [4], "deadlock"),          # release and wait unit by unit: the leader waits on itself
    ("early_v_refill", [4], "overwrite"),           # kPageA refills buffer 1's V low half before wait_pv
    ("early_tail_zeroing", [1], "overwrite"),       # kPageB zeroes page a's tail rows while S_a may read them
    ("page1_flips_without_b", [1, 2], "phase"),     # buffer 1's phase bit flipped by a pair without b
    ("wrong_next_b", [6], "stale"),                 # next_b looked up for page a's position
])
def test_mutation_is_caught(mutation, pieces, kind):
    violation, seen = explore(pieces, 500, seed=7, mutation=mutation, kind=kind)
    assert violation is not None, f"{mutation}: no {kind} violation in 500 interleavings (others: {seen})"


def test_mbarrier_parity_semantics():
    bar = MBarrier("b", 1)
    wait0 = Wait(bar, 0, 0, "b")
    assert not wait0.ready()
    bar.complete_tx(UNIT_BYTES)                     # bytes first: tx-count negative, the phase stays open
    assert not wait0.ready() and bar.phase == 0
    bar.arrive(expect_tx=UNIT_BYTES)
    assert wait0.ready() and bar.phase == 1
    wait0.passed()
    bar.arrive(expect_tx=UNIT_BYTES)                # phase 1 armed, bytes pending
    assert Wait(bar, 1, 1, "b").ready() is False
    bar.complete_tx(UNIT_BYTES)
    with pytest.raises(Violation, match="two phases ahead"):
        wait0.ready()                               # phase 2: a parity-0 waiter for phase 0 would block for good
    with pytest.raises(Violation):
        Wait(bar, 1, 2, "b").passed()               # parity 1 passes at phase 2, which is not phase 3


def test_scheduler_walk_matches_buffers():
    """tile_scheduler.h's first_block / next_block chain gives each buffer exactly its pages, in order."""
    for pieces in SHAPES + [[7, 0, 1, 6, 2]]:
        model = PairModel(pieces, 0)
        for stage in (0, 1):
            chain, page = [], model.first_block(stage)
            while page is not None:
                chain.append(page)
                page = model.next_block(page[0], page[1], stage)
            assert chain == model.walk[stage], (pieces, stage)
