"""What benchmarks/bench_flash_mla.py compares: flash_mla's own backends (cuda, triton, cpu), the PyTorch baseline
of benchmarks/baselines.py, and FlashInfer's MLA wrapper. A backend's prepare() does the per-workload setup
(metadata, plans) outside the timed region and returns the runner that is timed."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from baselines import describe as describe_plan
from baselines import plan_torch_mla, torch_mla_decode

import flash_mla
from flash_mla.backends import select_backend

from .timing import Runner
from .workloads import Workload

HEAD_DIM_V = 512


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
