"""A batched PyTorch baseline for MLA decoding over a paged KV cache: what a serving engine could write with
plain torch ops when it has no dedicated kernel. Same contract as `flash_mla_with_kvcache` (SPEC.md,
README "Semantics"): row packing, causal rule, L = 0 rows give out 0 and lse -inf.

Two steps, like flash_mla's own API:

    plan = plan_torch_mla(seqlens_on_host, s_q, h_q, h_kv, device)          # once per decoding step, on the host
    out, lse = torch_mla_decode(q, k_cache, block_table, cache_seqlens, plan, causal=True)   # once per layer

`plan_torch_mla` sorts the sequences by length and cuts them into chunks (dynamic programming over a simple cost
model: per-chunk launch overhead against padding waste, under a memory budget per chunk). `torch_mla_decode`, per
chunk, on the device and without host synchronisation:
  1. gathers the chunk's pages through the block table into a dense (n, Lpad, h_kv, 576) tensor, token by token
     (positions past a sequence's length read one known-good token instead, so garbage or NaN in unused cache
     slots never reaches the result);
  2. S = scale * Q K^T with fp32 accumulation and fp32 output (bmm with out_dtype on CUDA; else fp32/TF32, which
     is exact for bf16/fp16 inputs);
  3. masks keys past each row's visible range; P = exp(S - rowmax) in place (fp32), rounded to the input dtype;
     lse = rowmax + log(rowsum);
  4. O = (P V) / rowsum, V = the first 512 columns of the gathered tensor (a strided view, no copy), fp32
     accumulation, normalised on the small fp32 output.
The gather is part of every call, as it would be in an engine.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

PAGE = 64
HEAD_DIM_QK = 576
HEAD_DIM_V = 512

# Cost model for chunking, in "bytes moved" (the baseline is memory-bound): a chunk costs a fixed overhead (about
# a dozen kernel launches and small index tensors) plus the bytes its passes move per padded token.
CHUNK_OVERHEAD_BYTES = 128 << 20
DEFAULT_CHUNK_BUDGET_BYTES = 4 << 30


@dataclass
class Chunk:
    seq_idx: torch.Tensor | None   # (n,) int64 on the device: which sequences; None = all, in order
    n: int                            # sequences in the chunk
    lpad: int                         # keys per sequence after padding (a multiple of 64)
    needs_mask: bool                  # some row sees fewer than lpad keys
    seqs: list[int] = field(default_factory=list)   # host copy of seq_idx, for tests and reports


@dataclass
class TorchMLAPlan:
    b: int
    s_q: int
    h_q: int
    h_kv: int
    chunks: list[Chunk]
    anchor_seq: int          # a sequence with L > 0 whose first token stands in for padding slots (-1: none)
    has_empty: bool          # some sequence is left out of every chunk (L = 0): its out/lse need initialising


def _bytes_per_token(rows: int, h_kv: int, elem: int) -> tuple[int, int]:
    """(memory held, bytes moved) per padded key of one sequence in a chunk, for `rows` query rows per KV head."""
    held = h_kv * HEAD_DIM_QK * elem + h_kv * rows * (4 + 4 + elem) + 16
    moved = h_kv * HEAD_DIM_QK * elem * 4 + h_kv * rows * (32 + elem) + 24
    return held, moved


def plan_torch_mla(seqlens: Sequence[int], s_q: int, h_q: int, h_kv: int = 1, device="cpu",
                   dtype: torch.dtype = torch.bfloat16, chunk_budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES,
                   causal: bool = True) -> TorchMLAPlan:
    """Plan a decoding step from the host-side lengths (an engine's scheduler knows them).

    Sequences with L = 0 are left out. The rest, longest first, are cut into chunks minimising
    sum(CHUNK_OVERHEAD_BYTES + n * lpad * moved_per_token) with n * lpad * held_per_token <= chunk_budget_bytes
    (a single sequence always forms a chunk, whatever its size)."""
    lens = [int(x) for x in seqlens]
    b = len(lens)
    elem = torch.empty((), dtype=dtype).element_size()
    rows = s_q * h_q // h_kv
    held, moved = _bytes_per_token(rows, h_kv, elem)
    order = sorted((i for i in range(b) if lens[i] > 0), key=lambda i: -lens[i])
    pads = [-(-lens[i] // PAGE) * PAGE for i in order]
    m = len(order)
    # best[i]: cost of chunking order[i:]; cut[i]: end of the chunk starting at i.
    best = [0.0] * (m + 1)
    cut = [m] * (m + 1)
    for i in range(m - 1, -1, -1):
        max_n = max(1, min(m - i, chunk_budget_bytes // max(pads[i] * held, 1)))
        per_seq = pads[i] * moved
        best_cost, best_j = math.inf, i + 1
        for j in range(i + 1, i + max_n + 1):
            c = CHUNK_OVERHEAD_BYTES + (j - i) * per_seq + best[j]
            if c < best_cost:
                best_cost, best_j = c, j
        best[i], cut[i] = best_cost, best_j
    chunks = []
    i = 0
    while i < m:
        j = cut[i]
        seqs = order[i:j]
        lpad = pads[i]
        needs_mask = any(lens[s] != lpad for s in seqs) or (causal and s_q > 1)
        chunks.append(Chunk(seq_idx=None, n=len(seqs), lpad=lpad, needs_mask=needs_mask, seqs=list(seqs)))
        i = j
    if len(chunks) == 1 and chunks[0].seqs == list(range(b)):
        pass   # one chunk holding every sequence in order: no index_select / index_copy needed
    else:
        for c in chunks:
            c.seq_idx = torch.tensor(c.seqs, dtype=torch.int64, device=device)
    return TorchMLAPlan(b=b, s_q=s_q, h_q=h_q, h_kv=h_kv, chunks=chunks, anchor_seq=order[0] if order else -1,
                        has_empty=m < b)


# ------------------------------------------------------------------------------------------------------------------
# S = scale * Q K^T in fp32: pick the fastest exact way once per (device type, dtype)
# ------------------------------------------------------------------------------------------------------------------

_SCORE_MODE = {}
_ZEROS = {}


def _matmul_fp32(a: torch.Tensor, b: torch.Tensor, alpha: float, mode: str) -> torch.Tensor:
    """alpha * (a @ b), batched, fp32 accumulation and fp32 output, the way `mode` says (see score_mode)."""
    if mode == "baddbmm_out_dtype":
        dummy = _ZEROS.get(a.device)
        if dummy is None:   # the (ignored, beta = 0) addend, broadcast: allocated once per device
            dummy = _ZEROS[a.device] = torch.zeros((1, 1, 1), dtype=torch.float32, device=a.device)
        return torch.baddbmm(dummy, a, b, out_dtype=torch.float32, beta=0.0, alpha=alpha)
    if mode == "bmm_out_dtype":
        c = torch.bmm(a, b, out_dtype=torch.float32)
        return c if alpha == 1.0 else c.mul_(alpha)
    if a.is_cuda:   # fp32 inputs with TF32: bf16/fp16 values are exact in TF32, products are exact
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = a.dtype != torch.float32
        try:
            c = torch.bmm(a.float(), b.float())
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    else:
        c = torch.bmm(a.float(), b.float())
    return c if alpha == 1.0 else c.mul_(alpha)


def _probe(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor | None:
    try:
        return _matmul_fp32(a, b, 0.125, mode)
    except Exception:   # noqa: BLE001  (not implemented for this device, dtype or torch version)
        return None


def score_mode(device: torch.device, dtype: torch.dtype) -> str:
    """How S is computed on this device for this dtype: "baddbmm_out_dtype", "bmm_out_dtype" or "fp32"."""
    key = (device.type, dtype)
    if key not in _SCORE_MODE:
        mode = "fp32"
        if dtype != torch.float32:
            g = torch.Generator().manual_seed(0)
            a = torch.randn(2, 8, 64, generator=g).to(device=device, dtype=dtype)
            b = torch.randn(2, 64, 16, generator=g).to(device=device, dtype=dtype)
            want = torch.bmm(a.double().cpu(), b.double().cpu()) * 0.125
            for candidate in ("baddbmm_out_dtype", "bmm_out_dtype"):
                got = _probe(a, b, candidate)
                if got is not None and got.dtype == torch.float32 and \
                        torch.allclose(got.double().cpu(), want, rtol=1e-5, atol=1e-4):
                    mode = candidate
                    break
        _SCORE_MODE[key] = mode
    return _SCORE_MODE[key]


# ------------------------------------------------------------------------------------------------------------------
# the decode step
# ------------------------------------------------------------------------------------------------------------------

def torch_mla_decode(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                     plan: TorchMLAPlan, head_dim_v: int = HEAD_DIM_V, softmax_scale: float | None = None,
                     causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA decoding with torch ops. q (b, s_q, h_q, 576), k_cache (num_blocks, 64, h_kv, 576) in bf16, fp16 or
    fp32; block_table (b, max_pages) int32; cache_seqlens (b,) int32 on q's device; `plan` from plan_torch_mla on
    the same lengths. Returns out (b, s_q, h_q, head_dim_v) in q's dtype and lse (b, h_q, s_q) float32."""
    b, s_q, h_q, d = q.shape
    num_blocks, page, h_kv, _ = k_cache.shape
    if (plan.b, plan.s_q, plan.h_q, plan.h_kv) != (b, s_q, h_q, h_kv):
        raise ValueError(f"plan is for (b, s_q, h_q, h_kv) = {(plan.b, plan.s_q, plan.h_q, plan.h_kv)}, "
                         f"inputs are {(b, s_q, h_q, h_kv)}")
    if page != PAGE:
        raise ValueError(f"k_cache page size: expected {PAGE}, got {page}")
    scale = float(d ** -0.5 if softmax_scale is None else softmax_scale)
    group = h_q // h_kv
    rows = s_q * group
    dev = q.device
    mode = score_mode(dev, q.dtype)
    alloc = torch.zeros if plan.has_empty else torch.empty
    out = alloc(b, s_q, h_q, head_dim_v, dtype=q.dtype, device=dev)
    lse = (torch.full((b, h_q, s_q), -math.inf, dtype=torch.float32, device=dev) if plan.has_empty
           else torch.empty(b, h_q, s_q, dtype=torch.float32, device=dev))
    if not plan.chunks:
        return out, lse
    k_flat = k_cache.reshape(num_blocks * page, h_kv, d)
    # padding slots read the first token of a sequence that has one: finite data, multiplied by P = 0
    safe_token = block_table[plan.anchor_seq, 0].long() * page
    tok_in_page = torch.arange(page, device=dev)
    q_tok = torch.arange(s_q, device=dev)
    for c in plan.chunks:
        n, lpad = c.n, c.lpad
        npages = lpad // page
        if c.seq_idx is None:
            bt, lens, qc = block_table[:, :npages], cache_seqlens, q
        else:
            bt = block_table.index_select(0, c.seq_idx)[:, :npages]
            lens, qc = cache_seqlens.index_select(0, c.seq_idx), q.index_select(0, c.seq_idx)
        lens = lens.long()
        # 1. gather: token index of every (sequence, position), padding -> safe_token
        tok = (bt.long().unsqueeze(-1) * page + tok_in_page).reshape(n, lpad)
        pos = torch.arange(lpad, device=dev)
        if c.needs_mask:
            tok = torch.where(pos < lens.unsqueeze(1), tok, safe_token)
        kv = k_flat.index_select(0, tok.reshape(-1)).view(n, lpad, h_kv, d)
        if h_kv == 1:
            kv = kv.view(n, lpad, d)
            qh = qc.reshape(n, rows, d)                                             # row = s * h_q + h
        else:
            kv = kv.transpose(1, 2).reshape(n * h_kv, lpad, d)
            qh = qc.view(n, s_q, h_kv, group, d).permute(0, 2, 1, 3, 4).reshape(n * h_kv, rows, d)
        # 2. S = scale * Q K^T, fp32
        s = _matmul_fp32(qh, kv.transpose(1, 2), scale, mode)                      # (n*h_kv, rows, lpad)
        # 3. mask; unnormalised P = exp(S - rowmax) in place; lse = rowmax + log(rowsum)
        if c.needs_mask:
            visible = (lens.unsqueeze(1) - s_q + 1 + q_tok) if causal else lens.unsqueeze(1).expand(n, s_q)
            hidden = pos.view(1, 1, lpad) >= visible.unsqueeze(-1)                 # (n, s_q, lpad)
            s.view(n, h_kv, s_q, group, lpad).masked_fill_(hidden.view(n, 1, s_q, 1, lpad), -math.inf)
        row_max = s.amax(dim=-1, keepdim=True)
        if c.needs_mask:   # rows that see no key: exp(-inf - 0) = 0, sum 0, lse -inf
            row_max.masked_fill_(torch.isneginf(row_max), 0.0)
        s.sub_(row_max).exp_()
        row_sum = s.sum(dim=-1, keepdim=True)
        lse_c = (row_max + torch.log(row_sum)).squeeze(-1)                         # (n*h_kv, rows)
        p = s.to(q.dtype)
        del s
        # 4. O = (P V) / rowsum, normalised in fp32 on the small output
        v = kv[..., :head_dim_v]
        o = _matmul_fp32(p, v, 1.0, mode)
        del p
        o = o.div_(row_sum) if not c.needs_mask else torch.where(row_sum > 0, o / row_sum, 0.0)
        o = o.to(q.dtype)
        o = o.view(n, h_kv, s_q, group, head_dim_v).permute(0, 2, 1, 3, 4).reshape(n, s_q, h_q, head_dim_v)
        lse_c = lse_c.view(n, h_kv, s_q, group).permute(0, 1, 3, 2).reshape(n, h_q, s_q)
        if c.seq_idx is None:
            out.copy_(o)
            lse.copy_(lse_c)
        else:
            out.index_copy_(0, c.seq_idx, o)
            lse.index_copy_(0, c.seq_idx, lse_c)
    return out, lse


def describe(plan: TorchMLAPlan) -> str:
    sizes = ", ".join(f"{c.n}x{c.lpad}" for c in plan.chunks)
    return f"{len(plan.chunks)} chunk(s): {sizes}"
