"""Building realistic decoding batches and comparing results, shared by tests, benchmarks and the CLI."""
from __future__ import annotations

import math
import os
import shutil
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import torch

from ._geometry import HEAD_DIM_QK, HEAD_DIM_V, PAGE_BLOCK_SIZE
from .fp8 import FP8_DTYPE, FP8_MAX
from .reference import mla_decode_reference


@dataclass
class DecodeBatch:
    q: torch.Tensor              # (b, s_q, h_q, 576)
    k_cache: torch.Tensor        # (num_blocks, 64, h_kv, 576)
    block_table: torch.Tensor    # (b, max_blocks_per_seq) int32, -1 past each sequence's pages
    cache_seqlens: torch.Tensor  # (b,) int32
    causal: bool

    @property
    def shape(self) -> Dict[str, int]:
        b, s_q, h_q, _ = self.q.shape
        return dict(b=b, s_q=s_q, h_q=h_q, h_kv=self.k_cache.shape[2])


def make_decode_batch(seqlens: Sequence[int], s_q: int = 1, h_q: int = 16, h_kv: int = 1,
                      dtype: torch.dtype = torch.bfloat16, device="cpu", causal: bool = False,
                      generator: Optional[torch.Generator] = None, nan_past_end: bool = True,
                      shuffle_pages: bool = True, extra_blocks: int = 3) -> DecodeBatch:
    """A batch with pages in random physical order, NaN in every cache slot past a sequence's length,
    -1 in block_table entries past a sequence's pages, and `extra_blocks` unused (NaN) blocks in the pool.

    `generator` is a CPU generator; the data is drawn on `device` itself (a seeded generator there), so large
    GPU batches cost no host-side random numbers or copies."""
    device = torch.device(device)
    b = len(seqlens)
    pages = [-(-int(L) // PAGE_BLOCK_SIZE) for L in seqlens]
    max_pages = max(max(pages), 1)
    num_blocks = sum(pages) + extra_blocks
    perm = torch.randperm(num_blocks, generator=generator) if shuffle_pages else torch.arange(num_blocks)
    block_table = torch.full((b, max_pages), -1, dtype=torch.int32)
    valid = torch.zeros(num_blocks, PAGE_BLOCK_SIZE, dtype=torch.bool)
    used = 0
    for i, (L, n) in enumerate(zip(seqlens, pages)):
        phys = perm[used:used + n]
        used += n
        block_table[i, :n] = phys.int()
        valid[phys] = (torch.arange(n * PAGE_BLOCK_SIZE) < int(L)).reshape(n, PAGE_BLOCK_SIZE)
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    k_cache = torch.randn(num_blocks, PAGE_BLOCK_SIZE, h_kv, HEAD_DIM_QK, generator=dev_gen, device=device).to(dtype)
    if nan_past_end:
        k_cache[~valid.to(device)] = math.nan
    q = torch.randn(b, s_q, h_q, HEAD_DIM_QK, generator=dev_gen, device=device).to(dtype)
    return DecodeBatch(q=q, k_cache=k_cache, block_table=block_table.to(device),
                       cache_seqlens=torch.tensor([int(L) for L in seqlens], dtype=torch.int32, device=device),
                       causal=causal)


@dataclass
class Fp8DecodeBatch:
    """A decoding batch over an FP8 KV cache, as the kernels take it (stored values and their scales)."""
    q: torch.Tensor                      # (b, s_q, h_q, 576): float8_e4m3fn (stored values), or bf16 / fp16
    k_cache: torch.Tensor                # (num_blocks, 64, h_kv, 576) float8_e4m3fn (stored values)
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    causal: bool
    descale_q: Optional[torch.Tensor]    # (1,) float32 for an fp8 q, else None
    descale_k: torch.Tensor              # (1,) float32

    def dequantized(self) -> DecodeBatch:
        """The true values, float32: stored * descale (what the float32 reference is computed on)."""
        q = self.q.float() if self.descale_q is None else self.q.float() * self.descale_q
        return DecodeBatch(q=q, k_cache=self.k_cache.float() * self.descale_k, block_table=self.block_table,
                           cache_seqlens=self.cache_seqlens, causal=self.causal)

    def args(self):
        """(q, k_cache, block_table, cache_seqlens): the first four arguments of the decode calls."""
        return self.q, self.k_cache, self.block_table, self.cache_seqlens


# fp8 codes written into every cache slot past a sequence's length: NaN (0x7F, 0xFF) and +-448 (0x7E, 0xFE)
FP8_GARBAGE_CODES = (0x7F, 0xFF, 0x7E, 0xFE)


def make_fp8_decode_batch(seqlens: Sequence[int], s_q: int = 1, h_q: int = 16, h_kv: int = 1,
                          q_dtype: torch.dtype = FP8_DTYPE, descale_q: float = 1.0, descale_k: float = 1.0,
                          device="cpu", causal: bool = False, generator: Optional[torch.Generator] = None,
                          **kwargs) -> Fp8DecodeBatch:
    """An FP8 batch with the layout of make_decode_batch (pages shuffled, -1 past each sequence's pages).

    True values are N(0, 1) whatever the scales; stored = clamp(true / descale, -448, 448) rounded to
    float8_e4m3fn, so the descales choose which fp8 codes the data uses (a large descale: small and subnormal
    codes; a small one: large codes, the tail saturating at 448), while the attention scores keep their usual
    spread. q_dtype bf16 / fp16: q is unscaled (descale_q is ignored and None). Every cache slot past a sequence's
    length, and every unused block, holds NaN or +-448 codes (FP8_GARBAGE_CODES in turn): the kernels must never
    read them."""
    device = torch.device(device)
    base = make_decode_batch(seqlens, s_q=s_q, h_q=h_q, h_kv=h_kv, dtype=torch.float32, device=device,
                             causal=causal, generator=generator, nan_past_end=True, **kwargs)
    dk = torch.tensor([descale_k], dtype=torch.float32, device=device)
    garbage = torch.isnan(base.k_cache)
    k_cache = (base.k_cache / dk).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    codes = torch.tensor(FP8_GARBAGE_CODES, dtype=torch.uint8, device=device)
    n = int(garbage.sum())
    k_cache.view(torch.uint8)[garbage] = codes[torch.arange(n, device=device) % len(codes)]
    if q_dtype == FP8_DTYPE:
        dq = torch.tensor([descale_q], dtype=torch.float32, device=device)
        q = (base.q / dq).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    else:
        dq, q = None, base.q.to(q_dtype)
    return Fp8DecodeBatch(q=q, k_cache=k_cache, block_table=base.block_table, cache_seqlens=base.cache_seqlens,
                          causal=causal, descale_q=dq, descale_k=dk)


def make_attn_sink(h_q: int, generator: Optional[torch.Generator] = None, device="cpu") -> torch.Tensor:
    """(h_q,) float32 sink logits for tests: values around the lse of rows with tens to hundreds of keys (where
    the sink changes the output the most), plus the edge cases in heads 0-3: +inf (out 0), -inf (no effect),
    60 (out scaled by ~e^-55, i.e. nearly 0 but not quite), 0."""
    sink = torch.randn(h_q, generator=generator) * 2 + 4
    edges = torch.tensor([math.inf, -math.inf, 60.0, 0.0])[:h_q]
    sink[:len(edges)] = edges
    return sink.to(device)


def random_seqlens(b: int, mean: int, s_q: int = 1, varlen: bool = True,
                   generator: Optional[torch.Generator] = None) -> list:
    """Upstream's benchmark lengths: all `mean`, or ~N(mean, mean/2) clipped to at least s_q."""
    if not varlen:
        return [mean] * b
    lens = torch.normal(float(mean), mean / 2, (b,), generator=generator)
    return [max(int(x), s_q) for x in lens.tolist()]


def reference_for(batch: DecodeBatch, softmax_scale: Optional[float] = None, on_device: bool = False,
                  attn_sink: Optional[torch.Tensor] = None):
    """float32 reference (out, lse): on the CPU, or on the batch's device (TF32 off) for large GPU batches."""
    if on_device:
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return mla_decode_reference(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens.cpu(),
                                        HEAD_DIM_V, softmax_scale, batch.causal, attn_sink=attn_sink)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    return mla_decode_reference(batch.q.cpu(), batch.k_cache.cpu(), batch.block_table.cpu(),
                                batch.cache_seqlens.cpu(), HEAD_DIM_V, softmax_scale, batch.causal,
                                attn_sink=None if attn_sink is None else attn_sink.cpu())


def poison_cuda_allocator(nbytes: int, device="cuda") -> None:
    """Fill `nbytes` of the caching allocator's free memory with NaN and release it, so that tensors a call
    allocates next (its outputs) start as NaN: an element the kernels fail to write then shows up as NaN."""
    block = torch.full((nbytes // 4 + 1,), math.nan, dtype=torch.float32, device=device)
    del block


def compare(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor) -> Dict[str, float]:
    """Error metrics: relative L2 of out and of lse (finite entries), cosine difference of out, and counts of
    NaN and of lse -inf disagreements. Every figure is 0 for a perfect result."""
    out, lse = out.detach().float().cpu(), lse.detach().float().cpu()
    ref_out, ref_lse = ref_out.float().cpu(), ref_lse.float().cpu()
    finite = torch.isfinite(ref_lse)
    eps = 1e-12
    d_out, r_out = out.double().flatten(), ref_out.double().flatten()
    cos = (d_out @ r_out) / (d_out.norm() * r_out.norm()).clamp_min(eps)
    lse_err = ((lse[finite] - ref_lse[finite]).norm() / ref_lse[finite].norm().clamp_min(eps)).item() \
        if finite.any() else 0.0
    return dict(
        out_rel_l2=((out - ref_out).norm() / ref_out.norm().clamp_min(eps)).item(),
        lse_rel_l2=lse_err,
        cos_diff=(1 - cos).item() if r_out.norm() > 0 else (0.0 if d_out.norm() == 0 else 1.0),
        nan=int(torch.isnan(out).sum() + torch.isnan(lse).sum()),
        inf_mismatch=int((torch.isneginf(lse) != torch.isneginf(ref_lse)).sum()),
    )


TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
COS_TOLERANCE = 1e-5


def assert_close(metrics: Dict[str, float], dtype: torch.dtype, what: str = "") -> None:
    tol = TOLERANCE[dtype]
    assert metrics["nan"] == 0, f"{what}: NaN in output: {metrics}"
    assert metrics["inf_mismatch"] == 0, f"{what}: lse -inf pattern differs from the reference: {metrics}"
    assert metrics["out_rel_l2"] < tol, f"{what}: out error {metrics}"
    assert metrics["lse_rel_l2"] < tol, f"{what}: lse error {metrics}"
    assert metrics["cos_diff"] < COS_TOLERANCE, f"{what}: cosine difference {metrics}"


SPARSE_OUT_TOL = 1e-2     # sparse decoding: relative L2 of out against the float32 reference on dequantised tokens
SPARSE_LSE_TOL = 1e-3     # and absolute error of the finite lse entries


def sparse_fp16_key_lse_bound(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                              topk_length: Optional[torch.Tensor] = None,
                              softmax_scale: Optional[float] = None) -> torch.Tensor:
    """(b, h_q, s_q): how far a row's lse may move in the cuda backend's kernel, which stores the latent keys of each
    page of 64 index slots in fp16 as 2^-E times their values (E: the exponent of the page's largest scale, rounded
    up, within [-60, 126]; tests/test_sparse_dequant.py) and rounds q's latent values to fp16. A key value is off by
    at most (2^-10 + 2^-22) |k| + 897 * 2^-25 * 2^E (two roundings, or fp16's subnormals where its factor or the
    product falls there), a q value by 2^-25 below fp16's normal range (exact above it: q is bf16), so score j by at
    most scale * sum_d (|q_d| dk_jd + dq_d |k_jd|) over the latent d, and lse, a smooth maximum of the scores, by at
    most the largest such move over the row's keys."""
    from .sparse_fp8 import LATENT_DIM, NUM_SCALES, SCALES_OFFSET, as_bytes, dequantize_kv_cache_v32
    b, s_q, h_q, d = q.shape
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    keys = dequantize_kv_cache_v32(k_cache.cpu()).reshape(-1, d)[:, :LATENT_DIM].abs().double()   # (tokens, 512)
    raw = as_bytes(k_cache.cpu()).reshape(-1, as_bytes(k_cache).shape[-1])
    scales = raw[:, SCALES_OFFSET:SCALES_OFFSET + 4 * NUM_SCALES].contiguous().view(torch.float32).abs()
    page_max = scales.amax(dim=-1)                                                                # (tokens,)
    qa = q.detach().cpu().float()[..., :LATENT_DIM].abs().double()
    dq = torch.where(qa < 2.0 ** -14, torch.full_like(qa, 2.0 ** -25), torch.zeros_like(qa))
    idx = indices.cpu().long()
    bound = torch.zeros(b, h_q, s_q)
    for i in range(b):
        n = idx.shape[-1] if topk_length is None else max(0, min(int(topk_length[i]), idx.shape[-1]))
        for s in range(s_q):
            slots = idx[i, s, :n]
            valid = (slots >= 0) & (slots < keys.shape[0])
            if not valid.any():
                continue
            pos = torch.arange(n)[valid]
            tok = slots[valid]
            # the page exponent of every valid slot's page (64 slots of the row's index list)
            page = pos // 64
            m = torch.zeros(int(page.max()) + 1, dtype=torch.float32).scatter_reduce(0, page, page_max[tok], "amax")
            e = torch.ceil(torch.log2(m.double().clamp_min(2.0 ** -149))).clamp(-60, 126)[page]     # (keys,)
            k = keys[tok]                                                                          # (keys, 512)
            dk = (2.0 ** -10 + 2.0 ** -22) * k + 897.0 * 2.0 ** -25 * (2.0 ** e)[:, None]
            move = qa[i, s] @ dk.T + dq[i, s] @ k.T                                                # (h_q, keys)
            bound[i, :, s] = (move.amax(dim=-1) * scale).float()
    return bound


def assert_sparse_close(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor,
                        what: str = "", lse_bound: Optional[torch.Tensor] = None) -> None:
    """A sparse decoding result (out (b, s_q, h_q, 512), lse (b, h_q, s_q)) against sparse_decode_reference: out
    finite, lse neither NaN nor +inf, -inf exactly where the reference has it (rows with no valid index) and out 0
    there, the finite lse within SPARSE_LSE_TOL (plus `lse_bound`, per row: sparse_fp16_key_lse_bound for a
    backend that rounds the dequantised keys), out within SPARSE_OUT_TOL (all 0 when the reference is)."""
    out, lse = out.detach().cpu().float(), lse.detach().cpu()
    ref_out, ref_lse = ref_out.cpu().float(), ref_lse.cpu()
    assert torch.isfinite(out).all(), f"{what}: non-finite output (unwritten, or a masked slot read)"
    assert not torch.isnan(lse).any() and not torch.isposinf(lse).any(), f"{what}: NaN / +inf lse"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"{what}: lse -inf pattern differs"
    no_key = torch.isneginf(ref_lse).transpose(1, 2)                       # (b, s_q, h_q)
    assert (out[no_key] == 0).all(), f"{what}: rows with no valid index must be 0"
    finite = torch.isfinite(ref_lse)
    if finite.any():
        excess = (lse - ref_lse).abs() - (SPARSE_LSE_TOL if lse_bound is None else SPARSE_LSE_TOL + lse_bound.cpu())
        worst = excess[finite].max().item()
        err = (lse[finite] - ref_lse[finite]).abs().max().item()
        assert worst < 0, f"{what}: lse abs error {err:.2e} exceeds its tolerance by {worst:.2e}"
    norm = ref_out.norm()
    if norm > 0:
        rel = ((out - ref_out).norm() / norm).item()
        assert rel < SPARSE_OUT_TOL, f"{what}: out rel-L2 {rel:.2e}"
    else:
        assert (out == 0).all(), what


def cuda_median_seconds(fn: Callable[[], object], reps: int = 15, calls_per_rep: int = 10, warmup: int = 3) -> float:
    """Median seconds per fn() call on the current CUDA stream. Each timed rep runs `calls_per_rep` calls back to
    back between one pair of events, so the GPU queue stays full and host-side overhead (Python validation,
    launches) overlaps the kernels instead of adding to them, as in a serving engine's decode loop."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls_per_rep):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls_per_rep)
    return statistics.median(times)


def capture_cuda_graph(step: Callable[[], object]):
    """One eager call of step() on a side stream (the warm-up: Triton compiles and the allocator settles outside any
    capture), then one call captured in a CUDA graph. Returns (graph, eager result, captured result); each replay
    recomputes the captured result's tensors in place."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    return graph, eager, captured


def cuda_graph_median_seconds(fns: Sequence[Callable[[], object]], reps: int = 15) -> float:
    """Median seconds per call of `fns`, all captured in order in one CUDA graph and replayed `reps` times (each
    replay timed by CUDA events): no launch overhead, as in an engine that captures its decode step. The first
    call of each distinct fn runs once on a side stream before the capture (allocator, Triton compiles)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in {id(fn): fn for fn in fns}.values():
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(fns))
    return statistics.median(times)


def cpu_median_seconds(fn: Callable[[], object], reps: int = 5, calls_per_rep: int = 1, warmup: int = 1) -> float:
    """Median wall-clock seconds per fn() call (host timing: CPU work, or host-side overhead of a GPU call)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls_per_rep):
            fn()
        times.append((time.perf_counter() - t0) / calls_per_rep)
    return statistics.median(times)


def decode_flops_and_bytes(seqlens: Sequence[int], s_q: int, h_q: int, h_kv: int):
    """SPEC.md "Targets": FLOPs = 2 s_q sum(L) h_q (576 + 512); bytes = the cache once + q + out (2-byte types)."""
    total, b = sum(int(L) for L in seqlens), len(seqlens)
    flops = 2 * s_q * total * h_q * (HEAD_DIM_QK + HEAD_DIM_V)
    nbytes = 2 * (total * h_kv * HEAD_DIM_QK + b * s_q * h_q * HEAD_DIM_QK + b * s_q * h_q * HEAD_DIM_V)
    return flops, nbytes


def find_nvcc() -> Optional[str]:
    """nvcc on PATH, else under CUDA_HOME (default /usr/local/cuda), else None: the CPU tests that compile the
    kernels or the host-side checks use it."""
    candidate = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "nvcc"
    return shutil.which("nvcc") or (str(candidate) if candidate.exists() else None)
