"""A 16-bit q in the transposed FP8 kernel, modelled on the CPU: its Q tile as three e4m3 terms.

S^T = K Q^T runs on the e4m3 tensor cores, so a bf16 or fp16 q is cut per tile (the rows_per_kv rows of one KV head and
sequence) into q / d = t0 + t1 / 16 + t2 / 256 with d = max(amax / 448, 2^-126), t0 = e4m3(q / d), t1 = e4m3(16 (q / d -
t0)), t2 likewise from the rest (csrc/kernels/transposed_mainloop.h quantise_q; kQTerms and kQLoScale in
transposed_traits.h). This replays that arithmetic in float32 (torch's float8_e4m3fn cast rounds to nearest even and
saturates, as the kernel's __NV_SATFINITE conversion does) and checks the claims the kernel and README rest on: each
value is kept to 2^-12 of itself (plus 2^-18 d where e4m3 runs subnormal), so scores are exact to about 2^-12 of
sum |q||k| and lse to ~1e-5 of itself; two terms would not be; NaN stays where it was, infinities poison the
tile, an all-zero tile stays zero.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

TRAITS = Path(__file__).resolve().parents[1] / "csrc" / "kernels" / "transposed_traits.h"
E4M3_MAX = 448.0
LO_SCALE = 16.0


def quantise_terms(x: torch.Tensor, terms: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's terms of one Q tile x (float32 values of a bf16 / fp16 q): (terms, *x.shape) e4m3 values as
    float32, and the tile's descale d (float32)."""
    amax = torch.where(torch.isnan(x), torch.zeros_like(x), x.abs()).max()    # fmaxf leaves NaN out
    d = torch.clamp(amax / E4M3_MAX, min=2.0 ** -126)
    y = x * (1.0 / d)
    out = []
    for _ in range(terms):
        code = y.to(torch.float8_e4m3fn).float()
        out.append(code)
        y = (y - code) * LO_SCALE
    return torch.stack(out), d


def dequantise(t: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    weights = LO_SCALE ** -torch.arange(t.shape[0], dtype=torch.float64)
    return (t.double() * weights.view(-1, *([1] * (t.dim() - 1)))).sum(0) * d.double()


def random_q(rows: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(rows, 576, generator=gen) * scale).to(dtype).float()


def test_the_kernel_takes_three_terms_sixteen_apart():
    text = TRAITS.read_text()
    assert re.search(r"kQTerms\s*=\s*kWideQ\s*\?\s*3\s*:\s*1", text), "the model below assumes three terms"
    assert re.search(r"kQLoScale\s*=\s*16\.f", text), "the model below assumes terms 16 apart"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 300.0])
def test_each_value_is_kept_to_two_to_the_minus_twelve(dtype, scale):
    gen = torch.Generator().manual_seed(7)
    for rows in (1, 16, 32):
        x = random_q(rows, dtype, gen, scale)
        x[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 2.0 ** -20, 0.5, -1.0, 3.0]) * scale
        t, d = quantise_terms(x)
        assert t.abs().max() <= E4M3_MAX and torch.isfinite(t).all()
        err = (dequantise(t, d) - x.double()).abs()
        bound = 2.0 ** -12 * x.double().abs() + 2.0 ** -18 * d.double()
        assert (err <= bound).all(), float((err / bound).max())


def test_two_terms_would_not_be():
    gen = torch.Generator().manual_seed(8)
    x = random_q(32, torch.bfloat16, gen)
    t, d = quantise_terms(x, terms=2)
    rel = ((dequantise(t, d) - x.double()).abs() / x.double().abs().clamp(min=1e-6)).max()
    assert rel > 2.0 ** -9, "two terms keep only ~8 bits: the kernel's third term is what the tests need"


def attention(q: torch.Tensor, k: torch.Tensor, scale: float):
    """float64 lse (rows,) and out (rows, 512) of q (rows, 576) against keys k (L, 576), values k[:, :512]."""
    s = (q @ k.T) * scale
    lse = torch.logsumexp(s, dim=-1)
    return lse, torch.softmax(s, dim=-1) @ k[:, :512]


@pytest.mark.parametrize("softmax_scale", [576 ** -0.5, 1.0])
def test_scores_meet_the_gpu_tests_tolerances(softmax_scale):
    """Scores from the terms against exact ones, an e4m3 cache as the kernel reads it: lse off by at most ~1e-5 of
    |lse| (the default scale: |lse| <= 9, so far inside the GPU tests' 1e-3; softmax scale 1.0: scores ~100, lse ~1e-3
    off), out rel-L2 within 1e-3 (the GPU tests' bound is 1e-2). Two terms are at least 10 times further off, and
    2.6-6.5e-2 at scale 1.0 (on the GPU, with the tensor cores' own rounding, two terms put lse 1.2-2.6e-3 off at the
    default scale: docs/PERF.md)."""
    gen = torch.Generator().manual_seed(9)
    for length in (64, 1024, 4096):
        q = random_q(32, torch.bfloat16, gen)
        k = torch.randn(length, 576, generator=gen).to(torch.float8_e4m3fn).double()
        exact_lse, exact_out = attention(q.double(), k, softmax_scale)
        t, d = quantise_terms(q)
        lse, out = attention(dequantise(t, d), k, softmax_scale)
        assert ((lse - exact_lse).abs() <= 3e-5 * exact_lse.abs().clamp(min=1.0)).all()
        assert (out - exact_out).norm() / exact_out.norm() <= 1e-3
        t2, d2 = quantise_terms(q, terms=2)
        lse2, _ = attention(dequantise(t2, d2), k, softmax_scale)
        assert (lse2 - exact_lse).abs().max() >= 10 * (lse - exact_lse).abs().max()
        if softmax_scale == 1.0:
            assert (lse2 - exact_lse).abs().max() > 1e-2


def test_nan_stays_where_it_was():
    gen = torch.Generator().manual_seed(10)
    x = random_q(16, torch.bfloat16, gen)
    x[3, 100] = float("nan")
    t, d = quantise_terms(x)
    assert torch.isfinite(d)
    nan = torch.isnan(t).any(0)
    assert nan[3, 100] and nan.sum() == 1
    clean = x.clone()
    clean[3, 100] = 0.0
    tc, dc = quantise_terms(clean)
    assert d == dc and torch.equal(t[:, ~nan], tc[:, ~nan])


def test_infinity_poisons_the_tile():
    """An inf in q makes d inf: every finite value's terms become 0 and the inf's NaN, and the scores d x (terms . k)
    NaN, as the exact scores of that row would be inf or NaN; nothing finite and wrong comes out."""
    x = torch.ones(16, 576)
    x[0, 0] = float("inf")
    t, d = quantise_terms(x)
    assert math.isinf(float(d))
    scores = d.double() * (t.double().sum(0) @ torch.ones(576, dtype=torch.float64))
    assert torch.isnan(scores).all()


def test_zero_tile():
    t, d = quantise_terms(torch.zeros(32, 576))
    assert float(d) == 2.0 ** -126 and not t.any()
