"""Triton backend of sparse FP8 decoding (DeepSeek-V3.2): top-k attention over the 656-byte token cache.

Layout and semantics: flash_mla/sparse_fp8.py (the float32 reference there is the specification). Each query token
s of batch row i attends to the cache tokens listed in indices[i, s, :] (its own list), skipping -1 slots and the
slots at or past topk_length[i].

Plan. The scheduler (flash_mla/scheduler.py, the same rules as dense decoding) is applied to lengths =
topk_length (or topk for every row), num_heads_per_head_k = s_q * h_q, num_heads_k = 1: batch row i is a
"sequence" whose keys are its index slots, 64 slots a "page". Metadata row p says which slot ranges SM part p
takes, exactly as for dense decoding; a row cut into several pieces has its pieces' float32 partial results
merged by the dense backend's combine kernel (flash_mla/triton_backend.py, reused as it is: its workspace
layout (slot, KV head, query row, 512) with one KV head and query row r = token r // h_q, head r % h_q is the one
written here).

1. Split kernel, grid (query token x head block, SM part). A program owns BLOCK_M query heads of ONE query token
   (BLOCK_M = 64 for h_q >= 64, else the next power of two of h_q, at least 16: tl.dot's smallest M), so all its
   rows share one index list. h_q 128 gives two head blocks per token; they run side by side (the grid's fastest
   dimension), so the second reads the gathered tokens from L2. For each piece of its part it loads its query
   rows once, then walks the piece's index slots BLOCK_N = 32 at a time:
   - loads the BLOCK_N indices (masked slots: -1 or past the piece / topk_length / topk) and gathers the valid
     tokens: 4 x 128 e4m3 latent bytes, 4 float32 scales and 64 bf16 RoPE values each. Token t lives at byte
     t * 656 of the cache seen as one flat array of tokens (656 = 41 * 16, so every row of a gathered tile
     starts 16-byte aligned and the loads are 16 bytes wide). Masked slots are never dereferenced (masked
     loads: their rows read as 0), so what the cache holds there (NaN included) cannot leak in.
   - dequantisation is folded into the two products instead of scaling the 64 x 512 tile: the e4m3 tile is
     widened to bf16 as it is (exact: every e4m3 value is a bf16 value), and with the group scales c_g of the
     64 keys,  S = sum_g c_g * (Q_g . K_g) + Q_rope . K_rope  (four 128-deep dots, each column scaled in float32)
     and  O_g += (P * c_g) V_g  (the scale multiplies the BLOCK_M x BLOCK_N probability tile before its
     rounding to bf16). That is 8 * BLOCK_M * BLOCK_N multiplies per step instead of BLOCK_N * 512, and S is
     exact up to float32 accumulation (no rounding of dequantised values): the only roundings are P's (as in any
     flash decoding kernel) and out's. Under the interpreter the operands are held in float32, rounded to
     bf16 / fp16 exactly as a GPU rounds them (round to nearest even).
   - online softmax in float32 in log2 units (exp2, the softmax scale folded into the column scales); the
     same widened tile is K for S and V for P V.
   A piece of an unsplit row writes out (in q's dtype, scaled by the attention sink when there is one) and lse
   directly; a piece of a split row writes its normalised float32 output and lse to workspace slot
   num_splits[i] + split_idx.
2. Combine kernel (triton_backend._combine_kernel), grid (batch row, 1, 16-row tile): rows with more than one
   piece get lse = logsumexp of the pieces' and out = the pieces' outputs weighted by exp(lse_k - lse), then the
   sink factor. Rows that saw no valid index keep out 0 and lse -inf.

q may be bf16 or fp16. With fp16 q, S uses fp16 operands (the tile widened to fp16, exact too) and P V still
bf16 ones: P * c_g can be far below fp16's normal range (c_g is amax / 448), not below bf16's.

Measured on an H100 (Triton 3.6, bf16 q, topk 2048 with every slot valid, indices spread over 8192 tokens a row,
132-SM plan, do_bench median, both kernels): b = 128: h_q 64 ~300 us (s_q 1), h_q 128 ~580 us (s_q 1), i.e.
~120 TFLOP/s and ~290-570 GB/s of gathered tokens; the rest of the numbers in the report of the commit that
added this file. The kernel is bound by instruction issue and by waiting on its many small, synchronous
wgmma groups (N = BLOCK_N / 2 per warpgroup for S) and the barriers around the tile written to shared memory,
not by memory (DRAM ~10% busy) or by the tensor cores. Variants tried and dropped (all slower on the H100):
one 64 x 512 dequantised fp16 tile for both products (tokens normalised by their largest scale, q scaled per row
into fp16; 1.2-2.2x slower, more spills, and S no longer exact), a per-token normalised fp16 V with one
probability tile (1.3x slower), fp16 instead of bf16 widening (no faster), BLOCK_M 32, 4 or 16 warps.

Nothing synchronises with the host (the workspace is sized by the bound b + num_sm_parts on the slot count), so a
call can be captured in a CUDA graph. Needs compute capability 8.9+ on NVIDIA GPUs (Triton's float8e4nv), or
Triton's interpreter (TRITON_INTERPRET=1 before triton is first imported) for CPU tensors.
Importing this module never fails: without Triton, `unavailable_reason` says why and the kernels are absent.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ._geometry import METADATA_WIDTH
from . import triton_backend as _dense
from .fp8 import FP8_DTYPE
from .sparse_fp8 import LATENT_DIM, NUM_SCALES, ROPE_DIM, ROPE_OFFSET, SCALE_GROUP, SCALES_OFFSET, TOKEN_BYTES

triton = _dense.triton
tl = _dense.tl

LOG2E = _dense.LOG2E

# ---- tuning knobs ------------------------------------------------------------------------------------------
# Measured on the H100 (Triton 3.6, b = 128, topk 2048, s_q 1, bf16 q; see the module docstring for the numbers).
# Index slots per inner-loop step. 32 beat 64 by 3-6% (fewer registers live: 56 spilled words instead of 136).
BLOCK_N = 32
# Query heads per program (one query token each): the next power of two of h_q, between these. BLOCK_M 32 for
# h_q 64 (two programs per token, half the accumulator each) ran 1.9x slower: every extra program re-gathers and
# re-widens the same tokens.
MIN_BLOCK_M = 16
MAX_BLOCK_M = 64
# Warps per program by BLOCK_M: at 64, 8 warps (two warpgroups) hold the 64 x 512 float32 accumulator at
# 128 registers a thread; 4 warps spilled heavily (1.6x slower), 16 warps were 2.5x slower.
SPLIT_NUM_WARPS = {16: 4, 32: 4, 64: 8}
# Software-pipelining depth of the slot loop: 3 was 1-2% faster than 2, 1 was 15-20% slower.
SPLIT_NUM_STAGES = 3


def unavailable_reason(device: torch.device) -> Optional[str]:
    """None when the sparse Triton kernels can run on `device`, else a human-readable reason."""
    return _dense.unavailable_reason(device, fp8=True)


def _head_block(h_q: int) -> int:
    """Query heads per split-kernel program (see MIN_BLOCK_M / MAX_BLOCK_M)."""
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(h_q)))


def _token_rows(k_cache: torch.Tensor) -> torch.Tensor:
    """The cache as (num_tokens, 656) uint8 rows, token t = page * page_block_size + offset being row t: a view
    when the pages are laid out back to back (the usual case, slices along the page dimension included), else a
    contiguous copy. The start is kept 16-byte aligned (a copy otherwise) so that the gathers stay 16 bytes wide."""
    raw = k_cache if k_cache.dtype == torch.uint8 else k_cache.view(torch.uint8)
    num_blocks, page, _, width = raw.shape
    flat = (raw.stride(3) == 1 and (page == 1 or raw.stride(1) == width)
            and (num_blocks == 1 or raw.stride(0) == page * width))
    if not flat or raw.storage_offset() % 16 != 0:
        raw = raw.contiguous()
    return raw.as_strided((num_blocks * page, width), (width, 1))


if triton is not None:
    _LOG2E = _dense._LOG2E
    _TL_HALF = _dense._TL_HALF
    _loop_bound = _dense._loop_bound
    _part_pieces = _dense._part_pieces
    _sink_scale = _dense._sink_scale

    @triton.jit
    def _round_bf16(x):
        """float32 -> bf16 -> float32 rounding to nearest even, in integer arithmetic: Triton's interpreter
        (3.9) truncates float32 to bf16, which biases every rounded value toward 0 (finite x only)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _widen(x, TYPE: tl.constexpr, DOT_F32: tl.constexpr):
        """A dot operand in TYPE; under the interpreter (DOT_F32: its bf16 dot is not usable) the same value,
        rounded to TYPE as a GPU would, held in float32."""
        if DOT_F32:
            if TYPE == tl.bfloat16:
                return _round_bf16(x.to(tl.float32))
            return x.to(TYPE).to(tl.float32)
        return x.to(TYPE)

    @triton.jit
    def _store_rows(row_ptr, acc0, acc1, acc2, acc3, inv, row_ok, GROUP: tl.constexpr, DOT_F32: tl.constexpr):
        """Rows of a 4 x GROUP-column output (its pointers' element type), scaled by inv per row."""
        cols = tl.arange(0, GROUP)
        ptrs = row_ptr[:, None] + cols[None, :]
        mask = row_ok[:, None]
        ty = row_ptr.dtype.element_ty
        if DOT_F32 and ty == tl.bfloat16:   # the interpreter: round to nearest (see _round_bf16) before storing
            acc0 = _round_bf16(acc0 * inv[:, None])
            acc1 = _round_bf16(acc1 * inv[:, None])
            acc2 = _round_bf16(acc2 * inv[:, None])
            acc3 = _round_bf16(acc3 * inv[:, None])
            inv = inv * 0.0 + 1.0
        tl.store(ptrs, (acc0 * inv[:, None]).to(ty), mask=mask)
        tl.store(ptrs + GROUP, (acc1 * inv[:, None]).to(ty), mask=mask)
        tl.store(ptrs + 2 * GROUP, (acc2 * inv[:, None]).to(ty), mask=mask)
        tl.store(ptrs + 3 * GROUP, (acc3 * inv[:, None]).to(ty), mask=mask)

    @triton.jit
    def _sparse_split_kernel(
        q_ptr, latent_ptr, rope_ptr, scales_ptr, indices_ptr, topk_length_ptr, metadata_ptr, num_splits_ptr,
        out_ptr, lse_ptr, o_ws_ptr, lse_ws_ptr, sink_ptr,
        stride_q_b, stride_q_s, stride_q_h,
        stride_i_b, stride_i_s,
        stride_o_b, stride_o_s, stride_o_h,
        stride_lse_b, stride_lse_h, stride_lse_s,
        stride_ws_slot, stride_ws_row,      # o workspace (slot, 1, rows, 512), last dim contiguous
        stride_lws_slot,                    # lse workspace (slot, 1, rows), last dim contiguous
        h_q, topk, scale_log2,
        HEAD_BLOCKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        GROUP: tl.constexpr, D_ROPE: tl.constexpr,
        TOKEN_BYTES: tl.constexpr, SCALES_OFFSET: tl.constexpr, ROPE_OFFSET: tl.constexpr,
        META_WIDTH: tl.constexpr, HAS_TOPK_LENGTH: tl.constexpr, HAS_SINK: tl.constexpr,
        Q_HALF: tl.constexpr, Q_BF16: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        # latent_ptr / rope_ptr / scales_ptr: the same flat token rows seen as float8e4nv, bf16 and float32
        tile = tl.program_id(0)
        part = tl.program_id(1)
        q_token = tile // HEAD_BLOCKS
        head = (tile % HEAD_BLOCKS) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = head < h_q
        r = q_token * h_q + head            # the row in the workspace / combine kernel's numbering

        begin_seq, begin_token, end_seq, end_token, begin_split = _part_pieces(metadata_ptr, part, META_WIDTH)

        cols_g = tl.arange(0, GROUP)
        cols_r = tl.arange(0, D_ROPE)
        offs_n = tl.arange(0, BLOCK_N)

        for seq in range(_loop_bound(begin_seq), _loop_bound(end_seq + 1)):
            seq64 = tl.cast(seq, tl.int64)
            if HAS_TOPK_LENGTH:
                length = tl.minimum(tl.load(topk_length_ptr + seq), topk)
            else:
                length = topk
            lo = tl.where(seq == begin_seq, begin_token, 0)
            hi = tl.minimum(tl.where(seq == end_seq, end_token, length), length)
            split_idx = tl.where(seq == begin_seq, begin_split, 0)
            first_slot = tl.load(num_splits_ptr + seq)
            num_pieces = tl.load(num_splits_ptr + seq + 1) - first_slot

            q_row = q_ptr + seq64 * stride_q_b + q_token * stride_q_s + head * stride_q_h
            q0 = _widen(tl.load(q_row[:, None] + cols_g[None, :], mask=row_ok[:, None], other=0.0),
                        Q_HALF, DOT_F32)
            q1 = _widen(tl.load(q_row[:, None] + (GROUP + cols_g)[None, :], mask=row_ok[:, None], other=0.0),
                        Q_HALF, DOT_F32)
            q2 = _widen(tl.load(q_row[:, None] + (2 * GROUP + cols_g)[None, :], mask=row_ok[:, None], other=0.0),
                        Q_HALF, DOT_F32)
            q3 = _widen(tl.load(q_row[:, None] + (3 * GROUP + cols_g)[None, :], mask=row_ok[:, None], other=0.0),
                        Q_HALF, DOT_F32)
            q_rope = _widen(tl.load(q_row[:, None] + (4 * GROUP + cols_r)[None, :], mask=row_ok[:, None],
                                    other=0.0), Q_HALF, DOT_F32)

            row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # log2 units
            row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc0 = tl.zeros([BLOCK_M, GROUP], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_M, GROUP], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, GROUP], dtype=tl.float32)
            acc3 = tl.zeros([BLOCK_M, GROUP], dtype=tl.float32)

            idx_row = indices_ptr + seq64 * stride_i_b + q_token * stride_i_s
            for start in range(_loop_bound(lo), _loop_bound(hi), BLOCK_N):
                slot = start + offs_n
                idx = tl.load(idx_row + slot, mask=slot < hi, other=-1)
                ok = idx >= 0
                tok = tl.where(ok, idx, 0).to(tl.int64)       # masked slots are never dereferenced
                lat = latent_ptr + tok * TOKEN_BYTES
                k0 = tl.load(lat[:, None] + cols_g[None, :], mask=ok[:, None], other=0.0)
                k1 = tl.load(lat[:, None] + (GROUP + cols_g)[None, :], mask=ok[:, None], other=0.0)
                k2 = tl.load(lat[:, None] + (2 * GROUP + cols_g)[None, :], mask=ok[:, None], other=0.0)
                k3 = tl.load(lat[:, None] + (3 * GROUP + cols_g)[None, :], mask=ok[:, None], other=0.0)
                kr = tl.load((rope_ptr + tok * (TOKEN_BYTES // 2) + ROPE_OFFSET // 2)[:, None] + cols_r[None, :],
                             mask=ok[:, None], other=0.0)
                sc = scales_ptr + tok * (TOKEN_BYTES // 4) + SCALES_OFFSET // 4   # float32 elements
                # group scales of the 64 keys, times the softmax scale (log2 units) for S
                c0 = tl.load(sc + 0, mask=ok, other=0.0)
                c1 = tl.load(sc + 1, mask=ok, other=0.0)
                c2 = tl.load(sc + 2, mask=ok, other=0.0)
                c3 = tl.load(sc + 3, mask=ok, other=0.0)

                # e4m3 -> bf16 (exact); the same tiles are K for S and V for P V
                v0 = _widen(k0, tl.bfloat16, DOT_F32)
                v1 = _widen(k1, tl.bfloat16, DOT_F32)
                v2 = _widen(k2, tl.bfloat16, DOT_F32)
                v3 = _widen(k3, tl.bfloat16, DOT_F32)
                if Q_BF16:
                    s = tl.dot(q_rope, tl.trans(_widen(kr, Q_HALF, DOT_F32))) * scale_log2
                    s += tl.dot(q0, tl.trans(v0)) * (c0 * scale_log2)[None, :]
                    s += tl.dot(q1, tl.trans(v1)) * (c1 * scale_log2)[None, :]
                    s += tl.dot(q2, tl.trans(v2)) * (c2 * scale_log2)[None, :]
                    s += tl.dot(q3, tl.trans(v3)) * (c3 * scale_log2)[None, :]
                else:   # fp16 q: K widened to fp16 for S (exact), V stays bf16
                    s = tl.dot(q_rope, tl.trans(_widen(kr, Q_HALF, DOT_F32))) * scale_log2
                    s += tl.dot(q0, tl.trans(_widen(k0, Q_HALF, DOT_F32))) * (c0 * scale_log2)[None, :]
                    s += tl.dot(q1, tl.trans(_widen(k1, Q_HALF, DOT_F32))) * (c1 * scale_log2)[None, :]
                    s += tl.dot(q2, tl.trans(_widen(k2, Q_HALF, DOT_F32))) * (c2 * scale_log2)[None, :]
                    s += tl.dot(q3, tl.trans(_widen(k3, Q_HALF, DOT_F32))) * (c3 * scale_log2)[None, :]
                s = tl.where(ok[None, :], s, float("-inf"))

                # online softmax; a row that has seen no key keeps max -inf, so its exponents use base 0
                new_max = tl.maximum(row_max, tl.max(s, axis=1))
                base = tl.where(new_max == float("-inf"), 0.0, new_max)
                p = tl.exp2(s - base[:, None])
                rescale = tl.exp2(row_max - base)
                row_sum = row_sum * rescale + tl.sum(p, axis=1)
                row_max = new_max
                # O_g += (P * c_g) V_g: the group scale rides on P (masked slots: c = 0, V rows 0)
                acc0 = tl.dot(_widen(p * c0[None, :], tl.bfloat16, DOT_F32), v0, acc0 * rescale[:, None])
                acc1 = tl.dot(_widen(p * c1[None, :], tl.bfloat16, DOT_F32), v1, acc1 * rescale[:, None])
                acc2 = tl.dot(_widen(p * c2[None, :], tl.bfloat16, DOT_F32), v2, acc2 * rescale[:, None])
                acc3 = tl.dot(_widen(p * c3[None, :], tl.bfloat16, DOT_F32), v3, acc3 * rescale[:, None])

            seen = row_sum != 0.0          # NaN stays NaN in out and lse, as in the Hopper kernel
            inv = 1.0 / tl.where(seen, row_sum, 1.0)       # rows that saw no key: acc is 0, so out = 0
            lse = tl.where(seen, (row_max + tl.log2(tl.where(seen, row_sum, 1.0))) / _LOG2E, float("-inf"))
            if num_pieces == 1:
                if HAS_SINK:   # this row's final result: apply the sink here (split rows: in the combine)
                    inv = inv * _sink_scale(sink_ptr, head, row_ok, lse)
                o_row = out_ptr + seq64 * stride_o_b + q_token * stride_o_s + head * stride_o_h
                _store_rows(o_row, acc0, acc1, acc2, acc3, inv, row_ok, GROUP, DOT_F32)
                tl.store(lse_ptr + seq64 * stride_lse_b + head * stride_lse_h + q_token * stride_lse_s, lse,
                         mask=row_ok)
            else:
                ws_slot = (first_slot + split_idx).to(tl.int64)
                ws_row = o_ws_ptr + ws_slot * stride_ws_slot + r * stride_ws_row
                _store_rows(ws_row, acc0, acc1, acc2, acc3, inv, row_ok, GROUP, DOT_F32)
                tl.store(lse_ws_ptr + ws_slot * stride_lws_slot + r, lse, mask=row_ok)


def sparse_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                         topk_length: Optional[torch.Tensor], tile_scheduler_metadata: torch.Tensor,
                         num_splits: torch.Tensor, softmax_scale: float,
                         attn_sink: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sparse FP8 decoding with the Triton kernels; see the module docstring. Arguments are validated by the
    caller; CPU tensors run under TRITON_INTERPRET=1.

    Args:
        q: (b, s_q, h_q, 576) bf16 or fp16.
        k_cache: (num_blocks, page_block_size, 1, 656) uint8 or float8_e4m3fn (flash_mla/sparse_fp8.py layout).
        indices: (b, s_q, topk) int32 token numbers (page * page_block_size + offset), -1 = unused.
        topk_length: None or (b,) int32.
        tile_scheduler_metadata, num_splits: the scheduler's plan for lengths topk_length (or topk),
            s_q * h_q query rows per KV head, one KV head.
        softmax_scale: float.
        attn_sink: None or (h_q,) float32.

    Returns:
        out (b, s_q, h_q, 512) in q's dtype and lse (b, h_q, s_q) float32.
    """
    if triton is None:
        raise RuntimeError(f"flash_mla: {unavailable_reason(q.device)}")
    b, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    rows = s_q * h_q
    num_parts = tile_scheduler_metadata.shape[0]
    device = q.device
    if q.stride(-1) != 1:
        q = q.contiguous()
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    tokens = _token_rows(k_cache)
    latent = tokens.view(FP8_DTYPE)
    rope = tokens.view(torch.bfloat16)
    scales = tokens.view(torch.float32)

    out = torch.empty(b, s_q, h_q, LATENT_DIM, dtype=q.dtype, device=device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=device)
    # each part cuts at most one row, so at most b + num_parts pieces: a bound known without reading num_splits
    num_slots = b + num_parts
    o_ws = torch.empty(num_slots, 1, rows, LATENT_DIM, dtype=torch.float32, device=device)
    lse_ws = torch.empty(num_slots, 1, rows, dtype=torch.float32, device=device)
    # absent optional tensors: the kernels never read them (compile-time flags); pass any int32 / float32 tensor
    sink = lse if attn_sink is None else attn_sink.contiguous()
    lengths = num_splits if topk_length is None else topk_length.contiguous()

    block_m = _head_block(h_q)
    head_blocks = triton.cdiv(h_q, block_m)
    _sparse_split_kernel[(s_q * head_blocks, num_parts)](
        q, latent, rope, scales, indices, lengths, tile_scheduler_metadata, num_splits,
        out, lse, o_ws, lse_ws, sink,
        q.stride(0), q.stride(1), q.stride(2),
        indices.stride(0), indices.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        o_ws.stride(0), o_ws.stride(2), lse_ws.stride(0),
        h_q, topk, float(softmax_scale) * LOG2E,
        HEAD_BLOCKS=head_blocks, BLOCK_M=block_m, BLOCK_N=BLOCK_N, GROUP=SCALE_GROUP, D_ROPE=ROPE_DIM,
        TOKEN_BYTES=TOKEN_BYTES, SCALES_OFFSET=SCALES_OFFSET, ROPE_OFFSET=ROPE_OFFSET,
        META_WIDTH=METADATA_WIDTH, HAS_TOPK_LENGTH=topk_length is not None, HAS_SINK=attn_sink is not None,
        Q_HALF=_TL_HALF[q.dtype], Q_BF16=q.dtype == torch.bfloat16, DOT_F32=_dense._interpreted(),
        num_warps=SPLIT_NUM_WARPS[block_m], num_stages=SPLIT_NUM_STAGES,
    )
    _dense.combine_pieces(out, lse, o_ws, lse_ws, num_splits, sink, h_q, has_sink=attn_sink is not None)
    return out, lse


assert NUM_SCALES * SCALE_GROUP == LATENT_DIM and TOKEN_BYTES % 16 == 0 and ROPE_OFFSET % 16 == 0
