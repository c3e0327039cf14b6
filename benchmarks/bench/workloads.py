"""The workload groups of benchmarks/bench_flash_mla.py (all bf16, h_kv = 1, causal) and the targets each row is
judged against: the SPEC figures for the reference rows, time <= FLOOR_LIMIT x the bytes floor for the others."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flash_mla.testing import decode_flops_and_bytes, random_seqlens

GROUPS = ("reference", "long", "skewed", "specdec", "short")
SKEWED_LENGTHS = (4641, 45118, 1730, 1696)
FLOOR_LIMIT = 1.6                 # non-reference rows: within 1.6x of bytes / copy bandwidth


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
