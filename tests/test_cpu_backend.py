"""The CPU split-KV path (public API on CPU tensors) against the float32 reference.

Batches come from flash_mla.testing.make_decode_batch: pages in random physical order, NaN in every cache slot
past a sequence's length and in unused blocks, block_table padded with -1. Several num_sms values make the
scheduler cut sequences into many pieces, so the partial-attention and combine steps are both exercised.
"""
import math

import pytest
import torch

from flash_mla import flash_mla_with_kvcache, get_mla_metadata, mla_decode_reference
from flash_mla.backends import ENV_VAR, select_backend
from flash_mla.cpu_backend import combine_pieces
from flash_mla.testing import assert_close, compare, make_decode_batch, reference_for

RAGGED = [0, 1, 63, 64, 65, 127, 128, 4097, 300, 2]
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _automatic_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def run(batch, num_sms=None, softmax_scale=None):
    _, s_q, h_q, h_kv = (batch.shape[k] for k in ("b", "s_q", "h_q", "h_kv"))
    md, ns = get_mla_metadata(batch.cache_seqlens, s_q * h_q // h_kv, h_kv, num_sms=num_sms)
    out, lse = flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512,
                                      md, ns, softmax_scale=softmax_scale, causal=batch.causal)
    return out, lse, ns


def test_cpu_tensors_select_cpu_backend():
    assert select_backend(torch.device("cpu")) == "cpu"


CONFIGS = [  # dtype, h_q, h_kv, s_q, causal
    (torch.bfloat16, 16, 1, 1, False),
    (torch.bfloat16, 16, 1, 2, True),
    (torch.float16, 16, 2, 3, True),
    (torch.bfloat16, 128, 1, 1, True),
    (torch.float16, 128, 1, 2, False),
    (torch.bfloat16, 128, 2, 4, True),
    (torch.float16, 64, 1, 4, True),
    (torch.bfloat16, 32, 2, 1, False),
    (torch.float16, 16, 1, 4, False),
]


@pytest.mark.parametrize("dtype,h_q,h_kv,s_q,causal", CONFIGS)
def test_ragged_batch_matches_reference(dtype, h_q, h_kv, s_q, causal):
    g = torch.Generator().manual_seed(h_q * 100 + h_kv * 10 + s_q)
    batch = make_decode_batch(RAGGED, s_q=s_q, h_q=h_q, h_kv=h_kv, dtype=dtype, causal=causal, generator=g)
    ref_out, ref_lse = reference_for(batch)
    split_seen = False
    for num_sms in (132, 9, 1):
        out, lse, ns = run(batch, num_sms)
        assert out.shape == (len(RAGGED), s_q, h_q, 512) and out.dtype == dtype
        assert lse.shape == (len(RAGGED), h_q, s_q) and lse.dtype == torch.float32
        assert_close(compare(out, lse, ref_out, ref_lse), dtype, f"num_sms={num_sms}")
        pieces = ns[1:] - ns[:-1]
        split_seen |= bool((pieces > 1).any())
        if num_sms == 1:
            assert bool((pieces == 1).all())
    assert split_seen, "no configuration split a sequence: the combine path went untested"
    # empty sequences and rows that see no key: exactly 0 and -inf
    assert bool((out[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())
    if causal and s_q > 1:   # the length-1 sequence: only its last query token sees a key
        assert bool(torch.isneginf(lse[1, :, :-1]).all()) and bool(torch.isfinite(lse[1, :, -1]).all())
        assert bool((out[1, :-1] == 0).all())


@pytest.mark.parametrize("seed", range(3))
def test_random_lengths(seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 2500, (6,), generator=g).tolist()
    s_q = seed + 1
    batch = make_decode_batch(lens, s_q=s_q, h_q=16, h_kv=1, causal=bool(seed % 2), generator=g)
    out, lse, _ = run(batch, num_sms=[132, 20, 5][seed])
    assert_close(compare(out, lse, *reference_for(batch)), torch.bfloat16, f"lens={lens}")


def _ulp(dtype):
    return {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_result_independent_of_split_layout(dtype):
    g = torch.Generator().manual_seed(7)
    batch = make_decode_batch([4097, 0, 1000, 65, 1, 2000], s_q=2, h_q=32, h_kv=2, dtype=dtype, causal=True,
                              generator=g)
    base_out, base_lse, base_ns = run(batch, num_sms=1)
    assert base_ns.tolist() == list(range(7))
    layouts = {tuple(base_ns.tolist())}
    for num_sms in (2, 5, 33, 132, 1000):
        out, lse, ns = run(batch, num_sms=num_sms)
        layouts.add(tuple(ns.tolist()))
        torch.testing.assert_close(lse, base_lse, rtol=1e-5, atol=1e-5)
        assert torch.equal(torch.isneginf(lse), torch.isneginf(base_lse))
        # float32 accumulations in another order: after rounding to half precision at most one ulp apart
        torch.testing.assert_close(out.float(), base_out.float(), rtol=_ulp(dtype), atol=1e-6)
        assert (out != base_out).float().mean() < 0.02, f"num_sms={num_sms}: too many elements differ"
    assert len(layouts) >= 4, "the num_sms values should give different split layouts"


def test_all_empty_sequences():
    batch = make_decode_batch([0, 0, 0, 0], s_q=2, h_q=16, causal=True)
    for num_sms in (1, 132):
        out, lse, ns = run(batch, num_sms=num_sms)
        assert ns.tolist() == [0, 1, 2, 3, 4]
        assert bool((out == 0).all()) and not out.isnan().any()
        assert bool(torch.isneginf(lse).all())


def test_custom_softmax_scale():
    g = torch.Generator().manual_seed(3)
    batch = make_decode_batch([700, 65, 3000], s_q=2, h_q=16, causal=True, generator=g)
    scale = 0.11
    out, lse, _ = run(batch, num_sms=16, softmax_scale=scale)
    assert_close(compare(out, lse, *reference_for(batch, softmax_scale=scale)), torch.bfloat16, "custom scale")
    default_out, default_lse, _ = run(batch, num_sms=16)
    assert_close(compare(default_out, default_lse, *reference_for(batch)), torch.bfloat16, "default scale")
    # the custom scale changed the result (576 ** -0.5 ~ 0.0417 is far from 0.11)
    assert (lse - default_lse).abs().max() > 1.0
    explicit_out, explicit_lse, _ = run(batch, num_sms=16, softmax_scale=576 ** -0.5)
    assert torch.equal(explicit_out, default_out) and torch.equal(explicit_lse, default_lse)


def test_block_table_past_pages_never_read():
    """Entries past a sequence's pages are replaced with an out-of-range block: reading one would raise."""
    g = torch.Generator().manual_seed(5)
    batch = make_decode_batch([0, 130, 64, 1, 900], s_q=2, h_q=16, causal=True, generator=g)
    ref = reference_for(batch)
    padding = batch.block_table == -1
    assert padding.any()
    batch.block_table[padding] = 10 ** 7
    for num_sms in (1, 132):
        out, lse, _ = run(batch, num_sms=num_sms)
        assert_close(compare(out, lse, *ref), torch.bfloat16, f"num_sms={num_sms}")


def test_non_contiguous_q_and_cache_views():
    """Views with a contiguous last dimension but padded outer strides are legal input."""
    g = torch.Generator().manual_seed(11)
    batch = make_decode_batch([129, 3, 640], s_q=2, h_q=16, h_kv=1, causal=True, generator=g)
    ref = reference_for(batch)
    q_big = torch.full((3, 2, 24, 576), math.nan, dtype=torch.bfloat16)
    q_big[:, :, :16] = batch.q
    batch.q = q_big[:, :, :16]
    assert not batch.q.is_contiguous()
    out, lse, _ = run(batch, num_sms=40)
    assert_close(compare(out, lse, *ref), torch.bfloat16, "strided q")


# ---------------------------------------------------------------------------------------------------------------
# many pieces per sequence: the combine step at 1, 2, 133 and > 1000 pieces


class _PoisonedTorch:
    """`torch` as flash_mla.cpu_backend sees it, except that torch.empty returns NaN-filled tensors: an output
    element the backend fails to write then shows up as NaN."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*size, dtype=None, **kwargs):
        return torch.full(size, math.nan, dtype=dtype, **kwargs)


@pytest.fixture
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr("flash_mla.cpu_backend.torch", _PoisonedTorch())


# (pieces, length, num_sms): the scheduler twin's plan for one sequence of that length is cut into exactly that many
# pieces; lengths end mid-page, so the last page's slots past the end (NaN) must be masked.
PIECE_COUNTS = [(1, 3000, 1), (2, 10000 - 17, 2), (133, 33856 - 5, 134), (1100, 70383, 1200)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pieces,length,num_sms", PIECE_COUNTS, ids=[f"{c[0]}_pieces" for c in PIECE_COUNTS])
def test_one_sequence_cut_into_many_pieces(poisoned_outputs, pieces, length, num_sms, dtype):
    g = torch.Generator().manual_seed(pieces)
    batch = make_decode_batch([length], s_q=1, h_q=16, dtype=dtype, causal=True, generator=g)
    out, lse, ns = run(batch, num_sms=num_sms)
    assert ns.tolist() == [0, pieces]
    assert_close(compare(out, lse, *reference_for(batch)), dtype, f"{pieces} pieces")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_sms", [40, 132])
def test_empty_sequences_between_split_ones(poisoned_outputs, num_sms, dtype):
    """L = 0 rows (CUDA-graph padding) between split sequences: exactly 0 / -inf, and the split rows exact."""
    seqlens = [0, 5000, 0, 0, 3001, 0, 9000, 0]
    g = torch.Generator().manual_seed(num_sms)
    batch = make_decode_batch(seqlens, s_q=2, h_q=16, dtype=dtype, causal=True, generator=g)
    out, lse, ns = run(batch, num_sms=num_sms)
    pieces = (ns[1:] - ns[:-1]).tolist()
    assert all((n > 1) == (L > 0) for n, L in zip(pieces, seqlens)), pieces
    empty = batch.cache_seqlens == 0
    assert bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all())
    assert_close(compare(out, lse, *reference_for(batch)), dtype, f"num_sms={num_sms}")


# ---------------------------------------------------------------------------------------------------------------
# combine_pieces


def _pieces_from_scores(scores, values, bounds):
    """Cut the keys at `bounds` and compute each piece's normalised output and lse, as a split CTA would."""
    o_list, lse_list = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        s = scores[:, lo:hi]
        lse = torch.logsumexp(s, dim=1)
        seen = torch.isfinite(lse)
        p = torch.exp(s - torch.where(seen, lse, 0.0)[:, None])
        o_list.append(torch.where(seen[:, None], p @ values[lo:hi], 0.0))
        lse_list.append(lse)
    return torch.stack(o_list), torch.stack(lse_list)


def test_combine_matches_full_softmax():
    g = torch.Generator().manual_seed(0)
    rows, keys, dv = 6, 50, 16
    scores = torch.randn(rows, keys, generator=g, dtype=torch.float64) * 4
    values = torch.randn(keys, dv, generator=g, dtype=torch.float64)
    scores[2, 10:] = -math.inf          # row 2 only sees keys of the first two pieces
    scores[4, :30] = -math.inf          # row 4 only sees keys of the last piece
    o_pieces, lse_pieces = _pieces_from_scores(scores, values, [0, 7, 20, 30, 50])
    assert torch.isneginf(lse_pieces[2:, 2]).all() and torch.isneginf(lse_pieces[:3, 4]).all()
    out, lse = combine_pieces(o_pieces, lse_pieces)
    full_lse = torch.logsumexp(scores, dim=1)
    full_out = torch.softmax(scores, dim=1) @ values
    torch.testing.assert_close(lse, full_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, full_out, rtol=1e-12, atol=1e-12)
    # the order of the pieces does not matter
    perm = torch.tensor([3, 1, 0, 2])
    out_p, lse_p = combine_pieces(o_pieces[perm], lse_pieces[perm])
    torch.testing.assert_close(out_p, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse_p, lse, rtol=1e-12, atol=1e-12)


def test_combine_rows_without_keys():
    n, rows, dv = 3, 4, 8
    o_pieces = torch.randn(n, rows, dv)
    lse_pieces = torch.randn(n, rows)
    o_pieces[:, 1] = 0.0
    lse_pieces[:, 1] = -math.inf        # row 1 saw no key in any piece
    o_pieces[0, 3] = 0.0
    lse_pieces[0, 3] = -math.inf        # row 3 saw nothing in piece 0 only
    out, lse = combine_pieces(o_pieces, lse_pieces)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[1], torch.zeros(dv)) and bool(torch.isneginf(lse[1]))
    out_rest, lse_rest = combine_pieces(o_pieces[1:, 3:4], lse_pieces[1:, 3:4])
    torch.testing.assert_close(out[3:4], out_rest)
    torch.testing.assert_close(lse[3:4], lse_rest)


def test_combine_all_rows_without_keys():
    out, lse = combine_pieces(torch.zeros(5, 3, 4), torch.full((5, 3), -math.inf))
    assert torch.equal(out, torch.zeros(3, 4))
    assert bool(torch.isneginf(lse).all())


def test_combine_single_piece_is_identity():
    g = torch.Generator().manual_seed(1)
    o = torch.randn(1, 4, 8, generator=g)
    lse_in = torch.randn(1, 4, generator=g)
    out, lse = combine_pieces(o, lse_in)
    torch.testing.assert_close(out, o[0])
    torch.testing.assert_close(lse, lse_in[0])


def test_combine_large_lse_does_not_overflow():
    """lse values of long sequences at large scales are far beyond exp's float32 range."""
    f64 = torch.float64   # exp(1000) overflows float64 too; float64 keeps the expected values exact
    o = torch.stack([torch.full((2, 4), 1.0, dtype=f64), torch.full((2, 4), 3.0, dtype=f64)])
    lse_in = torch.tensor([[1000.0, -1000.0], [1000.0 + math.log(3.0), -1000.0]], dtype=f64)
    out, lse = combine_pieces(o, lse_in)
    torch.testing.assert_close(lse, torch.tensor([1000.0 + math.log(4.0), -1000.0 + math.log(2.0)], dtype=f64))
    torch.testing.assert_close(out, torch.tensor([[2.5] * 4, [2.0] * 4], dtype=f64))


def test_reference_is_exported():
    """The package-level reference is the one the comparisons above use."""
    batch = make_decode_batch([70], s_q=1, h_q=16, generator=torch.Generator().manual_seed(2))
    out, lse = mla_decode_reference(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512)
    ref_out, ref_lse = reference_for(batch)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
