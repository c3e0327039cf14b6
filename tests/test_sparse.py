"""Sparse FP8 decoding (DeepSeek-V3.2): flash_mla_with_kvcache(..., is_fp8_kvcache=True, indices=...).

On the CPU: the cpu backend through the public API, in both schedule forms (lazy get_mla_metadata() and the classic
get_mla_metadata(..., topk=topk)), against the float32 reference flash_mla.sparse_decode_reference on the
dequantised tokens (out rel-L2 < 1e-2, lse abs < 1e-3); every cache token no counted index slot names is filled
with NaN bytes (e4m3 NaN 0xFF / 0x7F, NaN scales, NaN RoPE), so a token read by mistake shows up; outputs are
poisoned with NaN (`nan_empty`). Ragged topk_length, -1 slots, repeated indices, page boundaries, h_q 16 / 64 /
128, s_q 1 / 2, attn_sink with +-inf, several plans (split independence), page sizes 64, 16 and 1, fp16 q, the
uint8 and float8_e4m3fn views of the cache; every validation error with nothing planned or written; the
quantiser's round trip; the custom op (opcheck) and torch.compile(fullgraph=True).

The triton backend: under TRITON_INTERPRET=1 on CPU tensors (set before triton is imported, as
tests/test_triton_backend.py does; in a fresh Python when triton was imported compiled earlier in the session),
and on CUDA tensors with a GPU (the same cases and a CUDA-graph replay with new indices written in place). Both
skip while flash_mla/triton_sparse.py is absent.
"""
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace
from typing import Optional

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
INTERPRETER_HERE = HAS_CUDA or "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"     # before triton is imported (see the module docstring)

import flash_mla  # noqa: E402
from flash_mla import (  # noqa: E402
    dequantize_kv_cache_v32, flash_mla_with_kvcache, get_mla_metadata, ops, quantize_kv_cache_v32,
    sparse_decode_reference)
from flash_mla._geometry import SPARSE_PLAN  # noqa: E402
from flash_mla.scheduler import get_mla_metadata_twin, num_sm_parts_for  # noqa: E402
from flash_mla.sparse_fp8 import (  # noqa: E402
    NUM_SCALES, ROPE_OFFSET, SCALE_GROUP, SCALES_OFFSET, TOKEN_BYTES, valid_index_mask)
from flash_mla.testing import (  # noqa: E402
    SPARSE_OUT_TOL, assert_sparse_close, capture_cuda_graph, make_attn_sink, sparse_fp16_key_lse_bound)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_TRITON_SPARSE = os.path.exists(os.path.join(ROOT, "flash_mla", "triton_sparse.py"))
try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
needs_triton_sparse_file = pytest.mark.skipif(
    not HAS_TRITON_SPARSE, reason="the Triton sparse kernel flash_mla/triton_sparse.py is not in this tree")


def needs_triton_sparse(test):
    return needs_triton(needs_triton_sparse_file(test))


needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
interpreter = pytest.mark.skipif(HAS_CUDA or not INTERPRETER_HERE,
                                 reason="CPU-only interpreter test; when triton was imported before "
                                        "TRITON_INTERPRET was set, test_subprocess_runs_interpreter_tests runs it")
pytestmark = pytest.mark.usefixtures("one_torch_thread", "default_environment")

FN = "flash_mla_with_kvcache"
H100_SMS = 132


# ---- batches ---------------------------------------------------------------------------------------------------

@dataclass
class SparseBatch:
    q: torch.Tensor                       # (b, s_q, h_q, 576) bf16 / fp16
    k_cache: torch.Tensor                 # (num_blocks, page_block_size, 1, 656) uint8
    indices: torch.Tensor                 # (b, s_q, topk) int32
    topk_length: Optional[torch.Tensor]   # (b,) int32 or None

    @property
    def topk(self) -> int:
        return self.indices.shape[2]

    def to(self, device) -> "SparseBatch":
        tl = None if self.topk_length is None else self.topk_length.to(device)
        return SparseBatch(self.q.to(device), self.k_cache.to(device), self.indices.to(device), tl)


def poison_unreferenced(k_cache: torch.Tensor, indices: torch.Tensor, topk_length) -> int:
    """Fill every token no counted slot names with NaN bytes, three patterns in turn: all 0xFF (e4m3, float32 and
    bf16 NaN); latent 0x7F (e4m3 NaN) with NaN scales and NaN RoPE; finite latent with +inf scales (inf * 0 and
    inf - inf are NaN). Returns how many tokens were poisoned."""
    raw = k_cache.view(-1, TOKEN_BYTES)
    valid = valid_index_mask(indices, topk_length)
    referenced = torch.zeros(raw.shape[0], dtype=torch.bool, device=raw.device)
    referenced[indices[valid].long()] = True
    garbage = (~referenced).nonzero().flatten()
    nan32 = torch.tensor([math.nan] * NUM_SCALES, dtype=torch.float32, device=raw.device).view(torch.uint8)
    inf32 = torch.tensor([math.inf] * NUM_SCALES, dtype=torch.float32, device=raw.device).view(torch.uint8)
    nan16 = torch.full((64,), math.nan, dtype=torch.bfloat16, device=raw.device).view(torch.uint8)
    for k in range(3):
        rows = garbage[k::3]
        if k == 0:
            raw[rows] = 0xFF
        elif k == 1:
            raw[rows, :SCALES_OFFSET] = 0x7F
            raw[rows, SCALES_OFFSET:ROPE_OFFSET] = nan32
            raw[rows, ROPE_OFFSET:] = nan16
        else:
            raw[rows, SCALES_OFFSET:ROPE_OFFSET] = inf32
    return int(garbage.numel())


def make_sparse_batch(b=4, s_q=2, h_q=16, topk=130, num_blocks=24, page=64, topk_length=None,
                      dtype=torch.bfloat16, seed=0, minus_one=0.1, unique=True, garbage_past_length=True,
                      edit=None, device="cpu") -> SparseBatch:
    """Random tokens (latent groups of different magnitudes, so the 4 scales differ), each (row, query token)
    naming `topk` random tokens (distinct when `unique`), a fraction `minus_one` of slots -1, slots past
    topk_length[i] holding garbage (-1, -7, out-of-range and NaN token numbers: never read), and every token no
    counted slot names poisoned (poison_unreferenced). `edit(indices)` changes the indices in place first."""
    g = torch.Generator().manual_seed(seed)
    tokens = num_blocks * page
    x = torch.randn(num_blocks, page, 1, 576, generator=g)
    exponent = torch.randint(-2, 3, (num_blocks, page, 1, NUM_SCALES), generator=g).float()
    x[..., :512] *= (2.0 ** exponent).repeat_interleave(SCALE_GROUP, dim=-1)
    k_cache = quantize_kv_cache_v32(x)
    if unique:
        assert topk <= tokens
        indices = torch.stack([torch.randperm(tokens, generator=g)[:topk] for _ in range(b * s_q)])
    else:
        indices = torch.randint(0, tokens, (b * s_q, topk), generator=g)
    indices = indices.view(b, s_q, topk).int()
    indices[torch.rand(b, s_q, topk, generator=g) < minus_one] = -1
    if edit is not None:
        edit(indices)
    tl = None
    if topk_length is not None:
        tl = torch.tensor(topk_length, dtype=torch.int32)
        past = torch.arange(topk).view(1, 1, -1) >= tl.view(-1, 1, 1)
        if garbage_past_length:
            junk = torch.tensor([-1, -7, tokens, 2 ** 30, 0], dtype=torch.int32)
            indices[past.expand_as(indices)] = junk[torch.arange(int(past.expand_as(indices).sum())) % 5]
    poison_unreferenced(k_cache, indices, tl)
    q = torch.randn(b, s_q, h_q, 576, generator=g).to(dtype)
    return SparseBatch(q, k_cache, indices, tl).to(device)


# ---- running and checking -------------------------------------------------------------------------------------

def plan_classic(batch: SparseBatch, num_sms=None):
    b, s_q, h_q, _ = batch.q.shape
    cache_seqlens = torch.full((b,), 12345, dtype=torch.int32, device=batch.q.device)   # only its size counts
    kw = {} if num_sms is None else {"num_sms": num_sms}
    return get_mla_metadata(cache_seqlens, s_q * h_q, 1, num_heads_q=h_q, is_fp8_kvcache=True, topk=batch.topk,
                            **kw)


def run(batch: SparseBatch, form="lazy", num_sms=None, softmax_scale=None, attn_sink=None, backend=None,
        k_cache=None, plan=None):
    """The public API: the referee's lazy call, or the classic plan with upstream's keywords."""
    if plan is None:
        plan = plan_classic(batch, num_sms) if form == "classic" else get_mla_metadata(
            **({} if num_sms is None else {"num_sms": num_sms}))
    k_cache = batch.k_cache if k_cache is None else k_cache
    return flash_mla_with_kvcache(batch.q, k_cache, None, None, 512, *plan, softmax_scale, False,
                                  is_fp8_kvcache=True, indices=batch.indices, attn_sink=attn_sink,
                                  topk_length=batch.topk_length, backend=backend)


def reference(batch: SparseBatch, softmax_scale=None, attn_sink=None):
    tl = None if batch.topk_length is None else batch.topk_length.cpu()
    return sparse_decode_reference(batch.q.cpu(), batch.k_cache.cpu(), batch.indices.cpu(), tl, softmax_scale,
                                   None if attn_sink is None else attn_sink.cpu())


def check(batch, out, lse, softmax_scale=None, attn_sink=None, what="", backend=None):
    """`backend` "cuda": the kernel rounds the dequantised keys (and q's latent values) to fp16, so lse may also move
    by the rows' bound."""
    b, s_q, h_q, _ = batch.q.shape
    assert out.shape == (b, s_q, h_q, 512) and out.dtype == batch.q.dtype, what
    assert lse.shape == (b, h_q, s_q) and lse.dtype == torch.float32, what
    ref_out, ref_lse = reference(batch, softmax_scale, attn_sink)
    bound = None
    if backend == "cuda":
        bound = sparse_fp16_key_lse_bound(batch.q, batch.k_cache, batch.indices, batch.topk_length, softmax_scale)
    assert_sparse_close(out, lse, ref_out, ref_lse, what, lse_bound=bound)
    return ref_out, ref_lse


# ---- the cpu backend against the reference --------------------------------------------------------------------

RAGGED = [0, 1, 63, 64, 65, 130]          # topk_length per row: empty, one slot, page boundaries +-1, full


@pytest.mark.parametrize("form", ["lazy", "classic"])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("h_q", [16, 64, 128])
def test_matches_reference(nan_empty, h_q, s_q, form):
    batch = make_sparse_batch(b=len(RAGGED), s_q=s_q, h_q=h_q, topk=130, topk_length=RAGGED,
                              seed=100 * s_q + h_q)
    out, lse = run(batch, form)
    ref_out, _ = check(batch, out, lse, what=f"h_q={h_q} s_q={s_q} {form}")
    assert (ref_out[0] == 0).all() and (ref_out[1:] != 0).any()            # the topk_length = 0 row


def test_without_topk_length_and_custom_scale(nan_empty):
    batch = make_sparse_batch(b=3, s_q=2, h_q=16, topk=200, seed=1)
    for form in ("lazy", "classic"):
        out, lse = run(batch, form, softmax_scale=0.07)
        check(batch, out, lse, softmax_scale=0.07, what=form)


@pytest.mark.parametrize("h_q", [16, 128])
def test_minus_one_slots(nan_empty, h_q):
    """A row all -1 (out 0, lse -inf), trailing -1 and interleaved -1, with and without topk_length (h_q 128: two row
    tiles per query token, four per row, on the Hopper kernel)."""
    def edit(indices):
        indices[0] = -1                                     # nothing to attend to, in both query tokens
        indices[1, :, 70:] = -1                             # trailing
        indices[2, :, ::2] = -1                             # interleaved
        indices[3, 1, :] = -1                               # one query token of a row
    batch = make_sparse_batch(b=4, s_q=2, h_q=h_q, topk=140, seed=2, minus_one=0.0, edit=edit)
    for tl in (None, torch.tensor([140, 100, 77, 140], dtype=torch.int32)):
        batch.topk_length = tl
        out, lse = run(batch, "classic")
        _, ref_lse = check(batch, out, lse, what=f"topk_length={tl}")
        assert torch.isneginf(ref_lse[0]).all() and torch.isneginf(ref_lse[3, :, 1]).all()
        assert torch.isfinite(ref_lse[1:3]).all() and torch.isfinite(ref_lse[3, :, 0]).all()


@pytest.mark.parametrize("h_q", [16, 128])
def test_repeated_indices(nan_empty, h_q):
    """A repeated index is one more key each time: every slot naming token t gives out = V_t exactly (up to the
    output's rounding) and lse = score + log(count)."""
    t = 5 * 64 + 17

    def edit(indices):
        indices[0] = t                                      # all 96 slots the same token
        indices[1, :, ::3] = indices[1, :, 1::3]            # pairs of duplicates among distinct tokens
    batch = make_sparse_batch(b=3, s_q=2, h_q=h_q, topk=96, seed=3, unique=False, minus_one=0.0, edit=edit)
    out, lse = run(batch)
    check(batch, out, lse)
    token = dequantize_kv_cache_v32(batch.k_cache.view(-1, 1, TOKEN_BYTES)[t]).view(576)
    expected = token[:512].expand(2, h_q, 512).to(torch.bfloat16)
    assert torch.equal(out[0], expected)
    score = (batch.q[0].float() @ token) * 576 ** -0.5                                   # (s_q, h_q)
    torch.testing.assert_close(lse[0], (score + math.log(96)).T, atol=1e-4, rtol=0)


@pytest.mark.parametrize("h_q", [16, 128])
def test_page_boundaries(nan_empty, h_q):
    """Tokens at offsets 0 and 63 of many pages, the cache's first and last tokens."""
    pages = torch.arange(20)
    edges = torch.cat([pages * 64, pages * 64 + 63, torch.tensor([0, 20 * 64 - 1])]).int()   # 42 tokens

    def edit(indices):
        indices[:, :, :42] = edges
        indices[1, 1, :42] = edges.flip(0)
    batch = make_sparse_batch(b=2, s_q=2, h_q=h_q, topk=64, num_blocks=20, seed=4, minus_one=0.0, edit=edit)
    out, lse = run(batch)
    check(batch, out, lse)


@pytest.mark.parametrize("form", ["lazy", "classic"])
@pytest.mark.parametrize("h_q", [16, 128])
def test_attn_sink(nan_empty, h_q, form):
    """Sinks +inf (out 0), -inf (no effect), 60, 0 and ordinary values; lse unchanged; rows with no key stay 0."""
    batch = make_sparse_batch(b=len(RAGGED), s_q=2, h_q=h_q, topk=130, topk_length=RAGGED, seed=5 + h_q)
    sink = make_attn_sink(h_q, torch.Generator().manual_seed(h_q))
    out, lse = run(batch, form, num_sms=H100_SMS, attn_sink=sink)
    check(batch, out, lse, attn_sink=sink)
    out_plain, lse_plain = run(batch, form, num_sms=H100_SMS)
    assert torch.equal(lse, lse_plain)
    assert (out[:, :, 0] == 0).all()                                                     # +inf sink
    torch.testing.assert_close(out[:, :, 1], out_plain[:, :, 1], rtol=0, atol=0)         # -inf sink
    seen = torch.isfinite(lse_plain).transpose(1, 2)[:, :, 4:]
    factor = torch.sigmoid(lse_plain.transpose(1, 2)[:, :, 4:] - sink[4:])
    assert (factor[seen] < 0.99).any(), "the sinks hardly change the output: the test would prove nothing"


@pytest.mark.parametrize("h_q", [16, 128])
def test_split_independence(nan_empty, h_q):
    """num_sms 1, 7 and 132: from unsplit rows to rows cut into several pieces (workspace + combine), the same
    answer up to float rounding, for both plans (full topk and topk_length)."""
    lengths = [0, 300, 1, 257, 64, 130]
    batch = make_sparse_batch(b=6, s_q=2, h_q=h_q, topk=300, num_blocks=40, topk_length=lengths, seed=6)
    pieces = {}
    results = {}
    for num_sms in (1, 7, H100_SMS):
        for form in ("lazy", "classic"):
            _, ns = (get_mla_metadata_twin(batch.topk_length, 2 * h_q, 1, num_sms, **SPARSE_PLAN)
                     if form == "lazy" else plan_classic(batch, num_sms))
            pieces[num_sms, form] = ns.diff().max().item()
            results[num_sms, form] = run(batch, form, num_sms=num_sms)
            check(batch, *results[num_sms, form], what=f"num_sms={num_sms} {form}")
    assert pieces[1, "lazy"] == 1 and pieces[H100_SMS, "lazy"] > 2 and pieces[H100_SMS, "classic"] > 2
    base_out, base_lse = results[1, "lazy"]
    for key, (out, lse) in results.items():
        torch.testing.assert_close(out.float(), base_out.float(), atol=2e-2, rtol=2e-2, msg=str(key))
        torch.testing.assert_close(lse, base_lse, atol=1e-5, rtol=1e-5, msg=str(key))


@pytest.mark.parametrize("page", [64, 16, 1])
def test_page_block_sizes(nan_empty, page):
    batch = make_sparse_batch(b=3, s_q=2, h_q=16, topk=90, num_blocks=1536 // page, page=page,
                              topk_length=[90, 0, 33], seed=7 + page)
    assert batch.k_cache.shape == (1536 // page, page, 1, TOKEN_BYTES)
    for form in ("lazy", "classic"):
        check(batch, *run(batch, form), what=f"page {page} {form}")


def test_fp16_q_and_fp8_view_of_the_cache(nan_empty):
    batch = make_sparse_batch(b=3, s_q=1, h_q=64, topk=100, topk_length=[100, 50, 1], dtype=torch.float16,
                              seed=8)
    out, lse = run(batch)
    check(batch, out, lse)
    out8, lse8 = run(batch, k_cache=batch.k_cache.view(torch.float8_e4m3fn))
    assert torch.equal(out, out8) and torch.equal(lse, lse8)


def test_deterministic_and_lazy_schedule_reused(nan_empty):
    batch = make_sparse_batch(b=4, s_q=2, h_q=64, topk=130, topk_length=[130, 5, 0, 64], seed=9)
    schedule, none = get_mla_metadata()
    assert none is None and not schedule.have_initialized
    first = run(batch, plan=(schedule, None))
    assert schedule.have_initialized and schedule.topk == 130 and schedule.shape == (4, 2, 64, 1)
    assert "topk=130" in repr(schedule)
    md, ns = schedule.tile_scheduler_metadata, schedule.num_splits
    assert md.shape == (num_sm_parts_for(H100_SMS, 128, 1), 8) and ns.shape == (5,)
    again = run(batch, plan=(schedule, None))                               # the next layer: same plan
    assert schedule.tile_scheduler_metadata is md
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    expected_md, expected_ns = get_mla_metadata_twin(batch.topk_length, 128, 1, H100_SMS, **SPARSE_PLAN)
    assert torch.equal(md, expected_md) and torch.equal(ns, expected_ns)   # planned on topk_length, floored
    plain_md, _ = get_mla_metadata_twin(batch.topk_length, 128, 1, H100_SMS)
    assert not torch.equal(md, plain_md), "the floor does not bind here: the check above would prove less"


def test_classic_plan_is_full_topk():
    batch = make_sparse_batch(b=3, s_q=2, h_q=64, topk=200, seed=10)
    for num_sms in (20, H100_SMS):          # payload 3 + 5 = 8 (the floor 7 does not bind); 1 + 5 = 6 (it does)
        md, ns = plan_classic(batch, num_sms=num_sms)
        full = torch.full((3,), 200, dtype=torch.int32)
        expected = get_mla_metadata_twin(full, 128, 1, num_sms, **SPARSE_PLAN)
        assert torch.equal(md, expected[0]) and torch.equal(ns, expected[1]), num_sms
        assert torch.equal(ns, get_mla_metadata_twin(full, 128, 1, num_sms)[1]) == (num_sms == 20)


def test_sparse_plans_have_the_payload_floor(nan_empty):
    """b = 1, h_q 128, s_q 1, topk 2048 (the shape the floor was measured on): the classic and the lazy plan give
    16 SM parts two pages each (the floor 7), not 32 parts of one page (the SPEC payload 6); a dense plan of the
    same length keeps the SPEC rule. The floored plan runs and matches the reference."""
    batch = make_sparse_batch(b=1, s_q=1, h_q=128, topk=2048, num_blocks=40, seed=19)
    full = torch.full((1,), 2048, dtype=torch.int32)
    floored = get_mla_metadata_twin(full, 128, 1, H100_SMS, **SPARSE_PLAN)
    assert floored[1].tolist() == [0, 16] and floored[0][:16, 3].tolist() == [128 * (p + 1) for p in range(16)]
    md, ns = plan_classic(batch, num_sms=H100_SMS)
    assert torch.equal(md, floored[0]) and torch.equal(ns, floored[1])
    schedule, _ = get_mla_metadata(num_sms=H100_SMS)
    check(batch, *run(batch, plan=(schedule, None)), what="lazy, floored")
    assert torch.equal(schedule.tile_scheduler_metadata, floored[0]) and torch.equal(schedule.num_splits, floored[1])
    _, dense_ns = get_mla_metadata(full, 128, 1, num_sms=H100_SMS)
    assert dense_ns.tolist() == [0, 32]


# ---- the lazy schedule's life cycle, keywords, backends ------------------------------------------------------

def test_schedule_shape_checks():
    batch = make_sparse_batch(b=3, s_q=2, h_q=16, topk=100, seed=11)
    schedule, _ = get_mla_metadata()
    run(batch, plan=(schedule, None))
    other = make_sparse_batch(b=3, s_q=2, h_q=16, topk=64, seed=12)
    with pytest.raises(ValueError, match=rf"^{FN}: tile_scheduler_metadata: expected the shapes the schedule was "
                                         r"planned for .*topk=100\), got .*topk=64"):
        run(other, plan=(schedule, None))
    # a dense call with a sparse schedule, and a sparse call with a dense one
    from flash_mla.testing import make_decode_batch
    dense = make_decode_batch([5, 70, 0], s_q=2, h_q=16, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"^{FN}: tile_scheduler_metadata: expected a schedule for dense"):
        flash_mla_with_kvcache(dense.q, dense.k_cache, dense.block_table, dense.cache_seqlens, 512, schedule, None)
    dense_schedule, _ = get_mla_metadata()
    flash_mla_with_kvcache(dense.q, dense.k_cache, dense.block_table, dense.cache_seqlens, 512, dense_schedule, None)
    with pytest.raises(ValueError, match=r"topk=None: a dense call planned it"):
        run(batch, plan=(dense_schedule, None))
    schedule.have_initialized = False                                       # dropping the plan forgets topk
    assert schedule.topk is None
    run(other, plan=(schedule, None))
    assert schedule.topk == 64


def test_remaining_sparse_keywords():
    batch = make_sparse_batch(b=2, s_q=1, h_q=16, topk=64, seed=13)
    for arg, value in (("extra_k_cache", batch.k_cache), ("extra_indices_in_kvcache", batch.indices),
                       ("extra_topk_length", torch.zeros(2, dtype=torch.int32))):
        with pytest.raises(NotImplementedError, match=rf"^{FN}: {arg}: .* is not supported"):
            flash_mla_with_kvcache(batch.q, batch.k_cache, None, None, 512, *plan_classic(batch), None, False,
                                   is_fp8_kvcache=True, indices=batch.indices, **{arg: value})
    from flash_mla.testing import make_decode_batch
    dense = make_decode_batch([5, 70], generator=torch.Generator().manual_seed(0))
    md, ns = get_mla_metadata(dense.cache_seqlens, 16, 1)
    with pytest.raises(TypeError, match=rf"^{FN}: topk_length: expected None without indices"):
        flash_mla_with_kvcache(dense.q, dense.k_cache, dense.block_table, dense.cache_seqlens, 512, md, ns,
                               topk_length=torch.zeros(2, dtype=torch.int32))


def test_backend_routing(monkeypatch):
    batch = make_sparse_batch(b=2, s_q=1, h_q=16, topk=64, seed=14)
    cpu = run(batch, backend="cpu")
    assert all(torch.equal(x, y) for x, y in zip(cpu, run(batch)))
    with pytest.raises(RuntimeError, match=r"'cuda' was requested but is unavailable: the cuda backend needs CUDA "
                                           r"tensors, q is on cpu"):
        run(batch, backend="cuda")
    monkeypatch.setenv("FLASH_MLA_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match=r"the cuda backend needs CUDA tensors"):
        run(batch)
    monkeypatch.setenv("FLASH_MLA_BACKEND", "bogus")
    with pytest.raises(ValueError, match=r"backend: expected one of"):
        run(batch)
    monkeypatch.delenv("FLASH_MLA_BACKEND")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"'triton' was requested but is unavailable.*TRITON_INTERPRET=1"):
        run(batch, backend="triton")


def test_debug_mode_checks_the_plan(monkeypatch):
    batch = make_sparse_batch(b=3, s_q=2, h_q=16, topk=200, topk_length=[200, 3, 150], seed=15)
    monkeypatch.setenv("FLASH_MLA_DEBUG", "1")
    for form in ("lazy", "classic"):                                  # both plans are accepted
        check(batch, *run(batch, form), what=form)
    wrong = get_mla_metadata_twin(torch.tensor([64, 64, 64], dtype=torch.int32), 32, 1, H100_SMS)
    with pytest.raises(ValueError, match=rf"^{FN}: tile_scheduler_metadata: expected the get_mla_metadata plan"):
        run(batch, plan=wrong)
    # the plans without the sparse payload floor (SPEC payload 6 here: the floor 7 binds) are rejected, with the
    # floored plan's num_splits in the message; the floored ones are accepted
    for lengths in ([200] * 3, [200, 3, 150]):
        lens = torch.tensor(lengths, dtype=torch.int32)
        floored = get_mla_metadata_twin(lens, 32, 1, H100_SMS, **SPARSE_PLAN)
        plain = get_mla_metadata_twin(lens, 32, 1, H100_SMS)
        assert not torch.equal(floored[1], plain[1])
        check(batch, *run(batch, plan=floored), what=f"floored plan of {lengths}")
        lazy_ns = get_mla_metadata_twin(batch.topk_length, 32, 1, H100_SMS, **SPARSE_PLAN)[1].tolist()
        expected = re.escape(f"(topk_length: num_splits {lazy_ns}, 132 x 8 metadata")
        with pytest.raises(ValueError, match=rf"^{FN}: tile_scheduler_metadata: expected .*{expected}"):
            run(batch, plan=plain)
    monkeypatch.delenv("FLASH_MLA_DEBUG")
    run(batch, plan=wrong)                                            # not checked without debug mode


# ---- validation: every check, nothing planned or written ------------------------------------------------------

def _kwargs(batch, plan, sink):
    return dict(q=batch.q, k_cache=batch.k_cache, block_table=None, cache_seqlens=None, head_dim_v=512,
                tile_scheduler_metadata=plan[0], num_splits=plan[1], softmax_scale=None, causal=False,
                is_fp8_kvcache=True, indices=batch.indices, attn_sink=sink, topk_length=batch.topk_length)


def _strided_last(t):
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


B, S_Q, H_Q, TOPK = 3, 2, 16, 80
META = torch.device("meta")
# (argument, change, exception, message fragment after "expected"); `change(kw)` edits the call's keywords
BAD_CALLS = [
    ("q", lambda kw: kw.update(q=kw["q"].tolist()), TypeError, "a torch.Tensor"),
    ("q", lambda kw: kw.update(q=kw["q"].float()), TypeError, "dtype torch.bfloat16 or torch.float16"),
    ("q", lambda kw: kw.update(q=kw["q"].to(torch.float8_e4m3fn)), TypeError, "dtype torch.bfloat16"),
    ("q", lambda kw: kw.update(q=kw["q"][0]), ValueError, "a 4-D tensor"),
    ("q", lambda kw: kw.update(q=kw["q"][..., :512]), ValueError, "size 576 in dimension 3"),
    ("q", lambda kw: kw.update(q=_strided_last(kw["q"])), ValueError, "a contiguous last dimension"),
    ("is_fp8_kvcache", lambda kw: kw.update(is_fp8_kvcache=False), TypeError, "True with indices"),
    ("k_cache", lambda kw: kw.update(k_cache=kw["k_cache"].to(torch.bfloat16)), TypeError, "dtype torch.uint8"),
    ("k_cache", lambda kw: kw.update(k_cache=kw["k_cache"][0]), ValueError, "a 4-D tensor"),
    ("k_cache", lambda kw: kw.update(k_cache=kw["k_cache"][..., :576]), ValueError, "size 656 in dimension 3"),
    ("k_cache", lambda kw: kw.update(k_cache=kw["k_cache"].expand(-1, -1, 2, -1)), ValueError,
     "size 1 in dimension 2"),
    ("k_cache", lambda kw: kw.update(k_cache=kw["k_cache"][:0]), ValueError, "num_blocks and page_block_size >= 1"),
    ("k_cache", lambda kw: kw.update(k_cache=kw["k_cache"].to(META)), ValueError, "a tensor on cpu"),
    ("k_cache", lambda kw: kw.update(k_cache=_strided_last(kw["k_cache"])), ValueError, "a contiguous last"),
    ("descale_k", lambda kw: kw.update(descale_k=torch.ones(1)), TypeError, "None with indices"),
    ("descale_q", lambda kw: kw.update(descale_q=torch.ones(1)), TypeError, "None with indices"),
    ("indices", lambda kw: kw.update(indices=kw["indices"].tolist()), TypeError, "a torch.Tensor"),
    ("indices", lambda kw: kw.update(indices=kw["indices"].long()), TypeError, "dtype torch.int32"),
    ("indices", lambda kw: kw.update(indices=kw["indices"][0]), ValueError, "a 3-D tensor"),
    ("indices", lambda kw: kw.update(indices=kw["indices"][:2]), ValueError, "shape (batch_size, seqlen_q, topk)"),
    ("indices", lambda kw: kw.update(indices=kw["indices"][:, :1]), ValueError, "shape (batch_size, seqlen_q"),
    ("indices", lambda kw: kw.update(indices=kw["indices"][..., :0]), ValueError, "topk (dimension 2) >= 1"),
    ("indices", lambda kw: kw.update(indices=_strided_last(kw["indices"])), ValueError, "a contiguous last"),
    ("indices", lambda kw: kw.update(indices=kw["indices"].to(META)), ValueError, "a tensor on cpu"),
    ("indices[1, 0, 7]", lambda kw: kw["indices"].__setitem__((1, 0, 7), 24 * 64), ValueError,
     "-1 (unused) or a token number in [0, 1536)"),
    ("indices[1, 1, 0]", lambda kw: kw["indices"].__setitem__((1, 1, 0), -2), ValueError, "-1 (unused) or a token"),
    ("topk_length", lambda kw: kw.update(topk_length=[80] * B), TypeError, "a torch.Tensor"),
    ("topk_length", lambda kw: kw.update(topk_length=kw["topk_length"].long()), TypeError, "dtype torch.int32"),
    ("topk_length", lambda kw: kw.update(topk_length=kw["topk_length"][None]), ValueError, "a 1-D tensor"),
    ("topk_length", lambda kw: kw.update(topk_length=kw["topk_length"][:2]), ValueError, "size 3 in dimension 0"),
    ("topk_length", lambda kw: kw.update(topk_length=kw["topk_length"].to(META)), ValueError, "a tensor on cpu"),
    ("topk_length[1]", lambda kw: kw["topk_length"].__setitem__(1, -1), ValueError, "a count in [0, topk = 80]"),
    ("topk_length[2]", lambda kw: kw["topk_length"].__setitem__(2, 81), ValueError, "a count in [0, topk = 80]"),
    ("block_table", lambda kw: kw.update(block_table=[[0]]), TypeError, "None or a torch.Tensor"),
    ("cache_seqlens", lambda kw: kw.update(cache_seqlens="lengths"), TypeError, "None or a torch.Tensor"),
    ("head_dim_v", lambda kw: kw.update(head_dim_v=576), ValueError, "512"),
    ("head_dim_v", lambda kw: kw.update(head_dim_v=512.0), TypeError, "a Python int"),
    ("causal", lambda kw: kw.update(causal=True), ValueError, "False with indices"),
    ("causal", lambda kw: kw.update(causal="no"), TypeError, "a bool"),
    ("softmax_scale", lambda kw: kw.update(softmax_scale=-1.0), ValueError, "a finite positive float"),
    ("softmax_scale", lambda kw: kw.update(softmax_scale="0.1"), TypeError, "a float or None"),
    ("attn_sink", lambda kw: kw.update(attn_sink=kw["attn_sink"].bfloat16()), TypeError, "dtype torch.float32"),
    ("attn_sink", lambda kw: kw.update(attn_sink=kw["attn_sink"][None]), ValueError, "a 1-D tensor"),
    ("attn_sink", lambda kw: kw.update(attn_sink=torch.zeros(H_Q + 1)), ValueError, "size 16 in dimension 0"),
    ("attn_sink", lambda kw: kw.update(attn_sink=kw["attn_sink"].to(META)), ValueError, "a tensor on cpu"),
]
BAD_PLANS = [   # classic form only
    ("tile_scheduler_metadata", lambda kw: kw.update(tile_scheduler_metadata=None), TypeError, "a torch.Tensor"),
    ("tile_scheduler_metadata", lambda kw: kw.update(tile_scheduler_metadata=kw["tile_scheduler_metadata"].float()),
     TypeError, "dtype torch.int32"),
    ("tile_scheduler_metadata", lambda kw: kw.update(tile_scheduler_metadata=kw["tile_scheduler_metadata"][:, :7]),
     ValueError, "size 8 in dimension 1"),
    ("num_splits", lambda kw: kw.update(num_splits=kw["num_splits"][:-1]), ValueError, "size 4 in dimension 0"),
    ("num_splits", lambda kw: kw.update(num_splits=kw["num_splits"].long()), TypeError, "dtype torch.int32"),
]


def _snapshot(kw):
    return {k: v.clone() for k, v in kw.items() if isinstance(v, torch.Tensor) and v.device.type == "cpu"}


VALIDATION_CASES = ([(form, *c) for c in BAD_CALLS for form in ("lazy", "classic")]
                    + [("classic", *c) for c in BAD_PLANS])          # the lazy form has no plan tensors


@pytest.mark.parametrize("form,arg,change,exc,expected", VALIDATION_CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(VALIDATION_CASES)])
def test_validation(monkeypatch, form, arg, change, exc, expected):
    batch = make_sparse_batch(b=B, s_q=S_Q, h_q=H_Q, topk=TOPK, topk_length=[80, 40, 0], seed=16)
    plan = get_mla_metadata() if form == "lazy" else plan_classic(batch)
    kw = _kwargs(batch, plan, make_attn_sink(H_Q))
    flash_mla_with_kvcache(**kw)                                # the unchanged call is valid
    plan = get_mla_metadata() if form == "lazy" else plan
    kw.update(tile_scheduler_metadata=plan[0])
    change(kw)
    before = _snapshot(kw)
    # nothing may run before the checks: no backend, no planning
    import flash_mla.backends as backends
    import flash_mla.interface as interface

    def boom(*a, **k):
        raise AssertionError("ran before the checks passed")
    monkeypatch.setattr(interface, "run_sparse_decode", boom)
    monkeypatch.setattr(backends, "run_metadata", boom)
    monkeypatch.setattr(interface, "run_metadata", boom)
    with pytest.raises(exc, match="^" + re.escape(f"{FN}: {arg}: expected {expected}")):
        flash_mla_with_kvcache(**kw)
    if form == "lazy":
        assert not plan[0].have_initialized
    after = _snapshot(kw)
    assert all(torch.equal(before[k], after[k]) for k in before), "the call modified its inputs"


def test_validation_accepts_garbage_past_topk_length():
    batch = make_sparse_batch(b=3, s_q=2, h_q=16, topk=80, topk_length=[80, 40, 0], seed=17)
    assert (batch.indices[1, :, 40:] >= 24 * 64).any() and (batch.indices[2] < -1).any()
    check(batch, *run(batch, "classic"))


def test_num_splits_with_a_schedule():
    batch = make_sparse_batch(b=2, s_q=1, h_q=16, topk=64, seed=18)
    schedule, _ = get_mla_metadata()
    with pytest.raises(TypeError, match=rf"^{FN}: num_splits: expected None with a schedule"):
        run(batch, plan=(schedule, torch.zeros(3, dtype=torch.int32)))
    assert not schedule.have_initialized


@pytest.mark.parametrize("form,kwargs,exc,expected", [
    *[(form, kw, exc, expected) for form in ("lazy", "classic") for kw, exc, expected in [
        (dict(topk=0), ValueError, "topk: expected an int >= 1, got 0"),
        (dict(topk=2.5), TypeError, "topk: expected a Python int, got float"),
        (dict(topk=True), TypeError, "topk: expected a Python int, got bool")]],
    ("classic", dict(topk=64, num_heads_k=2), ValueError, "num_heads_k: expected 1 with topk"),  # (lazy: ignored)
])
def test_metadata_validation(form, kwargs, exc, expected):
    kwargs = dict(kwargs)
    if form == "classic":
        args = (torch.zeros(3, dtype=torch.int32), 32, kwargs.pop("num_heads_k", 1))
    else:
        args = ()
    with pytest.raises(exc, match="^" + re.escape(f"get_mla_metadata: {expected}")):
        get_mla_metadata(*args, **kwargs)


# ---- the quantiser -------------------------------------------------------------------------------------------

def test_quantize_round_trip():
    g = torch.Generator().manual_seed(19)
    x = torch.randn(5, 64, 1, 576, generator=g)
    x[..., :512] *= 10.0 ** torch.randint(-3, 4, (5, 64, 1, 4), generator=g).float().repeat_interleave(128, -1)
    x[0, 0, 0, :128] = 0                                   # an all-zero group
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        packed = quantize_kv_cache_v32(xd)
        assert packed.dtype == torch.uint8 and packed.shape == (5, 64, 1, TOKEN_BYTES)
        back = dequantize_kv_cache_v32(packed)
        assert back.shape == (5, 64, 1, 576) and back.dtype == torch.float32
        assert torch.equal(back, dequantize_kv_cache_v32(packed.view(torch.float8_e4m3fn)))
        # RoPE: bf16-rounded copies
        assert torch.equal(back[..., 512:], xd[..., 512:].to(torch.bfloat16).float())
        # latent: per group of 128, scale = amax / 448 and an e4m3 value (3 mantissa bits: 2^-4 relative, plus
        # the subnormal step 2^-9 * scale)
        groups = xd[..., :512].float().reshape(5, 64, 1, 4, 128)
        scale = packed[..., 512:528].contiguous().view(torch.float32).reshape(5, 64, 1, 4, 1)
        amax = groups.abs().amax(-1, keepdim=True)
        torch.testing.assert_close(scale, (amax / 448).clamp_min(torch.finfo(torch.float32).tiny), rtol=0, atol=0)
        err = (back[..., :512].reshape(groups.shape) - groups).abs()
        assert (err <= groups.abs() * 2 ** -4 + scale * 2 ** -9 + 1e-30).all()
        assert (back[0, 0, 0, :128] == 0).all()


def test_quantize_non_finite_and_errors():
    x = torch.randn(1, 2, 1, 576)
    x[0, 0, 0, 3] = math.nan
    x[0, 0, 0, 200] = math.inf
    x[0, 1, 0, 300] = -math.inf
    back = dequantize_kv_cache_v32(quantize_kv_cache_v32(x))
    assert math.isnan(back[0, 0, 0, 3]) and torch.isfinite(back[0, 0, 0, 4:]).all()
    amax = x[0, 0, 0, 128:256].nan_to_num(posinf=0).abs().max()
    assert back[0, 0, 0, 200] == back[0, 0, 0, 128:256].max() and abs(back[0, 0, 0, 200] - amax) < amax * 2 ** -4
    assert back[0, 1, 0, 300] < 0 and torch.isfinite(back[0, 1, 0, 300])
    with pytest.raises(TypeError, match=r"^quantize_kv_cache_v32: latent_and_rope: expected dtype"):
        quantize_kv_cache_v32(x.double())
    with pytest.raises(ValueError, match=r"^quantize_kv_cache_v32: latent_and_rope: expected last dimension 576"):
        quantize_kv_cache_v32(x[..., :512])


def test_public_names():
    for name in ("quantize_kv_cache_v32", "dequantize_kv_cache_v32", "sparse_decode_reference"):
        assert name in flash_mla.__all__ and callable(getattr(flash_mla, name))


# ---- the custom op and torch.compile ---------------------------------------------------------------------------

needs_ops = pytest.mark.skipif(not ops.AVAILABLE, reason="torch.library.custom_op needs torch >= 2.4")


@needs_ops
def test_op_matches_the_api_and_opcheck():
    batch = make_sparse_batch(b=3, s_q=2, h_q=16, topk=80, topk_length=[80, 7, 0], seed=20)
    sink = make_attn_sink(16)
    md, ns = plan_classic(batch, num_sms=9)
    out, lse = run(batch, plan=(md, ns), attn_sink=sink, softmax_scale=0.05)
    op_out, op_lse = torch.ops.flash_mla.sparse_decode(batch.q, batch.k_cache, batch.indices, batch.topk_length,
                                                       md, ns, 0.05, None, sink)
    assert torch.equal(out, op_out) and torch.equal(lse, op_lse)
    schema = str(torch.ops.flash_mla.sparse_decode.default._schema)
    assert schema.startswith("flash_mla::sparse_decode(Tensor q, Tensor k_cache, Tensor indices, Tensor? "
                             "topk_length") and schema.endswith("-> (Tensor, Tensor)")
    torch.library.opcheck(torch.ops.flash_mla.sparse_decode.default,
                          (batch.q, batch.k_cache, batch.indices, batch.topk_length, md, ns, 0.05),
                          {"backend": None, "attn_sink": sink})
    whole = make_sparse_batch(b=3, s_q=2, h_q=16, topk=80, seed=22)       # no topk_length
    torch.library.opcheck(torch.ops.flash_mla.sparse_decode.default,
                          (whole.q, whole.k_cache, whole.indices, None, md, ns, 0.05))
    with pytest.raises(ValueError, match=rf"^{FN}: topk_length\[0\]: expected a count"):
        torch.ops.flash_mla.sparse_decode(batch.q, batch.k_cache, batch.indices, batch.topk_length + 1, md, ns,
                                          0.05)


def lazy_step(q, k_cache, indices, topk_length):
    """The referee's call, twice (two layers sharing the schedule)."""
    schedule, num_splits = get_mla_metadata()
    out1, lse1 = flash_mla_with_kvcache(q, k_cache, None, None, 512, schedule, num_splits, None, False,
                                        is_fp8_kvcache=True, indices=indices, topk_length=topk_length)
    out2, lse2 = flash_mla_with_kvcache(q * 2, k_cache, None, None, 512, schedule, num_splits, 0.03, False,
                                        is_fp8_kvcache=True, indices=indices, topk_length=topk_length)
    return out1, lse1, out2, lse2


def classic_step(q, k_cache, indices, topk_length, cache_seqlens):
    md, ns = get_mla_metadata(cache_seqlens, q.shape[1] * q.shape[2], 1, num_heads_q=q.shape[2],
                              is_fp8_kvcache=True, topk=indices.shape[2])
    return flash_mla_with_kvcache(q, k_cache, None, None, 512, md, ns, None, False, is_fp8_kvcache=True,
                                  indices=indices, topk_length=topk_length) + (md, ns)


@needs_ops
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compile_fullgraph(backend):
    torch._dynamo.reset()
    try:
        batch = make_sparse_batch(b=3, s_q=2, h_q=16, topk=80, topk_length=[80, 7, 0], seed=21)
        lazy = torch.compile(lazy_step, backend=backend, fullgraph=True)
        args = (batch.q, batch.k_cache, batch.indices, batch.topk_length)
        for x, y in zip(lazy(*args), lazy_step(*args)):
            assert torch.equal(x, y)
        classic = torch.compile(classic_step, backend=backend, fullgraph=True)
        args = (batch.q, batch.k_cache, batch.indices, batch.topk_length, torch.zeros(3, dtype=torch.int32))
        for x, y in zip(classic(*args), classic_step(*args)):
            assert torch.equal(x, y)
        bad = (batch.q, batch.k_cache, batch.indices.long(), batch.topk_length)
        with pytest.raises(Exception, match=re.escape(f"{FN}: indices: expected dtype torch.int32")):
            lazy(*bad)
    finally:
        torch._dynamo.reset()


# ---- the triton backend in Triton's interpreter (CPU) ---------------------------------------------------------

def _subprocess_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)
    return env


@needs_triton_sparse
@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines")
@pytest.mark.skipif(INTERPRETER_HERE, reason="the interpreter tests run in this process")
def test_subprocess_runs_interpreter_tests():
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
                             "-k", "test_interpreter_"], capture_output=True, text=True,
                            env=_subprocess_env(TRITON_INTERPRET="1"), timeout=1200, check=False)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]


@interpreter
@needs_triton_sparse
@pytest.mark.parametrize("s_q,h_q,page,dtype", [(2, 16, 64, torch.bfloat16), (1, 64, 16, torch.float16),
                                                (2, 128, 64, torch.bfloat16)])
def test_interpreter_matches_reference(nan_empty, s_q, h_q, page, dtype):
    def edit(indices):
        indices[2, 0, :] = -1                                            # a query token with no valid index
        indices[3, :, 60:] = -1                                          # trailing -1
        indices[5, :, 100:110] = indices[5, :, 0:10]                     # repeated indices
    batch = make_sparse_batch(b=len(RAGGED), s_q=s_q, h_q=h_q, topk=130, num_blocks=1024 // page, page=page,
                              topk_length=RAGGED, dtype=dtype, seed=30 + h_q, edit=edit)
    sink = make_attn_sink(h_q, torch.Generator().manual_seed(1))
    for form in ("lazy", "classic"):
        out, lse = run(batch, form, attn_sink=sink, backend="triton")
        check(batch, out, lse, attn_sink=sink, what=f"triton interpreter {form}")


@interpreter
@needs_triton_sparse
def test_interpreter_split_independence(nan_empty):
    batch = make_sparse_batch(b=3, s_q=2, h_q=16, topk=200, num_blocks=16, topk_length=[200, 1, 130], seed=33)
    results = [run(batch, "classic", num_sms=n, backend="triton") for n in (1, H100_SMS)]
    for out, lse in results:
        check(batch, out, lse, what="triton interpreter")
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-5, rtol=1e-5)


# ---- GPU: the cuda (Hopper) and triton backends on CUDA tensors ----------------------------------------------

def _is_hopper():
    return HAS_CUDA and torch.cuda.get_device_capability() == (9, 0) and flash_mla.backends.cuda_extension() is not None


BACKEND_MARKS = {"cuda": [pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper GPU and the compiled extension")],
                 "triton": [needs_triton, needs_triton_sparse_file]}
GPU_BACKENDS = [pytest.param(name, marks=marks, id=name) for name, marks in BACKEND_MARKS.items()]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("form", ["lazy", "classic"])
@pytest.mark.parametrize("s_q", [1, 2])
@pytest.mark.parametrize("h_q,backend", [pytest.param(h_q, name, marks=marks, id=f"{h_q}-{name}")
                                         for h_q in (16, 64, 128) for name, marks in BACKEND_MARKS.items()
                                         if h_q % 64 == 0 or name != "cuda"])    # the cuda kernel: h_q 64 and 128
def test_gpu_matches_reference(h_q, s_q, form, backend):
    lengths = [0, 1, 63, 64, 65, 2048, 1000, 2048]
    def edit(indices):
        indices[1, 0] = -1
        indices[6, :, ::3] = -1
        indices[7, :, 100:163] = -1          # a whole 64-slot page of -1 inside a row
    batch = make_sparse_batch(b=len(lengths), s_q=s_q, h_q=h_q, topk=2048, num_blocks=512, topk_length=lengths,
                              seed=40 + h_q + s_q, edit=edit, device="cuda")
    sink = make_attn_sink(h_q, torch.Generator().manual_seed(2), device="cuda")
    for attn_sink in (None, sink):
        out, lse = run(batch, form, attn_sink=attn_sink, backend=backend)
        assert out.device.type == "cuda"
        check(batch, out, lse, attn_sink=attn_sink, what=f"gpu {backend} h_q={h_q} s_q={s_q} {form}", backend=backend)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper GPU and the compiled extension")
def test_gpu_automatic_choice():
    from flash_mla.backends import select_sparse_backend
    dev = torch.device("cuda")
    assert select_sparse_backend(dev, None, torch.bfloat16, 64) == "cuda"
    assert select_sparse_backend(dev, None, torch.bfloat16, 128) == "cuda"
    assert select_sparse_backend(dev, None, torch.float16, 128) == "triton"
    assert select_sparse_backend(dev, None, torch.bfloat16, 16) == "triton"
    with pytest.raises(RuntimeError, match=r"'cuda' was requested but is unavailable: the cuda sparse kernel needs "
                                           r"num_heads_q a multiple of 64, got 16"):
        select_sparse_backend(dev, "cuda", torch.bfloat16, 16)
    with pytest.raises(RuntimeError, match=r"needs a bfloat16 q"):
        select_sparse_backend(dev, "cuda", torch.float16, 64)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_split_independence_and_pages(backend):
    for page in (64, 128, 1):
        batch = make_sparse_batch(b=4, s_q=2, h_q=64, topk=512, num_blocks=8192 // page, page=page,
                                  topk_length=[512, 3, 0, 300], seed=50 + page, device="cuda")
        results = [run(batch, "classic", num_sms=n, backend=backend) for n in (1, 7, H100_SMS)]
        for out, lse in results:
            check(batch, out, lse, what=f"gpu {backend} page {page}", backend=backend)
        torch.testing.assert_close(results[0][1], results[2][1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper GPU and the compiled extension")
def test_gpu_cuda_kernel_edge_cases():
    """The Hopper kernel's gather and dequantisation: group scales from 2^-100 to 2^15 times the data's (one power
    of two per page: fp16 keys across 115 binades), repeated indices, the cache's first and last tokens, a
    non-contiguous cache (a slice: copied), lengths ending inside either page buffer, rows of only -1, and no
    topk_length."""
    g = torch.Generator().manual_seed(70)
    num_blocks, page = 40, 64
    x = torch.randn(num_blocks, page, 1, 576, generator=g)
    exponent = torch.tensor([-100.0, -20.0, 0.0, 15.0])[torch.randint(0, 4, (num_blocks, page, 1, NUM_SCALES),
                                                                     generator=g)]
    x[..., :512] *= (2.0 ** exponent).repeat_interleave(SCALE_GROUP, dim=-1)
    k_cache = quantize_kv_cache_v32(x)
    b, s_q, h_q, topk = 6, 2, 128, 700
    tokens = num_blocks * page
    indices = torch.randint(0, tokens, (b, s_q, topk), generator=g).int()
    indices[0, :, :10] = 0
    indices[0, :, 10:20] = tokens - 1
    indices[1] = -1
    indices[2, 1] = -1
    q = torch.randn(b, s_q, h_q, 576, generator=g).bfloat16()
    # Scores O(1) beside the 2^15 groups (q x 1e-3 left them at a standard deviation of ~15, where the softmax is
    # nearly one-hot and the bf16 rounding of the keys, upstream's as well as ours, moves out by more than 1e-2).
    q[..., :512] *= 2.0 ** -15
    for topk_length in ([700, 0, 129, 64, 65, 1], None):
        tl = None if topk_length is None else torch.tensor(topk_length, dtype=torch.int32)
        batch = SparseBatch(q, k_cache, indices, tl).to("cuda")
        out, lse = run(batch, "classic", backend="cuda")
        check(batch, out, lse, what=f"edge cases topk_length={topk_length}", backend="cuda")
        sliced = torch.cat([batch.k_cache, batch.k_cache[:, :1]], dim=1)[:, :page]    # strided pages
        assert not sliced.is_contiguous()
        out2, lse2 = run(batch, "classic", backend="cuda", k_cache=sliced)
        assert torch.equal(out, out2) and torch.equal(lse, lse2)
        out3, lse3 = run(batch, "classic", backend="cuda")
        assert torch.equal(out, out3) and torch.equal(lse, lse3)                 # deterministic


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper GPU and the compiled extension")
@pytest.mark.parametrize("h_q", [128, 256])
def test_gpu_cuda_cluster_pairs_and_plans(nan_empty, h_q):
    """The Hopper kernel launches the two 64-head row tiles of an SM part as a cluster of two: h_q 128 (one pair per
    query token) and 256 (two), s_q 1 and 2; lengths ending inside either page buffer, on their boundaries and on a
    half page, an empty row, a row of -1, -1 slots over one half of a page; plans of 1, 7 and 132 SM parts (pieces
    split mid-row, one CTA pair walking many rows, one piece per pair); lse the same whatever the plan, and every
    result the same on a second run."""
    lengths = [0, 1, 31, 32, 33, 64, 65, 127, 128, 129, 700, 2048]
    def edit(indices):
        indices[3] = -1                     # a row whose slots are all -1: out 0, lse -inf
        indices[10, :, 32:64] = -1          # half a page, then every other slot of the next half
        indices[10, :, 64:96:2] = -1
    batch = make_sparse_batch(b=len(lengths), s_q=2, h_q=h_q, topk=2048, num_blocks=512, topk_length=lengths,
                              seed=90 + h_q, edit=edit, device="cuda")
    for s_q in (1, 2):
        part = SparseBatch(batch.q[:, :s_q].contiguous(), batch.k_cache, batch.indices[:, :s_q].contiguous(),
                           batch.topk_length)
        results = [run(part, "classic", num_sms=n, backend="cuda") for n in (1, 7, H100_SMS)]
        for out, lse in results:
            check(part, out, lse, what=f"cluster pairs h_q={h_q} s_q={s_q}", backend="cuda")
        for _out, lse in results[1:]:
            torch.testing.assert_close(lse, results[0][1], atol=1e-5, rtol=1e-5)
        again = run(part, "classic", num_sms=H100_SMS, backend="cuda")
        assert torch.equal(again[0], results[2][0]) and torch.equal(again[1], results[2][1])


@pytest.mark.gpu
@pytest.mark.skipif(not _is_hopper(), reason="needs a Hopper GPU and the compiled extension")
def test_gpu_cuda_q_layouts():
    """The Hopper kernel copies its Q tiles by TMA (a tensor map over q's own strides): a q sliced from wider rows,
    one whose batch rows are every other row of a larger q, one with (s_q, h_q) stored transposed, and an expanded
    one (stride 0 over the heads: copied first) give exactly the results of the same values stored contiguously;
    h_q 64 and 128 (one and two Q tiles per query token), lengths ending inside either page buffer."""
    for h_q in (64, 128):
        batch = make_sparse_batch(b=3, s_q=2, h_q=h_q, topk=300, num_blocks=40, seed=90 + h_q,
                                  topk_length=[300, 129, 64]).to("cuda")
        q = batch.q
        wide = torch.randn(3, 2, h_q, 640, device="cuda").bfloat16()
        wide[..., :576] = q
        every_other = torch.randn(6, 2, h_q, 576, device="cuda").bfloat16()
        every_other[::2] = q
        transposed = q.transpose(1, 2).contiguous().transpose(1, 2)
        expanded = q[:, :, :1].expand(-1, -1, h_q, -1)
        layouts = {"sliced": (wide[..., :576], q), "every other batch row": (every_other[::2], q),
                   "(s_q, h_q) transposed": (transposed, q), "expanded heads": (expanded, expanded.contiguous())}
        for what, (strided, values) in layouts.items():
            assert not strided.is_contiguous(), what
            out, lse = run(replace(batch, q=strided), "classic", backend="cuda")
            want_out, want_lse = run(replace(batch, q=values), "classic", backend="cuda")
            assert torch.equal(out, want_out) and torch.equal(lse, want_lse), f"h_q {h_q}, q {what}"
        check(batch, *run(batch, "classic", backend="cuda"), what=f"h_q {h_q}", backend="cuda")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_nan_code_in_a_counted_token(backend):
    """An e4m3 NaN byte (0x7F, 0xFF) under a finite group scale in a token a row counts makes that row's out and lse
    NaN, as the reference's dequantisation has it: the cuda kernel's carry test and patch, for each of the 16 byte
    positions of a 16-byte chunk and each of the 4 latent groups; rows that count no such token stay exact."""
    batch = make_sparse_batch(b=4, s_q=2, h_q=64, topk=256, num_blocks=512, minus_one=0.0, seed=80)
    raw = batch.k_cache.view(-1, batch.k_cache.shape[-1])
    for r in range(6):                                   # rows (i, s) = divmod(r, 2); rows 6 and 7 stay clean
        i, s = divmod(r, 2)
        for k, (slot, code) in enumerate(((3 + r, 0x7F), (100 + r, 0xFF))):
            byte = 128 * ((r + 2 * k) % 4) + 16 * r + (2 * r + 9 * k) % 16
            raw[int(batch.indices[i, s, slot]), byte] = code
    batch = batch.to("cuda")
    out, lse = run(batch, "classic", backend=backend)
    ref_out, ref_lse = reference(batch)
    out, lse = out.cpu().float(), lse.cpu()
    nan_rows = torch.isnan(ref_out).any(dim=-1)                                   # (b, s_q, h_q)
    assert nan_rows[:3].all() and (~nan_rows).any(), "each poisoned row NaN, at least one clean row"
    assert torch.equal(torch.isnan(out).all(dim=-1), nan_rows) and torch.equal(torch.isnan(out).any(dim=-1), nan_rows)
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse))
    clean = ~nan_rows
    rel = (out[clean] - ref_out[clean]).norm() / ref_out[clean].norm()
    assert rel < SPARSE_OUT_TOL, f"{backend}: clean rows out rel-L2 {rel:.1e}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_cuda_graph_replay_with_new_indices(backend):
    """Captured once; each replay reads the q, indices and topk_length written in place (the classic plan for
    full(topk) serves any topk_length)."""
    first = make_sparse_batch(b=8, s_q=2, h_q=64, topk=256, num_blocks=64, topk_length=[256] * 8, seed=60,
                              device="cuda")
    q, indices, topk_length = first.q.clone(), first.indices.clone(), first.topk_length.clone()
    live = SparseBatch(q, first.k_cache, indices, topk_length)
    md, ns = plan_classic(live)

    def step():
        return run(live, plan=(md, ns), backend=backend)

    graph, _, (out, lse) = capture_cuda_graph(step)
    for seed in (61, 62):
        new = make_sparse_batch(b=8, s_q=2, h_q=64, topk=256, num_blocks=64, seed=seed,
                                topk_length=[256, 0, 1, 100, 256, 64, 65, 200], garbage_past_length=False,
                                device="cuda")
        first.k_cache.copy_(new.k_cache)
        q.copy_(new.q)
        indices.copy_(new.indices)
        topk_length.copy_(new.topk_length)
        out.fill_(math.nan)
        lse.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        check(new, out, lse, what=f"replay {backend} {seed}", backend=backend)


# ---- the README's example --------------------------------------------------------------------------------------

def test_readme_example_runs_on_the_cpu(monkeypatch):
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme.split("\n## Sparse FP8 decoding (DeepSeek-V3.2)\n", 1)[1].split("\n## ", 1)[0]
    (example,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert 'device = "cuda"' in example and "get_mla_metadata()" in example and "topk=topk" in example
    ns = {}
    torch.manual_seed(0)
    exec(compile(example.replace('"cuda"', '"cpu"'), "README sparse example", "exec"), ns)
    out, lse = ns["out"], ns["lse"]
    assert out.shape == (4, 2, 128, 512) and out.dtype == torch.bfloat16 and lse.shape == (4, 128, 2)
    assert (out[3] == 0).all() and torch.isneginf(lse[3]).all()
    batch = SparseBatch(ns["q"], ns["k_cache"], ns["indices"], ns["topk_length"])
    check(batch, out, lse, softmax_scale=576 ** -0.5, what="README example")
