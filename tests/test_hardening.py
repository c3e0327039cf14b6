"""Production hardening on the CPU backend: the opt-in debug mode (FLASH_MLA_DEBUG=1), NaN/Inf in q, negative
lengths, stale metadata, padded batches and determinism (the cache-bound checks every CPU call makes are in
tests/test_cpu_value_checks.py). The GPU counterparts are in tests/test_gpu_hardening.py.
"""
import math

import pytest
import torch

from flash_mla import flash_mla_with_kvcache, get_mla_metadata
from flash_mla.backends import ENV_VAR
from flash_mla.testing import assert_close, compare, make_decode_batch, reference_for

DEBUG = "FLASH_MLA_DEBUG"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv(DEBUG, raising=False)


def make(seqlens, s_q=1, h_q=16, seed=0, causal=True, **kw):
    batch = make_decode_batch(seqlens, s_q=s_q, h_q=h_q, causal=causal, generator=torch.Generator().manual_seed(seed),
                              **kw)
    md, ns = get_mla_metadata(batch.cache_seqlens, s_q * h_q, 1)
    return batch, md, ns


def run(batch, md, ns, **kw):
    return flash_mla_with_kvcache(batch.q, kw.pop("k_cache", batch.k_cache), kw.pop("block_table", batch.block_table),
                                  kw.pop("cache_seqlens", batch.cache_seqlens), 512, md, ns, causal=batch.causal, **kw)


# ---------------------------------------------------------------------------------------------------------------
# debug mode
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value,enabled", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_debug_mode_is_read_at_every_call(monkeypatch, value, enabled):
    """The debug-only checks (here: finite q) follow the variable call by call; the cache bounds are checked on
    every call with CPU tensors, whatever it says (tests/test_cpu_value_checks.py)."""
    batch, md, ns = make([5, 70, 0])
    batch.q[1, 0, 3, 9] = math.nan                         # a query of the 70-token sequence
    run(batch, md, ns)                                     # debug off: not checked (NaN stays in row 1)
    bad_table = batch.block_table.clone()
    bad_table[1, 0] = -1                                   # page 0 of a 70-token sequence
    monkeypatch.setenv(DEBUG, value)
    if enabled:
        with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: q\[1\]: expected finite values"):
            run(batch, md, ns)
    else:
        run(batch, md, ns)
    with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: block_table\[1, 0\]: expected a block index"):
        run(batch, md, ns, block_table=bad_table)


def test_debug_mode_passes_valid_input(monkeypatch):
    """Padding rows (L = 0, block table all -1, q NaN) and entries past each sequence's pages are never checked."""
    batch, md, ns = make([0, 1, 63, 64, 65, 4097, 0], s_q=2, causal=True, seed=1)
    batch.q[0] = math.nan
    batch.q[6] = math.inf
    expected = run(batch, md, ns)
    monkeypatch.setenv(DEBUG, "1")
    got = run(batch, md, ns)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert get_mla_metadata(batch.cache_seqlens, 32, 1)[1].tolist() == ns.tolist()


@pytest.mark.parametrize("entry", [-1, -7, 10 ** 6, "num_blocks"])
def test_debug_mode_rejects_block_table_entries_out_of_range(monkeypatch, entry):
    batch, md, ns = make([5, 70, 130, 0])
    num_blocks = batch.k_cache.shape[0]
    value = num_blocks if entry == "num_blocks" else entry
    bad_table = batch.block_table.clone()
    bad_table[2, 2] = value                               # the last of sequence 2's three pages
    monkeypatch.setenv(DEBUG, "1")
    with pytest.raises(ValueError) as info:
        run(batch, md, ns, block_table=bad_table)
    msg = str(info.value)
    assert msg.startswith("flash_mla_with_kvcache: block_table[2, 2]: expected a block index in "
                          f"[0, {num_blocks})"), msg
    assert "sequence 2" in msg and "130 tokens" in msg and msg.endswith(f"got {value}")


def test_debug_mode_rejects_a_sequence_longer_than_its_pages(monkeypatch):
    batch, _, _ = make([5, 70, 130])
    seqlens = batch.cache_seqlens.clone()
    seqlens[1] = 3 * 64 + 1                               # block_table has 3 columns: 192 tokens at most
    md, ns = get_mla_metadata(seqlens, 16, 1)
    monkeypatch.setenv(DEBUG, "1")
    with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: cache_seqlens\[1\]: expected at most "
                                         r"block_table.shape\[1\] \* 64 = 192 tokens .*got 193$"):
        run(batch, md, ns, cache_seqlens=seqlens)


def test_negative_lengths(monkeypatch):
    seqlens = torch.tensor([5, -3, 70], dtype=torch.int32)
    # the CPU scheduler reads the lengths anyway, so it always rejects them
    with pytest.raises(ValueError, match=r"^get_mla_metadata: cache_seqlens\[1\]: expected a length >= 0, got -3$"):
        get_mla_metadata(seqlens, 16, 1)
    monkeypatch.setenv(DEBUG, "1")
    with pytest.raises(ValueError, match=r"^get_mla_metadata: cache_seqlens\[1\]: expected a length >= 0, got -3$"):
        get_mla_metadata(seqlens, 16, 1)
    batch, md, ns = make([5, 70, 0])
    with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: cache_seqlens\[1\]: expected a length >= 0"):
        run(batch, md, ns, cache_seqlens=seqlens)


def test_debug_mode_catches_stale_metadata(monkeypatch):
    """Metadata of the same batch size but other lengths (last step's plan) passes the shape checks; in debug mode
    it is compared with the plan of these lengths."""
    batch, md, ns = make([5, 70, 4097, 0])
    stale_md, stale_ns = get_mla_metadata(torch.tensor([5, 70, 64, 9000], dtype=torch.int32), 16, 1)
    monkeypatch.setenv(DEBUG, "1")      # without debug mode the plan is trusted: wrong results (documented)
    with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: num_splits: expected the get_mla_metadata "
                                         r"result for these cache_seqlens \(metadata from another step or batch\?\): "
                                         r"num_splits\[2\] = 3, got num_splits\[2\] = 2$"):
        run(batch, stale_md, stale_ns)
    # same num_splits, other rows: the per-part rows are compared too
    other_md = md.clone()
    other_md[0, 3] += 64
    with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: tile_scheduler_metadata: expected .*: row 0 = "
                                         r"\[.*\], got row 0 = \["):
        run(batch, other_md, ns)


def test_debug_mode_accepts_metadata_for_other_head_counts(monkeypatch):
    """Any plan get_mla_metadata makes for these lengths is valid (split independence): other num_sms or heads."""
    batch, _, _ = make([5, 70, 4097, 0], h_q=16)
    monkeypatch.setenv(DEBUG, "1")
    expected = reference_for(batch)
    for rows, num_sms in [(16, 132), (128, 132), (16, 7), (16, 1)]:
        md, ns = get_mla_metadata(batch.cache_seqlens, rows, 1, num_sms=num_sms)
        assert_close(compare(*run(batch, md, ns), *expected), torch.bfloat16, f"rows={rows} num_sms={num_sms}")


def test_debug_mode_rejects_non_finite_q(monkeypatch):
    batch, md, ns = make([5, 70, 0, 9], h_q=16)
    batch.q[3, 0, 7, 100] = math.inf
    monkeypatch.setenv(DEBUG, "1")
    with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: q\[3\]: expected finite values \(sequence 3 "
                                         r"has 9 tokens\), got NaN or Inf$"):
        run(batch, md, ns)


# ---------------------------------------------------------------------------------------------------------------
# NaN / Inf in q, without debug mode
# ---------------------------------------------------------------------------------------------------------------

def test_non_finite_q_stays_in_its_rows():
    """NaN or Inf in one query row is not checked (that would need a host sync): the call returns, and only
    that row's result is affected: NaN in out, or out 0 with lse -inf. Every other row is exact."""
    batch, md, ns = make([300, 70, 4097, 0, 9], s_q=2, h_q=16, seed=4)
    bad = [(0, 1, 3, math.nan), (2, 0, 15, math.inf), (4, 1, 0, -math.inf)]   # (seq, token, head, value)
    for seq, token, head, value in bad:
        batch.q[seq, token, head, 17] = value
    ref_out, ref_lse = reference_for(batch)
    for num_sms in (132, 3):                               # unsplit and split sequences
        md, ns = get_mla_metadata(batch.cache_seqlens, 32, 1, num_sms=num_sms)
        out, lse = run(batch, md, ns)
        mask = torch.ones(out.shape[:3], dtype=torch.bool)
        for seq, token, head, _ in bad:
            mask[seq, token, head] = False
            o, l_ = out[seq, token, head].float(), lse[seq, head, token]
            assert bool(torch.isnan(o).any()) or (bool((o == 0).all()) and not math.isfinite(l_)), (seq, token, head)
        good_out = out.float()[mask]
        assert torch.isfinite(good_out).all()
        torch.testing.assert_close(good_out, ref_out[mask], rtol=2e-2, atol=2e-2)
        lse_mask = mask.transpose(1, 2)
        torch.testing.assert_close(lse[lse_mask], ref_lse[lse_mask], rtol=1e-3, atol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# padded batches and determinism
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("garbage", [-1, 2 ** 31 - 1, -(2 ** 31)])
def test_padded_rows_are_zero_and_never_read(garbage):
    """CUDA-graph style padding: rows with L = 0, any block-table content, any q, give out 0 and lse -inf."""
    real = [300, 1, 4097, 65]
    batch, _, _ = make(real + [0, 0, 0], s_q=2, h_q=16, seed=5)
    batch.block_table[len(real):] = garbage
    batch.q[len(real):] = math.nan
    md, ns = get_mla_metadata(batch.cache_seqlens, 32, 1)
    out, lse = run(batch, md, ns)
    assert torch.equal(out[len(real):], torch.zeros_like(out[len(real):]))
    assert torch.isneginf(lse[len(real):]).all()
    assert_close(compare(out, lse, *reference_for(batch)), torch.bfloat16, "padded batch")


def test_deterministic_run_after_run():
    batch, md, ns = make([5000, 100, 9000, 0, 64], s_q=2, h_q=32, seed=6)
    first = run(batch, md, ns)
    for _ in range(2):
        again = run(batch, md, ns)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    # the same values at other addresses: still bit for bit
    copies = run(batch, md.clone(), ns.clone(), k_cache=batch.k_cache.clone(), block_table=batch.block_table.clone(),
                 cache_seqlens=batch.cache_seqlens.clone())
    assert torch.equal(first[0], copies[0]) and torch.equal(first[1], copies[1])
