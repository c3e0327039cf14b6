"""Value checks every decoding call with CPU tensors makes, without FLASH_MLA_DEBUG.

On the CPU reading a tensor costs nothing, so every flash_mla_with_kvcache / flash_mla_with_kvcache_fp8 call (and
torch.ops.flash_mla.mla_decode in eager mode) on CPU tensors checks, before any work:
  * cache_seqlens[i] >= 0 and <= block_table.shape[1] * 64;
  * every block_table entry a length reaches (block_table[i, :ceil(L_i / 64)]) in [0, num_blocks).
A failure is a ValueError naming the function, the argument, the row and the bad value; no backend runs, no input
changes and a lazy schedule stays unplanned. Entries past a sequence's last page are never checked (nor read).

Covered: the classic plan and the lazy schedule (fresh, and planned by an earlier call), a bf16 cache and an fp8
one (quantize_kv_cache_fp8 / quantize_q_fp8), both public functions and the torch.library op, on the cpu backend
and on the triton backend in Triton's interpreter. TRITON_INTERPRET=1 must be set before triton is imported, so
this module sets it first (as tests/test_triton_backend.py does); should triton already have been imported in
compiled mode, test_subprocess_runs_interpreter_tests runs the triton cases in a fresh Python.
"""
import importlib
import os
import re
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
# The interpreter can run in this process unless triton was imported before TRITON_INTERPRET was set.
INTERPRETER_HERE = HAS_CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import flash_mla.cpu_backend  # noqa: E402
from flash_mla import (  # noqa: E402
    MLASchedule, _validation, flash_mla_with_kvcache, flash_mla_with_kvcache_fp8, get_mla_metadata, ops,
    quantize_kv_cache_fp8, quantize_q_fp8)
from flash_mla.backends import ENV_VAR  # noqa: E402
from flash_mla.testing import DecodeBatch, assert_close, compare, make_decode_batch, reference_for  # noqa: E402

try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

pytestmark = pytest.mark.usefixtures("one_torch_thread", "default_environment")

interpreter = pytest.mark.skipif(HAS_CUDA or not INTERPRETER_HERE or not HAS_TRITON,
                                 reason="CPU-only interpreter test (needs triton; when triton was imported before "
                                        "TRITON_INTERPRET was set, test_subprocess_runs_interpreter_tests runs it)")
BACKENDS = [pytest.param("cpu"), pytest.param("triton", marks=interpreter)]
KINDS = ["bf16", "fp8"]
# (function, schedule): flash_mla_with_kvcache with either schedule, flash_mla_with_kvcache_fp8 (fp8 only) with
# either, and the torch.library op (classic plan only: the op never sees a schedule)
FORMS = [("kvcache", "classic"), ("kvcache", "lazy"), ("kvcache_fp8", "classic"), ("kvcache_fp8", "lazy"),
         ("op", "classic")]
CALLS = [pytest.param(kind, fn, sched, id=f"{kind}-{fn}-{sched}")
         for kind in KINDS for fn, sched in FORMS if kind == "fp8" or fn != "kvcache_fp8"]
FN_NAME = {"kvcache": "flash_mla_with_kvcache", "kvcache_fp8": "flash_mla_with_kvcache_fp8",
           "op": "flash_mla_with_kvcache"}     # the op's messages use the public function's name
H_Q = 16
SCALE = 576 ** -0.5


class Case:
    """One small batch (h_q 16, h_kv 1, s_q 1) as a call takes it, bf16 or fp8 (q and cache quantised)."""

    def __init__(self, kind, lengths, seed=0):
        base = make_decode_batch(lengths, h_q=H_Q, causal=True, generator=torch.Generator().manual_seed(seed))
        self.kind = kind
        if kind == "fp8":
            self.q, self.descale_q = quantize_q_fp8(base.q)
            self.k_cache, self.descale_k = quantize_kv_cache_fp8(base.k_cache)
        else:
            self.q, self.k_cache, self.descale_q, self.descale_k = base.q, base.k_cache, None, None
        self.block_table, self.cache_seqlens = base.block_table, base.cache_seqlens

    @property
    def num_blocks(self):
        return self.k_cache.shape[0]

    def reference(self):
        """float32 reference on the true (dequantised) values."""
        q, k = self.q, self.k_cache
        if self.kind == "fp8":
            q, k = q.float() * self.descale_q, k.float() * self.descale_k
        return reference_for(DecodeBatch(q=q, k_cache=k, block_table=self.block_table,
                                         cache_seqlens=self.cache_seqlens, causal=True))

    def tensors(self):
        return dict(q=self.q, k_cache=self.k_cache, block_table=self.block_table, cache_seqlens=self.cache_seqlens,
                    descale_q=self.descale_q, descale_k=self.descale_k)


def snapshot(case):
    """The bytes of every input tensor (bitwise: the caches hold NaN past each sequence's end)."""
    return {k: t.detach().clone().view(torch.uint8) for k, t in case.tensors().items() if t is not None}


def assert_unchanged(case, before):
    after = snapshot(case)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), f"{k} was modified"


def call(case, fn, schedule, backend, monkeypatch):
    """One decoding call in the given form; `schedule`: an MLASchedule, or None to plan classically here."""
    if schedule is None:
        # planned from the call's own lengths where get_mla_metadata takes them (it rejects negative ones itself)
        md, ns = get_mla_metadata(case.cache_seqlens.clamp_min(0), H_Q, 1)
    else:
        md, ns = schedule, None
    args = (case.q, case.k_cache, case.block_table, case.cache_seqlens, 512, md, ns)
    if fn == "kvcache":
        return flash_mla_with_kvcache(*args, causal=True, is_fp8_kvcache=case.kind == "fp8", backend=backend,
                                      descale_q=case.descale_q, descale_k=case.descale_k)
    if fn == "kvcache_fp8":
        monkeypatch.setenv(ENV_VAR, backend)                     # the fp8 function takes no backend keyword
        return flash_mla_with_kvcache_fp8(*args, causal=True, descale_q=case.descale_q, descale_k=case.descale_k)
    assert fn == "op" and schedule is None
    return torch.ops.flash_mla.mla_decode(*args, SCALE, True, backend, None, case.descale_q, case.descale_k)


def forbid_backends(monkeypatch):
    """Make every backend's entry point fail the test: a rejected call must not reach one."""
    def ran(*args, **kwargs):
        raise AssertionError("a backend ran although the call's values are bad")
    monkeypatch.setattr(flash_mla.cpu_backend, "mla_decode_cpu", ran)
    if HAS_TRITON:
        monkeypatch.setattr(importlib.import_module("flash_mla.triton_backend"), "mla_decode_triton", ran)


def skip_without_ops(fn):
    if fn == "op" and not ops.AVAILABLE:
        pytest.skip("torch.library.custom_op needs torch >= 2.4")


# ---------------------------------------------------------------------------------------------------------------
# bad values: ValueError naming the function, the argument, the row and the value, before any work
# ---------------------------------------------------------------------------------------------------------------

LENGTHS = [5, 130, 0]          # 1 page, 3 pages, an empty row (its block-table row all -1); block_table has 3 columns


def _negative_length(case):
    case.cache_seqlens[1] = -3
    return r"cache_seqlens[1]", "a length >= 0", "-3"


def _longer_than_the_table(case):
    case.cache_seqlens[2] = 3 * 64 + 1                          # the empty row, now past its block-table row
    return r"cache_seqlens[2]", "at most block_table.shape[1] * 64 = 192 tokens", "193"


def _block_id_num_blocks(case):
    case.block_table[1, 2] = case.num_blocks                    # the last of sequence 1's three pages
    return "block_table[1, 2]", f"a block index in [0, {case.num_blocks})", str(case.num_blocks)


def _block_id_minus_one_reached(case):
    case.block_table[1, 1] = -1                                 # a page sequence 1's 130 tokens read
    return "block_table[1, 1]", f"a block index in [0, {case.num_blocks})", "-1"


def _minus_one_padding_reached_by_a_length(case):
    case.cache_seqlens[2] = 1                                   # the empty row's -1 padding is now read
    return "block_table[2, 0]", f"a block index in [0, {case.num_blocks})", "-1"


def _block_id_int_min(case):
    case.block_table[0, 0] = -2 ** 31
    return "block_table[0, 0]", f"a block index in [0, {case.num_blocks})", str(-2 ** 31)


BAD = [_negative_length, _longer_than_the_table, _block_id_num_blocks, _block_id_minus_one_reached,
       _minus_one_padding_reached_by_a_length, _block_id_int_min]


def expect_rejected(case, fn, schedule, backend, monkeypatch, arg, expected, got):
    before = snapshot(case)
    pattern = rf"^{FN_NAME[fn]}: {re.escape(arg)}: expected {re.escape(expected)}.*, got {re.escape(got)}$"
    with pytest.raises(ValueError, match=pattern):
        call(case, fn, schedule, backend, monkeypatch)
    assert_unchanged(case, before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,fn,sched", CALLS)
@pytest.mark.parametrize("bad", BAD, ids=lambda f: f.__name__.strip("_"))
def test_bad_values_are_rejected_before_any_work(monkeypatch, bad, kind, fn, sched, backend):
    skip_without_ops(fn)
    case = Case(kind, LENGTHS)
    arg, expected, got = bad(case)
    forbid_backends(monkeypatch)
    schedule = MLASchedule() if sched == "lazy" else None
    expect_rejected(case, fn, schedule, backend, monkeypatch, arg, expected, got)
    if schedule is not None:
        assert not schedule.have_initialized, "a rejected first call planned the schedule"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_bad_values_on_a_planned_schedule(monkeypatch, kind, backend):
    """A later layer's call with a schedule an earlier call planned: the same checks; the plan stays as it was."""
    fn = "kvcache_fp8" if kind == "fp8" else "kvcache"
    case = Case(kind, LENGTHS)
    schedule = MLASchedule()
    call(case, fn, schedule, backend, monkeypatch)
    plan = schedule.tile_scheduler_metadata.clone(), schedule.num_splits.clone()
    forbid_backends(monkeypatch)
    for bad in BAD:
        case = Case(kind, LENGTHS)
        arg, expected, got = bad(case)
        expect_rejected(case, fn, schedule, backend, monkeypatch, arg, expected, got)
        assert torch.equal(schedule.tile_scheduler_metadata, plan[0]) and torch.equal(schedule.num_splits, plan[1])


def test_the_checks_do_not_depend_on_debug_mode(monkeypatch):
    """With FLASH_MLA_DEBUG=0 (or unset, as in every other test here) CPU calls are checked all the same."""
    monkeypatch.setenv(_validation.DEBUG_ENV_VAR, "0")
    case = Case("bf16", LENGTHS)
    arg, expected, got = _block_id_minus_one_reached(case)
    expect_rejected(case, "kvcache", None, "cpu", monkeypatch, arg, expected, got)


def test_debug_mode_runs_the_same_bounds_check(monkeypatch):
    """One function checks the bounds: every CPU call runs it, and debug mode (on any device) runs it first."""
    seen = []
    real = _validation.check_cache_bounds

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fn", args[3] if len(args) > 3 else None))
        return real(*args, **kwargs)

    monkeypatch.setattr(_validation, "check_cache_bounds", spy)
    case = Case("bf16", LENGTHS)
    call(case, "kvcache", None, "cpu", monkeypatch)
    assert seen == ["flash_mla_with_kvcache"]
    monkeypatch.setenv(_validation.DEBUG_ENV_VAR, "1")
    call(case, "kvcache", None, "cpu", monkeypatch)
    assert seen == ["flash_mla_with_kvcache"] * 2
    # CUDA tensors: only in debug mode (the check reads the tensors, a host synchronisation there)
    cuda = torch.device("cuda")
    assert _validation.bounds_checked(cuda)
    monkeypatch.setenv(_validation.DEBUG_ENV_VAR, "0")
    assert not _validation.bounds_checked(cuda) and _validation.bounds_checked(torch.device("cpu"))


def test_check_cache_bounds_is_vectorised():
    """No Python loop over the batch when the values are good: a batch of 100000 sequences checks quickly, and a
    bad entry deep in it is still named exactly."""
    b, pages = 100_000, 4
    k_cache = torch.empty(1, 64, 1, 576, dtype=torch.bfloat16).expand(2 * b, -1, -1, -1)   # only its shape counts
    lengths = torch.arange(b, dtype=torch.int32) % (pages * 64 + 1)
    block_table = torch.arange(b * pages, dtype=torch.int32).reshape(b, pages) % (2 * b)
    block_table[lengths <= 64, 1:] = -1                       # padding past the last page of short sequences
    _validation.check_cache_bounds(k_cache, block_table, lengths)
    row = 302 * (pages * 64 + 1) + pages * 64                # a sequence of 256 tokens: all four pages read
    block_table[row, 3] = 2 * b
    with pytest.raises(ValueError, match=rf"^f: block_table\[{row}, 3\]: .*which has 256 tokens, got {2 * b}$"):
        _validation.check_cache_bounds(k_cache, block_table, lengths, "f")


# ---------------------------------------------------------------------------------------------------------------
# good values: padding past each sequence's pages is never checked, and the result is right
# ---------------------------------------------------------------------------------------------------------------

GOOD_LENGTHS = [65, 192, 0]    # 2 of 3 pages, exactly the table's capacity, an empty row


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,fn,sched", CALLS)
@pytest.mark.parametrize("garbage", [-1, 2 ** 31 - 1, -2 ** 31, "num_blocks"])
def test_entries_past_the_last_page_are_accepted(monkeypatch, garbage, kind, fn, sched, backend):
    skip_without_ops(fn)
    case = Case(kind, GOOD_LENGTHS, seed=1)
    value = case.num_blocks if garbage == "num_blocks" else garbage
    case.block_table[0, 2] = value                            # past sequence 0's two pages
    case.block_table[2, :] = value                            # the L = 0 row: nothing is read
    before = snapshot(case)
    schedule = MLASchedule() if sched == "lazy" else None
    out, lse = call(case, fn, schedule, backend, monkeypatch)
    assert_unchanged(case, before)
    assert (out[2] == 0).all() and torch.isneginf(lse[2]).all()
    assert_close(compare(out, lse, *case.reference()), torch.bfloat16, f"{kind} {fn} {sched} {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
def test_all_empty_rows_with_minus_one_tables(monkeypatch, kind, backend):
    case = Case(kind, [0, 0])
    assert (case.block_table == -1).all()
    out, lse = call(case, "kvcache", MLASchedule(), backend, monkeypatch)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.skipif(HAS_CUDA or INTERPRETER_HERE or not HAS_TRITON,
                    reason="the interpreter tests run in this process (or need triton)")
def test_subprocess_runs_interpreter_tests():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                             "-k", "triton and not subprocess"], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]
