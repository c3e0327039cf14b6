"""torch.library custom ops (flash_mla/ops.py) and torch.compile of a decoding step.

On the CPU: the ops' schemas and fake implementations (torch.library.opcheck, FakeTensorMode), and
torch.compile(fullgraph=True) with the "eager" and "aot_eager" backends, static and dynamic shapes, against
eager results bit for bit. On a GPU (skipped without one): compiled (aot_eager, inductor, inductor with CUDA
graphs) against eager, per available backend.
"""
import math
import re

import pytest
import torch

import flash_mla
from flash_mla import flash_mla_with_kvcache, get_mla_metadata, ops
from flash_mla.backends import _unavailable_reason
from flash_mla.scheduler import METADATA_WIDTH, num_sm_parts_for
from flash_mla.testing import make_decode_batch

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not ops.AVAILABLE, reason="torch.library.custom_op needs torch >= 2.4")]

DECODE_OP = "flash_mla::mla_decode"
METADATA_OP = "flash_mla::get_mla_metadata"


@pytest.fixture(autouse=True)
def _fresh(default_environment):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def batch_for(seqlens, s_q=2, h_q=16, h_kv=1, seed=0, device="cpu", dtype=torch.bfloat16):
    return make_decode_batch(seqlens, s_q=s_q, h_q=h_q, h_kv=h_kv, causal=True, device=device, dtype=dtype,
                             generator=torch.Generator().manual_seed(seed))


def decode_step(q, k_cache, block_table, cache_seqlens, backend=None):
    """One decoding step as a serving engine writes it: plan once, then two "layers" share the plan."""
    _, s_q, h_q, _ = q.shape
    h_kv = k_cache.shape[2]
    md, ns = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
    out1, lse1 = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, md, ns, causal=True,
                                        backend=backend)
    out2, lse2 = flash_mla_with_kvcache(q * 2, k_cache, block_table, cache_seqlens, 512, md, ns,
                                        softmax_scale=0.03, causal=False, backend=backend)
    return out1, lse1, out2, lse2, md, ns


def assert_bitwise(got, expected, what=""):
    assert len(got) == len(expected)
    for i, (x, y) in enumerate(zip(got, expected)):
        assert x.shape == y.shape and x.dtype == y.dtype and x.device == y.device, f"{what} output {i}"
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=f"{what} output {i}")


def args_of(batch):
    return batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens


# ---------------------------------------------------------------------------------------------------------------
# the ops themselves
# ---------------------------------------------------------------------------------------------------------------

def test_ops_are_registered():
    decode = str(torch.ops.flash_mla.mla_decode.default._schema)
    metadata = str(torch.ops.flash_mla.get_mla_metadata.default._schema)
    assert decode.startswith(DECODE_OP + "(Tensor q, Tensor k_cache, Tensor block_table, Tensor cache_seqlens")
    assert decode.endswith("-> (Tensor, Tensor)") and "str? backend=None" in decode
    assert metadata.startswith(METADATA_OP + "(Tensor cache_seqlens") and metadata.endswith("-> (Tensor, Tensor)")


def test_ops_match_the_api_in_eager_mode():
    batch = batch_for([5, 70, 0, 130])
    md, ns = get_mla_metadata(batch.cache_seqlens, 32, 1)
    md_op, ns_op = torch.ops.flash_mla.get_mla_metadata(batch.cache_seqlens, 32, 1, 0)
    assert torch.equal(md, md_op) and torch.equal(ns, ns_op)
    md9, _ = torch.ops.flash_mla.get_mla_metadata(batch.cache_seqlens, 32, 1, 9)
    assert torch.equal(md9, get_mla_metadata(batch.cache_seqlens, 32, 1, num_sms=9)[0])
    out, lse = flash_mla_with_kvcache(*args_of(batch), 512, md, ns, causal=True)
    out_op, lse_op = torch.ops.flash_mla.mla_decode(*args_of(batch), 512, md, ns, 576 ** -0.5, True)
    assert_bitwise((out_op, lse_op), (out, lse), "op vs API")


def test_eager_calls_bypass_the_dispatcher(monkeypatch):
    """Eager mode never goes through the ops (their dispatch would cost per call)."""
    def boom(*args, **kwargs):
        raise AssertionError("the compile path was taken in eager mode")
    monkeypatch.setattr(ops, "decode_for_compile", boom)
    monkeypatch.setattr(ops, "metadata_for_compile", boom)
    decode_step(*args_of(batch_for([5, 70])))


def test_ops_validate_their_arguments():
    batch = batch_for([5, 70])
    md, ns = get_mla_metadata(batch.cache_seqlens, 32, 1)
    with pytest.raises(TypeError, match=r"^flash_mla_with_kvcache: q: expected dtype"):
        torch.ops.flash_mla.mla_decode(batch.q.float(), batch.k_cache, batch.block_table, batch.cache_seqlens,
                                       512, md, ns, 0.1, True)
    with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: softmax_scale: expected a finite positive"):
        torch.ops.flash_mla.mla_decode(*args_of(batch), 512, md, ns, -1.0, True)
    with pytest.raises(ValueError, match=r"^get_mla_metadata: num_sms: expected an int >= 1"):
        torch.ops.flash_mla.get_mla_metadata(batch.cache_seqlens, 32, 1, -3)


def test_metadata_op_carries_the_payload_rules():
    """min_payload and tight_payload (trailing, default 0 and False) reach the scheduler and are checked: b = 1,
    2048 tokens, 128 rows on 132 SMs (66 parts) gives 32 one-page pieces without a floor and 16 two-page ones with
    the sparse floor 7; b = 16 gives 48 pieces of 9 pages and 16 of 5 with SPEC.md's payload, 64 of 8 with the
    tight one."""
    from flash_mla._geometry import SPARSE_MIN_PAYLOAD
    from flash_mla.scheduler import schedule
    schema = str(torch.ops.flash_mla.get_mla_metadata.default._schema)
    assert re.search(r"\w+ num_sms, \w+ min_payload=0, bool tight_payload=False\) -> \(Tensor, Tensor\)$",
                     schema), schema
    lens = torch.tensor([2048], dtype=torch.int32)
    md, ns = torch.ops.flash_mla.get_mla_metadata(lens, 128, 1, 132, SPARSE_MIN_PAYLOAD)
    assert ns.tolist() == [0, 16] and (md.tolist(), ns.tolist()) == schedule([2048], 66, min_payload=7)
    md0, ns0 = torch.ops.flash_mla.get_mla_metadata(lens, 128, 1, 132)
    assert ns0.tolist() == [0, 32] and (md0.tolist(), ns0.tolist()) == schedule([2048], 66)
    with pytest.raises(ValueError, match=r"^get_mla_metadata: min_payload: expected an int >= 0, got -1"):
        torch.ops.flash_mla.get_mla_metadata(lens, 128, 1, 132, -1)
    lens16 = torch.full((16,), 2048, dtype=torch.int32)
    md, ns = torch.ops.flash_mla.get_mla_metadata(lens16, 128, 1, 132, SPARSE_MIN_PAYLOAD, True)
    assert ns.tolist() == list(range(0, 65, 4)) and md[:4].tolist() == [[0, 512 * k, 0, 512 * (k + 1), k, 0, 0, 0]
                                                                     for k in range(4)]
    assert (md.tolist(), ns.tolist()) == schedule([2048] * 16, 66, min_payload=7, tight_payload=True)
    md_spec = torch.ops.flash_mla.get_mla_metadata(lens16, 128, 1, 132, SPARSE_MIN_PAYLOAD)[0]
    assert md_spec[:4].tolist() == [[0, 0, 0, 576, 0, 0, 0, 0], [0, 576, 0, 1152, 1, 0, 0, 0],
                                    [0, 1152, 0, 1728, 2, 0, 0, 0], [0, 1728, 0, 2048, 3, 0, 0, 0]]
    from flash_mla import _validation
    with pytest.raises(TypeError, match=r"^get_mla_metadata: tight_payload: expected a bool, got int 1"):
        _validation.check_metadata_args(lens16, 128, 1, min_payload=7, tight_payload=1)
    torch.library.opcheck(torch.ops.flash_mla.get_mla_metadata.default, (lens, 128, 1, 132, SPARSE_MIN_PAYLOAD))
    torch.library.opcheck(torch.ops.flash_mla.get_mla_metadata.default, (lens16, 128, 1, 132, SPARSE_MIN_PAYLOAD,
                                                                         True))


OPCHECK_CASES = [  # seqlens, s_q, h_q, h_kv, dtype
    ([5, 70, 0, 130], 2, 16, 1, torch.bfloat16),
    ([1, 64, 65], 1, 32, 2, torch.float16),
    ([0, 0], 1, 16, 1, torch.bfloat16),
]


@pytest.mark.parametrize("seqlens,s_q,h_q,h_kv,dtype", OPCHECK_CASES)
def test_opcheck(seqlens, s_q, h_q, h_kv, dtype):
    """Schema, fake implementation (shapes, dtypes, strides) and AOT dispatch with dynamic shapes."""
    batch = batch_for(seqlens, s_q, h_q, h_kv, dtype=dtype)
    rows = s_q * h_q // h_kv
    for num_sms in (0, 7):
        torch.library.opcheck(torch.ops.flash_mla.get_mla_metadata.default, (batch.cache_seqlens, rows, h_kv, num_sms))
    md, ns = get_mla_metadata(batch.cache_seqlens, rows, h_kv, num_sms=7)
    torch.library.opcheck(torch.ops.flash_mla.mla_decode.default,
                          (*args_of(batch), 512, md, ns, 0.05, True), {"backend": None})


@pytest.mark.parametrize("num_sms,rows,h_kv", [(132, 16, 1), (132, 128, 1), (132, 256, 2), (7, 64, 1), (1, 512, 4)])
def test_fake_shapes(num_sms, rows, h_kv):
    """Under FakeTensorMode nothing runs; shapes follow from the SM count and the head counts alone."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    b, s_q, h_q = 5, 2, rows * h_kv // 2
    with FakeTensorMode():
        seqlens = torch.empty(b, dtype=torch.int32)
        md, ns = torch.ops.flash_mla.get_mla_metadata(seqlens, rows, h_kv, num_sms)
        q = torch.empty(b, s_q, h_q, 576, dtype=torch.float16)
        k_cache = torch.empty(9, 64, h_kv, 576, dtype=torch.float16)
        block_table = torch.empty(b, 3, dtype=torch.int32)
        out, lse = torch.ops.flash_mla.mla_decode(q, k_cache, block_table, seqlens, 512, md, ns, 0.1, False)
    assert md.shape == (num_sm_parts_for(num_sms, rows, h_kv), METADATA_WIDTH) and md.dtype == torch.int32
    assert ns.shape == (b + 1,) and ns.dtype == torch.int32
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == torch.float16 and out.is_contiguous()
    assert lse.shape == (b, h_q, s_q) and lse.dtype == torch.float32 and lse.is_contiguous()


# ---------------------------------------------------------------------------------------------------------------
# torch.compile on the CPU
# ---------------------------------------------------------------------------------------------------------------

class GraphRecorder:
    """A torch.compile backend that records the FX graphs it is given and runs them as they are."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def targets(self):
        return [str(n.target) for gm in self.graphs for n in gm.graph.nodes if n.op == "call_function"]


def test_compile_traces_one_graph_with_both_ops():
    batch = batch_for([5, 70, 0, 130])
    recorder = GraphRecorder()
    compiled = torch.compile(decode_step, backend=recorder, fullgraph=True)
    assert_bitwise(compiled(*args_of(batch)), decode_step(*args_of(batch)), "recorded graph")
    assert len(recorder.graphs) == 1
    targets = recorder.targets()
    assert sum(t == "flash_mla.get_mla_metadata" or t.startswith(METADATA_OP) for t in targets) == 1, targets
    assert sum(t == "flash_mla.mla_decode" or t.startswith(DECODE_OP) for t in targets) == 2, targets


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_matches_eager(backend, dynamic):
    compiled = torch.compile(decode_step, backend=backend, fullgraph=True, dynamic=dynamic)
    for seed, (seqlens, s_q, h_q, h_kv) in enumerate([([5, 70, 0, 130], 2, 16, 1),
                                                      ([300, 1, 64], 2, 16, 1),      # another batch size
                                                      ([65, 0, 129, 7, 2], 1, 32, 2)]):
        batch = batch_for(seqlens, s_q, h_q, h_kv, seed=seed)
        assert_bitwise(compiled(*args_of(batch)), decode_step(*args_of(batch)), f"{backend} {seqlens}")


def test_compile_forced_backend_and_num_sms():
    def step(q, k_cache, block_table, cache_seqlens):
        md, ns = get_mla_metadata(cache_seqlens, 32, 1, num_sms=5)
        return flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, md, ns, causal=True,
                                      backend="cpu") + (md, ns)
    batch = batch_for([5, 700, 0, 130])
    assert_bitwise(torch.compile(step, backend="aot_eager", fullgraph=True)(*args_of(batch)),
                   step(*args_of(batch)), "num_sms=5")


def test_compile_reports_bad_input_with_the_eager_message():
    batch = batch_for([5, 70])
    bad = (batch.q.float(), batch.k_cache, batch.block_table, batch.cache_seqlens)
    expected = ("flash_mla_with_kvcache: q: expected dtype torch.bfloat16 or torch.float16 or torch.float8_e4m3fn, "
                "got torch.float32")
    # fullgraph: Dynamo reports the exception it traced, message included
    with pytest.raises(Exception, match=re.escape(expected)):
        torch.compile(decode_step, backend="aot_eager", fullgraph=True)(*bad)
    torch._dynamo.reset()
    # otherwise the frame falls back to eager, which raises the original exception
    with pytest.raises(TypeError, match="^" + re.escape(expected)):
        torch.compile(decode_step, backend="aot_eager")(*bad)


def test_compiled_graph_honours_debug_mode(monkeypatch):
    """FLASH_MLA_DEBUG is read when the compiled graph runs (in the op), not when it is traced."""
    batch = batch_for([5, 70, 0, 130])
    compiled = torch.compile(decode_step, backend="aot_eager", fullgraph=True)
    compiled(*args_of(batch))                                   # traced and run with debug off
    monkeypatch.setenv("FLASH_MLA_DEBUG", "1")
    compiled(*args_of(batch))                                   # valid input passes the checks
    block_table = batch.block_table.clone()
    block_table[1, 1] = batch.k_cache.shape[0]                  # page 1 of sequence 1 (70 tokens) is read
    with pytest.raises(ValueError, match=r"block_table\[1, 1\]: expected a block index in \[0, "):
        compiled(batch.q, batch.k_cache, block_table, batch.cache_seqlens)


# ---------------------------------------------------------------------------------------------------------------
# GPU: compiled vs eager, per backend (skipped without a GPU)
# ---------------------------------------------------------------------------------------------------------------

def gpu_backends():
    if not torch.cuda.is_available():
        return [pytest.param("cuda", marks=pytest.mark.skip(reason="needs a CUDA GPU"))]
    params = []
    for name in ("cuda", "triton"):
        why = _unavailable_reason(name, torch.device("cuda"))
        params.append(pytest.param(name, marks=pytest.mark.skip(reason=why)) if why else name)
    return params


def needs_device_metadata():
    """Compiling with CUDA graphs needs get_mla_metadata on the device (the extension's kernel)."""
    if flash_mla.backends.cuda_extension() is None:
        pytest.skip("get_mla_metadata without the CUDA extension reads the lengths on the host")


@pytest.mark.gpu
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_compile_matches_eager(backend, compile_backend):
    if compile_backend == "inductor" and _unavailable_reason("triton", torch.device("cuda")):
        pytest.skip("inductor on CUDA needs triton")
    compiled = torch.compile(decode_step, backend=compile_backend, fullgraph=True)
    for seed, (seqlens, s_q, h_q) in enumerate([([4097, 1, 0, 300], 2, 64), ([70, 9000], 1, 128)]):
        batch = batch_for(seqlens, s_q, h_q, seed=seed, device="cuda")
        args = (*args_of(batch), backend)
        assert_bitwise(compiled(*args), decode_step(*args), f"{backend} {compile_backend} {seqlens}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", gpu_backends())
def test_gpu_compile_with_cuda_graphs(backend):
    """mode="reduce-overhead": inductor captures the step (metadata + decode) in a CUDA graph and replays it."""
    needs_device_metadata()
    if _unavailable_reason("triton", torch.device("cuda")):
        pytest.skip("inductor on CUDA needs triton")
    compiled = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    batch = batch_for([4097, 1, 0, 300], 2, 64, seed=3, device="cuda")
    args = (*args_of(batch), backend)
    expected = decode_step(*args)
    for _ in range(4):      # warm-up runs, then recorded, then replayed
        got = [t.clone() for t in compiled(*args)]
        assert_bitwise(got, expected, f"{backend} reduce-overhead")
    q2 = torch.randn_like(batch.q)
    args2 = (q2, *args_of(batch)[1:], backend)
    assert_bitwise([t.clone() for t in compiled(*args2)], decode_step(*args2), "new q")
    assert not math.isnan(float(expected[0].float().abs().sum()))
