"""flash_mla against the alternatives, every figure also as a fraction of the GPU's own ceilings.

    python benchmarks/bench_flash_mla.py                        # full sweep on a Hopper GPU (~5 min on an H100)
    python benchmarks/bench_flash_mla.py --quick                # 4 reference rows + the skewed batch (CI)
    python benchmarks/bench_flash_mla.py --device cpu --smoke   # tiny shapes, cpu backend + torch baseline

Steps:
1. Ceilings, measured first in the same process: device-to-device copy GB/s (bytes read + written) and bf16
   8192^3 matmul TFLOP/s (benchmarks/ceilings.py; on the CPU, small stand-ins).
2. Workload groups (--workloads), all bf16, h_kv = 1, causal:
   reference  SPEC "Targets" table: b = 128, mean L in {4096, 8192, 16384}, h_q in {16, 32, 64, 128}, s_q in
              {1, 2}, fixed and variable lengths (~N(mean, mean/2), at least s_q); same lengths and data seeds as
              `python tests/test_flash_mla.py`.
   long       long contexts at small batch: b in {1, 4, 16} x L in {32k, 64k, 128k}, s_q = 1, h_q = 16
              (DeepSeek-V3 at tensor-parallel 8: memory-bound, the bytes floor is the bound) and h_q = 128 (one
              GPU holds all 128 heads: ~240 FLOP per byte, so these rows are compute-bound and the bytes floor
              is out of reach below ~450 TFLOP/s; `roof_us` in the CSV accounts for compute).
   skewed     b = 4, lengths 4641 / 45118 / 1730 / 1696, s_q = 4, h_q = 16.
   specdec    speculative decoding: b = 32, L = 8192, h_q = 16 (DeepSeek-V3 at tensor-parallel 8), s_q = 1..8.
   short      many short sequences: b = 1024, L = 512, s_q = 1, h_q = 16 and 128.
3. Backends (--backends): cuda (flash_mla's Hopper kernels), triton (flash_mla's portable backend), torch
   (benchmarks/baselines.py: paged gather + matmul/softmax, gather included in the timed call), flashinfer
   (flashinfer.mla.BatchMLAPagedAttentionWrapper, when importable), cpu (flash_mla's CPU backend, --device cpu).
4. Correctness before timing: flash_mla (cuda, or cpu on --device cpu) against the float32 reference, every other
   backend against flash_mla's output (or the reference when flash_mla is not run), with the test suite's
   tolerances; one that misses against flash_mla is checked against the reference too (two bf16 results may
   each be within tolerance of it yet twice that apart) and passes with a note if it is within tolerance there.
   A backend that fails is reported FAIL and not timed; out of memory is reported OOM, other errors ERROR.
5. Timing: flash_mla.testing.cuda_median_seconds (median over reps; calls back to back per event pair, 15 x 10
   like the test suite's sweep, fewer for slow backends to keep the run short), metadata/plans outside the timed
   region. No L2 flush (as in tests/test_flash_mla.py), but a workload whose bytes fit in a few L2s is cycled over
   several copies of q and the cache, so back-to-back calls cannot hit in L2.

Figures per row (SPEC.md "Targets"): FLOPs = 2 s_q sum(L) h_q (576 + 512); bytes = 2 (sum(L) h_kv 576 +
b s_q h_q 576 + b s_q h_q 512); floor = bytes / measured copy GB/s. Reference rows are judged against the SPEC
targets (memory-bound h_q s_q <= 64: 2900 GB/s at mean >= 8192, 2750 at 4096; compute-bound: 560 / 520 TFLOP/s),
the other groups against time <= 1.6 x floor. "speedup" is how much faster a backend is than the next slower one
on the same workload.

Output: a table on stdout, a CSV (--csv, default <out-dir>/bench_flash_mla.csv, rewritten after every workload)
and two PNG plots in --out-dir (needs matplotlib: pip install -e ".[bench]"; --plot-from CSV draws them later on
another machine). Exit status 1 when a flash_mla backend fails a correctness check or raises, else 0.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the repository: flash_mla
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                    # benchmarks/: baselines
from baselines import describe as describe_plan
from baselines import plan_torch_mla, score_mode, torch_mla_decode

import flash_mla
from flash_mla.backends import select_backend
from flash_mla.testing import (
    COS_TOLERANCE,
    TOLERANCE,
    cpu_median_seconds,
    cuda_median_seconds,
    decode_flops_and_bytes,
    make_decode_batch,
    random_seqlens,
    reference_for,
)

HERE = os.path.dirname(os.path.abspath(__file__))

HEAD_DIM_V = 512
GROUPS = ("reference", "long", "skewed", "specdec", "short")
SKEWED_LENGTHS = (4641, 45118, 1730, 1696)
FLOOR_LIMIT = 1.6                 # issue #4: non-reference rows within 1.6x of bytes / copy bandwidth
ROTATE_MIN_BYTES = 256 << 20      # cycle input copies until one pass over them is at least this (and 4 L2s)
OOM_ERRORS = tuple(e for e in (getattr(torch, "OutOfMemoryError", None),
                               getattr(torch.cuda, "OutOfMemoryError", None)) if e is not None)


# --------------------------------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------------------------------

@dataclass
class Workload:
    group: str
    name: str
    seqlens: list[int]
    s_q: int
    h_q: int
    seed: int
    mean: int                 # nominal context length (the x axis of the plots)
    varlen: bool = False
    h_kv: int = 1
    causal: bool = True

    @property
    def b(self) -> int:
        return len(self.seqlens)

    @property
    def rows(self) -> int:
        return self.s_q * self.h_q

    def flops_bytes(self) -> tuple[int, int]:
        return decode_flops_and_bytes(self.seqlens, self.s_q, self.h_q, self.h_kv)


def reference_workloads(quick: bool = False, smoke: bool = False) -> list[Workload]:
    """The SPEC table in tests/test_flash_mla.py's order; row i uses seed i for lengths and data, as there."""
    b, means, heads = (4, [256], [16, 64]) if smoke else (128, [4096, 8192, 16384], [16, 32, 64, 128])
    quick_rows = {(8192, 16, 1, False), (8192, 64, 1, True), (8192, 128, 1, False), (4096, 64, 2, True)}
    out = []
    for i, (mean, h_q, s_q, varlen) in enumerate(itertools.product(means, heads, [1, 2], [False, True])):
        if quick and not smoke and (mean, h_q, s_q, varlen) not in quick_rows:
            continue
        if quick and smoke and (h_q, s_q, varlen) not in {(16, 1, False), (64, 2, True)}:
            continue
        seqlens = random_seqlens(b, mean, s_q, varlen, generator=torch.Generator().manual_seed(i))
        out.append(Workload("reference", f"ref L={mean} h{h_q} s{s_q} {'var' if varlen else 'fix'}", seqlens,
                            s_q, h_q, seed=i, mean=mean, varlen=varlen))
    return out


def long_context_workloads(smoke: bool = False) -> list[Workload]:
    batches, lengths, heads = (((1, 2), (512, 1024), (16,)) if smoke
                               else ((1, 4, 16), (32768, 65536, 131072), (16, 128)))
    return [Workload("long", f"long b={b} L={L // 1024}k h{h_q}", [L] * b, 1, h_q, seed=1000 + i, mean=L)
            for i, (h_q, b, L) in enumerate(itertools.product(heads, batches, lengths))]


def skewed_workloads(smoke: bool = False) -> list[Workload]:
    lens = [L // 16 for L in SKEWED_LENGTHS] if smoke else list(SKEWED_LENGTHS)
    return [Workload("skewed", "skewed b=4 s4 h16", lens, 4, 16, seed=2000, mean=sum(lens) // len(lens),
                     varlen=True)]


def specdec_workloads(smoke: bool = False) -> list[Workload]:
    b, L, s_qs = (2, 300, (1, 2, 3)) if smoke else (32, 8192, range(1, 9))
    return [Workload("specdec", f"specdec b={b} L={L} h16 s{s}", [L] * b, s, 16, seed=3000 + s, mean=L)
            for s in s_qs]


def short_workloads(smoke: bool = False) -> list[Workload]:
    b, L, heads = (32, 64, (16,)) if smoke else (1024, 512, (16, 128))
    return [Workload("short", f"short b={b} L={L} h{h_q}", [L] * b, 1, h_q, seed=4000 + h_q, mean=L)
            for h_q in heads]


def build_workloads(groups: Sequence[str], quick: bool = False, smoke: bool = False) -> list[Workload]:
    """--quick: 4 reference rows + the skewed batch (other groups only when named explicitly)."""
    makers = {"reference": lambda: reference_workloads(quick, smoke), "long": lambda: long_context_workloads(smoke),
              "skewed": lambda: skewed_workloads(smoke), "specdec": lambda: specdec_workloads(smoke),
              "short": lambda: short_workloads(smoke)}
    out = []
    for g in groups:
        if g not in makers:
            raise ValueError(f"unknown workload group {g!r}; choose from {', '.join(GROUPS)}")
        out += makers[g]()
    return out


def spec_target(wl: Workload) -> tuple[str, float] | None:
    """("GB/s" | "TFLOP/s", value) for a reference row, None otherwise."""
    if wl.group != "reference":
        return None
    if wl.rows <= 64:
        return "GB/s", 2900.0 if wl.mean >= 8192 else 2750.0
    return "TFLOP/s", 560.0 if wl.mean >= 8192 else 520.0


# --------------------------------------------------------------------------------------------------------------
# ceilings
# --------------------------------------------------------------------------------------------------------------

def measure_ceilings(device: torch.device, smoke: bool) -> dict[str, float]:
    if device.type == "cuda":
        from ceilings import copy_bandwidth, matmul_tflops
        c = {"copy_GBps": copy_bandwidth(), "matmul_TFLOPs": matmul_tflops(),
             "what": "copy 2 GiB fp32 d2d, bf16 8192^3 matmul, medians of 20"}
        torch.cuda.empty_cache()
        return c
    nbytes, n = (16 << 20, 256) if smoke else (256 << 20, 2048)
    src = torch.randn(nbytes // 4)
    dst = torch.empty_like(src)
    t_copy = cpu_median_seconds(lambda: dst.copy_(src), reps=5)
    a = torch.randn(n, n, dtype=torch.bfloat16)
    bm = torch.randn(n, n, dtype=torch.bfloat16)
    t_mm = cpu_median_seconds(lambda: a @ bm, reps=3)
    return {"copy_GBps": 2 * nbytes / t_copy / 1e9, "matmul_TFLOPs": 2 * n ** 3 / t_mm / 1e12,
            "what": f"CPU stand-ins: copy {nbytes >> 20} MiB fp32, bf16 {n}^3 matmul"}


# --------------------------------------------------------------------------------------------------------------
# backends
# --------------------------------------------------------------------------------------------------------------

Runner = Callable[[int], tuple[torch.Tensor, torch.Tensor]]   # runner(i) runs on input copy i


class Backend:
    name = "?"
    compare_lse = True

    def unavailable(self, device: torch.device) -> str | None:
        return None

    def prepare(self, wl: Workload, inputs: Inputs) -> Runner:
        raise NotImplementedError


@dataclass
class Inputs:
    copies: list[tuple[torch.Tensor, torch.Tensor]]    # (q, k_cache) per copy
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor


class FlashMLABackend(Backend):
    def __init__(self, which: str):
        self.name = which

    def unavailable(self, device):
        try:
            select_backend(device, self.name)
        except (RuntimeError, ValueError) as e:
            return str(e)
        return None

    def prepare(self, wl, inputs):
        md, ns = flash_mla.get_mla_metadata(inputs.cache_seqlens, wl.rows // wl.h_kv, wl.h_kv)
        bt, sl, which, causal = inputs.block_table, inputs.cache_seqlens, self.name, wl.causal
        copies = inputs.copies

        def run(i):
            q, k = copies[i]
            return flash_mla.flash_mla_with_kvcache(q, k, bt, sl, HEAD_DIM_V, md, ns, causal=causal, backend=which)
        return run


class TorchBackend(Backend):
    name = "torch"

    def __init__(self, chunk_gb: float = 4.0):
        self.chunk_bytes = int(chunk_gb * (1 << 30))
        self.last_plan = ""

    def prepare(self, wl, inputs):
        q0 = inputs.copies[0][0]
        plan = plan_torch_mla(wl.seqlens, wl.s_q, wl.h_q, wl.h_kv, device=q0.device, dtype=q0.dtype,
                              chunk_budget_bytes=self.chunk_bytes, causal=wl.causal)
        self.last_plan = describe_plan(plan)
        bt, sl, causal, copies = inputs.block_table, inputs.cache_seqlens, wl.causal, inputs.copies

        def run(i):
            q, k = copies[i]
            return torch_mla_decode(q, k, bt, sl, plan, HEAD_DIM_V, causal=causal)
        return run


class FlashInferBackend(Backend):
    """flashinfer.mla.BatchMLAPagedAttentionWrapper. Its caches are separate (pages, 64, 512) latent and
    (pages, 64, 64) RoPE tensors, made from ours outside the timed region; its lse convention (base 2 in some
    versions) differs, so only `out` is compared."""
    name = "flashinfer"
    compare_lse = False

    def __init__(self):
        self._mod = None
        self._workspace = None

    def unavailable(self, device):
        if device.type != "cuda":
            return "flashinfer needs CUDA tensors"
        try:
            import flashinfer.mla as mod
        except Exception as e:   # noqa: BLE001  (not installed, or a broken install)
            return f"flashinfer is not importable ({type(e).__name__}: {e})"
        self._mod = mod
        return None

    def prepare(self, wl, inputs):
        if wl.h_kv != 1:
            raise RuntimeError("flashinfer's MLA wrapper needs h_kv = 1")
        q0, k0 = inputs.copies[0]
        dev, b, s_q = q0.device, wl.b, wl.s_q
        if self._workspace is None:
            self._workspace = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        pages = [-(-L // 64) for L in wl.seqlens]
        bt = inputs.block_table.cpu()
        kv_indices = torch.cat([bt[i, :n] for i, n in enumerate(pages)]).to(torch.int32).to(dev)
        kv_indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=dev)
        qo_indptr = torch.arange(0, (b + 1) * s_q, s_q, dtype=torch.int32, device=dev)
        kv_len = inputs.cache_seqlens.to(torch.int32)
        wrapper = self._mod.BatchMLAPagedAttentionWrapper(self._workspace)
        wrapper.plan(qo_indptr, kv_indptr, kv_indices, kv_len, wl.h_q, 512, 64, 64, wl.causal,
                     q0.shape[-1] ** -0.5, q0.dtype, k0.dtype)
        split = []
        for q, k in inputs.copies:
            qf = q.reshape(b * s_q, wl.h_q, q.shape[-1])
            split.append((qf[..., :512].contiguous(), qf[..., 512:].contiguous(),
                          k[:, :, 0, :512].contiguous(), k[:, :, 0, 512:].contiguous()))

        def run(i):
            q_nope, q_pe, ckv, kpe = split[i]
            out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
            return out.view(b, s_q, wl.h_q, 512), lse
        return run


def make_backend(name: str, args) -> Backend:
    if name in ("cuda", "triton", "cpu"):
        return FlashMLABackend(name)
    if name == "torch":
        return TorchBackend(args.torch_chunk_gb)
    if name == "flashinfer":
        return FlashInferBackend()
    raise ValueError(f"unknown backend {name!r}; choose from cuda, triton, cpu, torch, flashinfer")


# --------------------------------------------------------------------------------------------------------------
# correctness (the test suite's metrics and tolerances, computed on the device)
# --------------------------------------------------------------------------------------------------------------

def device_compare(out, lse, ref_out, ref_lse) -> dict[str, float]:
    """Same figures as flash_mla.testing.compare, without moving the tensors to the host."""
    out, lse, ref_out, ref_lse = out.float(), lse.float(), ref_out.float(), ref_lse.float()
    eps = 1e-12
    finite = torch.isfinite(ref_lse)
    d, r = out.double().flatten(), ref_out.double().flatten()
    r_norm, d_norm = r.norm(), d.norm()
    cos = (d @ r) / (d_norm * r_norm).clamp_min(eps)
    lse_err = ((lse[finite] - ref_lse[finite]).norm() / ref_lse[finite].norm().clamp_min(eps)).item() \
        if bool(finite.any()) else 0.0
    if r_norm > 0:
        cos_diff = (1 - cos).item()
    else:
        cos_diff = 0.0 if d_norm == 0 else 1.0
    return {"out_rel_l2": ((out - ref_out).norm() / ref_out.norm().clamp_min(eps)).item(),
            "lse_rel_l2": lse_err,
            "cos_diff": cos_diff,
            "nan": int(torch.isnan(out).sum() + torch.isnan(lse).sum()),
            "inf_mismatch": int((torch.isneginf(lse) != torch.isneginf(ref_lse)).sum())}


def verdict(m: dict[str, float], dtype: torch.dtype) -> str | None:
    """None when within the test suite's tolerances (flash_mla.testing.assert_close), else why not."""
    tol = TOLERANCE[dtype]
    if m["nan"]:
        return f"{m['nan']} NaN"
    if m["inf_mismatch"]:
        return f"lse -inf pattern differs in {m['inf_mismatch']} rows"
    if m["out_rel_l2"] >= tol:
        return f"out rel-L2 {m['out_rel_l2']:.2e} >= {tol}"
    if m["lse_rel_l2"] >= tol:
        return f"lse rel-L2 {m['lse_rel_l2']:.2e} >= {tol}"
    if m["cos_diff"] >= COS_TOLERANCE:
        return f"cos diff {m['cos_diff']:.2e} >= {COS_TOLERANCE}"
    return None


# --------------------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------------------

def choose_reps(t_one: float, budget_s: float, reps: int = 15, calls: int = 10) -> tuple[int, int]:
    """(reps, calls_per_rep): the test suite's 15 x 10 when that fits `budget_s`, else fewer calls, then fewer reps
    (at least 5 x 1)."""
    if reps * calls * t_one > budget_s:
        calls = max(1, min(calls, int(budget_s / (reps * t_one))))
    if reps * calls * t_one > budget_s:
        reps = max(5, int(budget_s / (calls * t_one)))
    return reps, calls


def time_runner(runner: Runner, n_copies: int, device: torch.device, budget_s: float) -> tuple[float, int, int]:
    """(median seconds per call, reps, calls_per_rep), cycling over the input copies."""
    counter = itertools.count()

    def fn():
        return runner(next(counter) % n_copies)
    if device.type == "cuda":
        t_one = cuda_median_seconds(fn, reps=3, calls_per_rep=1, warmup=1)
        reps, calls = choose_reps(t_one, budget_s)
        return cuda_median_seconds(fn, reps=reps, calls_per_rep=calls, warmup=2), reps, calls
    t_one = cpu_median_seconds(fn, reps=1, warmup=0)
    reps = max(1, min(5, int(budget_s / t_one)))
    if reps < 3:   # slow (CPU smoke runs): the one call already made is the measurement
        return t_one, 1, 1
    return cpu_median_seconds(fn, reps=reps, warmup=0), reps, 1


def rotation_copies(nbytes: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) or (50 << 20)
    want = max(ROTATE_MIN_BYTES, 4 * l2)
    return 1 if nbytes >= want else min(16, -(-want // nbytes))


# --------------------------------------------------------------------------------------------------------------
# progress
# --------------------------------------------------------------------------------------------------------------

class Progress:
    """tqdm when importable and stderr is a terminal; else a one-line bar of our own (terminal) or a line per 10%
    (logs). `write` prints a table line to stdout without tearing the bar."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.t0, self.desc = total, 0, time.time(), ""
        self.tty = enabled and sys.stderr.isatty()
        self.enabled = enabled
        self.bar = None
        self.last_decile = -1
        if self.tty:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="row", dynamic_ncols=True, leave=False)
            except ImportError:
                self.bar = None

    def _render(self):
        if not self.tty or self.bar is not None:
            return
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{time.time() - self.t0:6.0f}s {self.desc}")
        sys.stderr.write("\r\033[K" + line[:150])
        sys.stderr.flush()

    def set(self, desc: str):
        self.desc = desc
        if self.bar is not None:
            self.bar.set_description_str(desc)
        self._render()

    def update(self):
        self.done += 1
        if self.bar is not None:
            self.bar.update(1)
        elif self.tty:
            self._render()
        elif self.enabled:
            decile = 10 * self.done // max(self.total, 1)
            if decile != self.last_decile:
                self.last_decile = decile
                sys.stderr.write(f"progress: {self.done}/{self.total} workloads, {time.time() - self.t0:.0f} s\n")
                sys.stderr.flush()

    def write(self, line: str):
        if self.bar is not None:
            self.bar.write(line)
            return
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        print(line, flush=True)
        self._render()

    def close(self):
        if self.bar is not None:
            self.bar.close()
        elif self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


# --------------------------------------------------------------------------------------------------------------
# one workload
# --------------------------------------------------------------------------------------------------------------

CSV_FIELDS = ["group", "workload", "backend", "status", "b", "s_q", "h_q", "h_kv", "mean_L", "sum_L", "max_L",
              "varlen", "causal", "time_us", "GBps", "TFLOPs", "pct_copy", "pct_matmul", "floor_us", "t_over_floor",
              "roof_us", "t_over_roof", "speedup_vs_next", "x_vs_best", "target", "target_met", "out_rel_l2",
              "lse_rel_l2", "cos_diff", "checked_against", "reps", "calls_per_rep", "input_copies", "copy_GBps",
              "matmul_TFLOPs", "note"]


def free_device(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_workload(wl: Workload, backends: list[Backend], ceil: dict[str, float], args,
                 device: torch.device, progress: Progress) -> list[dict]:
    free_device(device)
    flops, nbytes = wl.flops_bytes()
    floor_s = nbytes / (ceil["copy_GBps"] * 1e9)
    roof_s = max(floor_s, flops / (ceil["matmul_TFLOPs"] * 1e12))
    base = {"group": wl.group, "workload": wl.name, "b": wl.b, "s_q": wl.s_q, "h_q": wl.h_q, "h_kv": wl.h_kv,
            "mean_L": wl.mean, "sum_L": sum(wl.seqlens), "max_L": max(wl.seqlens), "varlen": wl.varlen,
            "causal": wl.causal, "floor_us": floor_s * 1e6, "roof_us": roof_s * 1e6,
            "copy_GBps": ceil["copy_GBps"], "matmul_TFLOPs": ceil["matmul_TFLOPs"]}
    results = {be.name: dict(base, backend=be.name, status="", note="") for be in backends}

    def finish():
        return [results[be.name] for be in backends]

    progress.set(f"{wl.name}: inputs")
    try:
        batch = make_decode_batch(wl.seqlens, s_q=wl.s_q, h_q=wl.h_q, h_kv=wl.h_kv, device=device,
                                  causal=wl.causal, generator=torch.Generator().manual_seed(wl.seed))
        n_copies = rotation_copies(nbytes, device)
        copies = [(batch.q, batch.k_cache)] + [(batch.q.clone(), batch.k_cache.clone()) for _ in range(n_copies - 1)]
        inputs = Inputs(copies, batch.block_table, batch.cache_seqlens)
        ref = None
        if not args.no_reference:
            progress.set(f"{wl.name}: fp32 reference")
            ref = reference_for(batch, on_device=device.type == "cuda")
    except OOM_ERRORS:
        for r in results.values():
            r.update(status="OOM", note="building the inputs / reference ran out of memory")
        batch = copies = inputs = ref = None
        free_device(device)
        return finish()

    anchor = None          # (name, out, lse) of the flash_mla backend that passed its check
    for be in backends:
        r = results[be.name]
        r["input_copies"] = n_copies
        progress.set(f"{wl.name}: {be.name} check")
        runner = None
        try:
            runner = be.prepare(wl, inputs)
            out, lse = runner(0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if isinstance(be, TorchBackend):
                r["note"] = be.last_plan
            checks = []        # flash_mla's output first, then the fp32 reference
            if anchor is not None:
                checks.append(anchor)
            if ref is not None:
                checks.append(("fp32 reference", *ref))
            if not checks:
                r["checked_against"] = "nothing (--no-reference)"
            failures = []
            for against, ref_out, ref_lse in checks:
                m = device_compare(out, lse if be.compare_lse else ref_lse, ref_out, ref_lse)
                why = verdict(m, batch.q.dtype)
                if why is None or not failures:
                    r.update(out_rel_l2=m["out_rel_l2"], lse_rel_l2=m["lse_rel_l2"], cos_diff=m["cos_diff"],
                             checked_against=against)
                if why is None:
                    break
                # two bf16 results each within tolerance of the reference can differ by about twice that: a
                # backend that misses against flash_mla but is within tolerance of the reference passes
                failures.append(f"vs {against}: {why}")
            if checks and len(failures) == len(checks):
                r.update(status="FAIL", note="; ".join(failures))
                del out, lse
                continue
            if failures:
                r["note"] = (r["note"] + "; " if r["note"] else "") + failures[0] + " (passes vs the reference)"
            if anchor is None and isinstance(be, FlashMLABackend) and be.name in ("cuda", "cpu"):
                anchor = (f"flash_mla {be.name}", out, lse)
            else:
                del out, lse
        except OOM_ERRORS:
            r.update(status="OOM", note="out of memory in the first call")
            runner = None
            free_device(device)
            continue
        except Exception as e:   # noqa: BLE001  (a backend that cannot run this shape is reported, not fatal)
            r.update(status="ERROR", note=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            runner = None
            free_device(device)
            continue
        progress.set(f"{wl.name}: {be.name} timing")
        try:
            t, reps, calls = time_runner(runner, n_copies, device, args.budget_s)
        except OOM_ERRORS:
            r.update(status="OOM", note="out of memory while timing")
            free_device(device)
            continue
        except Exception as e:   # noqa: BLE001
            r.update(status="ERROR", note=f"timing: {type(e).__name__}: {str(e)[:160]}")
            free_device(device)
            continue
        runner = None
        gbps, tflops = nbytes / t / 1e9, flops / t / 1e12
        r.update(status="OK", time_us=t * 1e6, GBps=gbps, TFLOPs=tflops, pct_copy=100 * gbps / ceil["copy_GBps"],
                 pct_matmul=100 * tflops / ceil["matmul_TFLOPs"], t_over_floor=t / floor_s, t_over_roof=t / roof_s,
                 reps=reps, calls_per_rep=calls)
        target = spec_target(wl)
        if target is not None:
            unit, value = target
            got = gbps if unit == "GB/s" else tflops
            r.update(target=f">={value:.0f} {unit}", target_met=got >= value)
        else:
            r.update(target=f"<={FLOOR_LIMIT}x floor", target_met=t / floor_s <= FLOOR_LIMIT)
    anchor = batch = copies = inputs = ref = None
    free_device(device)
    timed = sorted((r for r in results.values() if r["status"] == "OK"), key=lambda r: r["time_us"])
    for k, r in enumerate(timed):
        r["x_vs_best"] = r["time_us"] / timed[0]["time_us"]
        if k + 1 < len(timed):
            r["speedup_vs_next"] = timed[k + 1]["time_us"] / r["time_us"]
    return finish()


# --------------------------------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------------------------------

HEADER = (f"{'workload':<30} {'backend':<10} {'status':<6} {'us':>9} {'GB/s':>6} {'TFLOP/s':>7} {'%copy':>6} "
          f"{'%mm':>5} {'t/floor':>7} {'speedup':>7}  target")


def format_row(r: dict) -> str:
    if r["status"] != "OK":
        return f"{r['workload']:<30} {r['backend']:<10} {r['status']:<6} {r.get('note', '')}"
    sp = f"{r['speedup_vs_next']:.2f}x" if r.get("speedup_vs_next") else "-"
    tgt = ""
    if r.get("target"):
        tgt = f"{r['target']} {'met' if r['target_met'] else 'MISSED'}"
    gbps = f"{r['GBps']:>6.0f}" if r["GBps"] >= 100 else f"{r['GBps']:>6.2f}"
    tflops = f"{r['TFLOPs']:>7.1f}" if r["TFLOPs"] >= 10 else f"{r['TFLOPs']:>7.3f}"
    return (f"{r['workload']:<30} {r['backend']:<10} {r['status']:<6} {r['time_us']:>9.1f} {gbps} "
            f"{tflops} {r['pct_copy']:>5.1f}% {r['pct_matmul']:>4.1f}% {r['t_over_floor']:>7.2f} "
            f"{sp:>7}  {tgt}")


def write_csv(path: str, rows: list[dict]):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def summarize(rows: list[dict], backends: Sequence[str]) -> list[str]:
    lines = [("summary (per group and backend: rows timed / failed, targets met, median time/floor, "
             "median slowdown vs the fastest backend):")]
    groups = [g for g in GROUPS if any(r["group"] == g for r in rows)]
    for g in groups:
        for be in backends:
            rs = [r for r in rows if r["group"] == g and r["backend"] == be]
            if not rs:
                continue
            ok = [r for r in rs if r["status"] == "OK"]
            bad = [r for r in rs if r["status"] != "OK"]
            if ok:
                met = sum(bool(r["target_met"]) for r in ok)
                fl = statistics.median(r["t_over_floor"] for r in ok)
                xb = statistics.median(r["x_vs_best"] for r in ok)
                lines.append(f"  {g:<10} {be:<10} {len(ok):>3} ok {len(bad):>3} not   "
                             f"targets met {met:>3}/{len(ok):<3} t/floor {fl:5.2f}   x vs best {xb:5.2f}")
            else:
                kinds = sorted({r["status"] for r in bad})
                lines.append(f"  {g:<10} {be:<10}   0 ok {len(bad):>3} not   ({', '.join(kinds)})")
    return lines


def _values(rows: list[dict], group: str, key: str) -> str:
    return "/".join(str(v) for v in sorted({r[key] for r in rows if r["group"] == group})) or "-"


def make_plots(rows: list[dict], out_dir: str, ceil: dict[str, float], backends: Sequence[str]) -> list[str]:
    """Two PNGs; returns their paths ([] with a note when matplotlib is missing)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib, or pip install -e \".[bench]\")")
        return []
    ok = [r for r in rows if r["status"] == "OK"]
    colors = {be: f"C{i}" for i, be in enumerate(backends)}
    paths = []

    def scatter_with_means(ax, pts, color, label):
        """Every (x, y) point faintly, and a line through the mean y at each x."""
        groups: dict[float, list[float]] = {}
        for x, y in pts:
            groups.setdefault(x, []).append(y)
        xs = sorted(groups)
        ax.scatter(*zip(*pts), color=color, alpha=0.35, s=14)
        ax.plot(xs, [statistics.mean(groups[x]) for x in xs], color=color, marker="o", label=label)

    def finish_axes(ax, ceiling, ceiling_label, xlabel, ylabel):
        ax.axhline(ceiling, color="gray", linestyle="--", linewidth=1, label=ceiling_label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    def save(fig, name):
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    ax = axes[0]
    for be in backends:
        pts = [(r["mean_L"], r["GBps"]) for r in ok
               if r["backend"] == be and r["group"] == "reference" and r["s_q"] * r["h_q"] <= 64]
        if pts:
            scatter_with_means(ax, pts, colors[be], be)
    ax.set_title(f"reference rows, memory-bound (h_q*s_q <= 64), b = {_values(ok, 'reference', 'b')}")
    ax = axes[1]
    styles = ["-", "--", ":", "-."]
    for be in backends:
        bs = sorted({r["b"] for r in ok if r["backend"] == be and r["group"] == "long"})
        for k, bsz in enumerate(bs):
            pts = sorted((r["mean_L"], r["GBps"]) for r in ok
                         if r["backend"] == be and r["group"] == "long" and r["b"] == bsz)
            ax.plot(*zip(*pts), color=colors[be], linestyle=styles[k % len(styles)], marker="o",
                    label=f"{be} b={bsz}")
    ax.set_title(f"long contexts at small batch (h_q = {_values(ok, 'long', 'h_q')}, s_q = 1)")
    for ax in axes:
        finish_axes(ax, ceil["copy_GBps"], "copy ceiling", "context length (tokens; mean for variable lengths)",
                    "GB/s (SPEC bytes / time)")
    save(fig, "gbps_vs_context.png")

    fig, ax = plt.subplots(figsize=(8, 5))
    for be in backends:
        pts = [(r["s_q"] * r["h_q"], r["TFLOPs"]) for r in ok if r["backend"] == be and r["group"] == "reference"]
        if pts:
            scatter_with_means(ax, pts, colors[be], f"{be} reference (b={_values(ok, 'reference', 'b')})")
        pts = sorted((r["s_q"] * r["h_q"], r["TFLOPs"]) for r in ok if r["backend"] == be and r["group"] == "specdec")
        if pts:
            ax.plot(*zip(*pts), color=colors[be], marker="s", linestyle="--",
                    label=f"{be} specdec (h_q={_values(ok, 'specdec', 'h_q')})")
    finish_axes(ax, ceil["matmul_TFLOPs"], "bf16 matmul ceiling", "query rows per KV head (h_q * s_q)",
                "TFLOP/s (SPEC FLOPs / time)")
    save(fig, "tflops_vs_rows.png")
    return paths


# --------------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------------

def read_csv(path: str) -> list[dict]:
    """Rows of a CSV this script wrote, numbers and booleans parsed back (for --plot-from)."""
    def parse(v: str):
        if v in ("True", "False"):
            return v == "True"
        for kind in (int, float):
            try:
                return kind(v)
            except ValueError:
                pass
        return v
    with open(path, newline="") as f:
        return [{k: parse(v) for k, v in r.items()} for r in csv.DictReader(f)]


def plot_from_csv(path: str, out_dir: str) -> list[str]:
    """The plots of an earlier run, e.g. one on a GPU machine without matplotlib."""
    rows = read_csv(path)
    if not rows:
        print(f"{path}: no rows")
        return []
    ceil = {"copy_GBps": rows[0]["copy_GBps"], "matmul_TFLOPs": rows[0]["matmul_TFLOPs"]}
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    os.makedirs(out_dir, exist_ok=True)
    return make_plots(rows, out_dir, ceil, backends)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (with --device cpu: runs anywhere in ~10 s)")
    ap.add_argument("--quick", action="store_true", help="4 reference rows + the skewed batch")
    ap.add_argument("--workloads", default=None,
                    help=f"comma-separated groups from {','.join(GROUPS)} (default: all; --quick: reference,skewed)")
    ap.add_argument("--backends", default=None,
                    help="comma-separated from cuda,triton,torch,flashinfer,cpu "
                         "(default: cuda,triton,torch,flashinfer on --device cuda; cpu,torch on --device cpu)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    ap.add_argument("--csv", default=None, help="CSV path (default: <out-dir>/bench_flash_mla.csv)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds of timed calls per (workload, backend); default 0.75 (CUDA), 0.2 (CPU)")
    ap.add_argument("--torch-chunk-gb", type=float, default=4.0,
                    help="memory budget per chunk of the torch baseline (GiB)")
    ap.add_argument("--no-reference", action="store_true", help="skip the float32 reference check")
    ap.add_argument("--max-minutes", type=float, default=None,
                    help="start no new workload after this many minutes (the CSV is written after each one)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--plot-from", default=None, metavar="CSV",
                    help="only draw the plots of an earlier run's CSV into --out-dir (no GPU needed)")
    ap.add_argument("--no-progress", action="store_true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    t_start = time.time()
    args = parse_args(argv)
    if args.plot_from:
        paths = plot_from_csv(args.plot_from, args.out_dir)
        for p in paths:
            print(f"plot: {p}")
        return 0 if paths else 1
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_flash_mla: --device cuda but no CUDA GPU is visible (try --device cpu --smoke)")
        return 2
    device = torch.device(args.device)
    if args.budget_s is None:
        args.budget_s = 0.75 if device.type == "cuda" else 0.2
    groups = args.workloads.split(",") if args.workloads else (["reference", "skewed"] if args.quick else list(GROUPS))
    names = args.backends.split(",") if args.backends else (
        ["cuda", "triton", "torch", "flashinfer"] if device.type == "cuda" else ["cpu", "torch"])
    workloads = build_workloads(groups, args.quick, args.smoke)

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"bench_flash_mla: {dev_name}, torch {torch.__version__}, {len(workloads)} workloads "
          f"({', '.join(groups)}), bf16, h_kv = 1, causal")
    backends: list[Backend] = []
    for n in names:
        be = make_backend(n, args)
        why = be.unavailable(device)
        if why is not None:
            print(f"  backend {n}: skipped: {why}")
        else:
            if n == "triton" and device.type == "cpu":
                print("  backend triton: runs in Triton's interpreter (TRITON_INTERPRET=1): its results are "
                      "checked, its times are the interpreter's, not a kernel's")
            backends.append(be)
    if not backends:
        print("no backend can run here")
        return 2
    # flash_mla's own backend goes first: the others are checked against it
    backends.sort(key=lambda be: 0 if be.name in ("cuda", "cpu") else 1)
    print(f"  backends: {', '.join(be.name for be in backends)}"
          + (f"  (torch baseline: S in fp32 via {score_mode(device, torch.bfloat16)})"
             if any(be.name == "torch" for be in backends) else ""))

    ceil = measure_ceilings(device, args.smoke)
    print(f"  ceilings: copy {ceil['copy_GBps']:.0f} GB/s (read + write), matmul {ceil['matmul_TFLOPs']:.1f} TFLOP/s"
          f"  [{ceil['what']}]")
    print(f"  timing: median per call, up to 15 reps x 10 back-to-back calls, about {args.budget_s:.2f} s of calls "
          f"per row and backend; metadata/plans outside; inputs cycled over copies when they fit in L2")
    print(f"  floor = bytes / copy ceiling; reference rows vs SPEC targets, other rows vs <= {FLOOR_LIMIT}x floor")
    print(HEADER, flush=True)

    csv_path = args.csv or os.path.join(args.out_dir, "bench_flash_mla.csv")
    progress = Progress(len(workloads), enabled=not args.no_progress)
    rows: list[dict] = []
    skipped = 0
    try:
        for k, wl in enumerate(workloads):
            if args.max_minutes is not None and time.time() - t_start > 60 * args.max_minutes:
                skipped = len(workloads) - k
                break
            res = run_workload(wl, backends, ceil, args, device, progress)
            for r in res:
                progress.write(format_row(r))
            rows += res
            write_csv(csv_path, rows)     # after every workload: a run cut short keeps what it measured
            progress.update()
    finally:
        progress.close()
    if skipped:
        print(f"--max-minutes {args.max_minutes} reached: {skipped} workloads not run")

    for line in summarize(rows, [be.name for be in backends]):
        print(line)
    write_csv(csv_path, rows)
    print(f"csv: {csv_path}")
    if not args.no_plots:
        os.makedirs(args.out_dir, exist_ok=True)
        for p in make_plots(rows, args.out_dir, ceil, [be.name for be in backends]):
            print(f"plot: {p}")
    print(f"total elapsed: {time.time() - t_start:.1f} s")
    broken = [r for r in rows if r["backend"] in ("cuda", "triton", "cpu") and r["status"] in ("FAIL", "ERROR")]
    if broken:   # flash_mla itself wrong or crashing: a failure for CI (baselines' failures are only reported)
        print(f"{len(broken)} flash_mla rows FAILED or raised: "
              + ", ".join(f"{r['workload']} [{r['backend']}]" for r in broken[:10]))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
