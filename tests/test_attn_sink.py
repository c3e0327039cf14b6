"""attn_sink: one sink logit per query head, an extra entry in each row's softmax denominator with no value.

    out = softmax-weighted V * 1 / (1 + exp(attn_sink[h] - lse)),   lse unchanged

Checked here: the reference against the definition (a float64 softmax with the sink as one more column), the cpu
backend against the reference on ragged batches with split and unsplit rows (outputs poisoned with NaN, NaN in
every cache slot past each length), the edge values (+inf: out 0, -inf: no effect, rows with no key: out 0 and
lse -inf), the custom op's schema and fake, torch.compile, and on a GPU the cuda backend (skipped without one).
The Triton kernels' sink is tested in tests/test_triton_backend.py (interpreter on CPU, compiled on a GPU).
"""
import math

import pytest
import torch

from flash_mla import flash_mla_with_kvcache, get_mla_metadata, mla_decode_reference
from flash_mla.backends import ENV_VAR, _unavailable_reason
from flash_mla.scheduler import get_mla_metadata_twin
from flash_mla.testing import (HEAD_DIM_V, TOLERANCE, assert_close, compare, make_attn_sink, make_decode_batch,
                               reference_for)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = [0, 1, 63, 64, 65, 130, 0, 257, 2]
H100_SMS = 132


@pytest.fixture(autouse=True)
def _automatic_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def run(batch, attn_sink=None, num_sms=None, backend=None, softmax_scale=None):
    s_q, h_q, h_kv = batch.q.shape[1], batch.q.shape[2], batch.k_cache.shape[2]
    md, ns = get_mla_metadata(batch.cache_seqlens, s_q * h_q // h_kv, h_kv, num_sms=num_sms)
    return flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V, md, ns,
                                  softmax_scale=softmax_scale, causal=batch.causal, attn_sink=attn_sink,
                                  backend=backend)


# ---- the reference against the definition ----------------------------------------------------------------------

def test_reference_sink_is_one_more_logit_without_a_value():
    """Direct softmax over [scores..., sink] in float64 with a zero value row for the sink, on a tiny batch."""
    g = torch.Generator().manual_seed(0)
    batch = make_decode_batch([3, 70, 0, 1], s_q=2, h_q=4, causal=True, generator=g)
    sink = torch.tensor([0.5, -2.0, 6.0, math.inf])
    out, lse = mla_decode_reference(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V,
                                    causal=True, dtype=torch.float64, attn_sink=sink)
    _, lse_plain = mla_decode_reference(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V,
                                        causal=True, dtype=torch.float64)
    assert torch.equal(lse, lse_plain)
    scale = 576 ** -0.5
    for seq, length in enumerate(batch.cache_seqlens.tolist()):
        pages = batch.block_table[seq, :(length + 63) // 64].tolist()
        keys = torch.cat([batch.k_cache[p, :, 0] for p in pages])[:length].double() if length else None
        for token in range(2):
            visible = length - 2 + token + 1                      # causal: keys [0, L - s_q + token]
            for head in range(4):
                if visible <= 0:
                    assert (out[seq, token, head] == 0).all() and lse[seq, head, token] == -math.inf
                    continue
                k = keys[:visible]
                if sink[head] == math.inf:                        # all the weight on the sink (softmax: inf - inf)
                    expected = torch.zeros(HEAD_DIM_V, dtype=torch.float64)
                else:
                    logits = torch.cat([k @ batch.q[seq, token, head].double() * scale,
                                        sink[head:head + 1].double()])
                    weights = torch.softmax(logits, 0)[:-1]       # the sink's weight multiplies a zero vector
                    expected = weights @ k[:, :HEAD_DIM_V]
                torch.testing.assert_close(out[seq, token, head], expected, rtol=1e-10, atol=1e-12)
    assert (out[:, :, 3] == 0).all()                              # +inf sink takes all the weight


# ---- the cpu backend --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("s_q,h_q,h_kv,causal", [(1, 16, 1, False), (2, 16, 2, True), (3, 32, 1, True)])
def test_cpu_backend_matches_reference(nan_empty, dtype, s_q, h_q, h_kv, causal):
    g = torch.Generator().manual_seed(s_q * 100 + h_q + h_kv)
    batch = make_decode_batch(LENGTHS, s_q=s_q, h_q=h_q, h_kv=h_kv, dtype=dtype, causal=causal, generator=g)
    sink = make_attn_sink(h_q, g)
    _, ns = get_mla_metadata_twin(batch.cache_seqlens, s_q * h_q // h_kv, h_kv, H100_SMS)
    pieces = ns.diff()
    assert (pieces > 1).any() and (pieces[batch.cache_seqlens > 0] == 1).any()   # split and unsplit rows
    out, lse = run(batch, attn_sink=sink)
    out_plain, lse_plain = run(batch)
    ref_out, ref_lse = reference_for(batch, attn_sink=sink)
    assert_close(compare(out, lse, ref_out, ref_lse), dtype, "cpu backend with attn_sink")
    assert torch.equal(lse, lse_plain)                                        # lse unchanged
    no_key = torch.isneginf(ref_lse).transpose(1, 2)
    assert no_key.any() and (out[no_key] == 0).all() and torch.isneginf(lse.transpose(1, 2)[no_key]).all()
    assert (out[:, :, 0] == 0).all()                                          # +inf
    assert torch.equal(out[:, :, 1], out_plain[:, :, 1])                      # -inf: scale exactly 1
    # heads 4..: out = out_plain / (1 + exp(sink - lse)) row by row (same rounding path up to the final cast)
    factor = torch.sigmoid(lse_plain.transpose(1, 2).double() - sink.double())[..., None]
    seen = ~no_key[:, :, 4:]
    expected = (out_plain.double() * factor)[:, :, 4:]
    rel = (out[:, :, 4:].double() - expected)[seen].norm() / expected[seen].norm()
    assert rel < TOLERANCE[dtype]
    assert (factor[:, :, 4:][seen] < 0.99).any()                               # the sinks matter


@pytest.mark.parametrize("num_sms", [1, 3, H100_SMS])
def test_cpu_backend_any_split_layout(num_sms):
    """The sink is applied once per row whatever the plan: in the split step for whole sequences, in the combine
    for cut ones."""
    g = torch.Generator().manual_seed(num_sms)
    batch = make_decode_batch([300, 0, 129, 64, 1], s_q=2, h_q=16, causal=True, generator=g)
    sink = make_attn_sink(16, g)
    out, lse = run(batch, attn_sink=sink, num_sms=num_sms)
    assert_close(compare(out, lse, *reference_for(batch, attn_sink=sink)), torch.bfloat16, f"num_sms={num_sms}")


def test_sink_float64_reference_agrees_with_float32():
    g = torch.Generator().manual_seed(5)
    batch = make_decode_batch(LENGTHS, s_q=2, h_q=16, causal=True, dtype=torch.float16, generator=g)
    sink = make_attn_sink(16, g)
    args = (batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V)
    out64, lse64 = mla_decode_reference(*args, causal=True, dtype=torch.float64, attn_sink=sink)
    out, lse = run(batch, attn_sink=sink)
    assert_close(compare(out, lse, out64, lse64), torch.float16, "vs float64 reference")


def test_all_heads_infinite_sink_zeroes_the_output():
    g = torch.Generator().manual_seed(6)
    batch = make_decode_batch([70, 0, 5], s_q=1, h_q=16, generator=g)
    out, lse = run(batch, attn_sink=torch.full((16,), math.inf))
    _, lse_plain = run(batch)
    assert (out == 0).all() and torch.equal(lse, lse_plain)


def test_sink_of_the_row_lse_halves_the_output():
    """sink = lse gives exactly half the weight to the sink (the factor is 1 / (1 + e^0) = 1/2)."""
    g = torch.Generator().manual_seed(7)
    batch = make_decode_batch([100], s_q=1, h_q=16, dtype=torch.float16, generator=g)
    out_plain, lse_plain = run(batch)
    out, _ = run(batch, attn_sink=lse_plain[0, :, 0].clone())
    torch.testing.assert_close(out.float(), (out_plain.float() / 2).half().float(), rtol=0, atol=1e-3)


# ---- custom op, fake and torch.compile --------------------------------------------------------------------------

def test_op_schema_has_attn_sink():
    schema = str(torch.ops.flash_mla.mla_decode.default._schema)
    assert "Tensor? attn_sink=None" in schema


def test_opcheck_with_attn_sink():
    g = torch.Generator().manual_seed(8)
    batch = make_decode_batch([5, 70, 0, 130], s_q=2, h_q=16, causal=True, generator=g)
    md, ns = get_mla_metadata(batch.cache_seqlens, 32, 1, num_sms=7)
    sink = make_attn_sink(16, g)
    torch.library.opcheck(torch.ops.flash_mla.mla_decode.default,
                          (batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512, md, ns, 0.05, True),
                          {"backend": None, "attn_sink": sink})


def test_fake_checks_attn_sink():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        seqlens = torch.empty(3, dtype=torch.int32)
        md, ns = torch.ops.flash_mla.get_mla_metadata(seqlens, 16, 1, 132)
        q = torch.empty(3, 1, 16, 576, dtype=torch.bfloat16)
        k_cache = torch.empty(4, 64, 1, 576, dtype=torch.bfloat16)
        block_table = torch.empty(3, 2, dtype=torch.int32)
        out, lse = torch.ops.flash_mla.mla_decode(q, k_cache, block_table, seqlens, 512, md, ns, 0.1, False,
                                                  attn_sink=torch.empty(16))
        assert out.shape == (3, 1, 16, 512) and lse.shape == (3, 16, 1)
        with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: attn_sink: expected"):
            torch.ops.flash_mla.mla_decode(q, k_cache, block_table, seqlens, 512, md, ns, 0.1, False,
                                           attn_sink=torch.empty(8))


@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_compile_with_attn_sink(compile_backend):
    def step(q, k_cache, block_table, cache_seqlens, sink):
        md, ns = get_mla_metadata(cache_seqlens, q.shape[1] * q.shape[2], 1)
        return flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, md, ns, causal=True,
                                      attn_sink=sink)

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(9)
    batch = make_decode_batch([5, 70, 0, 130], s_q=2, h_q=16, causal=True, generator=g)
    sink = make_attn_sink(16, g)
    args = (batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, sink)
    got = torch.compile(step, backend=compile_backend, fullgraph=True)(*args)
    expected = step(*args)
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch._dynamo.reset()


# ---- GPU: the cuda backend (skipped without a GPU) ----------------------------------------------------------------

def _cuda_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return _unavailable_reason("cuda", torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_reason() is not None, reason=str(_cuda_reason()))
@pytest.mark.parametrize("s_q,h_q,causal", [(1, 16, False), (2, 64, True), (1, 128, True), (4, 32, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_cuda_backend_attn_sink(nan_empty, s_q, h_q, causal, dtype):
    """Split rows (sink in the combine kernel) and unsplit rows (in the split kernel's epilogue), padding rows,
    page-boundary lengths; outputs NaN-poisoned, NaN past every length."""
    lengths = [0, 1, 63, 64, 65, 4097, 0, 130, 20000, 2] * 3
    g = torch.Generator().manual_seed(40 + s_q + h_q)
    batch = make_decode_batch(lengths, s_q=s_q, h_q=h_q, dtype=dtype, causal=causal, generator=g, device="cuda")
    sink = make_attn_sink(h_q, g, device="cuda")
    _, ns = get_mla_metadata(batch.cache_seqlens, s_q * h_q, 1)
    pieces = ns.diff().cpu()
    assert (pieces > 1).any() and (pieces[batch.cache_seqlens.cpu() > 0] == 1).any()
    out, lse = run(batch, attn_sink=sink, backend="cuda")
    out_plain, lse_plain = run(batch, backend="cuda")
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_for(batch, attn_sink=sink, on_device=True)
    assert_close(compare(out, lse, ref_out, ref_lse), dtype, "cuda backend with attn_sink")
    assert torch.equal(lse, lse_plain)
    no_key = torch.isneginf(ref_lse).transpose(1, 2)
    assert (out[no_key] == 0).all() and (out[:, :, 0] == 0).all()
    torch.testing.assert_close(out[:, :, 1], out_plain[:, :, 1], rtol=2 ** -8, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_reason() is not None, reason=str(_cuda_reason()))
def test_gpu_cuda_backend_attn_sink_in_a_cuda_graph():
    g = torch.Generator().manual_seed(41)
    batch = make_decode_batch([4097, 0, 65, 300], s_q=2, h_q=64, causal=True, generator=g, device="cuda")
    sink = make_attn_sink(64, g, device="cuda")
    expected = run(batch, attn_sink=sink, backend="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        out, lse = run(batch, attn_sink=sink, backend="cuda")
    sink.copy_(sink.flip(0))                       # the sink is read at replay, not baked in at capture
    graph.replay()
    flipped = run(batch, attn_sink=sink, backend="cuda")
    torch.cuda.synchronize()
    torch.testing.assert_close(out, flipped[0], rtol=0, atol=0)
    torch.testing.assert_close(lse, expected[1], rtol=0, atol=0)
