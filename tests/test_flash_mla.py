"""Hopper kernel tests: correctness of flash_mla._cuda against the float32 reference.

Two ways to run:
  python tests/test_flash_mla.py [--quick]   full reference sweep of SPEC.md "Targets" on a Hopper GPU, one line
                                             per row (time, TFLOP/s, GB/s, verdict), then the edge-case sweep
  pytest tests/test_flash_mla.py             a reduced sweep; skips without a GPU and the built extension
Every check: relative L2 error of out and lse < 1e-2 (bf16) / 2e-3 (fp16), cosine difference < 1e-5, no NaN
(cache slots past each length are NaN, outputs come from NaN-poisoned memory), lse -inf exactly where the
reference has it, and the device scheduler's metadata equal to the Python twin's.
"""
from __future__ import annotations

import argparse
import inspect
import itertools
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flash_mla
from flash_mla.backends import cuda_extension
from flash_mla.scheduler import get_mla_metadata_twin, pieces_of_part, schedule
from flash_mla.testing import (assert_close, compare, cuda_median_seconds, decode_flops_and_bytes,
                               make_decode_batch, poison_cuda_allocator, random_seqlens, reference_for)


def _hopper_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if cuda_extension() is None:
        return "needs the CUDA extension flash_mla._cuda (pip install --no-build-isolation -e . with nvcc)"
    if torch.cuda.get_device_capability() != (9, 0):
        return "needs a Hopper (sm_90) GPU"
    return None


needs_hopper = pytest.mark.skipif(_hopper_reason() is not None, reason=_hopper_reason() or "")


def run_case(seqlens, s_q, h_q, h_kv=1, causal=True, dtype=torch.bfloat16, seed=0, reference_on_device=True,
             num_sms=None):
    """Build a batch, run metadata + decode on the GPU, compare with the reference. Returns (batch, metrics).
    num_sms: what get_mla_metadata plans for (default: the GPU's count); more SMs cut sequences into more pieces."""
    gen = torch.Generator().manual_seed(seed)
    batch = make_decode_batch(seqlens, s_q=s_q, h_q=h_q, h_kv=h_kv, dtype=dtype, device="cuda", causal=causal,
                              generator=gen)
    rows = s_q * h_q // h_kv
    metadata, num_splits = flash_mla.get_mla_metadata(batch.cache_seqlens, rows, h_kv, num_sms=num_sms)
    twin_md, twin_ns = get_mla_metadata_twin(batch.cache_seqlens.cpu(), rows, h_kv,
                                             num_sms or torch.cuda.get_device_properties(0).multi_processor_count)
    assert torch.equal(metadata.cpu(), twin_md), "device metadata differs from the Python twin"
    assert torch.equal(num_splits.cpu(), twin_ns), "device num_splits differs from the Python twin"
    b = len(seqlens)
    poison_cuda_allocator(2 * (b + metadata.shape[0]) * h_kv * rows * 512 * 4 + b * s_q * h_q * 512 * 2)
    out, lse = flash_mla.flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens,
                                                512, metadata, num_splits, causal=causal)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_for(batch, on_device=reference_on_device)
    return batch, (metadata, num_splits), out, lse, compare(out, lse, ref_out, ref_lse)


def time_decode(batch, metadata, num_splits, backend=None):
    """Median seconds per flash_mla_with_kvcache call (metadata outside), calls back to back."""
    args = (batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512, metadata, num_splits)
    return cuda_median_seconds(lambda: flash_mla.flash_mla_with_kvcache(*args, causal=batch.causal, backend=backend))


# ----------------------------------------------------------------------------------------------------------------
# pytest: reduced sweep (skips without a Hopper GPU and the extension)
# ----------------------------------------------------------------------------------------------------------------

@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s_q,h_q", [(1, 16), (2, 64), (1, 128)])
def test_reference_rows(dtype, s_q, h_q):
    seqlens = random_seqlens(32, 2048, s_q, varlen=True, generator=torch.Generator().manual_seed(h_q))
    *_, metrics = run_case(seqlens, s_q, h_q, dtype=dtype)
    assert_close(metrics, dtype, f"s_q={s_q} h_q={h_q}")


@needs_hopper
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
def test_ragged_lengths(causal, s_q):
    seqlens = [0, 1, 63, 64, 65, 4097, 0, 2, 127, 128]
    *_, metrics = run_case(seqlens, s_q, 16, causal=causal, seed=s_q)
    assert_close(metrics, torch.bfloat16, f"ragged causal={causal} s_q={s_q}")


@needs_hopper
@pytest.mark.parametrize("h_q", [1, 8, 16, 24, 64, 128])
def test_head_counts(h_q):
    *_, metrics = run_case([1, 63, 64, 65, 1000, 4097], 2, h_q, seed=h_q)
    assert_close(metrics, torch.bfloat16, f"h_q={h_q}")


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_two_kv_heads(dtype):
    *_, metrics = run_case([0, 65, 700, 4097], 2, 32, h_kv=2, dtype=dtype)
    assert_close(metrics, dtype, "h_kv=2")


@needs_hopper
def test_all_empty_sequences():
    _, _, out, lse, metrics = run_case([0, 0, 0], 1, 16)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse)), metrics


@needs_hopper
@pytest.mark.parametrize("rows,h_kv", [(16, 1), (256, 1), (64, 2)])
def test_metadata_kernel_large_batches(rows, h_kv):
    """The device scheduler equals the Python twin at batch sizes past upstream's 4096 limit."""
    gen = torch.Generator().manual_seed(rows)
    for b in (4097, 16384, 20000):
        seqlens = torch.randint(0, 200_000, (b,), generator=gen, dtype=torch.int32)
        seqlens[::7] = 0
        md, ns = flash_mla.get_mla_metadata(seqlens.cuda(), rows, h_kv)
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        twin_md, twin_ns = get_mla_metadata_twin(seqlens, rows, h_kv, num_sms)
        assert torch.equal(md.cpu(), twin_md) and torch.equal(ns.cpu(), twin_ns), f"b={b}"


@needs_hopper
def test_metadata_kernel_sparse_payload_floor():
    """The device scheduler's sparse plans (SPARSE_PLAN: the smallest covering payload, floored at
    SPARSE_MIN_PAYLOAD) equal the twin's: the classic form with topk on the referee's shapes (b = 1, h_q 128, s_q 1
    is where the floor binds: 16 parts of two pages, not 32 of one; b = 16 where the tight payload gives 64 parts of
    8 pages, not 48 of 9 and 16 of 5), and the extension called directly on ragged lengths (as a lazy schedule plans
    on topk_length) with this floor and others, with and without the tight payload; dense plans on the same lengths
    keep the SPEC rule."""
    from flash_mla._geometry import SPARSE_MIN_PAYLOAD, SPARSE_PLAN
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for b, s_q, h_q in ((1, 1, 128), (1, 2, 128), (16, 1, 128), (16, 2, 128), (32, 1, 64), (128, 2, 128)):
        full = torch.full((b,), 2048, dtype=torch.int32)
        md, ns = flash_mla.get_mla_metadata(full.cuda(), s_q * h_q, 1, num_heads_q=h_q, is_fp8_kvcache=True,
                                            topk=2048)
        twin_md, twin_ns = get_mla_metadata_twin(full, s_q * h_q, 1, num_sms, **SPARSE_PLAN)
        assert torch.equal(md.cpu(), twin_md) and torch.equal(ns.cpu(), twin_ns), f"b={b} s_q={s_q} h_q={h_q}"
        dense_md, dense_ns = flash_mla.get_mla_metadata(full.cuda(), s_q * h_q, 1)
        plain_md, plain_ns = get_mla_metadata_twin(full, s_q * h_q, 1, num_sms)
        assert torch.equal(dense_md.cpu(), plain_md) and torch.equal(dense_ns.cpu(), plain_ns), f"dense b={b}"
    if num_sms == 132:
        md, ns = flash_mla.get_mla_metadata(torch.zeros(1, dtype=torch.int32, device="cuda"), 128, 1, topk=2048)
        assert ns.tolist() == [0, 16]
        md, ns = flash_mla.get_mla_metadata(torch.zeros(16, dtype=torch.int32, device="cuda"), 128, 1, topk=2048)
        assert ns.tolist() == list(range(0, 65, 4)) and md[63].tolist() == [15, 1536, 15, 2048, 3, 0, 0, 0]
    gen = torch.Generator().manual_seed(11)
    ext = cuda_extension()
    tightened = 0
    for b in (1, 3, 16, 40, 5000):
        lengths = torch.randint(0, 2049, (b,), generator=gen, dtype=torch.int32)
        lengths[::5] = 0
        for rows in (64, 128, 256):
            for floor in (0, SPARSE_MIN_PAYLOAD, 9, 37, 100_000):
                for tight in (False, True):
                    md, ns = ext.get_mla_metadata(lengths.cuda(), rows, 1, num_sms, floor, tight)
                    twin_md, twin_ns = get_mla_metadata_twin(lengths, rows, 1, num_sms, floor, tight)
                    what = f"b={b} rows={rows} floor={floor} tight={tight}"
                    assert torch.equal(md.cpu(), twin_md) and torch.equal(ns.cpu(), twin_ns), what
                    if tight:
                        tightened += not torch.equal(twin_md, get_mla_metadata_twin(lengths, rows, 1, num_sms,
                                                                                    floor)[0])
    assert tightened >= 5, f"the tight payload changed only {tightened} plans: the test would prove little"
    with pytest.raises(RuntimeError, match=r"min_payload: expected an int in \[0, 2\^31\), got -1"):
        ext.get_mla_metadata(lengths.cuda(), 64, 1, num_sms, -1)


@needs_hopper
@pytest.mark.parametrize("b", [1, 4096, 16384])
def test_batch_sizes(b):
    gen = torch.Generator().manual_seed(b)
    seqlens = [int(x) for x in torch.randint(0, 300 if b > 1 else 20000, (b,), generator=gen)]
    *_, metrics = run_case(seqlens, 1, 16, seed=b)
    assert_close(metrics, torch.bfloat16, f"b={b}")


@needs_hopper
def test_deterministic():
    batch, (md, ns), out, lse, _ = run_case([5000, 100, 9000], 2, 64)
    again = flash_mla.flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512,
                                             md, ns, causal=True)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


# ----------------------------------------------------------------------------------------------------------------
# combine kernel: many pieces per sequence, empty rows between split ones, attention sink
# ----------------------------------------------------------------------------------------------------------------

# (pieces, length, SM parts): the device plan cuts one sequence of that length into exactly that many pieces
# (num_sms = parts * query-row tiles); 1024 pieces is a 1M-token cache (1.2 GB in bf16).
PIECE_COUNTS = [(1, 3000, 1), (2, 9983, 2), (133, 33851, 134), (1024, 1048256, 1024)]


WARP_ITEM_MAX_PIECES = 32     # csrc/kernels/combine.cu kWarpItemMaxPieces: more pieces get CTA items


def slice_cols(pieces: int) -> int:
    """csrc/kernels/combine.cu: output columns of one combine item of a sequence cut into `pieces`: slice_cols for
    warp items (up to WARP_ITEM_MAX_PIECES); past that, 64, the narrowest CTA item (cta_item_cols below gives the
    width a CTA item really has, which also depends on the rows and the grid)."""
    if pieces > WARP_ITEM_MAX_PIECES:
        return 64
    cols = 512
    while pieces * cols * 4 > 32 * 128:
        cols //= 2
    return cols


def cta_item_cols(pieces: int, rows: int, grid: int = 264) -> int:
    """csrc/kernels/combine.cu cta_item_cols: columns of one CTA item (pieces > WARP_ITEM_MAX_PIECES) when the CTA
    items of every such sequence of the batch cover `rows` packed rows, on `grid` combine CTAs (264 on an H100: two
    per SM)."""
    def ceil_div(a, b):
        return -(-a // b)

    best_cols, best_cost = 64, None
    for cols in (64, 128, 256):
        groups = 256 // (cols // 4)                      # piece groups of cols / 4 threads
        rounds = ceil_div(ceil_div(pieces, groups), 8)  # 8 pieces in flight per thread per round
        cost = ceil_div(rows * (512 // cols), grid) * (1 + rounds)
        if best_cost is None or cost < best_cost:
            best_cols, best_cost = cols, cost
    return best_cols


def length_with_pieces(pieces: int, parts: int) -> int:
    """The shortest b = 1 length (multiple of 64, plus 37) that a plan of `parts` SM parts cuts into `pieces`."""
    for blocks in range(pieces, 64 * pieces + 64):
        length = blocks * 64 - 27
        if schedule([length], parts)[1][1] == pieces:
            return length
    raise AssertionError(f"no length gives {pieces} pieces over {parts} parts")


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h_q", [16, 128])
@pytest.mark.parametrize("pieces,length,parts", PIECE_COUNTS, ids=[f"{c[0]}_pieces" for c in PIECE_COUNTS])
def test_combine_piece_counts(pieces, length, parts, h_q, dtype):
    """b = 1 cut into 1, 2, 133 and 1024 pieces: every output element written (outputs start as NaN, cache slots
    past the length are NaN) and equal to the float32 reference."""
    _, (md, ns), _, _, metrics = run_case([length], 1, h_q, dtype=dtype, num_sms=parts * -(-h_q // 64))
    assert md.shape[0] == parts and ns.tolist() == [0, pieces]
    assert_close(metrics, dtype, f"{pieces} pieces, h_q={h_q}")


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s_q,h_q", [(2, 16), (3, 2)])
@pytest.mark.parametrize("case", ["mixed", "padded_b32"])
def test_combine_empty_rows_between_split_rows(case, s_q, h_q, dtype):
    """L = 0 sequences (CUDA-graph padding) between split ones stay exactly out 0 / lse -inf, and every split row
    is exact. 'mixed' has sequences for both combine tiles (>= 16 pieces: wide, 2-15: tall) and unsplit ones;
    'padded_b32' is one long sequence padded to b = 32. h_q = 2, s_q = 3 leaves padding rows in the tall tile."""
    if case == "mixed":
        seqlens = [0, 20000, 0, 0, 2500, 0, 9000, 0, 700, 3000, 0, 1]
    else:
        seqlens = [33851] + [0] * 31
    batch, (_md, ns), out, lse, metrics = run_case(seqlens, s_q, h_q, dtype=dtype, seed=len(seqlens))
    pieces = (ns[1:] - ns[:-1]).tolist()
    assert all((n > 1) == (L > 64) for n, L in zip(pieces, seqlens)), pieces
    if case == "mixed":     # CTA items and warp items of several widths in one launch
        split = [n for n in pieces if n > 1]
        assert max(split) > WARP_ITEM_MAX_PIECES and len({slice_cols(n) for n in split}) >= 3, pieces
    empty = batch.cache_seqlens == 0
    assert bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all())
    assert_close(metrics, dtype, f"{case}: pieces {pieces}")


@needs_hopper
@pytest.mark.parametrize("h_q", [16, 64, 128])
@pytest.mark.parametrize("pieces", [2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129])
def test_combine_every_slice_width(pieces, h_q):
    """Every slice width of the combine's warp items (512 columns at 2 pieces down to 32 at 17-32) and of its CTA
    items (33 pieces on: 64 columns at h_q 16, 128 at h_q 64, 256 at h_q 128), at each width's edges: a thread
    with a partial last batch, groups with unequal piece counts, two or more rounds of loads in a CTA item."""
    parts = pieces + 1
    length = length_with_pieces(pieces, parts)
    _, (_md, ns), _, _, metrics = run_case([length], 1, h_q, num_sms=parts * -(-h_q // 64), seed=pieces)
    assert ns.tolist() == [0, pieces]
    cols = slice_cols(pieces) if pieces <= WARP_ITEM_MAX_PIECES else cta_item_cols(pieces, h_q)
    assert_close(metrics, torch.bfloat16, f"{pieces} pieces ({cols} columns), h_q={h_q}")


@needs_hopper
@pytest.mark.parametrize("h_q", [16, 64])
def test_combine_cta_items_of_several_sequences(h_q):
    """b = 4, each sequence cut into 33 pieces: the four sequences' CTA items share the grid, so their width counts
    all their rows (128 columns at h_q 16, 256 at h_q 64, where one sequence alone would get 64 and 128); every
    element written and equal to the float32 reference."""
    _, (_md, ns), _, _, metrics = run_case([12325] * 4, 1, h_q, num_sms=132, seed=h_q)
    pieces = (ns[1:] - ns[:-1]).tolist()
    assert min(pieces) > WARP_ITEM_MAX_PIECES, pieces
    assert cta_item_cols(max(pieces), 4 * h_q) == {16: 128, 64: 256}[h_q] != cta_item_cols(max(pieces), h_q)
    assert_close(metrics, torch.bfloat16, f"b = 4, {pieces} pieces, h_q={h_q}")


def test_cta_item_widths_cover_the_design():
    """The CTA item widths the combine's comment and static_assert name, mirrored; and the GPU test above
    reaches each of them (its grids: 264 CTAs at h_q 64 and 128; fewer at h_q 16, where the width is 64 either
    way)."""
    assert [cta_item_cols(128, 16), cta_item_cols(33, 16), cta_item_cols(34, 64), cta_item_cols(64, 64),
            cta_item_cols(64, 128), cta_item_cols(129, 128)] == [64, 64, 128, 128, 256, 256]
    widths = {cta_item_cols(n, h_q) for n in (33, 64, 65, 128, 129) for h_q in (16, 64, 128)}
    assert widths == {64, 128, 256}, widths


def test_slice_widths_cover_the_design():
    """The widths the combine's design comment names, mirrored here (the kernel static_asserts the same)."""
    assert [slice_cols(n) for n in (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 133)] == \
        [512, 256, 256, 128, 128, 64, 64, 32, 32, 64, 64, 64, 64, 64]
    for pieces in (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129):    # the GPU test's plans exist
        assert schedule([length_with_pieces(pieces, pieces + 1)], pieces + 1)[1] == [0, pieces]


LAZY_RESCALE_LOG2 = 8.0     # csrc/kernels/softmax.h kLazyRescaleLog2


def page_scale(pattern: str, page: int) -> float:
    """How much the keys (and so the values) of a sequence's page are scaled in test_softmax_references_that_move:
    'rising' every page a little more; 'a_pages_jump' / 'b_pages_jump' only the first / second page of each pair,
    by steps that pass a row's reference now and then (a random-score page maximum is ~3.5 log2 units per unit
    of scale)."""
    if pattern == "rising":
        return 1.0 + 0.5 * page
    jumping = page % 2 == (0 if pattern == "a_pages_jump" else 1)
    return 1.0 + 1.5 * (page // 2) if jumping else 1.0


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pattern", ["rising", "a_pages_jump", "b_pages_jump"])
def test_softmax_references_that_move(pattern, dtype):
    """Scores that pass a row's softmax reference by more than 2^8 (softmax.h lazy_reference) on later pages: on
    every page ('rising'), only on pages a of a pair (kPageA's reference moves; kPageB moves its own P_b) or only
    on pages b (kPageB's moves; kPageA rescales O between its two P V). The premise is checked on the scores of
    row 0 (the Python mirror of lazy_reference sees the reference move on such pages), then every row of out is
    compared with the float32 reference, row by row, and lse as everywhere."""
    seqlens = [64 * 40 + 17, 64 * 9, 64 * 64]           # odd and even page counts, a partial last page
    batch = make_decode_batch(seqlens, s_q=2, h_q=128, dtype=dtype, device="cuda", causal=True,
                              generator=torch.Generator().manual_seed(41))
    for i, length in enumerate(seqlens):
        for page in range(-(-length // 64)):
            block = int(batch.block_table[i, page])
            batch.k_cache[block] = (batch.k_cache[block].float() * page_scale(pattern, page)).to(dtype)

    # The premise: the rows of sequence 0's first token pass their references by more than 2^8 on pages of the
    # intended kind only (which of a pair's pages: 0 = a, 1 = b), as lazy_reference sees them (whole pages).
    full_pages = seqlens[0] // 64
    keys = batch.k_cache[batch.block_table[0, :full_pages].long()].reshape(-1, 576).float()
    scores = (batch.q[0, 0].float() @ keys.T) * (576 ** -0.5) * math.log2(math.e)        # (h_q, keys)
    moved_on = set()
    for row_maxima in scores.reshape(128, full_pages, 64).amax(-1).tolist():
        reference = -math.inf
        for page, page_max in enumerate(row_maxima):
            if reference == -math.inf or page_max - reference > LAZY_RESCALE_LOG2:
                if reference != -math.inf:
                    moved_on.add(page % 2)
                reference = max(reference, page_max)
    expected = {"rising": {0, 1}, "a_pages_jump": {0}, "b_pages_jump": {1}}[pattern]
    assert moved_on == expected, f"the reference moved on pages {moved_on} of a pair, wanted {expected}"

    rows = 2 * 128
    md, ns = flash_mla.get_mla_metadata(batch.cache_seqlens, rows, 1)
    out, lse = flash_mla.flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens,
                                                512, md, ns, causal=True)
    ref_out, ref_lse = reference_for(batch, on_device=True)
    assert_close(compare(out, lse, ref_out, ref_lse), dtype, pattern)
    row_err = (out.float() - ref_out.float()).norm(dim=-1) / ref_out.float().norm(dim=-1)
    worst = row_err.max().item()
    assert worst < 3 * {torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype], f"{pattern}: worst row error {worst:.2e}"


def piece_page_counts(metadata_rows, num_splits, length):
    """Pages of each piece of a b = 1 plan, in order (the pieces as the kernel walks them)."""
    return [-(-piece.end_token // 64) - piece.begin_token // 64
            for row in metadata_rows for piece in pieces_of_part(row, [length], num_splits)
            if piece.end_token > piece.begin_token]


def plan_with_pieces(pages, last_pages):
    """(SM parts, length) of a b = 1 call cut into >= 3 pieces of `pages` pages and a last one of `last_pages`, its
    last page partial (37 tokens), found with the scheduler's Python twin."""
    for parts in range(4, 40):
        for num_pages in range(pages, pages * parts + 10):
            length = (num_pages - 1) * 64 + 37
            sizes = piece_page_counts(*schedule([length], parts), length)
            if len(sizes) >= 3 and set(sizes[:-1]) == {pages} and sizes[-1] == last_pages:
                return parts, length
    raise AssertionError(f"no plan with pieces of {pages} pages and a last one of {last_pages}")


PIECE_SHAPES = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 2), (3, 3)]


@needs_hopper
@pytest.mark.parametrize("h_q", [16, 128])
@pytest.mark.parametrize("pages,last_pages", PIECE_SHAPES, ids=[f"{p}x{q}" for p, q in PIECE_SHAPES])
def test_pieces_of_few_pages(pages, last_pages, h_q):
    """The seesaw's edge shapes, one per piece: pieces of 1, 2 and 3 pages (a pair without page b, one whole pair,
    a pair and a half) and a last piece whose partial last page (NaN past the length) sits in buffer a or b, on
    one-tile (h_q 16) and four-tile (h_q 128, s_q 2) grids: every element written and equal to the float32
    reference."""
    parts, length = plan_with_pieces(pages, last_pages)
    tiles = -(-2 * h_q // 64)
    _, (md, ns), _, _, metrics = run_case([length], 2, h_q, num_sms=parts * tiles, seed=pages * 10 + last_pages)
    sizes = piece_page_counts(md.cpu().tolist(), ns.cpu().tolist(), length)
    assert set(sizes[:-1]) == {pages} and sizes[-1] == last_pages, sizes
    assert_close(metrics, torch.bfloat16, f"pieces of {sizes} pages, h_q={h_q}")


# Whole sequences of 1 to 6 pages, the last page partial or full and in either page buffer, and an empty one.
STAGED_LENGTHS = [1, 63, 64, 65, 127, 128, 129, 191, 192, 257, 0, 320]


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s_q,h_q", [(1, 128), (2, 128), (1, 160), (2, 64)])
def test_out_staged_in_page_buffers(s_q, h_q, dtype):
    """Unsplit pieces with 128 query heads or more (one KV head) go to out through the V half of their last page's
    buffer and TMA stores, which that half's refill for the next piece waits for (epilogue.h): two SM parts each
    walking 18 whole sequences, so every staged half is refilled for the next one; h_q 160 has a partial third
    tile (32 rows), whose padding rows lie outside out; h_q 64, s_q 2 (two tiles) stores from registers."""
    seqlens = STAGED_LENGTHS * 3
    tiles = -(-s_q * h_q // 64)
    _, (_, ns), _, _, metrics = run_case(seqlens, s_q, h_q, dtype=dtype, num_sms=2 * tiles, seed=s_q * h_q)
    assert torch.equal(ns[1:] - ns[:-1], torch.ones(len(seqlens), dtype=ns.dtype, device=ns.device)), "all unsplit"
    assert_close(metrics, dtype, f"staged out s_q={s_q} h_q={h_q}")


def _has_attn_sink():
    return "attn_sink" in inspect.signature(flash_mla.flash_mla_with_kvcache).parameters


@needs_hopper
@pytest.mark.skipif(not _has_attn_sink(), reason="flash_mla_with_kvcache takes no attn_sink here (an older binding)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attn_sink_on_split_and_unsplit_rows(dtype):
    """out = reference out / (1 + exp(sink[h] - lse)), lse unchanged, on split rows (the combine kernel) and unsplit
    ones (the split kernel's epilogue); a row that sees no key stays 0 / -inf; a +inf sink gives 0."""
    seqlens = [0, 20000, 70, 0, 9001, 1]          # causal, s_q = 2: the L = 1 sequence's first token sees no key
    s_q, h_q = 2, 16
    batch = make_decode_batch(seqlens, s_q=s_q, h_q=h_q, dtype=dtype, device="cuda", causal=True,
                              generator=torch.Generator().manual_seed(13))
    sink = torch.randn(h_q, generator=torch.Generator().manual_seed(14)) * 3
    sink[3], sink[5] = math.inf, -math.inf
    md, ns = flash_mla.get_mla_metadata(batch.cache_seqlens, s_q * h_q, 1)
    pieces = (ns[1:] - ns[:-1]).cpu()
    assert bool((pieces > 1).any()) and bool(((pieces == 1) & (batch.cache_seqlens.cpu() > 0)).any())
    poison_cuda_allocator(2 * (len(seqlens) + md.shape[0]) * s_q * h_q * 512 * 4)
    out, lse = flash_mla.flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512,
                                                md, ns, causal=True, attn_sink=sink.cuda())
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_for(batch)
    factor = torch.where(torch.isneginf(ref_lse), 1.0, 1.0 / (1.0 + torch.exp(sink[None, :, None] - ref_lse)))
    assert_close(compare(out, lse, ref_out * factor.transpose(1, 2)[..., None], ref_lse), dtype, "attn_sink")
    assert bool((out[:, :, 3] == 0).all()), "+inf sink"
    assert bool((out[5, 0] == 0).all()) and bool(torch.isneginf(lse[5, :, 0]).all()), "row without keys"


# ----------------------------------------------------------------------------------------------------------------
# script: the full reference sweep, one line per row
# ----------------------------------------------------------------------------------------------------------------

def reference_sweep(quick: bool):
    means = [4096] if quick else [4096, 8192, 16384]
    heads = [16, 128] if quick else [16, 32, 64, 128]
    for mean, h_q, s_q, varlen in itertools.product(means, heads, [1, 2], [False, True]):
        yield dict(b=128, mean=mean, h_q=h_q, s_q=s_q, varlen=varlen)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few rows only")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    args = parser.parse_args()
    reason = _hopper_reason()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"device: {torch.cuda.get_device_name()}  dtype: {args.dtype}  causal, h_kv=1, b=128")
    print(f"{'mean':>6} {'h_q':>4} {'s_q':>3} {'varlen':>6} {'time_us':>9} {'TFLOP/s':>8} {'GB/s':>7} "
          f"{'out_err':>9} {'lse_err':>9} {'cos':>9} verdict")
    failures = 0
    for i, row in enumerate(reference_sweep(args.quick)):
        gen = torch.Generator().manual_seed(i)
        seqlens = random_seqlens(row["b"], row["mean"], row["s_q"], row["varlen"], generator=gen)
        batch, (md, ns), out, lse, metrics = run_case(seqlens, row["s_q"], row["h_q"], dtype=dtype, seed=i)
        try:
            assert_close(metrics, dtype)
            verdict = "ok"
        except AssertionError as e:
            verdict = f"FAIL {e}"
            failures += 1
        del out, lse
        t = time_decode(batch, md, ns)
        flops, nbytes = decode_flops_and_bytes(seqlens, row["s_q"], row["h_q"], 1)
        print(f"{row['mean']:>6} {row['h_q']:>4} {row['s_q']:>3} {row['varlen']!s:>6} {t * 1e6:>9.1f} "
              f"{flops / t / 1e12:>8.1f} {nbytes / t / 1e9:>7.0f} {metrics['out_rel_l2']:>9.2e} "
              f"{metrics['lse_rel_l2']:>9.2e} {metrics['cos_diff']:>9.2e} {verdict}", flush=True)
        del batch
        torch.cuda.empty_cache()
    print("edge cases:", flush=True)
    edge = pytest.main([__file__, "-q", "-x", "-p", "no:cacheprovider"])
    failures += int(edge != 0)
    print("ALL ROWS PASSED" if failures == 0 else f"{failures} FAILURES")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
