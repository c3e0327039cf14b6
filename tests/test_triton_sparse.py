"""Tests of the sparse FP8 Triton kernels (flash_mla/triton_sparse.py) against sparse_fp8.sparse_decode_reference.

Without a CUDA GPU the kernels run in Triton's CPU interpreter on CPU tensors; TRITON_INTERPRET has to be set
before triton is first imported, so this module sets it first (as tests/test_triton_backend.py does). Should
triton already have been imported in compiled mode by an earlier module of the session, the interpreter tests
run in a fresh Python instead (test_subprocess_runs_interpreter_tests). With a GPU the same cases run on CUDA
tensors, plus the benchmark's shapes at b = 2 and topk 2048.

Every case is drawn fresh: random latent values with per-token magnitudes (so the 4 group scales differ), and
every cache token that no counted index slot names is filled with 0xFF bytes (NaN latent, NaN scales, NaN RoPE),
so a kernel that dereferences a -1 slot, a slot past topk_length or past topk, shows up as NaN. Outputs and
workspaces are poisoned with NaN (the nan_empty fixture) so an element never written shows up too.
"""
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRETER_HERE = HAS_CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from flash_mla.scheduler import get_mla_metadata_twin  # noqa: E402
from flash_mla.sparse_fp8 import (  # noqa: E402
    TOKEN_BYTES, quantize_kv_cache_v32, sparse_decode_reference, valid_index_mask)
from flash_mla.testing import SPARSE_OUT_TOL, assert_sparse_close, capture_cuda_graph  # noqa: E402

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

DEVICE = "cuda" if HAS_CUDA else "cpu"
H100_SMS = 132
PLANS = (1, 7, H100_SMS)          # num_sms: every row whole, a few pieces, many pieces

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
runs_here = pytest.mark.skipif(
    not HAS_TRITON or not INTERPRETER_HERE,
    reason="CPU-only interpreter test (needs triton; when triton was imported before TRITON_INTERPRET was set, "
           "test_subprocess_runs_interpreter_tests runs it)")


@pytest.fixture(scope="module")
def ts():
    """flash_mla.triton_sparse, its kernels interpreted (CPU) or compiled (GPU)."""
    import flash_mla.triton_backend as tb
    import flash_mla.triton_sparse as module
    assert HAS_CUDA or tb._interpreted(), "kernels are not in interpreter mode on a CPU-only machine"
    assert module.unavailable_reason(torch.device(DEVICE)) is None
    return module


@dataclass
class SparseCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    indices: torch.Tensor
    topk_length: Optional[torch.Tensor]
    attn_sink: Optional[torch.Tensor] = None

    @property
    def shape(self):
        b, s_q, h_q, _ = self.q.shape
        return b, s_q, h_q, self.indices.shape[-1]


def make_case(b, s_q, h_q, topk, *, topk_length=None, num_blocks=None, page=64, dtype=torch.bfloat16,
              invalid=0.2, repeats=True, seed=0, device=DEVICE, sink=False) -> SparseCase:
    """A random sparse decoding problem. topk_length: None or a list of b lengths. Index slots: random tokens,
    `invalid` of them -1, a few copies of another slot of the same list (repeated keys) when `repeats`."""
    g = torch.Generator().manual_seed(seed)
    if num_blocks is None:
        num_blocks = max(2, (2 * topk) // page + 1)
    tokens = num_blocks * page
    x = torch.randn(num_blocks, page, 1, 576, generator=g)
    x *= torch.rand(num_blocks, page, 1, 1, generator=g) * 4 + 0.05               # per-token magnitudes
    x[..., :512] *= (torch.rand(num_blocks, page, 1, 4, generator=g) * 3 + 0.1).repeat_interleave(128, -1)
    k_cache = quantize_kv_cache_v32(x)
    indices = torch.randint(0, tokens, (b, s_q, topk), generator=g, dtype=torch.int32)
    if repeats and topk > 4:
        src = torch.randint(0, topk, (b, s_q, topk // 8), generator=g)
        dst = torch.randint(0, topk, (b, s_q, topk // 8), generator=g)
        indices.scatter_(2, dst, indices.gather(2, src))
    indices[torch.rand(b, s_q, topk, generator=g) < invalid] = -1
    lengths = None if topk_length is None else torch.tensor(topk_length, dtype=torch.int32)
    # every token no counted slot names: all bytes 0xFF (NaN latent, scales and RoPE)
    used = torch.zeros(tokens, dtype=torch.bool)
    used[indices[valid_index_mask(indices, lengths)].long()] = True
    k_cache.view(tokens, TOKEN_BYTES)[~used] = 0xFF
    q = torch.randn(b, s_q, h_q, 576, generator=g).to(dtype)
    attn_sink = None
    if sink:
        attn_sink = torch.randn(h_q, generator=g) * 2 + 3
        attn_sink[:4] = torch.tensor([math.inf, -math.inf, 40.0, 0.0])
    def to(t):
        return None if t is None else t.to(device)

    return SparseCase(q.to(device), k_cache.to(device), indices.to(device), to(lengths), to(attn_sink))


def plan(case: SparseCase, num_sms: int):
    """The scheduler's plan: lengths topk_length (or topk), s_q * h_q rows per KV head, one KV head; without the
    sparse payload floor the API adds (SPARSE_MIN_PAYLOAD), so that one-page pieces are cut here too (the kernel
    takes any plan; tests/test_sparse.py runs it on the API's floored plans)."""
    b, s_q, h_q, topk = case.shape
    lengths = case.topk_length.cpu() if case.topk_length is not None else torch.full((b,), topk, dtype=torch.int32)
    md, ns = get_mla_metadata_twin(lengths, s_q * h_q, 1, num_sms)
    return md.to(case.q.device), ns.to(case.q.device)


def run(ts, case: SparseCase, num_sms: int = H100_SMS, softmax_scale: float = 576 ** -0.5, **overrides):
    md, ns = plan(case, num_sms)
    args = dict(q=case.q, k_cache=case.k_cache, indices=case.indices, topk_length=case.topk_length,
                tile_scheduler_metadata=md, num_splits=ns, softmax_scale=softmax_scale, attn_sink=case.attn_sink)
    args.update(overrides)
    return ts.sparse_decode_triton(**args)


def reference(case: SparseCase, softmax_scale: float = 576 ** -0.5):
    return sparse_decode_reference(case.q.cpu(), case.k_cache.cpu(), case.indices.cpu(),
                                   None if case.topk_length is None else case.topk_length.cpu(),
                                   softmax_scale, None if case.attn_sink is None else case.attn_sink.cpu())


def check(case: SparseCase, out, lse, what="", softmax_scale: float = 576 ** -0.5):
    b, s_q, h_q, _ = case.shape
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == case.q.dtype, what
    assert lse.shape == (b, h_q, s_q) and lse.dtype == torch.float32, what
    ref_out, ref_lse = reference(case, softmax_scale)
    assert_sparse_close(out, lse, ref_out, ref_lse, what)
    return ref_out, ref_lse


def _subprocess_env(**extra):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    return env


# ---- plumbing ------------------------------------------------------------------------------------------------

def test_module_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "import torch, flash_mla.triton_sparse as ts\n"
            "print(ts.unavailable_reason(torch.device('cuda')))\n"
            "try:\n"
            "    ts.sparse_decode_triton(torch.zeros(1, 1, 16, 576), None, None, None, None, None, 1.0, None)\n"
            "except RuntimeError as e:\n"
            "    print('RAISED', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_subprocess_env(),
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "triton is not importable" in result.stdout and "RAISED" in result.stdout, result.stdout


@needs_triton
@pytest.mark.skipif(HAS_CUDA or INTERPRETER_HERE, reason="the interpreter tests run in this process")
def test_subprocess_runs_interpreter_tests():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             os.path.abspath(__file__), "-k", "not subprocess and not gpu"],
                            capture_output=True, text=True, env=_subprocess_env(TRITON_INTERPRET="1"), timeout=900)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout, result.stdout[-2000:]


def test_token_rows_views_or_copies():
    import flash_mla.triton_sparse as ts     # plain torch: no kernel runs, no interpreter needed
    cache = torch.arange(3 * 4 * 656, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(3, 4, 1, 656)
    rows = ts._token_rows(cache)
    assert rows.shape == (12, 656) and rows.data_ptr() == cache.data_ptr()              # a view
    assert torch.equal(rows[5], cache[1, 1, 0])
    assert ts._token_rows(cache[1:]).data_ptr() == cache[1:].data_ptr()                  # page slice: a view
    assert ts._token_rows(cache.view(torch.float8_e4m3fn)).dtype == torch.uint8
    wide = torch.zeros(3, 4, 1, 672, dtype=torch.uint8)
    wide[..., :656] = cache
    strided = wide[..., :656]                                                            # token stride 672
    rows = ts._token_rows(strided)
    assert rows.is_contiguous() and torch.equal(rows, cache.reshape(12, 656))            # a copy


# ---- correctness against the reference (interpreter on CPU, compiled on a GPU) -------------------------------

@runs_here
@pytest.mark.parametrize("h_q,s_q,dtype", [
    (16, 1, torch.bfloat16), (16, 2, torch.float16), (64, 1, torch.bfloat16), (64, 2, torch.bfloat16),
], ids=["h16-s1-bf16", "h16-s2-fp16", "h64-s1-bf16", "h64-s2-bf16"])
def test_matches_reference_over_plans(ts, nan_empty, h_q, s_q, dtype):
    """Ragged topk_length (0, partial last block, past a block boundary, all of topk), -1 slots, repeated
    indices, NaN in every unreferenced token; the same answer for every plan."""
    case = make_case(3, s_q, h_q, 200, topk_length=[130, 0, 200], dtype=dtype, seed=h_q + s_q)
    results = []
    for num_sms in PLANS:
        out, lse = run(ts, case, num_sms)
        check(case, out, lse, f"num_sms={num_sms}")
        results.append((out.float().cpu(), lse.cpu()))
    _, ns = plan(case, H100_SMS)
    assert (ns.diff() > 1).any(), "the 132-SM plan should cut rows into pieces (combine path)"
    for out, lse in results[1:]:      # the plans agree up to rounding (bf16 out, rounded differently by the
        # combine kernel, which Triton's interpreter rounds toward zero)
        assert ((out - results[0][0]).norm() / results[0][0].norm()).item() < SPARSE_OUT_TOL
        torch.testing.assert_close(lse, results[0][1], atol=1e-4, rtol=0)


@runs_here
@pytest.mark.parametrize("h_q", [8, 32, 128])
def test_head_blocks(ts, nan_empty, h_q):
    """h_q below tl.dot's 16 rows (masked heads), a 32-row block, and two 64-head blocks per token."""
    case = make_case(2, 2, h_q, 96, topk_length=[96, 40], seed=h_q)
    for num_sms in (1, H100_SMS):
        check(case, *run(ts, case, num_sms), f"h_q={h_q} num_sms={num_sms}")


@runs_here
def test_no_topk_length_and_empty_rows(ts, nan_empty):
    """topk_length None (every slot counts); token 0 of row 1 has only -1 slots, row 2 only -1 slots for both
    tokens: those rows give out 0 and lse -inf, split or not."""
    case = make_case(3, 2, 16, 150, seed=5)
    case.indices[1, 0] = -1
    case.indices[2] = -1
    for num_sms in PLANS:
        out, lse = run(ts, case, num_sms)
        check(case, out, lse, f"num_sms={num_sms}")
        assert torch.isneginf(lse[1, :, 0]).all() and torch.isneginf(lse[2]).all()
        assert torch.isfinite(lse[1, :, 1]).all() and torch.isfinite(lse[0]).all()


@runs_here
def test_all_lengths_zero_reads_nothing(ts, nan_empty):
    case = make_case(2, 2, 16, 64, topk_length=[0, 0], seed=6)
    case.k_cache.fill_(0xFF)                     # the whole cache NaN
    out, lse = run(ts, case, H100_SMS)
    assert (out == 0).all() and torch.isneginf(lse).all()


@runs_here
@pytest.mark.parametrize("h_q,s_q", [(16, 2), (64, 1)])
def test_attn_sink(ts, nan_empty, h_q, s_q):
    """Sink logits +inf (out 0), -inf (no effect), 40, 0 and ordinary ones; split rows (sink in the combine
    kernel), unsplit rows (in the split kernel), a row with no valid index (stays 0); lse unchanged."""
    case = make_case(3, s_q, h_q, 160, topk_length=[160, 70, 0], sink=True, seed=7 + h_q)
    plain = SparseCase(case.q, case.k_cache, case.indices, case.topk_length)
    for num_sms in (1, H100_SMS):
        out, lse = run(ts, case, num_sms)
        check(case, out, lse, f"attn_sink num_sms={num_sms}")
        out_plain, lse_plain = run(ts, plain, num_sms)
        assert torch.equal(lse, lse_plain)
        assert (out[:, :, 0] == 0).all()                                            # +inf sink
        torch.testing.assert_close(out[:, :, 1], out_plain[:, :, 1], atol=0, rtol=0)   # -inf sink
        assert (out[2] == 0).all()


@runs_here
def test_cache_views_strided_q_and_scale(ts, nan_empty):
    """uint8 and float8_e4m3fn views of one cache agree; a cache that is a slice of pages (indices relative to
    it); a cache whose tokens are not back to back (copied inside); q with strided heads; softmax_scale 0.1."""
    case = make_case(2, 2, 16, 100, topk_length=[100, 37], seed=8)
    out_u8, lse_u8 = run(ts, case)
    out_f8, lse_f8 = run(ts, case, k_cache=case.k_cache.view(torch.float8_e4m3fn))
    assert torch.equal(out_u8, out_f8) and torch.equal(lse_u8, lse_f8)

    pad = torch.full((3, 64, 1, TOKEN_BYTES), 0xFF, dtype=torch.uint8, device=case.k_cache.device)
    sliced = torch.cat([pad, case.k_cache])[3:]
    wide = torch.full((*case.k_cache.shape[:3], 672), 0xFF, dtype=torch.uint8, device=case.k_cache.device)
    wide[..., :TOKEN_BYTES] = case.k_cache
    for cache in (sliced, wide[..., :TOKEN_BYTES]):
        out, lse = run(ts, case, k_cache=cache)
        torch.testing.assert_close(out, out_u8, atol=0, rtol=0)
        torch.testing.assert_close(lse, lse_u8, atol=0, rtol=0)

    b, s_q, h_q, _ = case.q.shape
    wide_q = torch.zeros(b, s_q, 2 * h_q, 576, dtype=case.q.dtype, device=case.q.device)
    wide_q[:, :, ::2] = case.q
    case.q = wide_q[:, :, ::2]
    assert not case.q.is_contiguous()
    out, lse = run(ts, case, softmax_scale=0.1)
    check(case, out, lse, "strided q, scale 0.1", softmax_scale=0.1)


# ---- GPU: the benchmark's shapes at b = 2 ---------------------------------------------------------------------

@needs_cuda
@needs_triton
@pytest.mark.parametrize("h_q,s_q", [(64, 1), (64, 2), (128, 1), (128, 2)])
def test_gpu_benchmark_shapes(ts, nan_empty, h_q, s_q):
    case = make_case(2, s_q, h_q, 2048, topk_length=[2048, 1500], num_blocks=256, seed=h_q * 10 + s_q,
                     sink=s_q == 2)
    for num_sms in (1, 8, H100_SMS):
        check(case, *run(ts, case, num_sms), f"h_q={h_q} s_q={s_q} num_sms={num_sms}")
    full = make_case(2, s_q, h_q, 2048, num_blocks=256, invalid=0.0, repeats=False, seed=h_q + s_q)
    check(full, *run(ts, full), f"h_q={h_q} s_q={s_q} every slot valid")


@needs_cuda
@needs_triton
def test_gpu_cuda_graph_capture(ts):
    case = make_case(4, 2, 64, 512, topk_length=[512, 0, 300, 64], seed=21)
    md, ns = plan(case, H100_SMS)

    def step():
        return ts.sparse_decode_triton(case.q, case.k_cache, case.indices, case.topk_length, md, ns,
                                       576 ** -0.5, None)

    graph, _, (g_out, g_lse) = capture_cuda_graph(step)
    g_out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    check(case, g_out, g_lse, "CUDA graph replay")
