"""Tests of the tile scheduler (get_mla_metadata on CPU tensors, i.e. the pure-Python twin of the metadata kernel).

Two kinds of checks:
  * properties over many random batches, with the payload recomputed here from the SPEC formula: every page of
    every sequence covered exactly once, parts within the payload, greedy filling, consistent num_splits, split
    indices and workspace slots, empty parts only at the end;
  * exact outputs for small batches worked out by hand from the SPEC rules, which pin the twin bit for bit
    (the CUDA metadata kernel must reproduce them).
Both also for sparse plans (docs/PERF.md "Scheduler"), whose payload is the smallest that still covers the batch
(recomputed here by walking the SPEC rules with each candidate), floored at 5 + 2.
"""
import random

import pytest
import torch

from flash_mla import get_mla_metadata
from flash_mla._geometry import SPARSE_MIN_PAYLOAD, SPARSE_PLAN
from flash_mla.scheduler import get_mla_metadata_twin, pieces_of_part, plan_payload, schedule

PAGE = 64
OVERHEAD = 5   # FIXED_OVERHEAD of the SPEC, written out here on purpose
SPARSE_FLOOR = OVERHEAD + 2   # sparse plans' payload floor (docs/PERF.md "Scheduler"): room for a pair of pages


def spec_num_sm_parts(num_sms, num_heads_per_head_k, h_kv):
    tiles = -(-num_heads_per_head_k // 64)
    return max(num_sms // h_kv // tiles, 1)


def spec_payload(seqlens, parts):
    total = sum(-(-L // PAGE) + OVERHEAD for L in seqlens)
    return -(-total // parts) + OVERHEAD


def walk_covers(seqlens, parts, payload):
    """Whether SPEC.md's walk with this payload covers the batch in `parts` parts (written out from the rules)."""
    seq, page = 0, 0
    for _ in range(parts):
        left = payload
        while seq < len(seqlens):
            rest = -(-seqlens[seq] // PAGE) - page + OVERHEAD
            if rest <= left:
                left, seq, page = left - rest, seq + 1, 0
            else:
                page += max(left - OVERHEAD, 0)
                break
    return seq == len(seqlens)


def tight_payload(seqlens, parts):
    """The smallest payload from ceil(total / parts) up whose walk covers the batch (the sparse plan's rule)."""
    lowest = spec_payload(seqlens, parts) - OVERHEAD
    return next(c for c in range(lowest, lowest + OVERHEAD + 1) if walk_covers(seqlens, parts, c))


def pages_of(begin, end):
    """Pages (64-token blocks) a token range [begin, end) touches."""
    return -(-end // PAGE) - begin // PAGE


def run_scheduler(seqlens, num_heads_per_head_k, h_kv, num_sms, min_payload=0, tight=False):
    """The public classic form (dense), or with min_payload / tight the twin with that floor and payload rule."""
    lens = torch.tensor(seqlens, dtype=torch.int32)
    if min_payload or tight:
        return get_mla_metadata_twin(lens, num_heads_per_head_k, h_kv, num_sms, min_payload, tight)
    return get_mla_metadata(lens, num_heads_per_head_k, h_kv, num_sms=num_sms)


def check_schedule(seqlens, num_heads_per_head_k, h_kv, num_sms, count_pages=True, min_payload=0, tight=False):
    """Run the scheduler and assert every SPEC property (the payload SPEC.md's, or with `tight` the smallest that
    covers, floored at min_payload). Returns (metadata rows, num_splits) as lists."""
    b = len(seqlens)
    parts = spec_num_sm_parts(num_sms, num_heads_per_head_k, h_kv)
    payload = max(tight_payload(seqlens, parts) if tight else spec_payload(seqlens, parts), min_payload)
    md_t, ns_t = run_scheduler(seqlens, num_heads_per_head_k, h_kv, num_sms, min_payload, tight)
    ctx = (f"b={b} nhphk={num_heads_per_head_k} h_kv={h_kv} num_sms={num_sms} min_payload={min_payload} "
           f"tight={tight}")

    # shapes and types
    assert md_t.dtype == torch.int32 and ns_t.dtype == torch.int32, ctx
    assert tuple(md_t.shape) == (parts, 8), ctx
    assert tuple(ns_t.shape) == (b + 1,), ctx
    assert md_t.device == ns_t.device == torch.device("cpu"), ctx
    md, ns = md_t.tolist(), ns_t.tolist()

    # num_splits: prefix sum from 0, every sequence at least one piece
    assert ns[0] == 0, ctx
    counts = [ns[i + 1] - ns[i] for i in range(b)]
    assert min(counts) >= 1, ctx
    assert ns[b] <= b + parts, ctx

    pieces_by_seq = [[] for _ in range(b)]
    seen_empty = False
    walk = (0, 0)             # (sequence, token) where the next part must begin
    for p, row in enumerate(md):
        begin_seq, begin_token, end_seq, end_token, begin_split = row[:5]
        assert row[5:] == [0, 0, 0], f"{ctx} part {p}: reserved words {row}"
        if begin_seq == b:                                   # empty part
            assert end_seq <= b - 1, f"{ctx} part {p}: empty part {row}"
            assert pieces_of_part(row, seqlens, ns) == [], f"{ctx} part {p}"
            seen_empty = True
            continue
        assert not seen_empty, f"{ctx} part {p}: work after an empty part: {md}"
        assert 0 <= begin_seq <= end_seq < b, f"{ctx} part {p}: {row}"
        assert (begin_seq, begin_token) == walk, f"{ctx} part {p}: starts at {row[:2]}, walk is at {walk}"
        assert begin_token % PAGE == 0, f"{ctx} part {p}: {row}"
        assert end_token % PAGE == 0 or end_token == seqlens[end_seq], f"{ctx} part {p}: {row}"

        pieces = pieces_of_part(row, seqlens, ns)
        assert [pc.seq for pc in pieces] == list(range(begin_seq, end_seq + 1)), f"{ctx} part {p}"
        assert pieces[0].split_idx == begin_split, f"{ctx} part {p}"
        cost = 0
        for pc in pieces:
            L = seqlens[pc.seq]
            if L == 0:
                assert (pc.begin_token, pc.end_token) == (0, 0), f"{ctx} part {p}: {pc}"
            else:
                assert 0 <= pc.begin_token < pc.end_token <= L, f"{ctx} part {p}: {pc}"
            assert pc.begin_token % PAGE == 0, f"{ctx} part {p}: {pc}"
            assert pc.end_token % PAGE == 0 or pc.end_token == L, f"{ctx} part {p}: {pc}"
            cost += pages_of(pc.begin_token, pc.end_token) + OVERHEAD
            pieces_by_seq[pc.seq].append(pc)
        assert cost <= payload, f"{ctx} part {p}: cost {cost} > payload {payload}"

        # greedy filling: a part stops early only when the next piece could not fit
        closed = end_token == seqlens[end_seq]
        if not closed:
            assert cost == payload, f"{ctx} part {p}: split a sequence with payload left ({cost}/{payload})"
            walk = (end_seq, end_token)
        else:
            walk = (end_seq + 1, 0)
            if end_seq + 1 < b:
                next_cost = -(-seqlens[end_seq + 1] // PAGE) + OVERHEAD
                assert cost + next_cost > payload, f"{ctx} part {p}: next sequence would have fit whole"
                assert payload - cost <= OVERHEAD, f"{ctx} part {p}: {payload - cost} left but nothing cut"
    assert walk == (b, 0), f"{ctx}: the parts stop at {walk}, not at the end of the batch"

    # per sequence: contiguous, non-overlapping pieces covering [0, L), split indices 0..n-1, slots
    slots = set()
    for seq, pieces in enumerate(pieces_by_seq):
        L = seqlens[seq]
        n = len(pieces)
        assert n == counts[seq], f"{ctx} seq {seq}: {n} pieces walked, num_splits says {counts[seq]}"
        if L == 0:
            assert n == 1, f"{ctx} seq {seq}: an empty sequence was split"
        assert pieces[0].begin_token == 0 and pieces[-1].end_token == L, f"{ctx} seq {seq}: {pieces}"
        for k, pc in enumerate(pieces):
            if k > 0:
                assert pc.begin_token == pieces[k - 1].end_token, f"{ctx} seq {seq}: gap or overlap {pieces}"
            assert pc.split_idx == k and pc.num_pieces == n, f"{ctx} seq {seq}: {pieces}"
            assert pc.slot == ns[seq] + k, f"{ctx} seq {seq}: {pc}"
            assert 0 <= pc.slot < b + parts, f"{ctx} seq {seq}: slot {pc.slot}"
            assert pc.slot not in slots, f"{ctx} seq {seq}: slot {pc.slot} used twice"
            slots.add(pc.slot)
    assert slots == set(range(ns[b])), ctx

    # literal page count: each 64-token page of each sequence taken exactly once
    if count_pages:
        page_base = [0]
        for L in seqlens:
            page_base.append(page_base[-1] + -(-L // PAGE))
        hits = torch.zeros(page_base[-1], dtype=torch.int32)
        for pieces in pieces_by_seq:
            for pc in pieces:
                first = page_base[pc.seq] + pc.begin_token // PAGE
                hits[first:first + pages_of(pc.begin_token, pc.end_token)] += 1
        assert bool((hits == 1).all()), f"{ctx}: pages covered {hits.unique().tolist()} times"
    return md, ns


# ---------------------------------------------------------------------------------------------------------------
# random batches

NUM_SMS = (132, 132, 132, 114, 78, 16, 7, 1, 264)
H_Q = (16, 32, 64, 128, 16, 128, 24, 96, 112)


def random_length(rng):
    kind = rng.random()
    if kind < 0.12:
        return 0
    if kind < 0.35:
        return rng.randint(1, 200)
    if kind < 0.5:                                   # around page boundaries
        return max(0, 64 * rng.randint(1, 100) + rng.choice((-1, 0, 1)))
    if kind < 0.9:
        return rng.randint(1, 20000)
    return rng.randint(20000, 200000)


def random_case(rng, b):
    h_kv = rng.choice((1, 1, 2))
    h_q = rng.choice(H_Q)
    s_q = rng.randint(1, 4)
    nhphk = s_q * h_q // h_kv
    lens = [random_length(rng) for _ in range(b)]
    if rng.random() < 0.1:                           # uniform batches are common in benchmarks
        lens = [lens[0]] * b
    return lens, nhphk, h_kv, rng.choice(NUM_SMS)


@pytest.mark.parametrize("seed", range(8))
def test_random_small_batches(seed):
    rng = random.Random(1000 + seed)
    for _ in range(60):
        lens, nhphk, h_kv, num_sms = random_case(rng, rng.randint(1, 40))
        check_schedule(lens, nhphk, h_kv, num_sms)


@pytest.mark.parametrize("seed", range(4))
def test_random_medium_batches(seed):
    rng = random.Random(2000 + seed)
    for _ in range(10):
        lens, nhphk, h_kv, num_sms = random_case(rng, rng.randint(41, 600))
        check_schedule(lens, nhphk, h_kv, num_sms)


@pytest.mark.parametrize("seed", range(4))
def test_random_sparse_plans(seed):
    """Sparse plans (the smallest covering payload, floored at 7): every property, on ragged lengths up to a few
    topk pages, where the floor binds often; the floor changes nothing where the tight payload already reaches it,
    and the tight payload is below SPEC.md's in many batches."""
    rng = random.Random(4000 + seed)
    bound = tighter = 0
    for _ in range(60):
        b = rng.choice((1, 1, 2, 3, rng.randint(4, 40)))
        lens = [rng.choice((0, rng.randint(1, 64), rng.randint(1, 2048), 2048, 64 * rng.randint(1, 40)))
                for _ in range(b)]
        s_q, h_q = rng.choice((1, 2)), rng.choice((16, 64, 128))
        num_sms = rng.choice((132, 132, 114, 78, 16, 7, 1))
        md, ns = check_schedule(lens, s_q * h_q, 1, num_sms, min_payload=SPARSE_FLOOR, tight=True)
        parts = spec_num_sm_parts(num_sms, s_q * h_q, 1)
        assert (md, ns) == schedule(lens, parts, **SPARSE_PLAN)
        if tight_payload(lens, parts) >= SPARSE_FLOOR:
            assert (md, ns) == schedule(lens, parts, tight_payload=True), "the floor changed a plan above it"
            tighter += tight_payload(lens, parts) < spec_payload(lens, parts)
        else:
            bound += 1
    assert bound >= 10, f"the floor bound in only {bound} of 60 batches: the test would prove little"
    assert tighter >= 5, f"the tight payload was below SPEC.md's in only {tighter} batches"


@pytest.mark.parametrize("seed", range(4))
def test_random_tight_plans(seed):
    """The tight payload on the dense tests' random batches: every property, the payload the smallest that covers
    (one less does not), never above SPEC.md's, and its busiest part never carries more than SPEC.md's."""
    rng = random.Random(5000 + seed)
    for _ in range(40):
        lens, nhphk, h_kv, num_sms = random_case(rng, rng.randint(1, 300))
        md, ns = check_schedule(lens, nhphk, h_kv, num_sms, tight=True)
        parts = spec_num_sm_parts(num_sms, nhphk, h_kv)
        payload = tight_payload(lens, parts)
        blocks = [-(-L // PAGE) for L in lens]
        assert plan_payload(lens, blocks, parts, tight_payload=True) == payload <= spec_payload(lens, parts)
        assert payload == spec_payload(lens, parts) - OVERHEAD or not walk_covers(lens, parts, payload - 1)

        spec_md, spec_ns = schedule(lens, parts)
        busiest = [max(sum(pages_of(pc.begin_token, pc.end_token) + OVERHEAD
                           for pc in pieces_of_part(row, lens, splits)) for row in rows)
                   for rows, splits in ((md, ns), (spec_md, spec_ns))]
        assert busiest[0] <= busiest[1], f"b={len(lens)} parts={parts}: busiest part {busiest}"


def test_sparse_floor_constant():
    assert SPARSE_MIN_PAYLOAD == SPARSE_FLOOR == OVERHEAD + 2


@pytest.mark.parametrize("seed", range(3))
def test_random_large_batches(seed):
    rng = random.Random(3000 + seed)
    b = 5000 if seed else rng.randint(1000, 5000)
    lens, nhphk, h_kv, num_sms = random_case(rng, b)
    check_schedule(lens, nhphk, h_kv, num_sms, count_pages=False)


def test_long_sequence_is_cut_across_all_parts():
    # 3125 pages, 132 parts: payload = ceil(3130 / 132) + 5 = 29, i.e. 24 pages a piece: 130 full pieces + 5 pages
    _, ns = check_schedule([200000], 16, 1, 132)
    assert ns == [0, 131]
    _, ns = check_schedule([200000, 0, 0, 0], 128, 1, 132)
    assert ns[1] - ns[0] > 1 and ns[4] <= 4 + 66


@pytest.mark.parametrize("lens", [[0], [0] * 7, [0] * 5000, [1], [64], [65], [1] * 300, [200000] * 3])
@pytest.mark.parametrize("num_sms", [1, 132])
def test_edge_batches(lens, num_sms):
    _, ns = check_schedule(lens, 64, 1, num_sms, count_pages=len(lens) < 1000)
    if all(L == 0 for L in lens):
        assert ns == list(range(len(lens) + 1))


# ---------------------------------------------------------------------------------------------------------------
# exact outputs worked out by hand from the SPEC rules

@pytest.mark.parametrize("num_sms,nhphk,h_kv,expected", [
    (132, 128, 1, 66), (132, 64, 1, 132), (132, 65, 1, 66), (132, 129, 1, 44), (132, 64, 2, 66),
    (132, 512, 1, 16), (132, 256, 2, 16), (4, 256, 2, 1), (1, 16, 1, 1), (114, 16, 1, 114), (7, 16, 2, 3),
])
def test_num_sm_parts(num_sms, nhphk, h_kv, expected):
    md, _ = run_scheduler([100, 2000], nhphk, h_kv, num_sms)
    assert md.shape[0] == expected


def test_exact_mixed_batch_four_parts():
    # pages 2, 4, 0, 16; total = 22 + 4 * 5 = 42; 4 parts; payload = ceil(42 / 4) + 5 = 16
    # part 0: seq 0 (7) and seq 1 (9) fill it exactly.
    # part 1: seq 2 (5), then 11 left: seq 3 needs 21 -> take 11 - 5 = 6 pages, split at token 384.
    # part 2: the remaining 10 pages of seq 3 (15) close it.
    # part 3: no work.
    md, ns = run_scheduler([100, 200, 0, 1000], 16, 1, 4)
    assert md.tolist() == [
        [0, 0, 1, 200, 0, 0, 0, 0],
        [2, 0, 3, 384, 0, 0, 0, 0],
        [3, 384, 3, 1000, 1, 0, 0, 0],
        [4, 0, 3, 1000, 0, 0, 0, 0],
    ]
    assert ns.tolist() == [0, 1, 2, 3, 5]


def test_exact_one_sequence_cut_in_three():
    # 10 pages; 8 SMs // 2 tiles -> 4 parts; total 15, payload = 4 + 5 = 9: pieces of 4, 4 and 2 pages
    md, ns = run_scheduler([640], 128, 1, 8)
    assert md.tolist() == [
        [0, 0, 0, 256, 0, 0, 0, 0],
        [0, 256, 0, 512, 1, 0, 0, 0],
        [0, 512, 0, 640, 2, 0, 0, 0],
        [1, 0, 0, 640, 0, 0, 0, 0],
    ]
    assert ns.tolist() == [0, 3]


def test_exact_no_cut_when_only_overhead_left():
    # pages 1, 5, 2; 6 SMs // 2 KV heads -> 3 parts; total 23, payload = 8 + 5 = 13
    # part 0: seq 0 (6), 7 left: seq 1 needs 10 -> 2 pages, split at 128.
    # part 1: seq 1's last 3 pages (8) close it; 5 left is not more than the overhead: seq 2 is not cut.
    # part 2: seq 2 whole.
    md, ns = run_scheduler([1, 300, 65], 64, 2, 6)
    assert md.tolist() == [
        [0, 0, 1, 128, 0, 0, 0, 0],
        [1, 128, 1, 300, 1, 0, 0, 0],
        [2, 0, 2, 65, 0, 0, 0, 0],
    ]
    assert ns.tolist() == [0, 1, 3, 4]


def test_exact_empty_sequences():
    # three empty sequences cost 5 each; 2 parts, total 15, payload 8 + 5 = 13: two fit, 3 left is too little
    md, ns = run_scheduler([0, 0, 0], 1, 1, 2)
    assert md.tolist() == [
        [0, 0, 1, 0, 0, 0, 0, 0],
        [2, 0, 2, 0, 0, 0, 0, 0],
    ]
    assert ns.tolist() == [0, 1, 2, 3]


def test_exact_single_part():
    md, ns = run_scheduler([5, 0, 7000], 128, 1, 1)
    assert md.tolist() == [[0, 0, 2, 7000, 0, 0, 0, 0]]
    assert ns.tolist() == [0, 1, 2, 3]


def test_exact_default_num_sms_is_h100():
    # CPU tensors plan for 132 SMs: h_q = 16 -> 132 parts; 1 sequence of 64 pages, total 69,
    # payload = 1 + 5 = 6: 64 pieces of one page, then 68 empty parts
    md, ns = get_mla_metadata(torch.tensor([4096], dtype=torch.int32), 16, 1)
    rows = md.tolist()
    assert len(rows) == 132
    assert rows[0] == [0, 0, 0, 64, 0, 0, 0, 0]
    assert rows[63] == [0, 4032, 0, 4096, 63, 0, 0, 0]
    assert all(r == [1, 0, 0, 4096, 0, 0, 0, 0] for r in rows[64:])
    assert ns.tolist() == [0, 64]


# sparse plans: SPEC payload floored at 7, worked out by hand

def one_row_plan(pages_per_part, parts, length):
    """Rows of one sequence of `length` tokens cut into pieces of `pages_per_part` pages, then empty parts."""
    tokens = pages_per_part * PAGE
    pieces = -(-length // tokens)
    rows = [[0, tokens * p, 0, min(tokens * (p + 1), length), p, 0, 0, 0] for p in range(pieces)]
    return rows + [[1, 0, 0, length, 0, 0, 0, 0]] * (parts - pieces)


def test_exact_sparse_floor_binds():
    # b = 1, topk 2048 (32 pages), h_q 128, s_q 1: 128 rows = 2 tiles, 132 // 2 = 66 parts; total 32 + 5 = 37.
    # SPEC payload ceil(37 / 66) + 5 = 6: 32 parts of one page, 34 empty.
    # Floored payload 7: 16 parts of two pages (a piece ends every 128 tokens), 50 empty.
    lens = torch.tensor([2048], dtype=torch.int32)
    md, ns = get_mla_metadata_twin(lens, 128, 1, 132, SPARSE_FLOOR)
    assert md.tolist() == one_row_plan(2, 66, 2048)
    assert md.tolist()[15] == [0, 1920, 0, 2048, 15, 0, 0, 0] and md.tolist()[16] == [1, 0, 0, 2048, 0, 0, 0, 0]
    assert ns.tolist() == [0, 16]
    md0, ns0 = get_mla_metadata_twin(lens, 128, 1, 132)
    assert md0.tolist() == one_row_plan(1, 66, 2048) and ns0.tolist() == [0, 32]
    # a larger floor is a longer piece: 11 = 6 pages + 5, so ceil(32 / 6) = 6 pieces
    md11, ns11 = get_mla_metadata_twin(lens, 128, 1, 132, 11)
    assert md11.tolist() == one_row_plan(6, 66, 2048) and ns11.tolist() == [0, 6]
    # the tight payload is 6 here (5 does not cover: nothing is cut with 5 left), below the floor: the same plan
    tight_md, tight_ns = get_mla_metadata_twin(lens, 128, 1, 132, **SPARSE_PLAN)
    assert tight_md.tolist() == one_row_plan(2, 66, 2048) and tight_ns.tolist() == [0, 16]


def test_exact_sparse_floor_ragged():
    # pages 3, 1, 0; h_q 16, s_q 2: 32 rows, 132 parts; total 4 + 15 = 19, SPEC payload 1 + 5 = 6, floored 7.
    # part 0: seq 0 needs 8 > 7 -> 2 pages, cut at 128.  part 1: seq 0's last page (6) closes it, 1 left.
    # part 2: seq 1 (6), 1 left.  part 3: seq 2 (5).  Then 128 empty parts.
    md, ns = get_mla_metadata_twin(torch.tensor([150, 64, 0], dtype=torch.int32), 32, 1, 132, SPARSE_FLOOR)
    assert md.tolist() == [
        [0, 0, 0, 128, 0, 0, 0, 0],
        [0, 128, 0, 150, 1, 0, 0, 0],
        [1, 0, 1, 64, 0, 0, 0, 0],
        [2, 0, 2, 0, 0, 0, 0, 0],
    ] + [[3, 0, 2, 0, 0, 0, 0, 0]] * 128
    assert ns.tolist() == [0, 2, 3, 4]
    # without the floor: one page a piece (seq 0 in 3 pieces)
    assert schedule([150, 64, 0], 132)[1] == [0, 3, 4, 5]


@pytest.mark.parametrize("b,s_q,h_q,payload,tight,pages", [(1, 2, 128, 7, 6, 2), (16, 1, 128, 14, 13, 8),
                                                           (16, 2, 128, 23, 21, 16), (32, 1, 64, 14, 13, 8),
                                                           (128, 2, 128, 149, 148, 128)])
def test_sparse_plans_of_the_referee_shapes(b, s_q, h_q, payload, tight, pages):
    """The referee's other sparse shapes (topk 2048, 132 SMs): SPEC.md's payload is already >= 7 (the floor binds
    only at b = 1, s_q 2, where the tight payload is 6); the tight payload cuts every row into pieces of `pages`
    pages (whole rows at b = 128: 4 a part) where SPEC.md's left a short last piece (9, 9, 9, 5 pages at b = 16,
    s_q 1; 18 and 14 at s_q 2)."""
    lens = torch.full((b,), 2048, dtype=torch.int32)
    parts = spec_num_sm_parts(132, s_q * h_q, 1)
    assert spec_payload(lens.tolist(), parts) == payload >= SPARSE_FLOOR
    assert tight_payload(lens.tolist(), parts) == tight
    floored = get_mla_metadata_twin(lens, s_q * h_q, 1, 132, SPARSE_FLOOR)
    plain = get_mla_metadata_twin(lens, s_q * h_q, 1, 132)
    assert torch.equal(floored[0], plain[0]) and torch.equal(floored[1], plain[1])
    md, ns = get_mla_metadata_twin(lens, s_q * h_q, 1, 132, **SPARSE_PLAN)
    sizes = [pages_of(pc.begin_token, pc.end_token) for row in md.tolist()
             for pc in pieces_of_part(row, lens.tolist(), ns.tolist())]
    assert sizes == [min(pages, 32)] * (b * max(32 // pages, 1)), sizes


def test_classic_form_sparse_plan_is_floored_dense_is_not():
    """get_mla_metadata(..., topk=2048) on CPU tensors plans with the floor; the dense call (fp8 cache or not)
    on the same lengths keeps the SPEC rule."""
    cache_seqlens = torch.tensor([12345], dtype=torch.int32)        # with topk only its size and device count
    md, ns = get_mla_metadata(cache_seqlens, 1 * 128, 1, num_heads_q=128, is_fp8_kvcache=True, topk=2048,
                              num_sms=132)
    assert md.tolist() == one_row_plan(2, 66, 2048) and ns.tolist() == [0, 16]
    md, ns = get_mla_metadata(torch.zeros(16, dtype=torch.int32), 128, 1, is_fp8_kvcache=True, topk=2048,
                              num_sms=132)
    assert (md.tolist(), ns.tolist()) == schedule([2048] * 16, 66, **SPARSE_PLAN)
    assert md.tolist()[:4] == [[0, 512 * k, 0, 512 * (k + 1), k, 0, 0, 0] for k in range(4)]
    for fp8 in (False, True):
        dense_md, dense_ns = get_mla_metadata(torch.tensor([2048], dtype=torch.int32), 128, 1, num_heads_q=128,
                                              is_fp8_kvcache=fp8, num_sms=132)
        assert dense_md.tolist() == one_row_plan(1, 66, 2048) and dense_ns.tolist() == [0, 32]


def test_deterministic():
    lens = torch.tensor([3, 5000, 0, 77777, 64], dtype=torch.int32)
    a = get_mla_metadata(lens, 64, 1)
    b = get_mla_metadata(lens.clone(), 64, 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---------------------------------------------------------------------------------------------------------------
# the twin's min_payload (sparse plans use 7; benchmarks/plan_policy.py times other floors on the GPU)

@pytest.mark.parametrize("seqlens", [[32768], [131072], [32768] * 4, [4641, 45118, 1730, 1696], [4096] * 32,
                                     [0, 20000, 0, 65, 1]])
@pytest.mark.parametrize("floor", [0, 9, 13, 21, 37, 10_000])
def test_min_payload_plans_are_valid(seqlens, floor):
    """Any floor gives a plan the kernels accept: every page of every sequence in exactly one piece, slots
    0..n-1 per sequence, parts without work only at the end (begin_seq = b), never more pieces than floor 0."""
    parts = 132
    md, ns = schedule(seqlens, parts, min_payload=floor)
    base_md, base_ns = schedule(seqlens, parts)
    if floor <= spec_payload(seqlens, parts):
        assert (md, ns) == (base_md, base_ns), "a floor below the payload changes nothing"
    b = len(seqlens)
    assert len(md) == parts and ns[0] == 0 and len(ns) == b + 1
    covered = [[] for _ in seqlens]
    empty_seen = False
    for row in md:
        if row[0] == b:
            empty_seen = True
            assert pieces_of_part(row, seqlens, ns) == []
            continue
        assert not empty_seen, "work after an empty part"
        for pc in pieces_of_part(row, seqlens, ns):
            covered[pc.seq].append(pc)
    for seq, pieces in enumerate(covered):
        assert [pc.split_idx for pc in pieces] == list(range(len(pieces))) == \
            list(range(ns[seq + 1] - ns[seq])), (seq, pieces)
        assert pieces[0].begin_token == 0 and pieces[-1].end_token == seqlens[seq]
        assert all(a.end_token == c.begin_token for a, c in zip(pieces, pieces[1:]))
        assert len(pieces) <= base_ns[seq + 1] - base_ns[seq]
