"""Tests of the Triton backend (flash_mla/triton_backend.py).

Without a CUDA GPU the kernels run in Triton's CPU interpreter. TRITON_INTERPRET has to be set before triton
is imported (triton.language's own jitted helpers are decorated at import), so this module sets it first.
Should triton already have been imported in compiled mode by an earlier module of the session, the
interpreter tests cannot run here; test_subprocess_runs_interpreter_tests then runs them in a fresh Python.
The interpreter tests go through the public API, as a user debugging the kernels on a CPU would:
get_mla_metadata + flash_mla_with_kvcache(..., backend="triton") with CPU tensors. With a GPU, the kernels are
swept through the same API on CUDA tensors.
"""
import math
import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# The interpreter can run in this process unless triton was imported before TRITON_INTERPRET was set.
INTERPRETER_HERE = HAS_CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from flash_mla import flash_mla_with_kvcache, get_mla_metadata  # noqa: E402
from flash_mla.reference import mla_decode_reference  # noqa: E402
from flash_mla.scheduler import get_mla_metadata_twin  # noqa: E402
from flash_mla.testing import (  # noqa: E402
    HEAD_DIM_V, TOLERANCE, assert_close, compare, make_attn_sink, make_decode_batch, reference_for)

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
cpu_only = pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines")
interpreter = pytest.mark.skipif(HAS_CUDA or not INTERPRETER_HERE,
                                 reason="CPU-only interpreter test; when triton was imported before "
                                        "TRITON_INTERPRET was set, test_subprocess_runs_interpreter_tests runs it")

LENGTHS = [0, 1, 63, 64, 65, 130]   # empty, one token, page boundaries +-1, a sequence over three pages
DTYPES = [torch.bfloat16, torch.float16]
H100_SMS = 132


@pytest.fixture(scope="module")
def tb():
    """flash_mla.triton_backend with its kernels in interpreter mode (CPU) or compiled (GPU)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    import flash_mla.triton_backend as module
    assert HAS_CUDA or module._interpreted(), "kernels are not in interpreter mode on a CPU-only machine"
    return module


def run_api(batch, num_sms=H100_SMS, softmax_scale=None, attn_sink=None):
    """The public API with backend="triton" on the batch's own device (CPU tensors: Triton's interpreter)."""
    s_q, h_q, h_kv = batch.q.shape[1], batch.q.shape[2], batch.k_cache.shape[2]
    metadata, num_splits = get_mla_metadata(batch.cache_seqlens, s_q * h_q // h_kv, h_kv, num_sms=num_sms)
    return flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V,
                                  metadata, num_splits, softmax_scale=softmax_scale, causal=batch.causal,
                                  attn_sink=attn_sink, backend="triton")


def _subprocess_env(**extra):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    return env


# ---- availability and dispatch ----------------------------------------------------------------------------

def test_triton_on_cpu_tensors_without_the_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    batch = make_decode_batch([5], generator=torch.Generator().manual_seed(0))
    metadata, num_splits = get_mla_metadata(batch.cache_seqlens, 16, 1)
    with pytest.raises(RuntimeError, match=r"'triton' was requested but is unavailable.*CUDA tensors.*cpu") as info:
        flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V,
                               metadata, num_splits, backend="triton")
    assert "TRITON_INTERPRET=1" in str(info.value)          # and how to get the interpreter
    monkeypatch.setenv("FLASH_MLA_BACKEND", "triton")      # the environment variable says the same
    with pytest.raises(RuntimeError, match=r"TRITON_INTERPRET=1"):
        flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V,
                               metadata, num_splits)


@pytest.mark.parametrize("value,expected", [("1", True), ("true", True), ("ON", True), ("yes", True),
                                            ("0", False), ("", False), ("false", False)])
def test_triton_interpret_values(monkeypatch, value, expected):
    from flash_mla.backends import triton_interpret_requested
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpret_requested() is expected


@needs_triton
def test_unavailable_reason_names_the_device(tb):
    reason = tb.unavailable_reason(torch.device("meta"))
    assert reason is not None and "CUDA" in reason and "meta" in reason
    if HAS_CUDA:
        assert tb.unavailable_reason(torch.device("cuda")) is None
    else:   # this module set TRITON_INTERPRET=1 before triton was imported: CPU tensors run interpreted
        assert tb.unavailable_reason(torch.device("cpu")) is None


@cpu_only
@needs_triton
@pytest.mark.parametrize("setup,expected", [
    # triton imported (compiled mode) before TRITON_INTERPRET=1 was set: the helpers would be compiled
    ("import triton; os.environ['TRITON_INTERPRET'] = '1'", "was set after triton was imported"),
    # flash_mla's kernels decorated without it, then the variable set
    ("import flash_mla.triton_backend; os.environ['TRITON_INTERPRET'] = '1'", "was imported without it"),
])
def test_interpreter_requested_too_late_says_why(setup, expected):
    """The public API names the cause instead of failing inside the first kernel."""
    code = ("import os, torch\n" + setup + "\n"
            "from flash_mla import flash_mla_with_kvcache, get_mla_metadata\n"
            "from flash_mla.testing import make_decode_batch\n"
            "b = make_decode_batch([5, 70], generator=torch.Generator().manual_seed(0))\n"
            "md, ns = get_mla_metadata(b.cache_seqlens, 16, 1)\n"
            "try:\n"
            "    flash_mla_with_kvcache(b.q, b.k_cache, b.block_table, b.cache_seqlens, 512, md, ns, "
            "backend='triton')\n"
            "except RuntimeError as e:\n"
            "    print('RAISED', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_subprocess_env(),
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RAISED" in result.stdout and expected in result.stdout and "TRITON_INTERPRET=1" in result.stdout, \
        result.stdout


def test_module_imports_without_triton():
    # A None entry in sys.modules makes `import triton` raise ImportError, as if it were not installed.
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "import torch, flash_mla.triton_backend as tb\n"
            "print(tb.unavailable_reason(torch.device('cuda')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_subprocess_env(),
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "triton is not importable" in result.stdout and "pip install triton" in result.stdout


# ---- interpreter: correctness against the reference -------------------------------------------------------

@cpu_only
@needs_triton
@pytest.mark.skipif(INTERPRETER_HERE, reason="the interpreter tests run in this process")
def test_subprocess_runs_interpreter_tests():
    env = _subprocess_env(TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                             "-k", "test_interpreter_"], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("h_kv", [1, 2])
def test_interpreter_matches_reference(tb, dtype, causal, s_q, h_kv):
    g = torch.Generator().manual_seed(1000 * s_q + 10 * h_kv + causal)
    batch = make_decode_batch(LENGTHS, s_q=s_q, h_q=16, h_kv=h_kv, dtype=dtype, causal=causal, generator=g)
    # 132 SM parts over 9 pages: the longer sequences are cut into pieces, so both the direct write and the
    # workspace + combine paths run.
    _, num_splits = get_mla_metadata_twin(batch.cache_seqlens, s_q * 16 // h_kv, h_kv, H100_SMS)
    assert (num_splits.diff() > 1).any() and (num_splits.diff() == 1).any()
    out, lse = run_api(batch)
    assert out.shape == (len(LENGTHS), s_q, 16, HEAD_DIM_V) and out.dtype == dtype
    assert lse.shape == (len(LENGTHS), 16, s_q) and lse.dtype == torch.float32
    assert_close(compare(out, lse, *reference_for(batch)), dtype, f"{dtype} causal={causal} s_q={s_q} h_kv={h_kv}")


@interpreter
@pytest.mark.parametrize("h_q,s_q", [(32, 3), (128, 1)])
def test_interpreter_several_row_tiles(tb, h_q, s_q):
    # 96 rows (two 64-row tiles, the second part padding) and 128 rows (two full tiles).
    g = torch.Generator().manual_seed(h_q + s_q)
    batch = make_decode_batch([1, 64, 130], s_q=s_q, h_q=h_q, causal=True, generator=g)
    assert tb._row_block(s_q * h_q) < s_q * h_q
    out, lse = run_api(batch)
    assert_close(compare(out, lse, *reference_for(batch)), torch.bfloat16, f"h_q={h_q} s_q={s_q}")


@interpreter
def test_interpreter_split_layout_does_not_change_the_result(tb):
    g = torch.Generator().manual_seed(7)
    batch = make_decode_batch([130, 0, 257, 65], s_q=2, h_q=16, dtype=torch.float16, causal=True, generator=g)
    results = {}
    for num_sms in (1, 5, H100_SMS):     # no split, a few pieces, many pieces
        _, num_splits = get_mla_metadata_twin(batch.cache_seqlens, 32, 1, num_sms)
        results[num_sms] = (num_splits[-1].item(), *run_api(batch, num_sms=num_sms))
    assert results[1][0] == 4 and results[H100_SMS][0] > results[5][0] > 4   # 4 pieces = unsplit
    ref = reference_for(batch)
    for num_sms, (_, out, lse) in results.items():
        assert_close(compare(out, lse, *ref), torch.float16, f"num_sms={num_sms}")
    # same answer up to float rounding whatever the layout
    torch.testing.assert_close(results[H100_SMS][1], results[1][1], atol=2e-3, rtol=0)
    torch.testing.assert_close(results[H100_SMS][2], results[1][2], atol=1e-5, rtol=1e-5)


@interpreter
def test_interpreter_writes_every_output_element(tb, monkeypatch):
    """Poison every buffer the backend allocates (out, lse and the workspace) with NaN: every element of
    out/lse must be written, and the combine may only read workspace slots the split kernel wrote."""
    real_empty = torch.empty

    def nan_empty(*size, dtype=None, device=None, **kw):
        t = real_empty(*size, dtype=dtype, device=device, **kw)
        return t.fill_(math.nan) if t.is_floating_point() else t

    g = torch.Generator().manual_seed(3)
    batch = make_decode_batch([0, 1, 130, 64, 0], s_q=2, h_q=16, h_kv=2, causal=True, generator=g)
    monkeypatch.setattr(torch, "empty", nan_empty)
    out, lse = run_api(batch)
    monkeypatch.undo()
    ref_out, ref_lse = reference_for(batch)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    # rows that see no key: out exactly 0 (L = 0, and causal token 0 of the L = 1 sequence)
    no_key = torch.isneginf(ref_lse).transpose(1, 2)               # (b, s_q, h_q)
    assert no_key[0].all() and no_key[4].all() and no_key[1, 0].all() and not no_key[1, 1].any()
    assert (out[no_key] == 0).all()
    assert_close(compare(out, lse, ref_out, ref_lse), torch.bfloat16, "poisoned buffers")


@interpreter
def test_interpreter_empty_batch_never_reads_the_cache(tb):
    # Every length 0, block table all -1, cache all NaN: out 0, lse -inf, nothing read.
    g = torch.Generator().manual_seed(4)
    batch = make_decode_batch([0, 0, 0], s_q=2, h_q=16, generator=g)
    batch.k_cache.fill_(math.nan)
    assert (batch.block_table == -1).all()
    out, lse = run_api(batch)
    assert (out == 0).all() and torch.isneginf(lse).all()


@interpreter
def test_interpreter_strided_q_and_custom_scale(tb):
    # q as every other head of a wider tensor (last dim contiguous, other strides arbitrary), scale 0.1.
    g = torch.Generator().manual_seed(5)
    batch = make_decode_batch([70, 1, 128], s_q=2, h_q=16, dtype=torch.float16, generator=g)
    wide = torch.zeros(3, 2, 32, 576, dtype=torch.float16)
    wide[:, :, ::2] = batch.q
    batch.q = wide[:, :, ::2]
    assert not batch.q.is_contiguous()
    out, lse = run_api(batch, softmax_scale=0.1)
    assert_close(compare(out, lse, *reference_for(batch, softmax_scale=0.1)), torch.float16, "strided q, scale 0.1")


SINK_LENGTHS = [0, 1, 63, 64, 65, 130, 0, 257]   # padding rows, page boundaries, sequences cut into pieces


def check_attn_sink_result(batch, sink, out, lse, out_plain, lse_plain, dtype):
    """The sink run against the float64 reference and against the same call without a sink."""
    ref_out, ref_lse = reference_for(batch, attn_sink=sink)
    assert_close(compare(out, lse, ref_out, ref_lse), dtype, "attn_sink vs reference")
    assert torch.equal(lse, lse_plain)                                        # lse is returned unchanged
    no_key = torch.isneginf(ref_lse).transpose(1, 2)                          # (b, s_q, h_q)
    assert no_key.any() and (out[no_key] == 0).all() and torch.isneginf(lse.transpose(1, 2)[no_key]).all()
    assert (out[:, :, 0] == 0).all()                                          # +inf sink: out 0
    torch.testing.assert_close(out[:, :, 1], out_plain[:, :, 1], rtol=2 ** -8, atol=1e-6)   # -inf sink: none
    # the ordinary heads: out / out_plain is the per-row factor 1 / (1 + exp(sink - lse))
    seen = ~no_key[:, :, 4:]
    factor = torch.sigmoid(lse_plain.transpose(1, 2)[:, :, 4:].double() - sink[4:].double())   # (b, s_q, h - 4)
    expected = out_plain[:, :, 4:].double() * factor[..., None]
    rel = (out[:, :, 4:].double() - expected)[seen].norm() / expected[seen].norm()
    assert rel < 2 * TOLERANCE[dtype], f"out is not out_without_sink / (1 + exp(sink - lse)): rel err {rel:.2e}"
    assert (factor[seen] < 0.99).any(), "the sinks chosen hardly change the output: the test would prove nothing"


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("s_q,h_kv,causal", [(1, 1, False), (2, 2, True)])
def test_interpreter_attn_sink(tb, nan_empty, dtype, s_q, h_kv, causal):
    """attn_sink through the public API: split rows (sink applied in the combine kernel) and unsplit rows (in the
    split kernel), rows with no key, every output buffer poisoned with NaN and NaN in every cache slot past each
    sequence's length."""
    g = torch.Generator().manual_seed(20 + s_q + h_kv)
    batch = make_decode_batch(SINK_LENGTHS, s_q=s_q, h_q=16, h_kv=h_kv, dtype=dtype, causal=causal, generator=g)
    sink = make_attn_sink(16, g)
    _, num_splits = get_mla_metadata_twin(batch.cache_seqlens, s_q * 16 // h_kv, h_kv, H100_SMS)
    pieces = num_splits.diff()
    assert (pieces > 1).any() and (pieces[batch.cache_seqlens > 0] == 1).any()   # split and unsplit rows
    out, lse = run_api(batch, attn_sink=sink)
    out_plain, lse_plain = run_api(batch)
    check_attn_sink_result(batch, sink, out, lse, out_plain, lse_plain, dtype)
    # the same with every sequence whole (no combine kernel at all)
    out1, lse1 = run_api(batch, num_sms=1, attn_sink=sink)
    assert_close(compare(out1, lse1, *reference_for(batch, attn_sink=sink)), dtype, "attn_sink, 1-SM plan")


# ---- GPU: the public API with backend="triton" ------------------------------------------------------------

GPU_LENGTHS = [0, 1, 63, 64, 65, 4097]


def _gpu_batch(lengths, s_q, h_q, dtype, causal, seed):
    g = torch.Generator().manual_seed(seed)
    return make_decode_batch(lengths, s_q=s_q, h_q=h_q, dtype=dtype, causal=causal, generator=g, device="cuda")


def _run_api(batch, **kw):
    s_q, h_q, h_kv = batch.q.shape[1], batch.q.shape[2], batch.k_cache.shape[2]
    metadata, num_splits = get_mla_metadata(batch.cache_seqlens, s_q * h_q // h_kv, h_kv)
    return flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V,
                                  metadata, num_splits, causal=batch.causal, backend="triton", **kw)


def _gpu_reference(batch):
    return mla_decode_reference(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V,
                                causal=batch.causal)


@needs_cuda
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
@pytest.mark.parametrize("h_q", [16, 64, 128])
def test_gpu_matches_reference(dtype, causal, s_q, h_q):
    b = 128 if h_q == 16 else 24     # the full batch size where it is cheap to check
    lengths = [GPU_LENGTHS[i % len(GPU_LENGTHS)] for i in range(b)]
    batch = _gpu_batch(lengths, s_q, h_q, dtype, causal, seed=s_q * 1000 + h_q)
    out, lse = _run_api(batch)
    assert out.device.type == "cuda"
    assert_close(compare(out, lse, *_gpu_reference(batch)), dtype, f"{dtype} causal={causal} s_q={s_q} h_q={h_q}")


@needs_cuda
@needs_triton
def test_gpu_h_kv_2_and_split_layouts():
    batch = make_decode_batch([4097, 0, 65, 1000], s_q=2, h_q=32, h_kv=2, causal=True,
                              generator=torch.Generator().manual_seed(11), device="cuda")
    ref = _gpu_reference(batch)
    import flash_mla.triton_backend as tb
    for num_sms in (1, 8, H100_SMS):
        metadata, num_splits = get_mla_metadata_twin(batch.cache_seqlens.cpu(), 32, 2, num_sms)
        out, lse = tb.mla_decode_triton(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens,
                                        HEAD_DIM_V, metadata.cuda(), num_splits.cuda(), 576 ** -0.5, True)
        assert_close(compare(out, lse, *ref), torch.bfloat16, f"num_sms={num_sms}")


@needs_cuda
@needs_triton
def test_gpu_cuda_graph_capture_and_side_stream():
    batch = _gpu_batch([4097, 1, 0, 300], 2, 64, torch.bfloat16, True, seed=12)
    ref = _gpu_reference(batch)
    metadata, num_splits = get_mla_metadata(batch.cache_seqlens, 2 * 64, 1)

    def step():
        return flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens,
                                      HEAD_DIM_V, metadata, num_splits, causal=True, backend="triton")

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = step()                        # warm-up (compiles) on a side stream
    torch.cuda.current_stream().wait_stream(side)
    assert_close(compare(out, lse, *ref), torch.bfloat16, "side stream")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out, g_lse = step()
    g_out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert_close(compare(g_out, g_lse, *ref), torch.bfloat16, "CUDA graph replay")


@needs_cuda
@needs_triton
@pytest.mark.parametrize("s_q,h_q", [(1, 16), (2, 64), (1, 128)])
def test_gpu_attn_sink(nan_empty, s_q, h_q):
    batch = _gpu_batch(GPU_LENGTHS * 4, s_q, h_q, torch.bfloat16, True, seed=30 + s_q + h_q)
    sink = make_attn_sink(h_q, torch.Generator().manual_seed(h_q), device="cuda")
    out, lse = _run_api(batch, attn_sink=sink)
    out_plain, lse_plain = _run_api(batch)
    check_attn_sink_result(batch, sink.cpu(), out.cpu(), lse.cpu(), out_plain.cpu(), lse_plain.cpu(),
                           torch.bfloat16)
