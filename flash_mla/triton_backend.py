"""Portable Triton backend: split-KV MLA decoding over the paged KV cache on any CUDA GPU Triton supports.

The algorithm is the one flash_mla/cpu_backend.py spells out, on the scheduler's metadata:

1. Split kernel, grid (query-row tile, KV head, SM part). A program reads its metadata row and walks the
   sequence pieces of its part (scheduler.pieces_of_part). For each piece it loads the tile's query rows
   once, then streams the piece's keys through the block table, BLOCK_N tokens at a time, with an online
   softmax in float32 (exp2, scale folded into log2 units). All query heads of one KV head are packed into
   the M dimension of tl.dot, so a cache page is read once per (KV head, row tile), not once per head.
   An unsplit sequence (one piece) is written straight to `out`/`lse`; a piece of a split sequence writes
   its normalised float32 partial output and lse to workspace slot num_splits[seq] + split_idx.
2. Combine kernel, grid (sequence, KV head, row tile): for sequences with more than one piece,
   lse = logsumexp_k lse_k and out = sum_k exp(lse_k - lse) * O_k; rows no piece saw keep out 0, lse -inf.
With an attention sink (attn_sink, one logit per query head), the kernel that writes a row's final result (the
split kernel for an unsplit sequence, the combine kernel for a split one) scales it by 1 / (1 + exp(sink - lse))
before the store: no extra pass over `out`. lse is stored unchanged.

FP8 KV cache (flash_mla/fp8.py): the split kernel loads the float8_e4m3fn cache (and an fp8 q) as it is stored,
one byte per element. With an fp8 q, S = Q K^T is one fp8 x fp8 tensor-core dot on the tiles as loaded (products
exact, moved into float32 every FP8_ACC_CHUNK of them; Triton's interpreter, which has no fp8 dot, widens both
tiles to fp16 instead: the same products); the V tile (the cache's first 512 columns) is widened in registers to fp16
(exact: every e4m3 value is an fp16 value) for P V, P being rounded to fp16. With a bf16 / fp16 q, the cache tile
is widened to q's type (exact too) and both dots run as for a half-precision cache. The scales are read from
their device tensors once per program and applied once: descale_q * descale_k is folded into the softmax scale
of S, and descale_k multiplies the normalised output of a piece, so the workspace and the combine kernel are the
same as for a half-precision cache.
(Measured on the H100, b = 128, L = 8192, causal, fp8 q, against this backend's bf16 path: h_q 64 / 128 run
1.04-1.18x faster with the fp8 dot for S, where widening K to bf16 for it had made them 0.63-0.72x; h_q 16 runs at
0.8-0.9x, bound by widening V for P V; a bf16 q with an fp8 cache, which widens K too, 0.7-0.9x.)

Nothing here synchronises with the host (the workspace is sized by the bound b + num_sm_parts on the slot
count, not by reading num_splits), so a call can be captured in a CUDA graph; kernels run on the current
stream (Triton launches on torch's current stream).

Importing this module never fails: without Triton, `unavailable_reason` says why and the kernels are absent.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ._geometry import METADATA_WIDTH, PAGE_BLOCK_SIZE
from .fp8 import FP8_DTYPE, decode_out_dtype

try:
    import triton
    import triton.language as tl
    _TRITON_IMPORT_ERROR: Optional[str] = None
except ImportError as e:  # Triton is an optional dependency
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = str(e)

LOG2E = math.log2(math.e)     # exp(x) = exp2(x * LOG2E): scores are kept in log2 units

# ---- tuning knobs ------------------------------------------------------------------------------------------
# Measured on the H100 (Triton 3.6, b = 128, L = 8192, causal, bf16; benchmarks/tune_triton.py):
# h_q 16 s_q 1 ~2000 GB/s, h_q 16 s_q 2 ~1600 GB/s, h_q 64 s_q 1 ~1460 GB/s, h_q 128 s_q 1 ~205 TFLOP/s.
#
# Keys per inner-loop step. 64 = one page; any power of two works (the block table is looked up per token).
# The K tile (BLOCK_N x 576 half) is the dot operand both for S = Q K^T and, its first 512 columns, for
# O += P V, so it is loaded once per step. 64 beat 32 at every row count measured (fewer rescales, longer
# bursts per gathered page).
BLOCK_N = 64
# Query rows per program: the M of tl.dot. Rows of one KV head (s_q * h_q / h_kv of them) are tiled by the
# smallest power of two that holds them, between 16 (tl.dot's minimum M) and MAX_BLOCK_M. Every extra row
# tile re-reads the cache, which cost more than the float32 accumulator's (BLOCK_M x 512) register spills:
# 128 rows ran 2.3x faster as 2 tiles of 64 than as 8 tiles of 16.
MIN_BLOCK_M = 16
MAX_BLOCK_M = 64
# Warps per split-kernel program, by BLOCK_M: 8 warps hold the accumulator without spilling at BLOCK_M 16
# (4 warps spilled and ran ~7% slower); 16 warps were slower at 128 rows, whatever the BLOCK_M.
SPLIT_NUM_WARPS = {16: 8, 32: 8, 64: 8}
# Software-pipelining depth of the key loop: 2 overlaps the next tile's (gathered) load with this tile's
# math; each stage holds a BLOCK_N x 576 tile in shared memory (72 KiB at BLOCK_N = 64). 1 stage was
# ~30% slower, 3 no faster.
SPLIT_NUM_STAGES = 2
# Combine kernel: rows per program and warps. It only streams n_pieces x rows x 512 float32 once.
COMBINE_BLOCK_M = 16
COMBINE_NUM_WARPS = 4
# FP8 cache: a page is half the bytes, so a third stage fits; it was 3-8% faster than 2 (H100, fp8 q).
SPLIT_NUM_STAGES_FP8 = 3
# fp8 dots on Hopper accumulate inside the tensor cores with fewer bits than float32 (Triton's default for them);
# max_num_imprecise_acc = 32 moves the partial sums into the float32 accumulator after every 32 products. Measured
# (H100, L up to 8192): lse max error 1e-4 with it, up to 2.6e-3 without (out alike, ~2e-3 relative either way),
# for 10-25% of the fp8 path's time at h_q 64 / 128.
FP8_ACC_CHUNK = 32


def unavailable_reason(device: torch.device, fp8: bool = False) -> Optional[str]:
    """None when the Triton kernels can run on `device` (with an fp8 KV cache when `fp8`), else a human-readable
    reason."""
    if _TRITON_IMPORT_ERROR is not None:
        return f"triton is not importable ({_TRITON_IMPORT_ERROR}); install it with `pip install triton`"
    device = torch.device(device)
    if device.type == "cpu":
        if not _interpreted():
            return (f"the triton backend needs CUDA tensors, got tensors on {device} (Triton's interpreter runs "
                    "the kernels on CPU tensors only when TRITON_INTERPRET=1 is set before triton is first "
                    "imported; in this process flash_mla.triton_backend was imported without it)")
        if not _triton_helpers_interpreted():
            return (f"the triton backend cannot run tensors on {device}: TRITON_INTERPRET=1 was set after triton "
                    "was imported, so triton.language's own helpers (tl.sum, tl.max, ...) were compiled for a GPU "
                    "while flash_mla's kernels are interpreted; set TRITON_INTERPRET=1 before the first import of "
                    "triton (e.g. in the environment of the process)")
        return None
    if device.type != "cuda":
        return f"the triton backend needs CUDA tensors, got tensors on {device}"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False: no usable CUDA GPU or driver"
    if torch.version.hip is None:
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            # bf16 tl.dot and the ~150 KiB of shared memory per program need Ampere or newer.
            return (f"the triton backend needs an NVIDIA GPU of compute capability 8.0 or newer, "
                    f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}")
        if fp8 and (major, minor) < (8, 9):
            # Triton has no float8e4nv type before Ada/Hopper
            return (f"the triton backend runs fp8 KV caches on compute capability 8.9 or newer (Ada, Hopper), "
                    f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}")
    return None


def _interpreted() -> bool:
    """True when the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when this module was imported).

    The interpreter multiplies bfloat16 dot operands as their raw uint16 bits (Triton 3.9), so under it the
    kernel upcasts its (already bf16-rounded) operands to float32 first: same numbers, exact products.
    It loads float8_e4m3fn tensors as they are and converts them exactly, with one exception (Triton 3.9): the NaN
    code 0x7F reads as 480 (0xFF is NaN). The kernel never converts the cache slots past a sequence's length (masked
    loads), so this only matters for NaN inside a sequence, which a GPU would propagate.
    """
    return type(_split_kv_kernel).__name__ == "InterpretedFunction"


def _triton_helpers_interpreted() -> bool:
    """True when triton.language's jitted helpers were decorated in interpreter mode too. Triton decides at
    decoration time, so setting TRITON_INTERPRET=1 between `import triton` and this module's import leaves the
    helpers compiled and the kernels interpreted, which fails inside the first kernel with an obscure error."""
    standard = getattr(tl, "standard", None)
    helper = getattr(standard, "sum", None)
    if helper is None:   # a Triton without this layout: nothing to compare, let the kernels run
        return True
    return type(helper).__name__ == "InterpretedFunction"


def _row_block(rows: int) -> int:
    """Query rows per split-kernel program (see MIN_BLOCK_M / MAX_BLOCK_M)."""
    return min(MAX_BLOCK_M, max(MIN_BLOCK_M, triton.next_power_of_2(rows)))


if triton is not None:
    _LOG2E = tl.constexpr(LOG2E)   # for use inside kernels
    _TL_HALF = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _loop_bound(x):
        """A scalar loaded from memory, as a `range()` bound. Compiled: the identity (the loops stay scf.for,
        so the key loop is still software-pipelined)."""
        return x

    if type(_loop_bound).__name__ == "InterpretedFunction":
        def _loop_bound(x):
            """Interpreted: a Python int. The interpreter runs range() on the bounds, which calls the tensor's
            __index__; Triton's interpreter holds every scalar as a 1-element 1-D numpy array, and older Triton
            (3.6; 3.9 squeezes first) makes __index__ int(array), which recent NumPy (2.4 here) refuses ("only
            0-dimensional arrays can be converted to Python scalars"). Read the one element ourselves."""
            handle = getattr(x, "handle", None)
            if handle is None:   # already a Python number or a constexpr
                return int(getattr(x, "value", x))
            return int(handle.data.reshape(-1)[0])

    @triton.jit
    def _part_pieces(metadata_ptr, part, META_WIDTH: tl.constexpr):
        """SM part `part`'s metadata row (SPEC.md "Scheduler"): its pieces run from token begin_token of begin_seq
        to token end_token of end_seq; begin_split is the first piece's index among its sequence's pieces. An idle
        part has begin_seq = b > end_seq, so a sequence loop over it does not run.
        Returns (begin_seq, begin_token, end_seq, end_token, begin_split)."""
        meta = metadata_ptr + part * META_WIDTH
        return tl.load(meta + 0), tl.load(meta + 1), tl.load(meta + 2), tl.load(meta + 3), tl.load(meta + 4)

    @triton.jit
    def _sink_scale(sink_ptr, head, row_ok, lse):
        """1 / (1 + exp(attn_sink[head] - lse)) per row; 1 for rows that saw no key (lse -inf: their out is 0
        and stays 0, and a -inf sink would otherwise give exp(nan))."""
        sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0)
        no_key = lse == float("-inf")
        # lse 0 stands in for -inf so that a -inf sink gives exp(-inf) = 0 rather than exp(-inf + inf) = NaN
        scale = 1.0 / (1.0 + tl.exp2((sink - tl.where(no_key, 0.0, lse)) * _LOG2E))
        return tl.where(no_key, 1.0, scale)

    @triton.jit
    def _split_kv_kernel(
        q_ptr, k_ptr, block_table_ptr, seqlens_ptr, metadata_ptr, num_splits_ptr,
        out_ptr, lse_ptr, o_ws_ptr, lse_ws_ptr, sink_ptr, descale_q_ptr, descale_k_ptr,
        stride_q_b, stride_q_s, stride_q_h,
        stride_k_block, stride_k_pos, stride_k_h,
        stride_bt_b,
        stride_o_b, stride_o_s, stride_o_h,
        stride_lse_b, stride_lse_h, stride_lse_s,
        stride_ws_slot, stride_ws_h, stride_ws_row,   # o workspace (slot, h_kv, rows, D_V), last dim contiguous
        stride_lws_slot, stride_lws_h,                # lse workspace (slot, h_kv, rows), last dim contiguous
        s_q, group, rows, scale_log2,
        CAUSAL: tl.constexpr, D_V: tl.constexpr, D_ROPE: tl.constexpr, PAGE: tl.constexpr,
        META_WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
        HAS_SINK: tl.constexpr, Q_FP8: tl.constexpr, KV_FP8: tl.constexpr, HALF: tl.constexpr,
        S_FP8: tl.constexpr, FP8_ACC_CHUNK: tl.constexpr,
    ):
        # HALF: P's precision for P V, and the type fp8 tiles are widened to (q's type; fp16 for an fp8 q).
        # S_FP8: S = Q K^T as one fp8 dot of the tiles as loaded (fp8 q and cache, compiled kernels), with
        # float32 accumulation every FP8_ACC_CHUNK products.
        row_tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)

        if KV_FP8:
            # true = stored * descale: S = (q . k_stored) * descale_q * descale_k (folded into the softmax scale
            # here), O = descale_k * (P V_stored) (applied once, where a piece's output is normalised)
            k_descale = tl.load(descale_k_ptr)
            scale_log2 = scale_log2 * k_descale
            if Q_FP8:
                scale_log2 = scale_log2 * tl.load(descale_q_ptr)

        begin_seq, begin_token, end_seq, end_token, begin_split = _part_pieces(metadata_ptr, part, META_WIDTH)

        # Packed query rows of this KV head: row r is query token r // group of head kv_head * group + r % group.
        r = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = r < rows
        q_token = r // group
        head = kv_head * group + r % group
        cols_v = tl.arange(0, D_V)            # latent ("NoPE") columns, also V's columns
        cols_rope = D_V + tl.arange(0, D_ROPE)
        offs_n = tl.arange(0, BLOCK_N)

        for seq in range(_loop_bound(begin_seq), _loop_bound(end_seq + 1)):
            seq64 = tl.cast(seq, tl.int64)   # 64-bit offsets: big batches overflow int32
            length = tl.load(seqlens_ptr + seq)
            lo = tl.where(seq == begin_seq, begin_token, 0)
            hi = tl.where(seq == end_seq, end_token, length)
            split_idx = tl.where(seq == begin_seq, begin_split, 0)
            first_slot = tl.load(num_splits_ptr + seq)
            num_pieces = tl.load(num_splits_ptr + seq + 1) - first_slot

            q_row_ptr = q_ptr + seq64 * stride_q_b + q_token * stride_q_s + head * stride_q_h
            q_nope = tl.load(q_row_ptr[:, None] + cols_v[None, :], mask=row_ok[:, None], other=0.0)
            q_rope = tl.load(q_row_ptr[:, None] + cols_rope[None, :], mask=row_ok[:, None], other=0.0)
            if Q_FP8 and not S_FP8:   # widen in registers (exact)
                q_nope = q_nope.to(HALF)
                q_rope = q_rope.to(HALF)
            if DOT_F32:
                q_nope = q_nope.to(tl.float32)
                q_rope = q_rope.to(tl.float32)

            # Last key each row may see: L - s_q + i for query token i when causal, else L - 1.
            if CAUSAL:
                last_key = length - s_q + q_token
            else:
                last_key = tl.zeros([BLOCK_M], dtype=tl.int32) + (length - 1)

            row_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)   # log2 units
            row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)

            for start in range(_loop_bound(lo), _loop_bound(hi), BLOCK_N):
                token = start + offs_n
                token_ok = token < hi   # hi <= L: tokens past the length (NaN slots, -1 pages) are never loaded
                page = tl.load(block_table_ptr + seq64 * stride_bt_b + token // PAGE, mask=token_ok, other=0)
                kv_row_ptr = (k_ptr + page.to(tl.int64) * stride_k_block + (token % PAGE) * stride_k_pos
                              + kv_head * stride_k_h)
                # Masked rows load as 0 rather than whatever the slot holds, so P V never sees 0 * NaN.
                kv = tl.load(kv_row_ptr[:, None] + cols_v[None, :], mask=token_ok[:, None], other=0.0)
                k_rope = tl.load(kv_row_ptr[:, None] + cols_rope[None, :], mask=token_ok[:, None], other=0.0)
                if S_FP8:   # S from the fp8 tiles as loaded; V widened for P V
                    s = tl.dot(q_rope, tl.trans(k_rope),
                               tl.dot(q_nope, tl.trans(kv), max_num_imprecise_acc=FP8_ACC_CHUNK),
                               max_num_imprecise_acc=FP8_ACC_CHUNK)
                    kv = kv.to(HALF)
                else:
                    if KV_FP8:   # loaded as stored (one byte per element), widened exactly in registers
                        kv = kv.to(HALF)
                        k_rope = k_rope.to(HALF)
                    if DOT_F32:
                        kv = kv.to(tl.float32)
                        k_rope = k_rope.to(tl.float32)
                    # S = Q K^T over the 512 latent + 64 RoPE columns
                    s = tl.dot(q_rope, tl.trans(k_rope), tl.dot(q_nope, tl.trans(kv)))
                s = s * scale_log2   # log2 units
                visible = token_ok[None, :] & (token[None, :] <= last_key[:, None])
                s = tl.where(visible, s, float("-inf"))

                # Online softmax; a row that has seen no key yet keeps max -inf, so exponents use base 0.
                new_max = tl.maximum(row_max, tl.max(s, axis=1))
                base = tl.where(new_max == float("-inf"), 0.0, new_max)
                p = tl.exp2(s - base[:, None])
                rescale = tl.exp2(row_max - base)
                row_sum = row_sum * rescale + tl.sum(p, axis=1)
                # O += P V, V being the first D_V columns of the same cache rows
                p = p.to(HALF)       # the tensor cores take P in half precision (the cache's, fp16 for fp8 q)
                if DOT_F32:
                    p = p.to(tl.float32)
                acc = tl.dot(p, kv, acc * rescale[:, None])
                row_max = new_max

            seen = row_sum != 0.0          # NaN stays NaN in out and lse, as in the Hopper kernel
            safe_sum = tl.where(seen, row_sum, 1.0)
            if KV_FP8:
                o = acc * (k_descale / safe_sum)[:, None]    # V's scale, once per row
            else:
                o = acc / safe_sum[:, None]                  # rows that saw no key: acc is 0, so o = 0
            lse = tl.where(seen, (row_max + tl.log2(safe_sum)) / _LOG2E, float("-inf"))

            if num_pieces == 1:
                if HAS_SINK:   # the row's final result: apply the sink here (split rows: in the combine)
                    o = o * _sink_scale(sink_ptr, head, row_ok, lse)[:, None]
                out_row_ptr = out_ptr + seq64 * stride_o_b + q_token * stride_o_s + head * stride_o_h
                tl.store(out_row_ptr[:, None] + cols_v[None, :], o.to(out_ptr.dtype.element_ty),
                         mask=row_ok[:, None])
                tl.store(lse_ptr + seq64 * stride_lse_b + head * stride_lse_h + q_token * stride_lse_s, lse,
                         mask=row_ok)
            else:
                slot = (first_slot + split_idx).to(tl.int64)
                ws_row_ptr = o_ws_ptr + slot * stride_ws_slot + kv_head * stride_ws_h + r * stride_ws_row
                tl.store(ws_row_ptr[:, None] + cols_v[None, :], o, mask=row_ok[:, None])
                tl.store(lse_ws_ptr + slot * stride_lws_slot + kv_head * stride_lws_h + r, lse, mask=row_ok)

    @triton.jit
    def _combine_kernel(
        out_ptr, lse_ptr, o_ws_ptr, lse_ws_ptr, num_splits_ptr, sink_ptr,
        stride_o_b, stride_o_s, stride_o_h,
        stride_lse_b, stride_lse_h, stride_lse_s,
        stride_ws_slot, stride_ws_h, stride_ws_row,
        stride_lws_slot, stride_lws_h,
        group, rows,
        D_V: tl.constexpr, BLOCK_M: tl.constexpr, HAS_SINK: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        row_tile = tl.program_id(2)
        first_slot = tl.load(num_splits_ptr + seq)
        num_pieces = tl.load(num_splits_ptr + seq + 1) - first_slot
        if num_pieces > 1:   # unsplit sequences were written by the split kernel
            seq64 = tl.cast(seq, tl.int64)   # 64-bit offsets: big batches overflow int32
            r = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
            row_ok = r < rows
            cols_v = tl.arange(0, D_V)
            lse_ws_row_ptr = lse_ws_ptr + kv_head * stride_lws_h + r
            o_ws_row_ptr = o_ws_ptr + kv_head * stride_ws_h + r * stride_ws_row

            # lse = logsumexp_k lse_k, first its max so that every exponent is <= 0
            max_lse = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            for k in range(_loop_bound(num_pieces)):
                slot = (first_slot + k).to(tl.int64)
                lse_k = tl.load(lse_ws_row_ptr + slot * stride_lws_slot, mask=row_ok, other=float("-inf"))
                max_lse = tl.maximum(max_lse, lse_k)
            base = tl.where(max_lse == float("-inf"), 0.0, max_lse)   # a row no piece saw: all weights 0

            # out = sum_k w_k O_k / sum_k w_k with w_k = exp(lse_k - max): the pieces' O_k are normalised
            weight_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, D_V], dtype=tl.float32)
            for k in range(_loop_bound(num_pieces)):
                slot = (first_slot + k).to(tl.int64)
                lse_k = tl.load(lse_ws_row_ptr + slot * stride_lws_slot, mask=row_ok, other=float("-inf"))
                w = tl.exp2((lse_k - base) * _LOG2E)
                o_k = tl.load(o_ws_row_ptr[:, None] + slot * stride_ws_slot + cols_v[None, :],
                              mask=row_ok[:, None], other=0.0)
                weight_sum += w
                acc += w[:, None] * o_k

            seen = weight_sum != 0.0       # a NaN piece makes the row NaN
            safe_sum = tl.where(seen, weight_sum, 1.0)
            o = acc / safe_sum[:, None]
            lse = tl.where(seen, base + tl.log(safe_sum), float("-inf"))
            q_token = r // group
            head = kv_head * group + r % group
            if HAS_SINK:
                o = o * _sink_scale(sink_ptr, head, row_ok, lse)[:, None]
            out_row_ptr = out_ptr + seq64 * stride_o_b + q_token * stride_o_s + head * stride_o_h
            tl.store(out_row_ptr[:, None] + cols_v[None, :], o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
            tl.store(lse_ptr + seq64 * stride_lse_b + head * stride_lse_h + q_token * stride_lse_s, lse, mask=row_ok)


def mla_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                      cache_seqlens: torch.Tensor, head_dim_v: int, tile_scheduler_metadata: torch.Tensor,
                      num_splits: torch.Tensor, softmax_scale: float, causal: bool,
                      attn_sink: Optional[torch.Tensor] = None, descale_q: Optional[torch.Tensor] = None,
                      descale_k: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Split-KV MLA decoding with the Triton kernels. Arguments are validated by the caller
    (flash_mla_with_kvcache); CPU tensors work under TRITON_INTERPRET=1 (tests). An fp8 cache comes with
    descale_k, an fp8 q with descale_q ((1,) float32 tensors on the device, read by the kernel)."""
    if triton is None:
        raise RuntimeError(f"flash_mla: {unavailable_reason(q.device)}")
    b, s_q, h_q, d = q.shape
    h_kv = k_cache.shape[2]
    group = h_q // h_kv
    rows = s_q * group
    d_rope = d - head_dim_v
    num_parts = tile_scheduler_metadata.shape[0]
    device = q.device

    out_dtype = decode_out_dtype(q.dtype)
    half = torch.float16 if q.dtype == FP8_DTYPE else q.dtype      # HALF (see the kernel)
    out = torch.empty(b, s_q, h_q, head_dim_v, dtype=out_dtype, device=device)
    lse = torch.empty(b, h_q, s_q, dtype=torch.float32, device=device)
    # Each part cuts at most one sequence, so there are at most b + num_parts pieces: a bound known without
    # reading num_splits[-1] back to the host.
    num_slots = b + num_parts
    o_ws = torch.empty(num_slots, h_kv, rows, head_dim_v, dtype=torch.float32, device=device)
    lse_ws = torch.empty(num_slots, h_kv, rows, dtype=torch.float32, device=device)

    # without a sink the kernels never read sink_ptr (HAS_SINK is a compile-time constant): pass any float32 tensor
    sink = lse if attn_sink is None else attn_sink.contiguous()
    # likewise the descales when absent (Q_FP8 / KV_FP8 are compile-time constants)
    kv_fp8 = k_cache.dtype == FP8_DTYPE
    q_fp8 = q.dtype == FP8_DTYPE

    block_m = _row_block(rows)
    _split_kv_kernel[(triton.cdiv(rows, block_m), h_kv, num_parts)](
        q, k_cache, block_table, cache_seqlens, tile_scheduler_metadata, num_splits,
        out, lse, o_ws, lse_ws, sink, descale_q if q_fp8 else lse, descale_k if kv_fp8 else lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        o_ws.stride(0), o_ws.stride(1), o_ws.stride(2),
        lse_ws.stride(0), lse_ws.stride(1),
        s_q, group, rows, softmax_scale * LOG2E,
        CAUSAL=bool(causal), D_V=head_dim_v, D_ROPE=d_rope, PAGE=PAGE_BLOCK_SIZE, META_WIDTH=METADATA_WIDTH,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, DOT_F32=_interpreted() and half == torch.bfloat16,
        HAS_SINK=attn_sink is not None, Q_FP8=q_fp8, KV_FP8=kv_fp8, HALF=_TL_HALF[half],
        # Triton's interpreter has no fp8 dot: there S uses the widened tiles (same products, exact)
        S_FP8=q_fp8 and not _interpreted(), FP8_ACC_CHUNK=FP8_ACC_CHUNK,
        num_warps=SPLIT_NUM_WARPS[block_m], num_stages=SPLIT_NUM_STAGES_FP8 if kv_fp8 else SPLIT_NUM_STAGES,
    )
    combine_pieces(out, lse, o_ws, lse_ws, num_splits, sink, group, has_sink=attn_sink is not None)
    return out, lse


def combine_pieces(out, lse, o_ws, lse_ws, num_splits, sink, heads_per_kv: int, has_sink: bool) -> None:
    """Merge the fp32 partials of every split sequence (workspace (slots, h_kv, rows, D_V) and (slots, h_kv,
    rows)) into out (b, s_q, h_q, D_V) and lse (b, h_q, s_q), applying the sink; row r of KV head k is query token
    r // heads_per_kv, head k * heads_per_kv + r % heads_per_kv. Also the sparse backend's combine."""
    b, h_kv, rows = out.shape[0], o_ws.shape[1], o_ws.shape[2]
    _combine_kernel[(b, h_kv, triton.cdiv(rows, COMBINE_BLOCK_M))](
        out, lse, o_ws, lse_ws, num_splits, sink,
        out.stride(0), out.stride(1), out.stride(2),
        lse.stride(0), lse.stride(1), lse.stride(2),
        o_ws.stride(0), o_ws.stride(1), o_ws.stride(2),
        lse_ws.stride(0), lse_ws.stride(1),
        heads_per_kv, rows,
        D_V=o_ws.shape[3], BLOCK_M=COMBINE_BLOCK_M, HAS_SINK=has_sink,
        num_warps=COMBINE_NUM_WARPS,
    )
