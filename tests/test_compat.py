"""The three ways serving engines call FlashMLA (SPEC.md "Compatibility with upstream's calling conventions").

1. classic: get_mla_metadata(cache_seqlens, rows, h_kv) -> tensors, passed to every layer;
2. upstream's current form: get_mla_metadata() -> (schedule, None); the first flash_mla_with_kvcache(...,
   schedule, None) plans and stores the plan, later calls reuse it; a call with another batch shape raises;
3. the keyword arguments engines pass: num_heads_q, is_fp8_kvcache, topk, indices, attn_sink (and upstream's
   sparse-attention extras): defaults work, unsupported values (the second sparse cache: extra_k_cache,
   extra_indices_in_kvcache, extra_topk_length) raise NotImplementedError naming the argument
   (is_fp8_kvcache=True is supported: tests/test_fp8.py; indices, topk_length and topk: tests/test_sparse.py).

On the CPU: all three forms against each other bit for bit, the schedule's life cycle and errors, debug mode,
torch.compile of the lazy form. On a GPU (skipped without one): the lazy form captured in a CUDA graph (planning
inside the graph) and compiled.
"""
import re

import pytest
import torch

import flash_mla
from flash_mla import FlashMLASchedMeta, MLASchedule, flash_mla_with_kvcache, get_mla_metadata
from flash_mla.backends import cuda_extension
from flash_mla.scheduler import num_sm_parts_for
from flash_mla.testing import (HEAD_DIM_V, assert_close, compare, make_attn_sink, make_decode_batch,
                               reference_for)

pytestmark = pytest.mark.usefixtures("one_torch_thread", "default_environment")
DECODE = "flash_mla_with_kvcache"
META = "get_mla_metadata"


def batch_for(seqlens=(5, 70, 0, 130), s_q=2, h_q=16, h_kv=1, seed=0, device="cpu"):
    return make_decode_batch(list(seqlens), s_q=s_q, h_q=h_q, h_kv=h_kv, causal=True, device=device,
                             generator=torch.Generator().manual_seed(seed))


def decode(batch, md, ns, q=None, **kw):
    return flash_mla_with_kvcache(batch.q if q is None else q, batch.k_cache, batch.block_table,
                                  batch.cache_seqlens, HEAD_DIM_V, md, ns, causal=batch.causal, **kw)


def assert_bitwise(got, expected, what=""):
    for i, (x, y) in enumerate(zip(got, expected)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"{what}: output {i}")


def rows_of(batch):
    _, s_q, h_q, _ = batch.q.shape
    return s_q * h_q // batch.k_cache.shape[2]


# ---- the three forms give the same answer --------------------------------------------------------------------

def test_three_forms_agree():
    batch = batch_for()
    h_q, h_kv = batch.q.shape[2], batch.k_cache.shape[2]
    md, ns = get_mla_metadata(batch.cache_seqlens, rows_of(batch), h_kv)
    classic = decode(batch, md, ns)

    schedule, none = get_mla_metadata()
    assert isinstance(schedule, MLASchedule) and none is None
    lazy = decode(batch, schedule, None)

    # every keyword engines pass, at its supported value
    md_kw, ns_kw = get_mla_metadata(batch.cache_seqlens, rows_of(batch), h_kv, num_heads_q=h_q,
                                    is_fp8_kvcache=False, topk=None)
    keywords = decode(batch, md_kw, ns_kw, softmax_scale=None, is_fp8_kvcache=False, indices=None, attn_sink=None,
                      extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None, extra_topk_length=None)
    # upstream's positional order: (..., num_heads_q, is_fp8_kvcache, topk) and (..., softmax_scale, causal,
    # is_fp8_kvcache, indices, attn_sink)
    md_pos, ns_pos = get_mla_metadata(batch.cache_seqlens, rows_of(batch), h_kv, h_q, False, None)
    positional = flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V,
                                        md_pos, ns_pos, None, True, False, None, None)
    assert_bitwise(lazy, classic, "lazy")
    assert_bitwise(keywords, classic, "keywords")
    assert_bitwise(positional, classic, "positional")
    assert_close(compare(*classic, *reference_for(batch)), torch.bfloat16, "classic vs reference")


def test_lazy_form_with_attn_sink_positionally():
    batch = batch_for(seed=1)
    sink = make_attn_sink(16, torch.Generator().manual_seed(1))
    schedule, _ = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, HEAD_DIM_V,
                                      schedule, None, None, True, False, None, sink)
    assert_close(compare(out, lse, *reference_for(batch, attn_sink=sink)), torch.bfloat16, "lazy + attn_sink")


def test_upstream_names_are_exported():
    assert FlashMLASchedMeta is MLASchedule
    assert "MLASchedule" in flash_mla.__all__ and "FlashMLASchedMeta" in flash_mla.__all__


# ---- the lazy schedule's life cycle -----------------------------------------------------------------------------

def test_lazy_schedule_plans_once_and_is_reused(monkeypatch):
    import flash_mla.interface as interface
    calls = []
    real = interface.run_metadata

    def counting(*args):
        calls.append(args[1:])
        return real(*args)

    monkeypatch.setattr(interface, "run_metadata", counting)
    batch = batch_for()
    schedule, _ = get_mla_metadata()
    assert not schedule.have_initialized and schedule.tile_scheduler_metadata is None
    assert "not planned" in repr(schedule)
    assert not calls                                             # get_mla_metadata() itself plans nothing

    layer1 = decode(batch, schedule, None)
    assert schedule.have_initialized and len(calls) == 1
    md, ns = schedule.tile_scheduler_metadata, schedule.num_splits
    expected_md, expected_ns = real(batch.cache_seqlens, rows_of(batch), 1, flash_mla.backends.DEFAULT_CPU_NUM_SMS)
    assert torch.equal(md, expected_md) and torch.equal(ns, expected_ns)
    assert schedule.shape == (4, 2, 16, 1)
    assert re.search(r"batch_size=4, seqlen_q=2, num_heads_q=16, num_heads_k=1, num_sm_parts=\d+", repr(schedule))

    q2 = torch.randn_like(batch.q)
    layer2 = decode(batch, schedule, None, q=q2, softmax_scale=0.05)   # another layer: same plan, other q
    assert len(calls) == 1, "the second call planned again"
    assert schedule.tile_scheduler_metadata is md and schedule.num_splits is ns
    assert_bitwise(layer1, decode(batch, expected_md, expected_ns))
    assert_bitwise(layer2, decode(batch, expected_md, expected_ns, q=q2, softmax_scale=0.05))

    schedule.have_initialized = False                            # upstream's way to reset: plans again
    assert schedule.tile_scheduler_metadata is None
    decode(batch, schedule, None)
    assert len(calls) == 2 and schedule.have_initialized
    with pytest.raises(ValueError, match=r"have_initialized: expected False"):
        MLASchedule().have_initialized = True


def test_lazy_schedule_keeps_num_sms():
    batch = batch_for([3000, 5])
    schedule, _ = get_mla_metadata(num_sms=5)
    out, lse = decode(batch, schedule, None)
    assert schedule.tile_scheduler_metadata.shape[0] == num_sm_parts_for(5, rows_of(batch), 1)
    assert_bitwise((out, lse), decode(batch, *get_mla_metadata(batch.cache_seqlens, rows_of(batch), 1, num_sms=5)))
    with pytest.raises(ValueError, match=rf"^{META}: num_sms: expected"):
        get_mla_metadata(num_sms=0)


def test_lazy_form_ignores_other_arguments():
    """Upstream's get_mla_metadata(*args, **kwargs) ignores its arguments; keywords are accepted here too."""
    schedule, none = get_mla_metadata(num_heads_q=16, num_q_tokens_per_head_k=32, num_heads_k=1, whatever=3)
    assert isinstance(schedule, MLASchedule) and none is None


@pytest.mark.parametrize("field,change", [
    ("batch_size", dict(seqlens=(5, 70, 0))),
    ("seqlen_q", dict(s_q=1)),
    ("num_heads_q", dict(h_q=32)),
    ("num_heads_k", dict(h_q=32, h_kv=2)),
])
def test_lazy_schedule_rejects_another_batch_shape(field, change):
    first = batch_for()
    schedule, _ = get_mla_metadata()
    decode(first, schedule, None)
    md = schedule.tile_scheduler_metadata
    other = batch_for(**{"seqlens": (5, 70, 0, 130), **change})
    b, s_q, h_q, _ = other.q.shape
    shape = dict(batch_size=b, seqlen_q=s_q, num_heads_q=h_q, num_heads_k=other.k_cache.shape[2])
    assert shape[field] != dict(batch_size=4, seqlen_q=2, num_heads_q=16, num_heads_k=1)[field]
    given = ", ".join(f"{k}={v}" for k, v in shape.items())
    with pytest.raises(ValueError, match=rf"^{DECODE}: tile_scheduler_metadata: expected the shapes the schedule "
                                         rf"was planned for") as info:
        decode(other, schedule, None)
    message = str(info.value)
    assert "(batch_size=4, seqlen_q=2, num_heads_q=16, num_heads_k=1)" in message    # planned for
    assert f"got {given}" in message and "take a new one" in message
    assert schedule.tile_scheduler_metadata is md                                    # the plan is kept


def test_lazy_first_call_checks_arguments_before_planning():
    batch = batch_for()
    schedule, _ = get_mla_metadata()
    with pytest.raises(TypeError, match=rf"^{DECODE}: q: expected dtype"):
        decode(batch, schedule, None, q=batch.q.float())
    assert not schedule.have_initialized
    with pytest.raises(ValueError, match=rf"^{DECODE}: attn_sink: expected"):
        decode(batch, schedule, None, attn_sink=torch.zeros(3))
    assert not schedule.have_initialized
    decode(batch, schedule, None)                                  # then a good call plans
    assert schedule.have_initialized
    with pytest.raises(TypeError, match=rf"^{DECODE}: q: expected dtype"):   # later calls: the classic checks
        decode(batch, schedule, None, q=batch.q.float())


def test_lazy_schedule_needs_none_as_num_splits():
    batch = batch_for()
    schedule, _ = get_mla_metadata()
    _, ns = get_mla_metadata(batch.cache_seqlens, rows_of(batch), 1)
    with pytest.raises(TypeError, match=rf"^{DECODE}: num_splits: expected None with a schedule"):
        decode(batch, schedule, ns)


def test_lazy_schedule_from_another_step_is_caught_in_debug_mode(monkeypatch):
    """Other lengths with the same shapes cannot be seen without a host sync; FLASH_MLA_DEBUG=1 catches them."""
    batch = batch_for()
    schedule, _ = get_mla_metadata()
    decode(batch, schedule, None)
    next_step = batch_for((500, 70, 9, 130), seed=1)
    monkeypatch.setenv("FLASH_MLA_DEBUG", "1")
    decode(batch, schedule, None)                                   # the same lengths pass the checks
    with pytest.raises(ValueError, match=r"(num_splits|tile_scheduler_metadata): expected the get_mla_metadata "
                                         r"result for these cache_seqlens"):
        decode(next_step, schedule, None)


# ---- keywords ---------------------------------------------------------------------------------------------------

def test_num_heads_q_is_checked():
    seqlens = torch.tensor([5, 70], dtype=torch.int32)
    md, ns = get_mla_metadata(seqlens, 32, 1, num_heads_q=16)          # s_q = 2
    assert torch.equal(md, get_mla_metadata(seqlens, 32, 1)[0]) and torch.equal(ns, get_mla_metadata(seqlens, 32,
                                                                                                     1)[1])
    with pytest.raises(ValueError, match=rf"^{META}: num_heads_q: expected a multiple of num_heads_k"):
        get_mla_metadata(seqlens, 32, 1, num_heads_q=24)                 # 32 rows are not s_q * 24
    with pytest.raises(ValueError, match=rf"^{META}: num_heads_q: expected"):
        get_mla_metadata(seqlens, 32, 2, num_heads_q=3)                  # not a multiple of h_kv
    with pytest.raises(TypeError, match=rf"^{META}: num_heads_q: expected"):
        get_mla_metadata(seqlens, 32, 1, num_heads_q=16.0)


def test_metadata_argument_names():
    seqlens = torch.tensor([5, 70], dtype=torch.int32)
    expected = get_mla_metadata(seqlens, 32, 1)
    renamed = get_mla_metadata(cache_seqlens=seqlens, num_q_tokens_per_head_k=32, num_heads_k=1)   # upstream's name
    assert all(torch.equal(x, y) for x, y in zip(renamed, expected))
    with pytest.raises(TypeError, match=r"both num_heads_per_head_k and num_q_tokens_per_head_k"):
        get_mla_metadata(seqlens, 32, 1, num_q_tokens_per_head_k=32)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['bogus'\]"):
        get_mla_metadata(seqlens, 32, 1, bogus=1)
    with pytest.raises(TypeError, match=r"missing num_heads_k"):
        get_mla_metadata(seqlens, 32)


@pytest.mark.parametrize("arg,value", [
    ("extra_k_cache", torch.zeros(1, 64, 1, 656, dtype=torch.uint8)),
    ("extra_indices_in_kvcache", torch.zeros(4, 2, 16, 64, dtype=torch.int32)),
    ("extra_topk_length", torch.zeros(4, dtype=torch.int32)),
])
@pytest.mark.parametrize("form", ["classic", "lazy"])
def test_unsupported_decode_keywords(arg, value, form):
    batch = batch_for()
    plan = get_mla_metadata(batch.cache_seqlens, rows_of(batch), 1) if form == "classic" else get_mla_metadata()
    with pytest.raises(NotImplementedError, match=rf"^{DECODE}: {arg}: .* is not supported") as info:
        decode(batch, *plan, **{arg: value})
    assert "expected" in str(info.value) and "got" in str(info.value)
    if form == "lazy":
        assert not plan[0].have_initialized                     # refused before anything was planned


# ---- torch.compile of the lazy form -------------------------------------------------------------------------------

def lazy_step(q, k_cache, block_table, cache_seqlens):
    """One decoding step in upstream's current form: a fresh schedule, two layers."""
    schedule, num_splits = get_mla_metadata()
    out1, lse1 = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, schedule, num_splits,
                                        causal=True)
    out2, lse2 = flash_mla_with_kvcache(q * 2, k_cache, block_table, cache_seqlens, 512, schedule, num_splits,
                                        softmax_scale=0.03, causal=True)
    return out1, lse1, out2, lse2, schedule.tile_scheduler_metadata, schedule.num_splits


@pytest.mark.skipif(not flash_mla.ops.AVAILABLE, reason="torch.library.custom_op needs torch >= 2.4")
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_compile_lazy_form(compile_backend, dynamic):
    torch._dynamo.reset()
    calls = []

    def recorder(gm, example_inputs):
        calls.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    backend = recorder if compile_backend == "eager" else compile_backend
    compiled = torch.compile(lazy_step, backend=backend, fullgraph=True, dynamic=dynamic)
    for seed, (seqlens, s_q, h_q, h_kv) in enumerate([((5, 70, 0, 130), 2, 16, 1), ((300, 1, 64), 2, 16, 1),
                                                      ((65, 0, 129, 7, 2), 1, 32, 2)]):
        batch = batch_for(seqlens, s_q, h_q, h_kv, seed=seed)
        args = (batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens)
        assert_bitwise(compiled(*args), lazy_step(*args), f"{compile_backend} {seqlens}")
    if calls:   # one graph per compilation; the plan is made once per step, inside it
        assert all(sum("get_mla_metadata" in t for t in targets) == 1 for targets in calls), calls
        assert all(sum("mla_decode" in t for t in targets) == 2 for targets in calls), calls
    torch._dynamo.reset()


@pytest.mark.skipif(not flash_mla.ops.AVAILABLE, reason="torch.library.custom_op needs torch >= 2.4")
def test_compiled_layer_with_a_schedule_from_outside():
    """The engine makes the schedule eagerly and passes it to a compiled layer: the first compiled call plans, and
    the schedule then holds real tensors that eager calls can use."""
    torch._dynamo.reset()

    def layer(q, k_cache, block_table, cache_seqlens, schedule):
        return flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, schedule, None, causal=True)

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    batch = batch_for(seed=3)
    args = (batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens)
    schedule, _ = get_mla_metadata()
    first = compiled(*args, schedule)
    assert schedule.have_initialized and type(schedule.tile_scheduler_metadata) is torch.Tensor
    md, ns = get_mla_metadata(batch.cache_seqlens, rows_of(batch), 1)
    assert torch.equal(schedule.tile_scheduler_metadata, md) and torch.equal(schedule.num_splits, ns)
    assert_bitwise(first, decode(batch, md, ns))
    assert_bitwise(compiled(*args, schedule), first, "planned schedule, compiled")     # reuses the plan
    assert_bitwise(layer(*args, schedule), first, "planned schedule, eager")
    fresh, _ = get_mla_metadata()
    assert_bitwise(compiled(*args, fresh), first, "a new step's schedule")
    torch._dynamo.reset()


# ---- GPU (skipped without one) -----------------------------------------------------------------------------------

def _gpu_reason():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if cuda_extension() is None:
        return "planning inside a CUDA graph needs the CUDA extension (device scheduler)"
    return None


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_lazy_form_in_a_cuda_graph(backend):
    """Capture a step in upstream's current form (schedule made outside, planned by the first call inside the
    graph); replaying with new lengths re-plans on the device and matches the classic form."""
    from flash_mla.backends import _unavailable_reason
    why = _unavailable_reason(backend, torch.device("cuda"))
    if why:
        pytest.skip(why)
    b, s_q, h_q, max_pages = 8, 2, 64, 80
    first = batch_for((4097, 1, 0, 300, 64, 65, 0, 5000), s_q, h_q, seed=10, device="cuda")
    first.k_cache.nan_to_num_(0.25)                  # the next step reuses pages past the first step's lengths
    pages = first.k_cache.shape[0]
    q = first.q.clone()
    block_table = torch.full((b, max_pages), -1, dtype=torch.int32, device="cuda")
    block_table[:, :first.block_table.shape[1]] = first.block_table
    cache_seqlens = first.cache_seqlens.clone()
    sink = make_attn_sink(h_q, torch.Generator().manual_seed(10), device="cuda")

    def step(schedule):
        out1, lse1 = flash_mla_with_kvcache(q, first.k_cache, block_table, cache_seqlens, 512, schedule, None,
                                            causal=True, attn_sink=sink, backend=backend)
        out2, lse2 = flash_mla_with_kvcache(q * 2, first.k_cache, block_table, cache_seqlens, 512, schedule, None,
                                            causal=True, backend=backend)
        return out1, lse1, out2, lse2

    def classic():
        md, ns = get_mla_metadata(cache_seqlens, s_q * h_q, 1)
        return (*decode_on(q, md, ns, attn_sink=sink), *decode_on(q * 2, md, ns))

    def decode_on(qq, md, ns, **kw):
        return flash_mla_with_kvcache(qq, first.k_cache, block_table, cache_seqlens, 512, md, ns, causal=True,
                                      backend=backend, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm, _ = get_mla_metadata()
        step(warm)                                   # warm-up (Triton compiles here)
    torch.cuda.current_stream().wait_stream(side)
    schedule, _ = get_mla_metadata()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(schedule)
    assert schedule.have_initialized
    # the next step: new lengths (same pages; shorter or longer within them) and a new q, written in place
    new_lengths = torch.tensor([64, 4097, 1, 0, 300, 65, 5000, 0], dtype=torch.int32, device="cuda")
    new_pages = (new_lengths.cpu() + 63) // 64
    for i in range(b):
        block_table[i] = -1
        block_table[i, :new_pages[i]] = torch.randperm(pages, generator=torch.Generator().manual_seed(i))[
            :new_pages[i]].cuda().int()
    cache_seqlens.copy_(new_lengths)
    q.copy_(torch.randn_like(q))
    graph.replay()
    expected = classic()
    torch.cuda.synchronize()
    for i, (x, y) in enumerate(zip(captured, expected)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"replayed output {i}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not flash_mla.ops.AVAILABLE, reason="torch.library.custom_op needs torch >= 2.4")
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_gpu_compile_lazy_form(compile_backend):
    from flash_mla.backends import _unavailable_reason
    if compile_backend == "inductor" and _unavailable_reason("triton", torch.device("cuda")):
        pytest.skip("inductor on CUDA needs triton")
    torch._dynamo.reset()
    compiled = torch.compile(lazy_step, backend=compile_backend, fullgraph=True)
    for seed, seqlens in enumerate([(4097, 1, 0, 300), (70, 9000)]):
        batch = batch_for(seqlens, 2, 64, seed=seed, device="cuda")
        args = (batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens)
        assert_bitwise(compiled(*args), lazy_step(*args), f"{compile_backend} {seqlens}")
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or cuda_extension() is not None,
                    reason="needs a CUDA GPU without the CUDA extension (the host scheduler)")
def test_gpu_planning_in_a_capture_without_the_extension_says_why():
    batch = batch_for(device="cuda")
    schedule, _ = get_mla_metadata()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"cannot plan while a CUDA graph is being captured"):
        with torch.cuda.graph(graph):
            decode(batch, schedule, None, backend="triton")
