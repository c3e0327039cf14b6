"""Pure-Python twin of the on-device tile scheduler (``get_mla_metadata``).

It applies the rules of SPEC.md ("Scheduler") with plain integers, so it is the executable definition the
CUDA metadata kernel is checked against bit for bit, and the scheduler the CPU backend runs on.

Work unit: one 64-token page ("block") of one sequence. Every piece of a sequence a part takes also costs
``FIXED_OVERHEAD`` block-equivalents (reading Q, writing the output, combining).

Sparse FP8 plans take the smallest payload that still covers the batch (``tight_payload``, `plan_payload`) and a
floor on it, ``SPARSE_MIN_PAYLOAD`` (``min_payload``): _geometry.SPARSE_PLAN, the same arguments here and in the
CUDA kernel (flash_mla/_geometry.py says why; the rules are written in docs/PERF.md "Scheduler").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

# PAGE_BLOCK_SIZE: tokens per KV-cache page, the scheduler's unit of work
from ._geometry import FIXED_OVERHEAD, METADATA_WIDTH, PAGE_BLOCK_SIZE, ROWS_PER_TILE

# Column indices of one tile_scheduler_metadata row.
BEGIN_SEQ, BEGIN_TOKEN, END_SEQ, END_TOKEN, BEGIN_SPLIT = range(5)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def num_sm_parts_for(num_sms: int, num_heads_per_head_k: int, num_heads_k: int) -> int:
    """SM parts per (query tile, KV head): the grid then holds about one CTA per multiprocessor."""
    tiles = ceil_div(num_heads_per_head_k, ROWS_PER_TILE)
    return max(num_sms // num_heads_k // tiles, 1)


@dataclass(frozen=True)
class Piece:
    """A contiguous token range [begin_token, end_token) of one sequence, processed by one SM part."""
    seq: int
    begin_token: int
    end_token: int
    split_idx: int       # index of this piece among the sequence's pieces
    num_pieces: int      # pieces the sequence was cut into (1 = unsplit)
    slot: int            # workspace slot for split pieces: num_splits[seq] + split_idx


def _walk(seqlens: Sequence[int], blocks: Sequence[int], num_sm_parts: int,
          payload: int) -> Tuple[List[List[int]], List[int], int]:
    """The greedy walk of SPEC.md with a given payload: (metadata rows, num_splits prefix sums, sequences covered).
    The plan is valid only if the last value is len(blocks) (the parts' payload covers the whole batch)."""
    b = len(blocks)
    metadata: List[List[int]] = []
    num_splits = [0] * (b + 1)
    seq, block, split_idx = 0, 0, 0   # walk position: sequence, first untaken block, pieces already cut
    splits_so_far = 0
    for _ in range(num_sm_parts):
        begin_seq, begin_block, begin_split = seq, block, split_idx
        remaining = payload
        while seq < b:
            cost_to_close = blocks[seq] - block + FIXED_OVERHEAD
            if cost_to_close <= remaining:          # the rest of the sequence fits: take it whole
                remaining -= cost_to_close
                splits_so_far += split_idx + 1
                num_splits[seq + 1] = splits_so_far
                seq, block, split_idx = seq + 1, 0, 0
                continue
            if remaining > FIXED_OVERHEAD:          # room for a piece: cut the sequence here
                block += remaining - FIXED_OVERHEAD
                split_idx += 1
            break
        if block > 0:
            end_seq, end_token = seq, block * PAGE_BLOCK_SIZE
        else:
            end_seq = seq - 1
            end_token = int(seqlens[end_seq]) if end_seq >= 0 else 0
        metadata.append([begin_seq, begin_block * PAGE_BLOCK_SIZE, end_seq, end_token, begin_split, 0, 0, 0])
    return metadata, num_splits, seq


def plan_payload(seqlens: Sequence[int], blocks: Sequence[int], num_sm_parts: int, min_payload: int = 0,
                 tight_payload: bool = False) -> int:
    """Each SM part's payload, in blocks (FIXED_OVERHEAD included).

    SPEC.md's rule: ceil(total / num_sm_parts) + FIXED_OVERHEAD, which always covers the batch. tight_payload: the
    smallest payload >= ceil(total / num_sm_parts) whose walk still covers the batch (the FIXED_OVERHEAD candidates
    below SPEC.md's are walked, SPEC.md's if none covers), so the busiest part carries as little as the walk
    allows: 16 sequences of 32 pages over 66 parts take 64 parts of 8 pages instead of 48 of 9 and 16 of 5
    (docs/PERF.md "Scheduler").
    min_payload: a floor on the result."""
    total = sum(blocks) + FIXED_OVERHEAD * len(blocks)
    lowest = ceil_div(total, num_sm_parts)
    payload = lowest + FIXED_OVERHEAD
    if tight_payload:
        payload = next((c for c in range(lowest, payload)
                        if _walk(seqlens, blocks, num_sm_parts, c)[2] == len(blocks)), payload)
    return max(payload, min_payload)


def schedule(seqlens: Sequence[int], num_sm_parts: int, min_payload: int = 0,
             tight_payload: bool = False) -> Tuple[List[List[int]], List[int]]:
    """Apply the scheduler rules. Returns (metadata rows, num_splits prefix sums) as Python lists.

    min_payload: a floor on each part's payload, in blocks (FIXED_OVERHEAD included). 0 (no floor) is SPEC.md's
    rule, the dense plan; sparse plans pass SPARSE_MIN_PAYLOAD; benchmarks/plan_policy.py times other plans. A
    floor that binds leaves the trailing parts without work (begin_seq = b). tight_payload: the smallest payload
    that covers the batch instead of SPEC.md's (plan_payload)."""
    b = len(seqlens)
    if b == 0:
        raise ValueError("cache_seqlens: expected at least one sequence, got an empty batch")
    i = next((i for i, L in enumerate(seqlens) if int(L) < 0), None)
    if i is not None:
        raise ValueError(f"get_mla_metadata: cache_seqlens[{i}]: expected a length >= 0, got {int(seqlens[i])}")
    blocks = [ceil_div(int(L), PAGE_BLOCK_SIZE) for L in seqlens]
    payload = plan_payload(seqlens, blocks, num_sm_parts, min_payload, tight_payload)
    metadata, num_splits, covered = _walk(seqlens, blocks, num_sm_parts, payload)
    assert covered == b, "scheduler invariant: the parts' payload covers the whole batch"
    return metadata, num_splits


def get_mla_metadata_twin(cache_seqlens: torch.Tensor, num_heads_per_head_k: int, num_heads_k: int,
                          num_sms: int, min_payload: int = 0,
                          tight_payload: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scheduler's tensors, exactly as the CUDA metadata kernel returns them (on cache_seqlens.device);
    min_payload: the payload floor, tight_payload: the smallest covering payload (see `schedule`; sparse plans
    pass _geometry.SPARSE_PLAN)."""
    parts = num_sm_parts_for(num_sms, num_heads_per_head_k, num_heads_k)
    metadata, num_splits = schedule(cache_seqlens.tolist(), parts, min_payload, tight_payload)
    dev = cache_seqlens.device
    return (torch.tensor(metadata, dtype=torch.int32, device=dev).reshape(parts, METADATA_WIDTH),
            torch.tensor(num_splits, dtype=torch.int32, device=dev))


def pieces_of_part(row: Sequence[int], seqlens: Sequence[int], num_splits: Sequence[int]) -> List[Piece]:
    """Decode one metadata row into the sequence pieces its SM part processes (what the kernel walks)."""
    begin_seq, begin_token, end_seq, end_token, begin_split = (int(x) for x in row[:5])
    pieces = []
    for seq in range(begin_seq, end_seq + 1):
        lo = begin_token if seq == begin_seq else 0
        hi = end_token if seq == end_seq else int(seqlens[seq])
        split_idx = begin_split if seq == begin_seq else 0
        n = int(num_splits[seq + 1]) - int(num_splits[seq])
        pieces.append(Piece(seq, lo, hi, split_idx, n, int(num_splits[seq]) + split_idx))
    return pieces
