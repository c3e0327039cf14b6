"""Bad input to get_mla_metadata and flash_mla_with_kvcache: the exact exception type, and a message that names
the function and the argument. Wrong type or dtype -> TypeError; wrong shape or value -> ValueError; unknown
backend -> ValueError; a backend that cannot run -> RuntimeError.
"""
import math
import re

import pytest
import torch

from flash_mla import flash_mla_with_kvcache, get_mla_metadata
from flash_mla.backends import ENV_VAR
from flash_mla.testing import assert_close, compare, make_decode_batch, reference_for

B, S_Q, H_Q, H_KV = 2, 1, 16, 1
DECODE = "flash_mla_with_kvcache"
META = "get_mla_metadata"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _automatic_backend(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)


def good_args():
    """Valid keyword arguments for flash_mla_with_kvcache, fresh for every case."""
    batch = make_decode_batch([5, 70], s_q=S_Q, h_q=H_Q, h_kv=H_KV, generator=torch.Generator().manual_seed(0))
    md, ns = get_mla_metadata(batch.cache_seqlens, S_Q * H_Q // H_KV, H_KV)
    return dict(q=batch.q, k_cache=batch.k_cache, block_table=batch.block_table, cache_seqlens=batch.cache_seqlens,
                head_dim_v=512, tile_scheduler_metadata=md, num_splits=ns, softmax_scale=None, causal=False)


def strided_last_dim(t):
    """Same shape and dtype as t, but the last dimension has stride 2."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    return view


def misaligned(t):
    """Same shape, contiguous, but the data pointer is 2 bytes off a 16-byte boundary."""
    flat = torch.zeros(t.numel() + 1, dtype=t.dtype)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


def outer_stride_not_8(t):
    """Same shape and dtype as t, last dimension contiguous, but rows 577 elements apart (not 16-byte aligned)."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)
    view = wide[..., :t.shape[-1]]
    view.copy_(t)
    return view


def column_major(t):
    """Same 2-D values, stride(1) != 1."""
    return t.t().contiguous().t()


def other_batch_metadata(n):
    return get_mla_metadata(torch.full((n,), 64, dtype=torch.int32), S_Q * H_Q // H_KV, H_KV)


# Each case: id, function that edits the good arguments, exception type, argument named in the message.
DECODE_CASES = [
    # q
    ("q-not-tensor", lambda a: a.update(q=a["q"].tolist()), TypeError, "q"),
    ("q-fp32", lambda a: a.update(q=a["q"].float()), TypeError, "q"),
    ("q-int8", lambda a: a.update(q=a["q"].to(torch.int8)), TypeError, "q"),
    ("q-rank3", lambda a: a.update(q=a["q"][:, 0]), ValueError, "q"),
    ("q-rank5", lambda a: a.update(q=a["q"][None]), ValueError, "q"),
    ("q-head-dim-512", lambda a: a.update(q=a["q"][..., :512].contiguous()), ValueError, "q"),
    ("q-head-dim-640", lambda a: a.update(q=torch.zeros(B, S_Q, H_Q, 640, dtype=torch.bfloat16)), ValueError, "q"),
    ("q-zero-heads", lambda a: a.update(q=a["q"][:, :, :0]), ValueError, "q"),
    ("q-last-dim-strided", lambda a: a.update(q=strided_last_dim(a["q"])), ValueError, "q"),
    ("q-misaligned", lambda a: a.update(q=misaligned(a["q"])), ValueError, "q"),
    ("q-zero-batch", lambda a: a.update(q=a["q"][:0]), ValueError, "q"),
    ("q-zero-seqlen_q", lambda a: a.update(q=a["q"][:, :0]), ValueError, "q"),
    ("q-fp64", lambda a: a.update(q=a["q"].double()), TypeError, "q"),
    ("q-row-stride-577", lambda a: a.update(q=outer_stride_not_8(a["q"])), ValueError, "q"),
    ("q-other-device", lambda a: a.update(q=a["q"].to("meta")), ValueError, "k_cache"),   # q sets the device
    # k_cache
    ("k_cache-not-tensor", lambda a: a.update(k_cache=None), TypeError, "k_cache"),
    ("k_cache-fp16-vs-bf16-q", lambda a: a.update(k_cache=a["k_cache"].half()), TypeError, "k_cache"),
    ("k_cache-fp32", lambda a: a.update(k_cache=a["k_cache"].float()), TypeError, "k_cache"),
    ("k_cache-bf16-vs-fp16-q", lambda a: a.update(q=a["q"].half()), TypeError, "k_cache"),
    ("k_cache-row-stride-577", lambda a: a.update(k_cache=outer_stride_not_8(a["k_cache"])), ValueError, "k_cache"),
    ("k_cache-zero-kv-heads", lambda a: a.update(k_cache=a["k_cache"][:, :, :0]), ValueError, "k_cache"),
    ("k_cache-rank5", lambda a: a.update(k_cache=a["k_cache"][None]), ValueError, "k_cache"),
    ("k_cache-rank3", lambda a: a.update(k_cache=a["k_cache"][:, :, 0]), ValueError, "k_cache"),
    ("k_cache-page-32", lambda a: a.update(k_cache=a["k_cache"][:, :32].contiguous()), ValueError, "k_cache"),
    ("k_cache-page-128", lambda a: a.update(k_cache=torch.cat([a["k_cache"]] * 2, dim=1)), ValueError, "k_cache"),
    ("k_cache-head-dim-512", lambda a: a.update(k_cache=a["k_cache"][..., :512].contiguous()), ValueError,
     "k_cache"),
    ("k_cache-h_kv-3", lambda a: a.update(k_cache=torch.cat([a["k_cache"]] * 3, dim=2)), ValueError, "k_cache"),
    ("k_cache-no-blocks", lambda a: a.update(k_cache=a["k_cache"][:0]), ValueError, "k_cache"),
    ("k_cache-last-dim-strided", lambda a: a.update(k_cache=strided_last_dim(a["k_cache"])), ValueError, "k_cache"),
    ("k_cache-other-device", lambda a: a.update(k_cache=a["k_cache"].to("meta")), ValueError, "k_cache"),
    # head_dim_v
    ("head_dim_v-576", lambda a: a.update(head_dim_v=576), ValueError, "head_dim_v"),
    ("head_dim_v-256", lambda a: a.update(head_dim_v=256), ValueError, "head_dim_v"),
    ("head_dim_v-float", lambda a: a.update(head_dim_v=512.0), TypeError, "head_dim_v"),
    ("head_dim_v-bool", lambda a: a.update(head_dim_v=True), TypeError, "head_dim_v"),
    ("head_dim_v-tensor", lambda a: a.update(head_dim_v=torch.tensor(512)), TypeError, "head_dim_v"),
    # block_table
    ("block_table-int64", lambda a: a.update(block_table=a["block_table"].long()), TypeError, "block_table"),
    ("block_table-rank1", lambda a: a.update(block_table=a["block_table"].flatten()), ValueError, "block_table"),
    ("block_table-batch", lambda a: a.update(block_table=a["block_table"][:1]), ValueError, "block_table"),
    ("block_table-not-tensor", lambda a: a.update(block_table=[[0, 1], [2, 3]]), TypeError, "block_table"),
    ("block_table-float", lambda a: a.update(block_table=a["block_table"].float()), TypeError, "block_table"),
    ("block_table-other-device", lambda a: a.update(block_table=a["block_table"].to("meta")), ValueError,
     "block_table"),
    ("block_table-column-major", lambda a: a.update(block_table=column_major(a["block_table"])), ValueError,
     "block_table"),
    ("block_table-rank3", lambda a: a.update(block_table=a["block_table"][None]), ValueError, "block_table"),
    # cache_seqlens
    ("cache_seqlens-int64", lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), TypeError,
     "cache_seqlens"),
    ("cache_seqlens-batch", lambda a: a.update(cache_seqlens=torch.cat([a["cache_seqlens"]] * 2)), ValueError,
     "cache_seqlens"),
    ("cache_seqlens-rank2", lambda a: a.update(cache_seqlens=a["cache_seqlens"][:, None]), ValueError,
     "cache_seqlens"),
    ("cache_seqlens-list", lambda a: a.update(cache_seqlens=[5, 70]), TypeError, "cache_seqlens"),
    ("cache_seqlens-other-device", lambda a: a.update(cache_seqlens=a["cache_seqlens"].to("meta")), ValueError,
     "cache_seqlens"),
    ("cache_seqlens-uint8", lambda a: a.update(cache_seqlens=a["cache_seqlens"].to(torch.uint8)), TypeError,
     "cache_seqlens"),
    # tile_scheduler_metadata
    ("metadata-int64", lambda a: a.update(tile_scheduler_metadata=a["tile_scheduler_metadata"].long()), TypeError,
     "tile_scheduler_metadata"),
    ("metadata-width-4", lambda a: a.update(tile_scheduler_metadata=a["tile_scheduler_metadata"][:, :4]
                                            .contiguous()), ValueError, "tile_scheduler_metadata"),
    ("metadata-empty", lambda a: a.update(tile_scheduler_metadata=a["tile_scheduler_metadata"][:0]), ValueError,
     "tile_scheduler_metadata"),
    ("metadata-rank1", lambda a: a.update(tile_scheduler_metadata=a["tile_scheduler_metadata"].flatten()),
     ValueError, "tile_scheduler_metadata"),
    ("metadata-not-tensor", lambda a: a.update(tile_scheduler_metadata=None), TypeError, "tile_scheduler_metadata"),
    ("metadata-other-device", lambda a: a.update(tile_scheduler_metadata=a["tile_scheduler_metadata"].to("meta")),
     ValueError, "tile_scheduler_metadata"),
    ("metadata-non-contiguous", lambda a: a.update(tile_scheduler_metadata=column_major(a["tile_scheduler_metadata"])),
     ValueError, "tile_scheduler_metadata"),
    ("metadata-rank3", lambda a: a.update(tile_scheduler_metadata=a["tile_scheduler_metadata"][None]), ValueError,
     "tile_scheduler_metadata"),
    # num_splits
    ("num_splits-int64", lambda a: a.update(num_splits=a["num_splits"].long()), TypeError, "num_splits"),
    ("num_splits-other-batch", lambda a: a.update(num_splits=other_batch_metadata(5)[1]), ValueError,
     "num_splits"),
    ("num_splits-one-short", lambda a: a.update(num_splits=a["num_splits"][1:]), ValueError,
     "num_splits"),
    ("num_splits-not-tensor", lambda a: a.update(num_splits=(0, 1, 2)), TypeError, "num_splits"),
    ("num_splits-other-device", lambda a: a.update(num_splits=a["num_splits"].to("meta")), ValueError, "num_splits"),
    ("num_splits-rank2", lambda a: a.update(num_splits=a["num_splits"][None]), ValueError, "num_splits"),
    # softmax_scale, causal
    ("softmax_scale-negative", lambda a: a.update(softmax_scale=-0.1), ValueError, "softmax_scale"),
    ("softmax_scale-zero", lambda a: a.update(softmax_scale=0.0), ValueError, "softmax_scale"),
    ("softmax_scale-nan", lambda a: a.update(softmax_scale=math.nan), ValueError, "softmax_scale"),
    ("softmax_scale-inf", lambda a: a.update(softmax_scale=math.inf), ValueError, "softmax_scale"),
    ("softmax_scale-str", lambda a: a.update(softmax_scale="0.1"), TypeError, "softmax_scale"),
    ("softmax_scale-bool", lambda a: a.update(softmax_scale=True), TypeError, "softmax_scale"),
    ("causal-int", lambda a: a.update(causal=1), TypeError, "causal"),
    ("causal-str", lambda a: a.update(causal="yes"), TypeError, "causal"),
    ("causal-tensor", lambda a: a.update(causal=torch.tensor(True)), TypeError, "causal"),
    # attn_sink: (num_heads_q,) float32 on q's device
    ("attn_sink-list", lambda a: a.update(attn_sink=[0.0] * H_Q), TypeError, "attn_sink"),
    ("attn_sink-bf16", lambda a: a.update(attn_sink=torch.zeros(H_Q, dtype=torch.bfloat16)), TypeError, "attn_sink"),
    ("attn_sink-fp64", lambda a: a.update(attn_sink=torch.zeros(H_Q, dtype=torch.float64)), TypeError, "attn_sink"),
    ("attn_sink-rank2", lambda a: a.update(attn_sink=torch.zeros(1, H_Q)), ValueError, "attn_sink"),
    ("attn_sink-rank0", lambda a: a.update(attn_sink=torch.tensor(0.0)), ValueError, "attn_sink"),
    ("attn_sink-h_kv-long", lambda a: a.update(attn_sink=torch.zeros(H_KV)), ValueError, "attn_sink"),
    ("attn_sink-too-long", lambda a: a.update(attn_sink=torch.zeros(H_Q + 1)), ValueError, "attn_sink"),
    ("attn_sink-other-device", lambda a: a.update(attn_sink=torch.zeros(H_Q, device="meta")), ValueError,
     "attn_sink"),
    # the classic form needs both tensors
    ("num_splits-none", lambda a: a.update(num_splits=None), TypeError, "num_splits"),
    ("plan-none", lambda a: a.update(tile_scheduler_metadata=None, num_splits=None), TypeError,
     "tile_scheduler_metadata"),
]


def _message(fn, arg):
    """The message starts '<function>: <argument>: expected ...'."""
    return rf"^{fn}: {re.escape(arg)}: expected "


@pytest.mark.parametrize("edit,exc,arg", [c[1:] for c in DECODE_CASES], ids=[c[0] for c in DECODE_CASES])
def test_decode_rejects_bad_input(edit, exc, arg):
    args = good_args()
    edit(args)
    with pytest.raises(exc, match=_message(DECODE, arg)) as info:
        flash_mla_with_kvcache(**args)
    assert type(info.value) is exc          # the exact type, not a subclass
    assert "got" in str(info.value)         # says what it was given


def test_decode_message_says_expected_and_given():
    args = good_args()
    args["q"] = args["q"].float()
    with pytest.raises(TypeError) as info:
        flash_mla_with_kvcache(**args)
    msg = str(info.value)
    assert "bfloat16" in msg and "float32" in msg

    args = good_args()
    args["k_cache"] = args["k_cache"][:, :32].contiguous()
    with pytest.raises(ValueError) as info:
        flash_mla_with_kvcache(**args)
    assert "64" in str(info.value) and "32" in str(info.value)


def test_metadata_from_a_different_batch():
    """The whole metadata of another (larger) batch: num_splits gives it away."""
    args = good_args()
    args["tile_scheduler_metadata"], args["num_splits"] = other_batch_metadata(7)
    with pytest.raises(ValueError, match=_message(DECODE, "num_splits") + r".*batch"):
        flash_mla_with_kvcache(**args)


def test_bad_input_leaves_tensors_untouched():
    args = good_args()
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    args["head_dim_v"] = 576
    with pytest.raises(ValueError):
        flash_mla_with_kvcache(**args)
    for k, v in before.items():
        assert torch.equal(args[k].nan_to_num(), v.nan_to_num()), k


# get_mla_metadata
SEQLENS = torch.tensor([5, 70], dtype=torch.int32)
METADATA_CASES = [
    ("cache_seqlens-int64", (SEQLENS.long(), 16, 1), TypeError, "cache_seqlens"),
    ("cache_seqlens-float", (SEQLENS.float(), 16, 1), TypeError, "cache_seqlens"),
    ("cache_seqlens-list", ([5, 70], 16, 1), TypeError, "cache_seqlens"),
    ("cache_seqlens-rank2", (SEQLENS[None], 16, 1), ValueError, "cache_seqlens"),
    ("cache_seqlens-rank0", (SEQLENS[0], 16, 1), ValueError, "cache_seqlens"),
    ("cache_seqlens-empty", (SEQLENS[:0], 16, 1), ValueError, "cache_seqlens"),
    ("cache_seqlens-meta-device", (SEQLENS.to("meta"), 16, 1), ValueError, "cache_seqlens"),
    ("num_heads_per_head_k-0", (SEQLENS, 0, 1), ValueError, "num_heads_per_head_k"),
    ("num_heads_per_head_k-negative", (SEQLENS, -16, 1), ValueError, "num_heads_per_head_k"),
    ("num_heads_per_head_k-float", (SEQLENS, 16.0, 1), TypeError, "num_heads_per_head_k"),
    ("num_heads_per_head_k-bool", (SEQLENS, True, 1), TypeError, "num_heads_per_head_k"),
    ("num_heads_per_head_k-tensor", (SEQLENS, torch.tensor(16), 1), TypeError, "num_heads_per_head_k"),
    ("num_heads_k-0", (SEQLENS, 16, 0), ValueError, "num_heads_k"),
    ("num_heads_k-str", (SEQLENS, 16, "1"), TypeError, "num_heads_k"),
    ("num_heads_k-bool", (SEQLENS, 16, False), TypeError, "num_heads_k"),
    # the kernels take int32: 2^32 would wrap to 0 (a division by zero in the binding)
    ("num_heads_per_head_k-2^32", (SEQLENS, 2 ** 32, 1), ValueError, "num_heads_per_head_k"),
    ("num_heads_k-2^31", (SEQLENS, 16, 2 ** 31), ValueError, "num_heads_k"),
]


@pytest.mark.parametrize("args,exc,arg", [c[1:] for c in METADATA_CASES], ids=[c[0] for c in METADATA_CASES])
def test_metadata_rejects_bad_input(args, exc, arg):
    with pytest.raises(exc, match=_message(META, arg)) as info:
        get_mla_metadata(*args)
    assert type(info.value) is exc


@pytest.mark.parametrize("num_sms,exc", [(0, ValueError), (-4, ValueError), (132.0, TypeError), (True, TypeError),
                                         (2 ** 32, ValueError)])
def test_metadata_rejects_bad_num_sms(num_sms, exc):
    with pytest.raises(exc, match=_message(META, "num_sms")) as info:
        get_mla_metadata(SEQLENS, 16, 1, num_sms=num_sms)
    assert type(info.value) is exc


# backends
def test_unknown_backend_keyword():
    with pytest.raises(ValueError, match=r"backend.*'tpu'") as info:
        flash_mla_with_kvcache(**good_args(), backend="tpu")
    assert type(info.value) is ValueError
    assert "cuda" in str(info.value) and "cpu" in str(info.value)   # lists the valid names


@pytest.mark.parametrize("name", ["cuda", "triton"])
def test_forced_gpu_backend_on_cpu_tensors(name, monkeypatch):
    # (with TRITON_INTERPRET=1 the triton backend runs CPU tensors in Triton's interpreter: tests/test_triton_backend)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=rf"backend '{name}' was requested but is unavailable") as info:
        flash_mla_with_kvcache(**good_args(), backend=name)
    assert type(info.value) is RuntimeError
    assert "cpu" in str(info.value)                                   # says where q is


def test_backend_from_environment(monkeypatch):
    args = good_args()
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match=r"backend 'cuda' was requested but is unavailable"):
        flash_mla_with_kvcache(**args)
    monkeypatch.setenv(ENV_VAR, "bogus")
    with pytest.raises(ValueError, match=rf"backend.*{ENV_VAR}.*'bogus'"):
        flash_mla_with_kvcache(**args)
    # the keyword wins over the environment
    out, lse = flash_mla_with_kvcache(**args, backend="cpu")
    assert torch.isfinite(lse).all()
    monkeypatch.setenv(ENV_VAR, "cpu")
    out_env, lse_env = flash_mla_with_kvcache(**args)
    assert torch.equal(out, out_env) and torch.equal(lse, lse_env)
    monkeypatch.setenv(ENV_VAR, "")                                   # empty means automatic
    out_auto, _ = flash_mla_with_kvcache(**args)
    assert torch.equal(out, out_auto)


def test_validation_before_backend_selection():
    """Bad input is reported as such even when the requested backend could not run either."""
    args = good_args()
    args["q"] = args["q"].float()
    with pytest.raises(TypeError, match=_message(DECODE, "q")):
        flash_mla_with_kvcache(**args, backend="cuda")


# valid input
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_valid_input_passes(dtype):
    args = good_args()
    args["q"], args["k_cache"] = args["q"].to(dtype), args["k_cache"].to(dtype)
    for extra in (dict(), dict(softmax_scale=0.05, causal=True), dict(softmax_scale=1, causal=False)):
        out, lse = flash_mla_with_kvcache(**{**args, **extra})
        assert out.shape == (B, S_Q, H_Q, 512) and out.dtype == dtype
        assert lse.shape == (B, H_Q, S_Q) and lse.dtype == torch.float32
        assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()


def test_valid_edge_input_passes():
    """Legal corner cases: all-empty batch, block_table with zero columns, h_kv = 2, padded outer strides."""
    seqlens = torch.zeros(3, dtype=torch.int32)
    md, ns = get_mla_metadata(seqlens, 16, 1)
    q = torch.randn(3, 1, 16, 576, dtype=torch.bfloat16)
    k_cache = torch.randn(1, 64, 1, 576, dtype=torch.bfloat16)
    out, lse = flash_mla_with_kvcache(q, k_cache, torch.empty(3, 0, dtype=torch.int32), seqlens, 512, md, ns)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()

    batch = make_decode_batch([100, 1], s_q=2, h_q=16, h_kv=2, causal=True, generator=torch.Generator().manual_seed(1))
    md, ns = get_mla_metadata(batch.cache_seqlens, 2 * 16 // 2, 2)
    padded = torch.zeros(batch.k_cache.shape[0], 64, 2, 640, dtype=torch.bfloat16)
    padded[..., :576] = batch.k_cache
    out, lse = flash_mla_with_kvcache(batch.q, padded[..., :576], batch.block_table, batch.cache_seqlens, 512,
                                      md, ns, causal=True)
    assert_close(compare(out, lse, *reference_for(batch)), torch.bfloat16, "padded k_cache")


def test_non_contiguous_views_with_supported_strides_pass():
    """Non-contiguous caches (every other token slot, blocks taken from a bigger pool) and queries (a slice of a
    wider projection) are fine when the last dimension is contiguous and rows stay 16-byte aligned."""
    batch = make_decode_batch([100, 1, 0, 130], s_q=2, h_q=16, causal=True, generator=torch.Generator().manual_seed(2))
    md, ns = get_mla_metadata(batch.cache_seqlens, 32, 1)
    expected = reference_for(batch)
    interleaved = torch.full((batch.k_cache.shape[0], 128, 1, 576), math.nan, dtype=torch.bfloat16)
    interleaved[:, ::2] = batch.k_cache
    pool = torch.full((2 * batch.k_cache.shape[0], 64, 1, 576), math.nan, dtype=torch.bfloat16)
    pool[1::2] = batch.k_cache
    wide_q = torch.full((4, 2, 16, 1152), math.nan, dtype=torch.bfloat16)
    wide_q[..., 576:] = batch.q
    for name, q, k_cache in [("token stride 2", batch.q, interleaved[:, ::2]),
                             ("block stride 2", batch.q, pool[1::2]),
                             ("q slice", wide_q[..., 576:], batch.k_cache)]:
        assert not k_cache.is_contiguous() or not q.is_contiguous()
        out, lse = flash_mla_with_kvcache(q, k_cache, batch.block_table, batch.cache_seqlens, 512, md, ns,
                                          causal=True)
        assert_close(compare(out, lse, *expected), torch.bfloat16, name)


def test_valid_calls_take_the_fast_path():
    """Valid arguments pass the one-expression check (the detailed checks only run for bad input); each bad case
    above is caught because the fast check declines it and the detailed checks raise."""
    from flash_mla import _validation
    args = good_args()
    order = ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata", "num_splits",
             "softmax_scale", "causal", "attn_sink")
    sink = torch.zeros(H_Q)
    for extra in ({}, {"softmax_scale": 0.05, "causal": True}, {"softmax_scale": 2}, {"attn_sink": sink},
                  {"attn_sink": torch.zeros(2 * H_Q)[::2]}):       # any stride: the backends make it contiguous
        call = {"attn_sink": None, **args, **extra}
        assert _validation._decode_args_ok(*(call[k] for k in order), pointers=True)
