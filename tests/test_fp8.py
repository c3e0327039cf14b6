"""FP8 KV cache (float8_e4m3fn cache, fp8 or bf16/fp16 q, per-tensor descales): every backend against the float32
reference computed on the dequantised tensors (true value = stored value * descale), through the public API.

Covered on the CPU: the cpu backend over a wide matrix and the triton backend in Triton's interpreter over a
smaller one (ragged lengths 0/1/63/64/65/127/128/129/..., s_q 1-8, h_q 16-128, h_kv 1-2, causal and not, split and
unsplit sequences, descales 1, 0.01 and 37); NaN and +-448 codes in every cache slot past a sequence's end;
outputs allocated NaN-poisoned (conftest's nan_empty); determinism and independence of the split layout; the three
call forms agreeing bit for bit; attn_sink; the quantisation helpers; every bad-input rule; backend routing;
the torch.library op and torch.compile. On a GPU (skipped without one): the cuda (Hopper) and triton paths against
the reference over the GPU matrix (NaN / +-448 codes past every sequence's end, split and unsplit sequences,
attn_sink), automatic routing (cuda on Hopper, else triton), CUDA-graph capture and replay with new inputs and
scales written in place, torch.compile.

Tolerance (out: relative L2 < TOLERANCE[out dtype], 1e-2 for bf16, 2e-3 for fp16; lse: relative L2 < 1e-2 and
max |error| < 1e-3). The reference is computed in float32 on the dequantised values, so quantisation error is not
part of the comparison. What remains:
  * S = Q K^T: e4m3 products are exact in float32 (4 x 4 significant bits), fp8 -> bf16 / fp16 widening is exact,
    and the descales are applied in float32. With a bf16 / fp16 q the cuda kernel widens the cache to fp16 and
    accumulates S in float32 on the tensor cores (a bf16 q is rounded to fp16 first: relative 2^-11, below bf16's
    own 2^-8; measured lse error ~2e-6). With an fp8 q it runs S on the e4m3 tensor cores, which keep only ~14
    bits while accumulating, and promotes each 128-column unit's partial sum to float32: measured lse error
    2.4e-4 to 7.8e-4 on the H100 over this file's GPU shapes, against the 1e-3 bound. The cpu backend and the
    interpreter accumulate in float32 (lse off by ~1e-6); the triton backend's fp8 tensor-core dot moves its
    partial sums into float32 every 32 products (triton_backend's FP8_ACC_CHUNK): measured lse error <= 1.2e-4 on
    the H100 (|lse| ~10), against the 1e-3 bound (without the float32 steps it reached 2.6e-3 and this test
    failed).
  * P is rounded to a half type before P V (fp16 for an fp8 q, bf16 / fp16 for a bf16 / fp16 q; the cpu backend
    keeps float32): each weight gets an independent relative error of RMS ~u / sqrt(3), u = 2^-8 for bf16 (2^-11
    for fp16). For random V the output o = sum_j w_j v_j and its error sum_j w_j e_j v_j have the same
    sum_j w_j^2 scaling, so the relative error of o is ~u / sqrt(3) ~ 2.3e-3 for bf16.
  * out is stored in bf16 (fp8 / bf16 q) or fp16: another independent ~u / sqrt(3), 2.3e-3 for bf16.
  Together at most ~sqrt(2) * 2.3e-3 ~ 3.2e-3 for a bf16 output (measured: 1.1e-3-2.0e-3 cpu, which has only the
  output rounding; 1.2e-3-3.7e-3 triton in the interpreter, ~2e-3 on the H100), so 1e-2 leaves a factor of 2.5 or
  more; fp16 output: ~1e-4 measured against 2e-3. The same kernel with P rounded to fp8 measures 2e-2 and fails,
  as does one that drops or misplaces a descale (37 vs 0.01 here), reads a masked slot or mixes up rows.
"""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# Triton's interpreter runs the triton backend on CPU tensors when TRITON_INTERPRET=1 is set before triton is
# imported (as in test_triton_backend.py); otherwise test_subprocess_runs_interpreter_tests runs those tests.
INTERPRETER_HERE = HAS_CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import flash_mla  # noqa: E402
from flash_mla import (  # noqa: E402
    MLASchedule, flash_mla_with_kvcache, flash_mla_with_kvcache_fp8, get_mla_metadata, ops, quantize_kv_cache_fp8,
    quantize_q_fp8)
from flash_mla.backends import ENV_VAR, _unavailable_reason, select_backend  # noqa: E402
from flash_mla.fp8 import FP8_DTYPE, FP8_MAX, MIN_DESCALE  # noqa: E402
from flash_mla.scheduler import get_mla_metadata_twin  # noqa: E402
from flash_mla.testing import (  # noqa: E402
    FP8_GARBAGE_CODES, HEAD_DIM_V, assert_close, capture_cuda_graph, compare, make_decode_batch,
    make_fp8_decode_batch, poison_cuda_allocator, reference_for)

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

pytestmark = pytest.mark.usefixtures("one_torch_thread", "default_environment")

needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
interpreter = pytest.mark.skipif(HAS_CUDA or not INTERPRETER_HERE or not HAS_TRITON,
                                 reason="CPU-only interpreter test (needs triton; when triton was imported before "
                                        "TRITON_INTERPRET was set, test_subprocess_runs_interpreter_tests runs it)")
needs_ops = pytest.mark.skipif(not ops.AVAILABLE, reason="torch.library.custom_op needs torch >= 2.4")

FP8 = FP8_DTYPE
BF16, FP16 = torch.bfloat16, torch.float16
H100_SMS = 132
RAGGED = [0, 1, 63, 64, 65, 127, 128, 129, 300, 2]     # page boundaries +-1, a long one, a short one, empty
LENGTHS = [0, 1, 63, 64, 65, 129]                      # the interpreter's (slower) subset
LSE_ATOL = 1e-3


def out_dtype_of(batch):
    return BF16 if batch.q.dtype == FP8 else batch.q.dtype


def make(seqlens, s_q=1, h_q=16, h_kv=1, q_dtype=FP8, descales=(1.0, 1.0), causal=False, seed=0, device="cpu"):
    return make_fp8_decode_batch(seqlens, s_q=s_q, h_q=h_q, h_kv=h_kv, q_dtype=q_dtype, descale_q=descales[0],
                                 descale_k=descales[1], causal=causal, device=device,
                                 generator=torch.Generator().manual_seed(seed))


def rows_of(batch):
    _, s_q, h_q, _ = batch.q.shape
    return s_q * h_q // batch.k_cache.shape[2]


def plan(batch, num_sms=None):
    return get_mla_metadata(batch.cache_seqlens, rows_of(batch), batch.k_cache.shape[2], is_fp8_kvcache=True,
                            num_sms=num_sms)


def run(batch, num_sms=H100_SMS, backend=None, softmax_scale=None, attn_sink=None):
    """flash_mla_with_kvcache with the fp8 keywords (the form that also takes backend= and attn_sink=)."""
    md, ns = plan(batch, num_sms)
    return flash_mla_with_kvcache(*batch.args(), HEAD_DIM_V, md, ns, softmax_scale=softmax_scale,
                                  causal=batch.causal, is_fp8_kvcache=True, attn_sink=attn_sink, backend=backend,
                                  descale_q=batch.descale_q, descale_k=batch.descale_k)


def check(batch, out, lse, what, softmax_scale=None, attn_sink=None, ref=None):
    """Against the float32 reference on the dequantised tensors: shapes, dtypes, the tolerance derived in the
    module docstring, finite everywhere except lse = -inf exactly where the reference has it, and rows that see
    no key exactly 0."""
    b, s_q, h_q, _ = batch.q.shape
    assert out.shape == (b, s_q, h_q, HEAD_DIM_V) and out.dtype == out_dtype_of(batch), what
    assert lse.shape == (b, h_q, s_q) and lse.dtype == torch.float32, what
    ref_out, ref_lse = ref if ref is not None else reference_for(batch.dequantized(), softmax_scale,
                                                                 attn_sink=attn_sink)
    out, lse, ref_out, ref_lse = out.cpu(), lse.cpu(), ref_out.cpu(), ref_lse.cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite output"
    no_key = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), no_key) and torch.isfinite(lse[~no_key]).all(), what
    assert (out[no_key.transpose(1, 2)] == 0).all(), f"{what}: rows that see no key are not 0"
    assert_close(compare(out, lse, ref_out, ref_lse), out.dtype, what)
    if (~no_key).any():
        err = (lse[~no_key] - ref_lse[~no_key]).abs().max().item()
        assert err < LSE_ATOL, f"{what}: lse max error {err:.2e}"


# ---------------------------------------------------------------------------------------------------------------
# cpu backend: the wide matrix
# ---------------------------------------------------------------------------------------------------------------

CPU_CONFIGS = [  # q dtype, h_q, h_kv, s_q, causal, (descale_q, descale_k)
    (FP8, 16, 1, 1, False, (1.0, 1.0)),
    (FP8, 16, 1, 2, True, (0.01, 37.0)),
    (FP8, 128, 1, 1, True, (37.0, 0.01)),
    (FP8, 128, 2, 8, True, (0.01, 0.01)),
    (FP8, 64, 1, 4, False, (37.0, 37.0)),
    (FP8, 32, 2, 3, True, (1.0, 37.0)),
    (BF16, 16, 1, 1, True, (None, 37.0)),
    (BF16, 128, 1, 2, False, (None, 0.01)),
    (FP16, 16, 2, 8, True, (None, 1.0)),
    (FP16, 64, 1, 1, False, (None, 37.0)),
]


@pytest.mark.parametrize("q_dtype,h_q,h_kv,s_q,causal,descales", CPU_CONFIGS)
def test_cpu_matches_reference(q_dtype, h_q, h_kv, s_q, causal, descales):
    batch = make(RAGGED, s_q, h_q, h_kv, q_dtype, descales, causal, seed=h_q + 10 * s_q + h_kv)
    ref = reference_for(batch.dequantized())
    split_seen = False
    for num_sms in (H100_SMS, 9, 1):
        md, ns = plan(batch, num_sms)
        pieces = ns.diff()
        split_seen |= bool((pieces > 1).any())
        out, lse = flash_mla_with_kvcache_fp8(*batch.args(), HEAD_DIM_V, md, ns, None, causal,
                                              descale_q=batch.descale_q, descale_k=batch.descale_k)
        check(batch, out, lse, f"cpu {q_dtype} h_q={h_q} h_kv={h_kv} s_q={s_q} num_sms={num_sms}", ref=ref)
    assert split_seen, "no plan split a sequence: the combine path went untested"
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()            # L = 0
    if causal and s_q > 1:        # L = 1: only the last query token sees a key
        assert torch.isneginf(lse[1, :, :-1]).all() and torch.isfinite(lse[1, :, -1]).all()


def test_cpu_custom_scale_and_attn_sink():
    from flash_mla.testing import make_attn_sink
    batch = make(RAGGED, 2, 16, 1, FP8, (0.01, 37.0), True, seed=5)
    sink = make_attn_sink(16, torch.Generator().manual_seed(5))
    out, lse = run(batch, softmax_scale=0.05, attn_sink=sink)
    check(batch, out, lse, "scale 0.05 + attn_sink", softmax_scale=0.05, attn_sink=sink)
    out_plain, lse_plain = run(batch, softmax_scale=0.05)
    assert torch.equal(lse, lse_plain)                       # the sink leaves lse alone
    assert (out[:, :, 0] == 0).all()                         # +inf sink: out 0
    torch.testing.assert_close(out[:, :, 1], out_plain[:, :, 1], rtol=2 ** -8, atol=1e-6)   # -inf sink: none


@pytest.mark.parametrize("q_dtype", [FP8, BF16])
def test_cpu_split_layout_and_determinism(q_dtype):
    batch = make([130, 0, 257, 65, 1000], 2, 16, 1, q_dtype, (0.01, 37.0), True, seed=7)
    results = {n: run(batch, n) for n in (1, 5, H100_SMS)}
    for n, (out, lse) in results.items():
        check(batch, out, lse, f"num_sms={n}")
    torch.testing.assert_close(results[1][0], results[H100_SMS][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[1][1], results[H100_SMS][1], atol=1e-5, rtol=1e-5)
    again = run(batch, 5)
    assert torch.equal(again[0], results[5][0]) and torch.equal(again[1], results[5][1])   # bitwise


def test_garbage_past_the_end_never_leaks():
    """Every slot past a sequence's end, and every unused block, holds NaN or +-448 codes (make_fp8_decode_batch);
    with the pages cut at odd places and the last page of each sequence mostly garbage, results stay finite and
    match the reference. Also: the garbage really is there."""
    batch = make([1, 65, 127, 0, 129], 3, 16, 2, FP8, (37.0, 0.01), True, seed=11)
    codes = batch.k_cache.view(torch.uint8)
    assert all(int((codes == c).sum()) > 1000 for c in FP8_GARBAGE_CODES)
    for num_sms in (H100_SMS, 1):
        out, lse = run(batch, num_sms)
        check(batch, out, lse, f"garbage past the end, num_sms={num_sms}")


def test_all_empty_batch_never_reads_the_cache():
    batch = make([0, 0, 0], 2, 16, 1, FP8, (1.0, 1.0), seed=12)
    batch.k_cache.view(torch.uint8).fill_(0x7F)                     # every byte NaN
    assert (batch.block_table == -1).all()
    out, lse = run(batch)
    assert out.dtype == BF16 and (out == 0).all() and torch.isneginf(lse).all()


def test_cpu_poisoned_outputs(nan_empty):
    """torch.empty hands out NaN (conftest's nan_empty): every element of out and lse must be written."""
    batch = make([0, 1, 130, 64, 0], 2, 16, 2, FP8, (0.01, 37.0), True, seed=13)
    out, lse = run(batch)
    check(batch, out, lse, "poisoned outputs")


# ---------------------------------------------------------------------------------------------------------------
# the three call forms, get_mla_metadata's keyword, the flag
# ---------------------------------------------------------------------------------------------------------------

def call_forms(batch, backend=None):
    """{form: (out, lse)} for the classic fp8 function (positional, as the referee calls it), the keywords on
    flash_mla_with_kvcache, and the lazy schedule with both functions."""
    causal, dq, dk = batch.causal, batch.descale_q, batch.descale_k
    env = {} if backend is None else {ENV_VAR: backend}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        md, ns = plan(batch)
        forms = {
            "fp8 function": flash_mla_with_kvcache_fp8(*batch.args(), 512, md, ns, 576 ** -0.5, causal,
                                                       descale_q=dq, descale_k=dk),
            "keywords": flash_mla_with_kvcache(*batch.args(), 512, md, ns, causal=causal, is_fp8_kvcache=True,
                                               descale_q=dq, descale_k=dk),
        }
        schedule, none = get_mla_metadata(is_fp8_kvcache=True)
        assert isinstance(schedule, MLASchedule) and none is None
        forms["lazy fp8 function"] = flash_mla_with_kvcache_fp8(*batch.args(), 512, schedule, None, causal=causal,
                                                                descale_q=dq, descale_k=dk)
        forms["lazy keywords, same schedule"] = flash_mla_with_kvcache(*batch.args(), 512, schedule, None,
                                                                       None, causal, True, descale_q=dq,
                                                                       descale_k=dk)
        assert torch.equal(schedule.tile_scheduler_metadata, md) and torch.equal(schedule.num_splits, ns)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return forms


@pytest.mark.parametrize("q_dtype", [FP8, BF16])
def test_three_forms_agree(q_dtype):
    batch = make([5, 70, 0, 130], 2, 16, 1, q_dtype, (0.01, 37.0), True, seed=20)
    forms = call_forms(batch)
    first = forms["fp8 function"]
    for name, (out, lse) in forms.items():
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), name
    check(batch, *first, "fp8 function")


def test_metadata_is_the_same_for_fp8():
    seqlens = torch.tensor([5, 70, 0, 4097], dtype=torch.int32)
    plain = get_mla_metadata(seqlens, 32, 1)
    for kw in (dict(is_fp8_kvcache=True), dict(num_heads_q=16, is_fp8_kvcache=True)):
        fp8 = get_mla_metadata(seqlens, 32, 1, **kw)
        assert all(torch.equal(x, y) for x, y in zip(fp8, plain))
    positional = get_mla_metadata(seqlens, 32, 1, 16, True, None)           # upstream's positional order
    assert all(torch.equal(x, y) for x, y in zip(positional, plain))


def test_lazy_schedule_serves_fp8_and_bf16_layers_alike():
    """One step's schedule, planned by an fp8 layer, reused by a bf16 layer of the same batch (same plan)."""
    batch = make([5, 70, 0, 130], 1, 16, 1, FP8, (0.01, 37.0), seed=21)
    schedule, _ = get_mla_metadata()
    flash_mla_with_kvcache_fp8(*batch.args(), 512, schedule, None, descale_q=batch.descale_q,
                               descale_k=batch.descale_k)
    bf16 = make_decode_batch([5, 70, 0, 130], generator=torch.Generator().manual_seed(21))
    out, lse = flash_mla_with_kvcache(bf16.q, bf16.k_cache, bf16.block_table, bf16.cache_seqlens, 512, schedule,
                                      None)
    assert_close(compare(out, lse, *reference_for(bf16)), BF16, "bf16 layer on an fp8-planned schedule")


# ---------------------------------------------------------------------------------------------------------------
# bad input: before any kernel, the documented exception, a message naming the argument
# ---------------------------------------------------------------------------------------------------------------

def good_fp8_args():
    batch = make([5, 70], 1, 16, 1, FP8, (0.5, 2.0), seed=30)
    md, ns = plan(batch)
    return dict(q=batch.q, k_cache=batch.k_cache, block_table=batch.block_table, cache_seqlens=batch.cache_seqlens,
                head_dim_v=512, tile_scheduler_metadata=md, num_splits=ns, softmax_scale=None, causal=False,
                descale_q=batch.descale_q, descale_k=batch.descale_k)


def fp8_row_stride_584(t):
    """fp8 q with rows 584 elements apart: 16-byte aligned for bf16 (584 % 8 == 0), not for fp8 (584 % 16)."""
    wide = torch.zeros(*t.shape[:-1], 584, dtype=t.dtype)
    view = wide[..., :576]
    view.view(torch.uint8).copy_(t.view(torch.uint8))
    return view


FP8_CASES = [   # id, edit of the good arguments, exception, argument named first in the message
    ("k_cache-bf16", lambda a: a.update(k_cache=a["k_cache"].to(BF16)), TypeError, "k_cache"),
    ("k_cache-uint8", lambda a: a.update(k_cache=a["k_cache"].view(torch.uint8)), TypeError, "k_cache"),
    ("k_cache-e5m2", lambda a: a.update(k_cache=a["k_cache"].float().to(torch.float8_e5m2)), TypeError, "k_cache"),
    ("k_cache-fp32", lambda a: a.update(k_cache=a["k_cache"].float()), TypeError, "k_cache"),
    ("q-fp32", lambda a: a.update(q=a["q"].float()), TypeError, "q"),
    ("q-e5m2", lambda a: a.update(q=a["q"].float().to(torch.float8_e5m2)), TypeError, "q"),
    ("q-int8", lambda a: a.update(q=a["q"].view(torch.int8)), TypeError, "q"),
    ("q-row-stride-584", lambda a: a.update(q=fp8_row_stride_584(a["q"])), ValueError, "q"),
    ("descale_k-missing", lambda a: a.update(descale_k=None), TypeError, "descale_k"),
    ("descale_q-missing", lambda a: a.update(descale_q=None), TypeError, "descale_q"),
    ("descale_q-with-bf16-q", lambda a: a.update(q=a["q"].to(BF16)), TypeError, "descale_q"),
    ("descale_k-float", lambda a: a.update(descale_k=2.0), TypeError, "descale_k"),
    ("descale_k-fp64", lambda a: a.update(descale_k=a["descale_k"].double()), TypeError, "descale_k"),
    ("descale_q-bf16", lambda a: a.update(descale_q=a["descale_q"].to(BF16)), TypeError, "descale_q"),
    ("descale_k-0d", lambda a: a.update(descale_k=a["descale_k"].reshape(())), ValueError, "descale_k"),
    ("descale_k-2", lambda a: a.update(descale_k=a["descale_k"].repeat(2)), ValueError, "descale_k"),
    ("descale_q-1x1", lambda a: a.update(descale_q=a["descale_q"].reshape(1, 1)), ValueError, "descale_q"),
    ("descale_k-other-device", lambda a: a.update(descale_k=a["descale_k"].to("meta")), ValueError, "descale_k"),
    ("descale_q-other-device", lambda a: a.update(descale_q=a["descale_q"].to("meta")), ValueError, "descale_q"),
]


def _message(fn, arg):
    return rf"^{fn}: {re.escape(arg)}: expected "


@pytest.mark.parametrize("edit,exc,arg", [c[1:] for c in FP8_CASES], ids=[c[0] for c in FP8_CASES])
@pytest.mark.parametrize("form", ["fp8 function", "keywords", "lazy"])
def test_fp8_rejects_bad_input(edit, exc, arg, form, monkeypatch):
    import flash_mla.backends as backends

    def boom(*a, **k):
        raise AssertionError("a backend ran on bad input")
    monkeypatch.setattr(backends, "select_backend", boom)
    args = good_fp8_args()
    edit(args)
    if form == "lazy":
        args["tile_scheduler_metadata"], args["num_splits"] = get_mla_metadata(is_fp8_kvcache=True)
    if form == "fp8 function":
        fn, call = "flash_mla_with_kvcache_fp8", flash_mla_with_kvcache_fp8
    else:
        fn, call = "flash_mla_with_kvcache", lambda **a: flash_mla_with_kvcache(**a, is_fp8_kvcache=True)
    with pytest.raises(exc, match=_message(fn, arg)) as info:
        call(**args)
    assert type(info.value) is exc and "got" in str(info.value)
    if form == "lazy":
        assert not args["tile_scheduler_metadata"].have_initialized        # refused before planning


def test_messages_say_what_to_do():
    args = good_fp8_args()
    with pytest.raises(TypeError, match=r"k_cache\.view\(torch\.float8_e4m3fn\)"):
        flash_mla_with_kvcache_fp8(**{**args, "k_cache": args["k_cache"].view(torch.uint8)})
    with pytest.raises(TypeError, match=r"descale_k: expected a float32 tensor of shape \(1,\).*got None"):
        flash_mla_with_kvcache_fp8(**{**args, "descale_k": None})
    with pytest.raises(ValueError, match=r"descale_k: expected shape \(1,\).*reshape\(1\).*got shape \(\)"):
        flash_mla_with_kvcache_fp8(**{**args, "descale_k": args["descale_k"].reshape(())})
    with pytest.raises(TypeError, match=r"descale_q: expected None \(q is torch\.bfloat16, not fp8"):
        flash_mla_with_kvcache_fp8(**{**args, "q": args["q"].to(BF16)})


def test_flag_must_agree_with_the_cache():
    """is_fp8_kvcache=True with a bf16 cache, and an fp8 cache with is_fp8_kvcache=False (the default): TypeError
    naming k_cache, before anything runs."""
    bf16 = make_decode_batch([5, 70], generator=torch.Generator().manual_seed(31))
    md, ns = get_mla_metadata(bf16.cache_seqlens, 16, 1)
    bf16_args = (bf16.q, bf16.k_cache, bf16.block_table, bf16.cache_seqlens, 512, md, ns)
    with pytest.raises(TypeError, match=r"^flash_mla_with_kvcache: k_cache: expected dtype torch\.float8_e4m3fn, "
                                        r"since is_fp8_kvcache=True"):
        flash_mla_with_kvcache(*bf16_args, is_fp8_kvcache=True, descale_k=torch.ones(1))
    with pytest.raises(TypeError, match=r"^flash_mla_with_kvcache_fp8: k_cache: expected dtype torch\.float8_e4m3fn"):
        flash_mla_with_kvcache_fp8(*bf16_args)
    # descales with a bf16 cache and no flag: the descale is the odd one out
    with pytest.raises(TypeError, match=r"^flash_mla_with_kvcache: descale_k: expected None \(k_cache is "
                                        r"torch\.bfloat16, not fp8"):
        flash_mla_with_kvcache(*bf16_args, descale_k=torch.ones(1))

    args = good_fp8_args()
    for flag in (False, 0):
        with pytest.raises(TypeError, match=r"^flash_mla_with_kvcache: k_cache: expected a bf16 or fp16 cache, "
                                            r"since is_fp8_kvcache=False .*got torch\.float8_e4m3fn") as info:
            flash_mla_with_kvcache(**args, is_fp8_kvcache=flag)
        assert "flash_mla_with_kvcache_fp8" in str(info.value)
    # an fp8 q with a bf16 cache
    with pytest.raises(TypeError, match=r"^flash_mla_with_kvcache: k_cache: expected dtype torch\.float8_e4m3fn "
                                        r"\(q is torch\.float8_e4m3fn: an fp8 q needs an fp8 cache\)"):
        flash_mla_with_kvcache(args["q"], bf16.k_cache, bf16.block_table, bf16.cache_seqlens, 512, md, ns,
                               descale_q=args["descale_q"])


def test_valid_fp8_calls_take_the_fast_path():
    from flash_mla import _validation
    a = good_fp8_args()
    order = ("q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata", "num_splits",
             "softmax_scale", "causal")
    positional = [a[k] for k in order] + [None]
    for extra in (dict(descale_q=a["descale_q"], descale_k=a["descale_k"], is_fp8_kvcache=True),
                  dict(descale_q=a["descale_q"], descale_k=a["descale_k"]),                # the op: no flag
                  dict(descale_q=None, descale_k=a["descale_k"], is_fp8_kvcache=True)):
        args = list(positional)
        if extra["descale_q"] is None:
            args[0] = a["q"].to(BF16)
        assert _validation._decode_args_ok(*args, pointers=True, **extra)
    assert not _validation._decode_args_ok(*positional, pointers=True, descale_q=a["descale_q"],
                                           descale_k=a["descale_k"], is_fp8_kvcache=False)


def test_debug_mode_checks_the_descales(monkeypatch):
    monkeypatch.setenv("FLASH_MLA_DEBUG", "1")
    args = good_fp8_args()
    flash_mla_with_kvcache_fp8(**args)                                     # valid input passes
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match=r"descale_k: expected a finite scale > 0"):
            flash_mla_with_kvcache_fp8(**{**args, "descale_k": torch.tensor([bad])})
    q = args["q"].clone()
    q.view(torch.uint8)[1, 0, 3, 7] = 0x7F                                 # NaN in the query of sequence 1
    with pytest.raises(ValueError, match=r"q\[1\]: expected finite values"):
        flash_mla_with_kvcache_fp8(**{**args, "q": q})


# ---------------------------------------------------------------------------------------------------------------
# backend routing
# ---------------------------------------------------------------------------------------------------------------

def test_fp8_routes_like_half_precision():
    """The cuda backend runs fp8 caches wherever it runs bf16 ones (its fp8 kernel is part of the extension): the
    reason it cannot, if any, is the same for both (checked before any CUDA call, so this runs without a GPU too)."""
    cuda = torch.device("cuda")
    assert _unavailable_reason("cuda", cuda, fp8=True) == _unavailable_reason("cuda", cuda, fp8=False)
    assert select_backend(torch.device("cpu"), None, fp8=True) == "cpu"


def test_forced_backend_for_fp8_on_cpu_tensors(monkeypatch):
    args = good_fp8_args()
    monkeypatch.setenv(ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match=r"'cuda' was requested but is unavailable"):
        flash_mla_with_kvcache_fp8(**args)
    monkeypatch.setenv(ENV_VAR, "cpu")
    out, _ = flash_mla_with_kvcache_fp8(**args)
    assert out.dtype == BF16


# ---------------------------------------------------------------------------------------------------------------
# quantisation helpers
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn", [quantize_kv_cache_fp8, quantize_q_fp8])
@pytest.mark.parametrize("dtype", [BF16, FP16, torch.float32])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 300.0])
def test_quantize_round_trip(fn, dtype, magnitude):
    g = torch.Generator().manual_seed(int(magnitude * 1000) % 97)
    x = (torch.randn(3, 64, 2, 576, generator=g) * magnitude).to(dtype)
    stored, descale = fn(x)
    assert stored.dtype == FP8 and stored.shape == x.shape
    assert descale.dtype == torch.float32 and descale.shape == (1,)
    xf = x.float()
    amax = xf.abs().max()
    assert descale.item() == pytest.approx(amax.item() / FP8_MAX, rel=1e-6)
    assert stored.float().abs().max().item() == FP8_MAX                  # the largest |x| maps to 448
    deq = stored.float() * descale
    # e4m3: 3 mantissa bits, relative rounding error <= 2^-4 for normal codes; subnormal codes (|stored| < 2^-6)
    # are 2^-9 apart, an absolute error <= 2^-10 * descale
    bound = torch.maximum(xf.abs() * 2 ** -4, torch.full_like(xf, 2 ** -10) * descale) * (1 + 1e-5)
    assert ((deq - xf).abs() <= bound).all()
    rel = ((deq - xf).norm() / xf.norm()).item()
    assert 5e-3 < rel < 4e-2, f"rel-L2 of the round trip {rel:.2e} (e4m3: ~2.6e-2 on Gaussian data)"


def test_quantize_edge_cases():
    zeros, d = quantize_kv_cache_fp8(torch.zeros(2, 64, 1, 576, dtype=BF16))
    assert d.item() == MIN_DESCALE > 0 and (zeros.float() == 0).all()
    empty, d = quantize_q_fp8(torch.zeros(0, 1, 16, 576))
    assert empty.shape == (0, 1, 16, 576) and d.item() == MIN_DESCALE

    x = torch.tensor([0.0, 1.0, -3.0, math.nan, math.inf, -math.inf, 2.0])
    stored, d = quantize_kv_cache_fp8(x)
    assert d.item() == pytest.approx(3.0 / FP8_MAX)                      # amax of the finite values only
    s = stored.float()
    assert torch.isnan(s[3]) and s[4] == FP8_MAX and s[5] == -FP8_MAX and s[2] == -FP8_MAX and s[0] == 0
    nonfinite, d = quantize_q_fp8(torch.tensor([math.nan, math.inf]))
    assert d.item() == MIN_DESCALE and torch.isnan(nonfinite.float()[0]) and nonfinite.float()[1] == FP8_MAX
    tiny, d = quantize_q_fp8(torch.full((8,), 1e-37))                    # amax / 448 below the floor
    assert d.item() == MIN_DESCALE and torch.isfinite(tiny.float()).all() and (tiny.float() > 0).all()

    for bad, what in ((torch.zeros(3, dtype=torch.int32), "dtype"), (torch.zeros(3, dtype=FP8), "dtype"),
                      ([1.0, 2.0], "torch.Tensor")):
        with pytest.raises(TypeError, match=rf"^quantize_kv_cache_fp8: k_cache: expected .*{what}"):
            quantize_kv_cache_fp8(bad)
    with pytest.raises(TypeError, match=r"^quantize_q_fp8: q: expected dtype"):
        quantize_q_fp8(torch.zeros(3, dtype=torch.float64))


def test_quantized_decode_tracks_the_bf16_result():
    """End to end: quantise a bf16 batch (NaN past every sequence's end, ignored by the scale) with the helpers,
    decode, and compare with (a) the reference on the dequantised tensors (kernel error only) and (b) the bf16
    result on the original tensors (kernel + fp8 quantisation error: e4m3 keeps 3 mantissa bits, ~2.5e-2 rel-L2
    per tensor, so a few percent here; measured ~3e-2)."""
    g = torch.Generator().manual_seed(40)
    bf16 = make_decode_batch(RAGGED, s_q=2, h_q=32, causal=True, generator=g)
    k8, dk = quantize_kv_cache_fp8(bf16.k_cache)
    q8, dq = quantize_q_fp8(bf16.q)
    assert torch.isfinite(dk).all() and torch.isfinite(dq).all()
    md, ns = get_mla_metadata(bf16.cache_seqlens, 64, 1, is_fp8_kvcache=True)
    out, lse = flash_mla_with_kvcache_fp8(q8, k8, bf16.block_table, bf16.cache_seqlens, 512, md, ns, None, True,
                                          descale_q=dq, descale_k=dk)
    from flash_mla.testing import Fp8DecodeBatch
    fp8 = Fp8DecodeBatch(q=q8, k_cache=k8, block_table=bf16.block_table, cache_seqlens=bf16.cache_seqlens,
                         causal=True, descale_q=dq, descale_k=dk)
    check(fp8, out, lse, "quantised with the helpers")
    m = compare(out, lse, *reference_for(bf16))
    assert m["inf_mismatch"] == 0 and m["nan"] == 0
    assert m["out_rel_l2"] < 0.08 and m["lse_rel_l2"] < 0.01, m


# ---------------------------------------------------------------------------------------------------------------
# torch.library op and torch.compile (CPU)
# ---------------------------------------------------------------------------------------------------------------

@needs_ops
def test_op_schema_is_backward_compatible():
    schema = str(torch.ops.flash_mla.mla_decode.default._schema)
    assert "str? backend=None, Tensor? attn_sink=None, Tensor? descale_q=None, Tensor? descale_k=None)" in schema
    batch = make([5, 70, 0, 130], 2, 16, 1, FP8, (0.01, 37.0), True, seed=50)
    md, ns = plan(batch)
    expected = flash_mla_with_kvcache_fp8(*batch.args(), 512, md, ns, None, True, descale_q=batch.descale_q,
                                          descale_k=batch.descale_k)
    got = torch.ops.flash_mla.mla_decode(*batch.args(), 512, md, ns, 576 ** -0.5, True,
                                         descale_q=batch.descale_q, descale_k=batch.descale_k)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    with pytest.raises(TypeError, match=r"^flash_mla_with_kvcache: descale_k: expected a float32 tensor"):
        torch.ops.flash_mla.mla_decode(*batch.args(), 512, md, ns, 0.1, True, descale_q=batch.descale_q)


@needs_ops
@pytest.mark.parametrize("q_dtype", [FP8, FP16])
def test_opcheck_and_fake_dtype(q_dtype):
    batch = make([5, 70, 0], 2, 16, 1, q_dtype, (0.5, 2.0), True, seed=51)
    md, ns = plan(batch, 7)
    # opcheck's test_schema cannot run here: its SchemaCheckMode multiplies the inputs, which torch has no float8
    # kernel for ("mul_cpu_reduced_float" not implemented); test_custom_ops.py runs it on the same op (bf16)
    torch.library.opcheck(torch.ops.flash_mla.mla_decode.default, (*batch.args(), 512, md, ns, 0.05, True),
                          {"backend": None, "descale_q": batch.descale_q, "descale_k": batch.descale_k},
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in batch.args()]
        dq = None if batch.descale_q is None else mode.from_tensor(batch.descale_q)
        out, lse = torch.ops.flash_mla.mla_decode(*fake, 512, mode.from_tensor(md), mode.from_tensor(ns), 0.1,
                                                  False, descale_q=dq, descale_k=mode.from_tensor(batch.descale_k))
    assert out.dtype == (BF16 if q_dtype == FP8 else FP16) and out.shape == (3, 2, 16, 512)
    assert lse.dtype == torch.float32 and lse.shape == (3, 16, 2)


def fp8_step(q, k_cache, block_table, cache_seqlens, descale_q, descale_k):
    """A decoding step over an fp8 cache: classic plan for two layers in both forms, and a lazy schedule."""
    s_q, h_q, h_kv = q.shape[1], q.shape[2], k_cache.shape[2]
    md, ns = get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv, is_fp8_kvcache=True)
    out1, lse1 = flash_mla_with_kvcache_fp8(q, k_cache, block_table, cache_seqlens, 512, md, ns, None, True,
                                            descale_q=descale_q, descale_k=descale_k)
    out2, lse2 = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, md, ns, softmax_scale=0.03,
                                        is_fp8_kvcache=True, descale_q=descale_q, descale_k=descale_k)
    schedule, _ = get_mla_metadata(is_fp8_kvcache=True)
    out3, lse3 = flash_mla_with_kvcache_fp8(q, k_cache, block_table, cache_seqlens, 512, schedule, None,
                                            causal=True, descale_q=descale_q, descale_k=descale_k)
    return out1, lse1, out2, lse2, out3, lse3


@needs_ops
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("compile_backend", ["eager", "aot_eager"])
def test_compile_matches_eager(compile_backend, dynamic):
    torch._dynamo.reset()
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    compiled = torch.compile(fp8_step, backend=recorder if compile_backend == "eager" else compile_backend,
                             fullgraph=True, dynamic=dynamic)
    for seed, (seqlens, s_q, h_q, h_kv, q_dtype) in enumerate([([5, 70, 0, 130], 2, 16, 1, FP8),
                                                               ([300, 1, 64], 1, 32, 2, FP8),
                                                               ([65, 0, 129], 2, 16, 1, BF16)]):
        batch = make(seqlens, s_q, h_q, h_kv, q_dtype, (0.01, 37.0), True, seed=60 + seed)
        args = (*batch.args(), batch.descale_q, batch.descale_k)
        got, expected = compiled(*args), fp8_step(*args)
        for i, (x, y) in enumerate(zip(got, expected)):
            torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"{compile_backend} {seqlens} output {i}")
        check(batch, *expected[:2], f"compiled step {seqlens}")
    for targets in graphs:    # one graph per compilation, every decode through the custom op
        assert sum("mla_decode" in t for t in targets) == 3, targets
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------------
# triton backend in Triton's interpreter (CPU-only machines)
# ---------------------------------------------------------------------------------------------------------------

TRITON_CONFIGS = [  # q dtype, h_q, h_kv, s_q, causal, descales
    (FP8, 16, 1, 1, False, (1.0, 1.0)),
    (FP8, 16, 2, 2, True, (0.01, 37.0)),
    (FP8, 16, 1, 8, True, (37.0, 0.01)),        # 128 rows: two row tiles
    (FP8, 128, 1, 1, True, (0.01, 0.01)),       # 128 heads
    (FP8, 64, 2, 2, False, (37.0, 37.0)),
    (BF16, 16, 1, 3, True, (None, 37.0)),
    (BF16, 32, 2, 1, False, (None, 0.01)),
    (FP16, 16, 1, 2, False, (None, 37.0)),
]


@interpreter
@pytest.mark.parametrize("q_dtype,h_q,h_kv,s_q,causal,descales", TRITON_CONFIGS)
def test_interpreter_matches_reference(q_dtype, h_q, h_kv, s_q, causal, descales):
    batch = make(LENGTHS, s_q, h_q, h_kv, q_dtype, descales, causal, seed=100 + h_q + 10 * s_q + h_kv)
    rows = rows_of(batch)
    _, ns = get_mla_metadata_twin(batch.cache_seqlens, rows, h_kv, H100_SMS)
    assert (ns.diff() > 1).any() and (ns.diff()[batch.cache_seqlens > 0] == 1).any()   # split and unsplit rows
    ref = reference_for(batch.dequantized())
    out, lse = run(batch, H100_SMS, backend="triton")
    check(batch, out, lse, f"triton {q_dtype} h_q={h_q} h_kv={h_kv} s_q={s_q} causal={causal} {descales}", ref=ref)


@interpreter
def test_interpreter_split_layout_determinism_and_cpu_agreement():
    batch = make([130, 0, 257, 65], 2, 16, 1, FP8, (0.01, 37.0), True, seed=110)
    results = {n: run(batch, n, backend="triton") for n in (1, 5, H100_SMS)}
    ref = reference_for(batch.dequantized())
    for n, (out, lse) in results.items():
        check(batch, out, lse, f"triton num_sms={n}", ref=ref)
    torch.testing.assert_close(results[1][0], results[H100_SMS][0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(results[1][1], results[H100_SMS][1], atol=1e-5, rtol=1e-5)
    again = run(batch, 5, backend="triton")
    assert torch.equal(again[0], results[5][0]) and torch.equal(again[1], results[5][1])
    cpu = run(batch, 5, backend="cpu")
    torch.testing.assert_close(cpu[1], results[5][1], atol=1e-4, rtol=1e-5)          # same lse, two backends


@interpreter
def test_interpreter_three_forms_agree():
    batch = make([5, 70, 0, 130], 2, 16, 1, FP8, (37.0, 0.01), True, seed=111)
    forms = call_forms(batch, backend="triton")
    first = forms["fp8 function"]
    for name, (out, lse) in forms.items():
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), name
    check(batch, *first, "triton, fp8 function")


@interpreter
def test_interpreter_poisoned_outputs_garbage_and_attn_sink(nan_empty):
    from flash_mla.testing import make_attn_sink
    batch = make([0, 1, 130, 64, 0, 257], 2, 16, 2, FP8, (0.01, 37.0), True, seed=112)
    sink = make_attn_sink(16, torch.Generator().manual_seed(112))
    out, lse = run(batch, backend="triton", attn_sink=sink)
    check(batch, out, lse, "triton, poisoned outputs + attn_sink", attn_sink=sink)
    out, lse = run(batch, 1, backend="triton")
    check(batch, out, lse, "triton, poisoned outputs, unsplit")


@interpreter
def test_interpreter_all_empty_batch():
    batch = make([0, 0], 1, 16, 1, FP8, (1.0, 1.0), seed=113)
    batch.k_cache.view(torch.uint8).fill_(0xFF)
    out, lse = run(batch, backend="triton")
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.skipif(HAS_CUDA or INTERPRETER_HERE or not HAS_TRITON,
                    reason="the interpreter tests run in this process (or need triton)")
def test_subprocess_runs_interpreter_tests():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                             "-k", "test_interpreter_"], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# GPU (skipped without one)
# ---------------------------------------------------------------------------------------------------------------

GPU_LENGTHS = [0, 1, 63, 64, 65, 4097]


def gpu_batch(b, s_q, h_q, h_kv, q_dtype, descales, causal, seed):
    lengths = [GPU_LENGTHS[i % len(GPU_LENGTHS)] for i in range(b)]
    return make(lengths, s_q, h_q, h_kv, q_dtype, descales, causal, seed, device="cuda")


def gpu_reference(batch, softmax_scale=None):
    return reference_for(batch.dequantized(), softmax_scale, on_device=True)


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("q_dtype,descales", [(FP8, (0.01, 37.0)), (FP8, (1.0, 1.0)), (BF16, (None, 0.01)),
                                              (FP16, (None, 37.0))], ids=["fp8-q", "fp8-q-unit", "bf16-q", "fp16-q"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q,h_q,h_kv", [(1, 16, 1), (2, 64, 1), (1, 128, 1), (4, 32, 2), (8, 16, 1)])
def test_gpu_triton_matches_reference(q_dtype, descales, causal, s_q, h_q, h_kv):
    if _unavailable_reason("triton", torch.device("cuda"), fp8=True):
        pytest.skip(_unavailable_reason("triton", torch.device("cuda"), fp8=True))
    batch = gpu_batch(64 if h_q <= 32 else 24, s_q, h_q, h_kv, q_dtype, descales, causal, seed=200 + s_q + h_q)
    out, lse = run(batch, num_sms=None, backend="triton")
    assert out.device.type == "cuda"
    check(batch, out, lse, f"triton {q_dtype} s_q={s_q} h_q={h_q} h_kv={h_kv} causal={causal}",
          ref=gpu_reference(batch))


def cuda_fp8_or_skip():
    reason = _unavailable_reason("cuda", torch.device("cuda"), fp8=True)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("q_dtype,descales", [(FP8, (0.01, 37.0)), (FP8, (1.0, 1.0)), (FP8, (37.0, 0.01)),
                                              (BF16, (None, 0.01)), (FP16, (None, 37.0))],
                         ids=["fp8-q", "fp8-q-unit", "fp8-q-inverse", "bf16-q", "fp16-q"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("s_q,h_q,h_kv", [(1, 16, 1), (2, 64, 1), (1, 128, 1), (2, 128, 1), (4, 32, 2), (8, 16, 1),
                                          (3, 64, 2)])
def test_gpu_cuda_matches_reference(q_dtype, descales, causal, s_q, h_q, h_kv):
    """The Hopper kernel: ragged lengths with splits (4097 keys over 132 SMs), NaN / +-448 codes past every end."""
    cuda_fp8_or_skip()
    batch = gpu_batch(64 if h_q <= 32 else 24, s_q, h_q, h_kv, q_dtype, descales, causal, seed=300 + s_q + h_q)
    out, lse = run(batch, num_sms=None, backend="cuda")
    check(batch, out, lse, f"cuda {q_dtype} s_q={s_q} h_q={h_q} h_kv={h_kv} causal={causal}",
          ref=gpu_reference(batch))
    auto = run(batch, num_sms=None)             # automatic choice: cuda on Hopper
    assert torch.equal(auto[0], out) and torch.equal(auto[1], lse)
    again = run(batch, num_sms=None, backend="cuda")
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)      # deterministic


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_sms", [1, 7, 132])
@pytest.mark.parametrize("h_q", [32, 128])
def test_gpu_cuda_ragged_lengths_and_sink(num_sms, h_q):
    """Every length around the page edges, few and many SM parts (unsplit and split), with an attention sink; one
    row tile and four. With one SM part a CTA walks every piece (odd page counts, L = 0 rows between), so the
    widening warpgroup's barriers change phase across pieces and buffers as the computing warpgroups' do."""
    cuda_fp8_or_skip()
    lengths = [0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 640, 1000, 2049]
    batch = make(lengths, 2, h_q, 1, FP8, (0.01, 37.0), True, seed=310 + num_sms + h_q, device="cuda")
    sink = torch.randn(h_q, device="cuda") * 2
    out, lse = run(batch, num_sms=num_sms, backend="cuda", attn_sink=sink)
    check(batch, out, lse, f"cuda ragged num_sms={num_sms} h_q={h_q}", attn_sink=sink,
          ref=reference_for(batch.dequantized(), None, attn_sink=sink, on_device=True))


_TRANSPOSED_SHAPES = [(1, 16, 1, False), (2, 8, 1, True), (4, 8, 2, True), (1, 8, 2, False), (3, 4, 1, True),
                      (1, 1, 1, False), (2, 16, 1, True), (1, 32, 1, False), (4, 16, 2, True), (3, 8, 1, True),
                      (1, 20, 1, False)]    # (s_q, h_q, h_kv, causal)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_sms", [1, 7, 132])
@pytest.mark.parametrize("s_q,h_q,h_kv,causal,q_dtype",
                         [pytest.param(*shape, FP8, id="fp8-q-{}-{}-{}-{}".format(*shape))
                          for shape in _TRANSPOSED_SHAPES] +
                         [pytest.param(*shape, q_dtype, id=f"{name}-" + "{}-{}-{}-{}".format(*shape))
                          for q_dtype, name in ((BF16, "bf16-q"), (FP16, "fp16-q"))
                          for shape in _TRANSPOSED_SHAPES])
def test_gpu_cuda_transposed_kernel(num_sms, s_q, h_q, h_kv, causal, q_dtype):
    """At most 32 packed query rows per KV head with an fp8, bf16 or fp16 q (a 16-bit q's Q tiles cut into three
    e4m3 terms, in two S tiles above 16 rows): the transposed kernel (csrc/kernels/transposed_*.h; its 16-row tile at
    16, 12, 4 and 1 rows, its 32-row tile at 32, 24 and 20, causal across s_q tokens, two KV heads). One SM part walks
    every piece (the producer's ring and Q slots wrap, the two warpgroups' page parity changes across pieces, L = 0
    rows merge nothing), 7 and 132 cut sequences into split pieces; NaN / +-448 codes past every end, outputs from
    NaN-poisoned memory, an attention sink."""
    cuda_fp8_or_skip()
    lengths = [0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 640, 1000, 2049, 0]
    descales = (0.01, 37.0) if q_dtype == FP8 else (None, 1.0)
    batch = make(lengths, s_q, h_q, h_kv, q_dtype, descales, causal, seed=330 + num_sms + 10 * s_q + h_q + h_kv,
                 device="cuda")
    sink = torch.randn(h_q, device="cuda") * 2
    md, _ = plan(batch, num_sms)
    poison_cuda_allocator(2 * (len(lengths) + md.shape[0]) * h_kv * rows_of(batch) * 512 * 4 +
                          len(lengths) * s_q * h_q * 512 * 2)
    out, lse = run(batch, num_sms=num_sms, backend="cuda", attn_sink=sink)
    check(batch, out, lse, f"cuda transposed num_sms={num_sms} s_q={s_q} h_q={h_q} h_kv={h_kv} causal={causal}",
          attn_sink=sink, ref=reference_for(batch.dequantized(), None, attn_sink=sink, on_device=True))
    again = run(batch, num_sms=num_sms, backend="cuda", attn_sink=sink)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)      # deterministic


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("q_dtype", [BF16, FP16], ids=["bf16-q", "fp16-q"])
@pytest.mark.parametrize("s_q,h_q", [(1, 16), (2, 16)])
def test_gpu_cuda_transposed_kernel_nan_and_inf_in_q(q_dtype, s_q, h_q):
    """A 16-bit q's three e4m3 terms take one scale per tile (the KV head's rows of one sequence;
    tests/test_q_terms.py): a NaN in q leaves the maximum alone and stays in its own row; an infinity makes the scale
    infinite and every row of that tile NaN, out and lse. Other sequences are bit for bit those of the same call
    without it."""
    cuda_fp8_or_skip()
    batch = make([65, 200, 130], s_q, h_q, 1, q_dtype, (None, 1.0), False, seed=340 + s_q, device="cuda")
    clean_out, clean_lse = run(batch, num_sms=7, backend="cuda")
    assert torch.isfinite(clean_out).all() and torch.isfinite(clean_lse).all()
    for bad in (float("nan"), float("inf")):
        q = batch.q.clone()
        batch.q[1, s_q - 1, 3, 10] = bad
        out, lse = run(batch, num_sms=7, backend="cuda")
        batch.q.copy_(q)
        for seq in (0, 2):
            assert torch.equal(out[seq], clean_out[seq]) and torch.equal(lse[seq], clean_lse[seq]), (bad, seq)
        if bad != bad:    # NaN: only its row (token s_q - 1, head 3)
            assert torch.isnan(out[1, s_q - 1, 3]).all() and torch.isnan(lse[1, 3, s_q - 1])
            keep = torch.ones(s_q, h_q, dtype=torch.bool, device="cuda")
            keep[s_q - 1, 3] = False
            assert torch.equal(out[1][keep], clean_out[1][keep])
        else:
            assert torch.isnan(out[1]).all() and torch.isnan(lse[1]).all()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("q_dtype,descales", [(FP8, (0.01, 37.0)), (BF16, (None, 0.01)), (FP16, (None, 37.0))],
                         ids=["fp8-q", "bf16-q", "fp16-q"])
@pytest.mark.parametrize("s_q,h_q", [(1, 128), (2, 160)])
def test_gpu_cuda_out_staged_in_page_buffers(q_dtype, descales, s_q, h_q):
    """Two SM parts each walking whole sequences of 1 to 6 pages: with 128 query heads or more the bf16 out of an
    e4m3 or bf16 q goes through the V half of each piece's last page buffer and TMA stores before that half is
    refilled (epilogue.h), an fp16 out by registers; h_q 160 has a partial row tile."""
    cuda_fp8_or_skip()
    lengths = [1, 63, 64, 65, 127, 128, 129, 191, 192, 257, 0, 320] * 2
    batch = make(lengths, s_q, h_q, 1, q_dtype, descales, False, seed=320 + s_q + h_q, device="cuda")
    out, lse = run(batch, num_sms=2 * -(-s_q * h_q // 64), backend="cuda")
    check(batch, out, lse, f"cuda staged {q_dtype} s_q={s_q} h_q={h_q}", ref=gpu_reference(batch))


@pytest.mark.gpu
@needs_cuda
def test_gpu_cuda_rejects_bad_input_before_the_kernel():
    """The binding's own checks (direct callers of the extension) mirror the Python validation."""
    cuda_fp8_or_skip()
    from flash_mla.backends import cuda_extension
    batch = gpu_batch(4, 1, 16, 1, FP8, (1.0, 1.0), False, seed=320)
    md, ns = plan(batch)
    args = (batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512, md, ns, 576 ** -0.5, False, None)
    ext = cuda_extension()
    with pytest.raises(RuntimeError, match="descale_k"):
        ext.mla_decode(*args, batch.descale_q, None)
    with pytest.raises(RuntimeError, match="descale_q"):
        ext.mla_decode(*args, batch.descale_q.view(1, 1), batch.descale_k)
    with pytest.raises(RuntimeError, match="descale_k"):
        ext.mla_decode(*args, batch.descale_q, batch.descale_k.double())
    with pytest.raises(RuntimeError, match="q: expected dtype"):
        ext.mla_decode(batch.q, batch.k_cache.view(torch.uint8), *args[2:], batch.descale_q, batch.descale_k)


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_gpu_cuda_graph_replay_with_new_inputs_and_scales():
    """Capture the fp8 call once; write a new q, a new cache and new scales into the captured tensors and replay:
    the result follows them (the kernel reads the descales from device memory at every replay)."""
    if _unavailable_reason("triton", torch.device("cuda"), fp8=True):
        pytest.skip(_unavailable_reason("triton", torch.device("cuda"), fp8=True))
    batch = gpu_batch(16, 2, 64, 1, FP8, (0.01, 37.0), True, seed=220)
    md, ns = plan(batch)

    def step():
        return flash_mla_with_kvcache_fp8(*batch.args(), 512, md, ns, None, True, descale_q=batch.descale_q,
                                          descale_k=batch.descale_k)

    graph, eager, (g_out, g_lse) = capture_cuda_graph(step)
    check(batch, *eager, "eager before capture", ref=gpu_reference(batch))
    g_out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, eager[0]) and torch.equal(g_lse, eager[1])

    # the next step: same lengths (so the same plan), other pages, values and scales, written in place
    other = make([GPU_LENGTHS[i % len(GPU_LENGTHS)] for i in range(16)], 2, 64, 1, FP8, (37.0, 0.01), True,
                 seed=221, device="cuda")
    for name in ("q", "k_cache", "block_table", "descale_q", "descale_k"):
        getattr(batch, name).copy_(getattr(other, name))
    graph.replay()
    torch.cuda.synchronize()
    check(batch, g_out, g_lse, "CUDA graph replay, new q / cache / scales", ref=gpu_reference(batch))
    assert not torch.equal(g_out, eager[0])


@pytest.mark.gpu
@needs_cuda
def test_gpu_quantize_helpers_capture_in_a_graph():
    """No host synchronisation in the helpers: they capture in a CUDA graph and replay on new data."""
    x = torch.randn(4, 64, 1, 576, device="cuda", dtype=BF16)
    quantize_kv_cache_fp8(x)                   # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        stored, descale = quantize_kv_cache_fp8(x)
    x.mul_(3)
    graph.replay()
    expected_stored, expected_descale = quantize_kv_cache_fp8(x)
    assert torch.equal(descale, expected_descale)
    assert torch.equal(stored.view(torch.uint8), expected_stored.view(torch.uint8))


@pytest.mark.gpu
@needs_cuda
@needs_triton
@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_gpu_compile_matches_eager(compile_backend):
    if _unavailable_reason("triton", torch.device("cuda"), fp8=True):
        pytest.skip(_unavailable_reason("triton", torch.device("cuda"), fp8=True))
    torch._dynamo.reset()
    compiled = torch.compile(fp8_step, backend=compile_backend, fullgraph=True)
    batch = gpu_batch(8, 2, 64, 1, FP8, (0.01, 37.0), True, seed=230)
    args = (*batch.args(), batch.descale_q, batch.descale_k)
    for i, (x, y) in enumerate(zip(compiled(*args), fp8_step(*args))):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=f"{compile_backend} output {i}")
    torch._dynamo.reset()


def test_public_names():
    for name in ("flash_mla_with_kvcache_fp8", "quantize_kv_cache_fp8", "quantize_q_fp8"):
        assert name in flash_mla.__all__ and callable(getattr(flash_mla, name))
    import inspect
    params = list(inspect.signature(flash_mla_with_kvcache_fp8).parameters)
    assert params == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v", "tile_scheduler_metadata",
                      "num_splits", "softmax_scale", "causal", "descale_q", "descale_k"]
    kvcache = inspect.signature(flash_mla_with_kvcache).parameters
    assert list(kvcache)[:16] == ["q", "k_cache", "block_table", "cache_seqlens", "head_dim_v",
                                  "tile_scheduler_metadata", "num_splits", "softmax_scale", "causal",
                                  "is_fp8_kvcache", "indices", "attn_sink", "extra_k_cache",
                                  "extra_indices_in_kvcache", "topk_length", "extra_topk_length"]
    for name in ("descale_q", "descale_k", "backend"):
        assert kvcache[name].kind is inspect.Parameter.KEYWORD_ONLY and kvcache[name].default is None
