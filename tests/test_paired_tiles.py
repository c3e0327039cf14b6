"""Paired row tiles on the Hopper kernel: targeted GPU tests of the shared page-copy protocol.

With an even number of 64-row query tiles per KV head (s_q * h_q in {128, 256, ...}), the split kernel launches the
tiles of one SM part in clusters of two that fetch every page once and multicast it into both CTAs (mainloop.h
"refill"). compute-sanitizer's racecheck sees neither TMA nor cluster traffic, so these tests aim at the protocol's
corners instead: sequences whose last page ends in either page buffer, partial or full; pieces of one page (many
SM parts, short sequences); L = 0 rows between others; a pair whose second tile has fewer rows than the first;
clusters of 2, 4 and 6 tiles per KV head; two KV heads; the FP8 cache (its copies are widened in each CTA's own
shared memory after the shared copy lands). Each case runs against the float32 reference with NaN in every cache
slot past a sequence's length and NaN-poisoned outputs (flash_mla.testing). Skips without a Hopper GPU.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flash_mla
from flash_mla.testing import (assert_close, compare, make_fp8_decode_batch, poison_cuda_allocator,
                               reference_for)
from test_flash_mla import needs_hopper, run_case

# Lengths whose last page is page 0 / 1 / 2 / 3 of a piece (buffer 0 or 1), partial or full, and empty rows.
RING_LENGTHS = [1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 0, 1000]

# (s_q, h_q, h_kv): query rows per KV head 128 / 256 / 224 (second pair's last tile 32 rows) / 384 / 2 KV heads.
PAIRED_SHAPES = [(1, 128, 1), (2, 128, 1), (2, 112, 1), (3, 128, 1), (2, 128, 2)]


@needs_hopper
@pytest.mark.parametrize("s_q,h_q,h_kv", PAIRED_SHAPES)
@pytest.mark.parametrize("num_sms", [None, 7, 1])
def test_ring_corners(s_q, h_q, h_kv, num_sms):
    """Every page-count parity and tail, whole sequences (1 SM part), a few parts, and the GPU's count (pieces
    of one page at 33+ parts for these short sequences)."""
    *_, metrics = run_case(RING_LENGTHS, s_q, h_q, h_kv=h_kv, causal=True, seed=s_q * 100 + h_q + (num_sms or 0),
                           num_sms=num_sms)
    assert_close(metrics, torch.bfloat16, f"s_q={s_q} h_q={h_q} h_kv={h_kv} num_sms={num_sms}")


@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_pieces_and_one_page_pieces(dtype):
    """A long sequence cut into many pieces next to one-page sequences, non-causal."""
    *_, metrics = run_case([8191, 1, 64, 65, 4097, 0, 2], 2, 128, causal=False, dtype=dtype, seed=7)
    assert_close(metrics, dtype, "long + one-page pieces")


@needs_hopper
def test_many_short_sequences_deterministic():
    """b = 300 short sequences at h_q 128, s_q 2 (4 tiles: two pairs per SM part): bitwise equal run to run."""
    lengths = [(i * 37) % 300 for i in range(300)]
    batch, (md, ns), out, lse, metrics = run_case(lengths, 2, 128, causal=True, seed=11)
    assert_close(metrics, torch.bfloat16, "b=300 short")
    again = flash_mla.flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512,
                                             md, ns, causal=True)
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1])


@needs_hopper
@pytest.mark.parametrize("q_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("num_sms", [None, 5])
def test_fp8_cache_paired(q_dtype, num_sms):
    """The FP8 kernel with paired tiles: each CTA widens its own copy of the shared page."""
    gen = torch.Generator().manual_seed(21 + (num_sms or 0))
    batch = make_fp8_decode_batch(RING_LENGTHS, s_q=2, h_q=128, q_dtype=q_dtype, descale_q=0.01, descale_k=37.0,
                                  device="cuda", causal=True, generator=gen)
    md, ns = flash_mla.get_mla_metadata(batch.cache_seqlens, 256, 1, is_fp8_kvcache=True, num_sms=num_sms)
    poison_cuda_allocator(64 * 1024 * 1024)
    out, lse = flash_mla.flash_mla_with_kvcache_fp8(*batch.args(), 512, md, ns, causal=True,
                                                    descale_q=batch.descale_q, descale_k=batch.descale_k)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_for(batch.dequantized())
    assert torch.isfinite(out).all()
    assert_close(compare(out, lse, ref_out, ref_lse), out.dtype, f"fp8 cache paired, q {q_dtype}")
