"""Production hardening on the GPU (skipped without one), for every GPU backend that can run (cuda, triton):

* CUDA graphs: get_mla_metadata + flash_mla_with_kvcache captured once for a fixed batch size, replayed with new
  lengths, block tables, queries and cache contents written into the captured buffers;
* no host synchronisation in either call (torch.cuda.set_sync_debug_mode("error"));
* padded batches: L = 0 rows whose block tables hold -1 or garbage and whose q is NaN;
* bad input on the GPU (tensors on the wrong device), NaN/Inf in q, debug mode;
* determinism: bitwise identical results run after run;
* limits (`-k limits`): one 1M-token sequence, a cache of more than 2^32 elements with the pages at its end,
  and b = 16384 with q and out of more than 2^31 elements.

    python3 -m pytest -q tests/test_gpu_hardening.py            # all of it
    python3 -m pytest -q tests/test_gpu_hardening.py -k limits  # the large cases only
"""
import math

import pytest
import torch

from flash_mla import flash_mla_with_kvcache, get_mla_metadata
from flash_mla.backends import _unavailable_reason, cuda_extension
from flash_mla.scheduler import get_mla_metadata_twin
from flash_mla.testing import (
    DecodeBatch,
    assert_close,
    compare,
    make_decode_batch,
    poison_cuda_allocator,
    reference_for,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]
BF16 = torch.bfloat16
NAN = math.nan


def _backends():
    params = []
    for name in ("cuda", "triton"):
        # only asked on a GPU machine: on a CPU-only one this would import triton in compiled mode
        why = _unavailable_reason(name, torch.device("cuda")) if HAS_CUDA else "needs a CUDA GPU"
        params.append(pytest.param(name, marks=pytest.mark.skip(reason=why)) if why else name)
    return params


BACKENDS = _backends()


@pytest.fixture(autouse=True)
def _clean_environment(default_environment):
    yield
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _one_limits_case_at_a_time(request):
    """The limits cases take up to half of an 80 GB GPU each: under pytest-xdist (`-n 8`) two of them at once ran
    out of memory on the H100. A file lock shared by the worker processes runs them one at a time."""
    if not request.node.name.startswith("test_limits_"):
        yield
        return
    import fcntl
    import tempfile
    from pathlib import Path

    with open(Path(tempfile.gettempdir()) / "flash_mla_gpu_limits.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()    # the memory goes back before the next process takes the lock
            fcntl.flock(lock, fcntl.LOCK_UN)


def num_sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def needs_device_metadata():
    """Capturing get_mla_metadata (or running it without a host sync) needs its CUDA kernel, in the extension."""
    if cuda_extension() is None:
        pytest.skip("get_mla_metadata runs on the device only with the CUDA extension (else it reads the lengths)")


def gpu_batch(seqlens, s_q, h_q, seed, causal=True, h_kv=1, **kw):
    return make_decode_batch(seqlens, s_q=s_q, h_q=h_q, h_kv=h_kv, dtype=BF16, device=DEVICE, causal=causal,
                             generator=torch.Generator().manual_seed(seed), **kw)


def plan(batch):
    s_q, h_q, h_kv = batch.q.shape[1], batch.q.shape[2], batch.k_cache.shape[2]
    return get_mla_metadata(batch.cache_seqlens, s_q * h_q // h_kv, h_kv)


def decode(batch, md, ns, backend, **kw):
    return flash_mla_with_kvcache(batch.q, kw.pop("k_cache", batch.k_cache), kw.pop("block_table", batch.block_table),
                                  kw.pop("cache_seqlens", batch.cache_seqlens), 512, md, ns, causal=batch.causal,
                                  backend=backend, **kw)


def check_metadata(batch, md, ns):
    s_q, h_q, h_kv = batch.q.shape[1], batch.q.shape[2], batch.k_cache.shape[2]
    twin_md, twin_ns = get_mla_metadata_twin(batch.cache_seqlens.cpu(), s_q * h_q // h_kv, h_kv, num_sms())
    assert torch.equal(md.cpu(), twin_md) and torch.equal(ns.cpu(), twin_ns), "metadata differs from the twin"


# ---------------------------------------------------------------------------------------------------------------
# CUDA graphs
# ---------------------------------------------------------------------------------------------------------------

class CapturedStep:
    """Static input buffers for a fixed batch size, and one decoding step (plan + decode) captured over them."""

    def __init__(self, b, s_q, h_q, max_pages, num_blocks, backend, causal=True):
        self.b, self.s_q, self.h_q, self.max_pages, self.num_blocks = b, s_q, h_q, max_pages, num_blocks
        self.backend, self.causal = backend, causal
        self.q = torch.zeros(b, s_q, h_q, 576, dtype=BF16, device=DEVICE)
        self.k_cache = torch.zeros(num_blocks, 64, 1, 576, dtype=BF16, device=DEVICE)
        self.block_table = torch.full((b, max_pages), -1, dtype=torch.int32, device=DEVICE)
        self.cache_seqlens = torch.zeros(b, dtype=torch.int32, device=DEVICE)

    def step(self):
        md, ns = get_mla_metadata(self.cache_seqlens, self.s_q * self.h_q, 1)
        out, lse = flash_mla_with_kvcache(self.q, self.k_cache, self.block_table, self.cache_seqlens, 512, md, ns,
                                          causal=self.causal, backend=self.backend)
        return md, ns, out, lse

    def load(self, seqlens, generator):
        """Write a fresh batch with these lengths into the static buffers; returns it (for the reference)."""
        assert len(seqlens) == self.b and max(seqlens) <= self.max_pages * 64
        pages = sum(-(-L // 64) for L in seqlens)
        batch = make_decode_batch(seqlens, s_q=self.s_q, h_q=self.h_q, dtype=BF16, device=DEVICE, causal=self.causal,
                                  generator=generator, extra_blocks=self.num_blocks - pages)
        self.q.copy_(batch.q)
        self.k_cache.copy_(batch.k_cache)
        self.block_table.fill_(-1)
        self.block_table[:, :batch.block_table.shape[1]].copy_(batch.block_table)
        self.cache_seqlens.copy_(batch.cache_seqlens)
        return batch

    def capture(self):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):            # warm-up off the capture: Triton compiles, the allocator fills
            for _ in range(2):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = self.step()
        return self.outputs


def replay_cases(b, capacity, gen):
    full = [capacity] * b
    rand = [int(x) for x in torch.randint(0, capacity + 1, (b,), generator=gen)]
    real = [capacity, 1, 63, 64, 65, 700][:b // 2]
    padded = real + [0] * (b - len(real))                  # a real batch padded to the captured size
    ragged = [0, 1, capacity, 64, 0, 4 * 64 + 1, capacity - 1, 2] * (b // 8 + 1)
    return [("random", rand), ("full capacity", full), ("padded", padded), ("all empty", [0] * b),
            ("ragged", ragged[:b]), ("random again", [int(x) for x in torch.randint(0, capacity + 1, (b,),
                                                                                    generator=gen)])]


@pytest.mark.parametrize("s_q,h_q", [(1, 16), (2, 128), (4, 16)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replay_with_new_lengths_and_tables(backend, s_q, h_q):
    needs_device_metadata()
    b, max_pages = 16, 24                                  # capacity 1536 tokens per sequence
    gen = torch.Generator().manual_seed(100 * s_q + h_q)
    step = CapturedStep(b, s_q, h_q, max_pages, num_blocks=b * max_pages + 5, backend=backend)
    step.load([700] * b, gen)
    g_md, g_ns, g_out, g_lse = step.capture()
    for name, seqlens in replay_cases(b, max_pages * 64, gen):
        batch = step.load(seqlens, gen)
        g_out.fill_(NAN)                                   # anything the replay fails to write shows up
        g_lse.fill_(NAN)
        step.graph.replay()
        torch.cuda.synchronize()
        check_metadata(batch, g_md, g_ns)
        assert_close(compare(g_out, g_lse, *reference_for(batch)), BF16, f"{backend} replay '{name}'")
        empty = batch.cache_seqlens.cpu() == 0
        assert torch.all(g_out[empty] == 0) and torch.all(torch.isneginf(g_lse[empty])), name
        # the replay is bit for bit the eager call on the same buffers
        _, _, out, lse = step.step()
        assert torch.equal(out, g_out) and torch.equal(lse, g_lse), f"{backend} replay '{name}' vs eager"


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replays_on_a_side_stream_and_repeats(backend):
    """Replaying the same inputs many times, also from another stream, gives the same bits."""
    needs_device_metadata()
    gen = torch.Generator().manual_seed(7)
    step = CapturedStep(8, 2, 64, 40, num_blocks=8 * 40, backend=backend)
    step.load([2560, 0, 1, 100, 2000, 64, 65, 0], gen)
    _, _, g_out, g_lse = step.capture()
    step.graph.replay()
    first = (g_out.clone(), g_lse.clone())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):
            step.graph.replay()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(first[0], g_out) and torch.equal(first[1], g_lse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graph_replay_long_sequences_many_pieces(backend):
    """The combine kernel inside a graph, launched as a programmatic dependent of the split kernel (the default):
    one capture over long sequences, replayed with plans that cut one sequence into ~130 pieces, split several
    with L = 0 rows between them, or split nothing. Outputs start as NaN before every replay."""
    needs_device_metadata()
    b, max_pages = 4, 640                                  # capacity 40960 tokens per sequence
    gen = torch.Generator().manual_seed(12)
    step = CapturedStep(b, 1, 16, max_pages, num_blocks=b * max_pages, backend=backend)
    step.load([20000] * b, gen)
    g_md, g_ns, g_out, g_lse = step.capture()
    cases = [("one long", [40960, 0, 0, 0]), ("padded", [0, 33851, 0, 9001]), ("short", [1, 64, 0, 65]),
             ("all empty", [0] * b), ("full", [40960] * b), ("one long again", [0, 0, 0, 40000])]
    for name, seqlens in cases:
        batch = step.load(seqlens, gen)
        g_out.fill_(NAN)
        g_lse.fill_(NAN)
        step.graph.replay()
        torch.cuda.synchronize()
        check_metadata(batch, g_md, g_ns)
        assert_close(compare(g_out, g_lse, *reference_for(batch, on_device=True)), BF16, f"{backend} '{name}'")
        empty = batch.cache_seqlens == 0
        assert torch.all(g_out[empty] == 0) and torch.all(torch.isneginf(g_lse[empty])), name
        _, _, out, lse = step.step()
        assert torch.equal(out, g_out) and torch.equal(lse, g_lse), f"{backend} '{name}': replay vs eager"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_host_sync(backend):
    """Neither call synchronises with the host (validation included), so both can be captured."""
    needs_device_metadata()
    batch = gpu_batch([4097, 0, 65, 300, 1], 2, 64, seed=1)
    md, ns = plan(batch)
    decode(batch, md, ns, backend)                        # warm-up: compiles Triton kernels, fills caches
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        md, ns = plan(batch)
        out, lse = decode(batch, md, ns, backend)
        with pytest.raises(RuntimeError):                 # the mode is on: a host read is caught
            batch.cache_seqlens.tolist()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    assert_close(compare(out, lse, *reference_for(batch)), BF16, backend)


def test_debug_mode_synchronises_and_checks(monkeypatch):
    """FLASH_MLA_DEBUG=1 reads the tensors (a host sync, so not while capturing a graph) and names bad entries."""
    needs_device_metadata()
    batch = gpu_batch([4097, 0, 65, 300], 1, 16, seed=2)
    md, ns = plan(batch)
    monkeypatch.setenv("FLASH_MLA_DEBUG", "1")
    out, lse = decode(batch, md, ns, None)                # valid input passes
    assert_close(compare(out, lse, *reference_for(batch)), BF16, "debug mode")
    bad = batch.block_table.clone()
    bad[3, 4] = batch.k_cache.shape[0] + 10               # the last of sequence 3's 5 pages
    with pytest.raises(ValueError, match=r"block_table\[3, 4\]: expected a block index in \[0, "):
        decode(batch, md, ns, None, block_table=bad)
    stale_md, stale_ns = get_mla_metadata(batch.cache_seqlens.flip(0), 16, 1)
    with pytest.raises(ValueError, match=r"(num_splits|tile_scheduler_metadata): expected the get_mla_metadata"):
        decode(batch, stale_md, stale_ns, None)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            decode(batch, md, ns, None)
    finally:
        torch.cuda.set_sync_debug_mode(previous)


# ---------------------------------------------------------------------------------------------------------------
# padded batches, bad input, NaN/Inf
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("garbage", [-1, 2 ** 31 - 1, -(2 ** 31), 12345], ids=["minus1", "int_max", "int_min", "big"])
@pytest.mark.parametrize("s_q,h_q,causal", [(1, 128, False), (2, 64, True), (4, 16, True)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_batch(backend, s_q, h_q, causal, garbage):
    """CUDA-graph padding: rows with L = 0 never read their block table, q or the cache; out 0, lse -inf."""
    real = [4097, 1, 300, 65, 0, 64]
    seqlens = real + [0] * 10
    batch = gpu_batch(seqlens, s_q, h_q, seed=3, causal=causal)
    batch.block_table[len(real):] = garbage
    batch.q[len(real):] = NAN
    md, ns = plan(batch)
    poison_cuda_allocator(4 * (len(seqlens) + md.shape[0]) * s_q * h_q * 512 * 4)
    out, lse = decode(batch, md, ns, backend)
    torch.cuda.synchronize()
    assert torch.equal(out[len(real):], torch.zeros_like(out[len(real):]))
    assert torch.isneginf(lse[len(real):]).all()
    assert_close(compare(out, lse, *reference_for(batch)), BF16, f"{backend} padded, garbage {garbage}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_on_the_gpu(backend):
    batch = gpu_batch([5, 70, 0], 1, 16, seed=4)
    md, ns = plan(batch)
    fields = {"q": batch.q, "k_cache": batch.k_cache, "block_table": batch.block_table,
              "cache_seqlens": batch.cache_seqlens, "head_dim_v": 512, "tile_scheduler_metadata": md,
              "num_splits": ns, "causal": True, "backend": backend}
    for arg in ("k_cache", "block_table", "cache_seqlens", "tile_scheduler_metadata", "num_splits"):
        args = dict(fields, **{arg: fields[arg].cpu()})
        with pytest.raises(ValueError, match=rf"^flash_mla_with_kvcache: {arg}: expected a tensor on cuda:0 "
                                             r"\(the device of q\), got a tensor on cpu$"):
            flash_mla_with_kvcache(**args)
    with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: k_cache: expected a tensor on cpu"):
        flash_mla_with_kvcache(**dict(fields, q=batch.q.cpu()))
    with pytest.raises(TypeError, match=r"^flash_mla_with_kvcache: k_cache: expected the dtype of q"):
        flash_mla_with_kvcache(**dict(fields, q=batch.q.half()))
    with pytest.raises(RuntimeError, match=r"backend 'cpu' was requested but is unavailable"):
        flash_mla_with_kvcache(**dict(fields, backend="cpu"))
    other = dict(fields)
    other["tile_scheduler_metadata"], other["num_splits"] = get_mla_metadata(batch.cache_seqlens[:2], 16, 1)
    with pytest.raises(ValueError, match=r"^flash_mla_with_kvcache: num_splits: .*batch"):
        flash_mla_with_kvcache(**other)
    # nothing ran: the stream is still healthy
    out, lse = flash_mla_with_kvcache(**fields)
    torch.cuda.synchronize()
    assert_close(compare(out, lse, *reference_for(batch)), BF16, "after bad input")


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_q_stays_in_its_rows(backend):
    """NaN/Inf in q is not checked (debug mode does): the call completes, only the affected rows are off (NaN in
    out, or out 0 with a non-finite lse), every other row is exact."""
    batch = gpu_batch([300, 70, 20000, 0, 9], 2, 16, seed=5)
    bad = [(0, 1, 3, NAN), (2, 0, 15, math.inf), (4, 1, 0, -math.inf), (2, 1, 4, NAN)]   # (seq, token, head, value)
    for seq, token, head, value in bad:
        batch.q[seq, token, head, 17] = value
    ref_out, ref_lse = reference_for(batch)
    md, ns = plan(batch)
    out, lse = decode(batch, md, ns, backend)
    torch.cuda.synchronize()
    out, lse = out.float().cpu(), lse.cpu()
    for seq, token, head, _ in bad:
        o, l_ = out[seq, token, head], float(lse[seq, head, token])
        assert bool(torch.isnan(o).any()) or (bool((o == 0).all()) and not math.isfinite(l_)), (seq, token, head)
        out[seq, token, head] = ref_out[seq, token, head] = 0        # compare the rest
        lse[seq, head, token] = ref_lse[seq, head, token] = 0
    assert_close(compare(out, lse, ref_out, ref_lse), BF16, f"{backend}: the other rows")


# ---------------------------------------------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("s_q,h_q", [(1, 16), (2, 128), (3, 64)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_deterministic(backend, s_q, h_q):
    batch = gpu_batch([9000, 100, 0, 20000, 4097, 1], s_q, h_q, seed=6)
    md, ns = plan(batch)
    first = decode(batch, md, ns, backend)
    for _ in range(5):
        again = decode(batch, md, ns, backend)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    # the same values at other addresses, with a fresh plan
    md2, ns2 = get_mla_metadata(batch.cache_seqlens.clone(), s_q * h_q, 1)
    copies = decode(batch, md2, ns2, backend, k_cache=batch.k_cache.clone(), block_table=batch.block_table.clone(),
                    cache_seqlens=batch.cache_seqlens.clone())
    assert torch.equal(first[0], copies[0]) and torch.equal(first[1], copies[1])


# ---------------------------------------------------------------------------------------------------------------
# limits: 64-bit offsets everywhere (python3 -m pytest tests/test_gpu_hardening.py -k limits)
# ---------------------------------------------------------------------------------------------------------------

ONE_MILLION = 1 << 20


@pytest.mark.parametrize("seqlens,s_q,h_q", [([ONE_MILLION], 1, 128), ([ONE_MILLION, 0, 777, 300001], 2, 16)],
                         ids=["b1_h128", "b4_h16_sq2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_limits_one_million_tokens(backend, seqlens, s_q, h_q):
    """A 1,048,576-token sequence (a 1.2 GB bf16 cache), split over every SM part; float32 reference on the GPU."""
    batch = gpu_batch(seqlens, s_q, h_q, seed=8)
    md, ns = plan(batch)
    check_metadata(batch, md, ns)
    out, lse = decode(batch, md, ns, backend)
    torch.cuda.synchronize()
    assert_close(compare(out, lse, *reference_for(batch, on_device=True)), BF16, f"{backend} L = 2^20")


def test_limits_metadata_many_long_sequences():
    """The device scheduler at b = 16384 with lengths up to 2^20 (its int32 cost prefix reaches 2.7e8)."""
    needs_device_metadata()
    gen = torch.Generator().manual_seed(9)
    for seqlens in (torch.full((16384,), ONE_MILLION, dtype=torch.int32),
                    torch.randint(0, ONE_MILLION + 1, (16384,), generator=gen, dtype=torch.int32)):
        for rows in (16, 128):
            md, ns = get_mla_metadata(seqlens.to(DEVICE), rows, 1)
            twin_md, twin_ns = get_mla_metadata_twin(seqlens, rows, 1, num_sms())
            assert torch.equal(md.cpu(), twin_md) and torch.equal(ns.cpu(), twin_ns), f"rows={rows}"


# Block index whose page straddles element 2^31 of a (num_blocks, 64, 1, 576) cache: 2^31 // (64 * 576).
STRADDLE_BLOCK = 2 ** 31 // (64 * 576)


@pytest.mark.parametrize("backend", BACKENDS)
def test_limits_cache_beyond_2_32_elements(backend):
    """A 131072-block cache (4.8e9 elements, 9.7 GB): half the pages live around element 2^31, half at the very
    end of the cache, so any 32-bit (signed or unsigned) element or byte offset wraps."""
    num_blocks = 1 << 17
    assert num_blocks * 64 * 576 > 2 ** 32
    small = gpu_batch([5000, 0, 64, 130, 70000, 1], 2, 64, seed=10, extra_blocks=0)
    n = small.k_cache.shape[0]
    first_half = n // 2
    physical = torch.cat([torch.arange(STRADDLE_BLOCK - first_half // 2, STRADDLE_BLOCK - first_half // 2 + first_half),
                          torch.arange(num_blocks - (n - first_half), num_blocks)]).to(device=DEVICE,
                                                                                        dtype=torch.int32)
    assert int(physical.max()) == num_blocks - 1 and bool((physical == STRADDLE_BLOCK).any())
    big_cache = torch.full((num_blocks, 64, 1, 576), NAN, dtype=BF16, device=DEVICE)
    big_cache[physical.long()] = small.k_cache
    table = small.block_table
    big_table = torch.where(table >= 0, physical[table.clamp(min=0).long()], table)
    big = DecodeBatch(q=small.q, k_cache=big_cache, block_table=big_table, cache_seqlens=small.cache_seqlens,
                      causal=True)
    md, ns = plan(big)
    out, lse = decode(big, md, ns, backend)
    torch.cuda.synchronize()
    assert_close(compare(out, lse, *reference_for(small, on_device=True)), BF16, f"{backend} pages past 2^31")


@pytest.mark.parametrize("backend", BACKENDS)
def test_limits_batch_16384_q_and_out_beyond_2_31_elements(backend):
    """b = 16384, s_q = 3, h_q = 128: q has 3.6e9 elements, out 3.2e9, the workspace 3.2e9 floats. Every row is
    written (outputs come from NaN-poisoned memory); a sample of sequences from both ends and the middle is
    checked against the float32 reference."""
    b, s_q, h_q = 16384, 3, 128
    gen = torch.Generator().manual_seed(11)
    seqlens = [int(x) for x in torch.randint(0, 130, (b,), generator=gen)]
    for i in range(0, b, 9):
        seqlens[i] = 0
    seqlens[-1] = 129
    batch = gpu_batch(seqlens, s_q, h_q, seed=12)
    torch.cuda.empty_cache()                              # the float32 draws behind q (14.5 GB) go back
    assert batch.q.numel() > 2 ** 31 and b * s_q * h_q * 512 > 2 ** 31
    md, ns = plan(batch)
    slots = b + md.shape[0]
    poison_cuda_allocator(b * s_q * h_q * 512 * 2 + slots * s_q * h_q * 512 * 4)
    out, lse = decode(batch, md, ns, backend)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(out).any()) and not bool(torch.isnan(lse).any()), "unwritten or NaN outputs"
    lengths = batch.cache_seqlens
    assert bool((out[lengths == 0] == 0).all()) and bool(torch.isneginf(lse[lengths == 0]).all())
    sample = torch.cat([torch.arange(48), torch.arange(b - 48, b), torch.randint(48, b - 48, (32,), generator=gen)])
    idx = sample.to(DEVICE)
    part = DecodeBatch(q=batch.q[idx], k_cache=batch.k_cache, block_table=batch.block_table[idx],
                       cache_seqlens=lengths[idx], causal=True)
    ref_out, ref_lse = reference_for(part, on_device=True)
    assert_close(compare(out[idx], lse[idx], ref_out, ref_lse), BF16, f"{backend} b = 16384 sample")
