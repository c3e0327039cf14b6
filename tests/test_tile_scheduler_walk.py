"""The split kernel's tile scheduler (csrc/kernels/tile_scheduler.h), walked on the CPU.

csrc/checks/tile_scheduler_walk.cu replays every SM part's CTA with the PieceRange calls of the mainloop (the
math left out) and prints what it would copy where. Here that trace is checked against the plan the scheduler
twin makes and the block table:
  * a part walks exactly the pieces `pieces_of_part` decodes (bounds, split flag, workspace slot);
  * page k of a piece is consumed from buffer k % 2, and each buffer's fills arrive in consumption order: the
    i-th page consumed from a buffer is the i-th block sent to it, the block the block table names;
  * nothing is left in flight when the part ends (no stray copy), and no page is consumed that was never sent;
  * the Q tile loaded for each piece with pages is that piece's sequence, and no extra tile is loaded.
Batches are ragged (0, 1, 63, 64, 65, ... tokens, L = 0 rows between split rows), with 1 to 1000+ pieces per
sequence. Needs a C++ compiler (nvcc, else the host's c++), no GPU.
"""
from __future__ import annotations

import random
import shutil
import subprocess
from collections import deque
from pathlib import Path

import pytest

from flash_mla.scheduler import num_sm_parts_for, pieces_of_part, schedule
from flash_mla.testing import find_nvcc

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "csrc" / "checks" / "tile_scheduler_walk.cu"
PAGE = 64


@pytest.fixture(scope="module")
def walker(tmp_path_factory):
    exe = tmp_path_factory.mktemp("walk") / "tile_scheduler_walk"
    nvcc, cxx = find_nvcc(), shutil.which("c++") or shutil.which("g++")
    if nvcc:
        cmd = [nvcc, "-std=c++17", "-O1", f"-I{ROOT / 'csrc' / 'kernels'}", str(SOURCE), "-o", str(exe)]
    elif cxx:
        cmd = [cxx, "-std=c++17", "-O1", "-x", "c++", f"-I{ROOT / 'csrc' / 'kernels'}", str(SOURCE), "-o", str(exe)]
    else:
        pytest.skip("no C++ compiler")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return exe


def walk(exe, seqlens, parts, block_table, max_blocks):
    metadata, num_splits = schedule(seqlens, parts)
    words = [len(seqlens), parts, max_blocks, *seqlens, *num_splits]
    words += [x for row in metadata for x in row] + [x for row in block_table for x in row]
    proc = subprocess.run([str(exe)], input=" ".join(map(str, words)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return metadata, num_splits, proc.stdout.splitlines()


def random_block_table(seqlens, seed):
    """Distinct random physical blocks, so that a block names its (sequence, page) uniquely."""
    rng = random.Random(seed)
    max_blocks = max(1, max(-(-L // PAGE) for L in seqlens))
    pool = rng.sample(range(10 * len(seqlens) * max_blocks), len(seqlens) * max_blocks)
    return [pool[i * max_blocks:(i + 1) * max_blocks] for i in range(len(seqlens))], max_blocks


def check_walk(exe, seqlens, parts, seed=0):
    block_table, max_blocks = random_block_table(seqlens, seed)
    metadata, num_splits, lines = walk(exe, seqlens, parts, block_table, max_blocks)
    check_trace(lines, seqlens, parts, metadata, num_splits, block_table)


def check_trace(lines, seqlens, parts, metadata, num_splits, block_table):
    """Assert the properties listed in the module docstring on one walk's trace."""
    ctx = f"seqlens={seqlens if len(seqlens) <= 12 else '...'} parts={parts}"

    # Split the trace per part.
    traces, current = [], None
    for line in lines:
        word, *args = line.split()
        if word == "part":
            assert int(args[0]) == len(traces), ctx
            current = []
            traces.append(current)
        else:
            current.append((word, args))
    assert len(traces) == parts, ctx

    covered = [[] for _ in seqlens]
    for part, events in enumerate(traces):
        where = f"{ctx} part {part}"
        expected = deque(pieces_of_part(metadata[part], seqlens, num_splits))
        fills = (deque(), deque())           # blocks sent to each buffer, not yet consumed (None: nothing left)
        q_tiles = deque()                    # sequences whose Q tile was loaded, not yet used
        q_done = False                       # a Q load came back "none"
        piece, pages_seen, piece_pages = None, 0, 0
        for word, args in events:
            if word == "fill":
                stage = int(args[0])
                fills[stage].append(None if args[1] == "none" else int(args[1]))
            elif word == "q":
                seq = int(args[0])
                assert not q_done, f"{where}: a Q tile after the last one"
                if seq < 0:
                    q_done = True
                else:
                    q_tiles.append(seq)
            elif word == "piece":
                if piece is not None:
                    assert pages_seen == piece_pages, f"{where}: piece {piece} consumed {pages_seen} pages"
                assert expected, f"{where}: more pieces than the plan holds"
                want = expected.popleft()
                seq, begin, end, split, slot = map(int, args)
                assert (seq, begin, end, bool(split), slot) == (
                    want.seq, want.begin_token, want.end_token, want.num_pieces > 1, want.slot), where
                covered[seq].append((begin, end))
                piece, pages_seen = want, 0
                piece_pages = -(-(end - begin) // PAGE) if end > begin else 0
                if piece_pages:
                    assert q_tiles and q_tiles[0] == seq, f"{where}: piece of seq {seq} finds Q {list(q_tiles)}"
                    q_tiles.popleft()
            elif word == "page":
                seq, k, stage = map(int, args)
                assert piece is not None and seq == piece.seq and k == pages_seen, f"{where}: page {args}"
                assert stage == k % 2, f"{where}: page {k} from buffer {stage}"
                assert fills[stage], f"{where}: seq {seq} page {k}: buffer {stage} was never sent it (hang)"
                block = fills[stage].popleft()
                assert block is not None, f"{where}: seq {seq} page {k}: buffer {stage} was told nothing is left"
                assert block == block_table[seq][piece.begin_token // PAGE + k], (
                    f"{where}: seq {seq} page {k}: buffer {stage} holds block {block}")
                pages_seen += 1
            else:
                raise AssertionError(f"{where}: unknown event {word}")
        if piece is not None:
            assert pages_seen == piece_pages, f"{where}: last piece consumed {pages_seen} pages"
        assert not expected, f"{where}: pieces never walked: {list(expected)}"
        for stage in (0, 1):
            assert all(b is None for b in fills[stage]), f"{where}: buffer {stage} has copies in flight at the end"
        assert not q_tiles, f"{where}: Q tiles loaded and never used: {list(q_tiles)}"

    # Every token of every sequence is walked exactly once; an empty sequence by exactly one piece (its output
    # is written as empty).
    for seq, L in enumerate(seqlens):
        ranges = sorted(covered[seq])
        if L == 0:
            assert ranges == [(0, 0)], f"{ctx}: seq {seq} (L = 0) walked as {ranges}"
            continue
        pos = 0
        for begin, end in ranges:
            assert begin == pos and end > begin, f"{ctx}: seq {seq} walked as {ranges}"
            pos = end
        assert pos == L, f"{ctx}: seq {seq} walked as {ranges}"


RAGGED = [0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 4096, 4097]


@pytest.mark.parametrize("parts", [1, 2, 3, 7, 66, 132])
def test_ragged_batch(walker, parts):
    check_walk(walker, RAGGED, parts)
    check_walk(walker, list(reversed(RAGGED)), parts, seed=1)


@pytest.mark.parametrize("seqlens", [[0], [1], [64], [65], [0, 0, 0], [0, 5000, 0, 0, 9000, 0]],
                         ids=["L0", "L1", "L64", "L65", "all_empty", "empty_between_splits"])
def test_edge_batches(walker, seqlens):
    for parts in (1, 2, 16, 132):
        check_walk(walker, seqlens, parts)


@pytest.mark.parametrize("pieces", [1, 2, 133, 1200])
def test_one_long_sequence(walker, pieces):
    """b = 1 cut into about `pieces` pieces of 9 pages (odd: every piece ends with a pair without b), the last
    page partial."""
    parts = pieces
    L = 8 * pieces * PAGE - 47
    _, num_splits = schedule([L], parts)
    assert num_splits[1] >= 0.85 * pieces, f"the plan cut L = {L} into {num_splits[1]} pieces"
    check_walk(walker, [L], parts)


def test_random_batches(walker):
    rng = random.Random(12)
    for trial in range(60):
        b = rng.choice([1, 2, 3, 4, 8, 16, 33])
        seqlens = [rng.choice([0, rng.randint(1, 200), rng.randint(1, 3000), rng.randint(3000, 20000)])
                   for _ in range(b)]
        parts = num_sm_parts_for(rng.choice([1, 8, 78, 132]), rng.choice([16, 64, 128]), 1)
        check_walk(walker, seqlens, parts, seed=trial)


def _mutations(lines):
    """Traces that are wrong in one way each: (what, lines)."""
    fill = next(i for i, line in enumerate(lines) if line.startswith("fill 1 ") and "none" not in line)
    q = next(i for i, line in enumerate(lines) if line.startswith("q ") and line != "q -1")
    last_page = max(i for i, line in enumerate(lines) if line.startswith("page "))
    stage, block = lines[fill].split()[1:]
    yield "wrong block", lines[:fill] + [f"fill {stage} {int(block) + 1}"] + lines[fill + 1:]
    yield "fills swapped between buffers", lines[:fill] + [f"fill 0 {block}"] + lines[fill + 1:]
    yield "Q never loaded", lines[:q] + lines[q + 1:]
    yield "page never consumed", lines[:last_page] + lines[last_page + 1:]
    yield "stray copy at the end", lines + [f"fill {stage} {block}"]
    yield "extra Q tile", lines + [f"q {lines[q].split()[1]}"]


def test_the_checker_fails_wrong_traces(walker):
    """check_trace is not vacuous: each one-line corruption of a good trace fails it."""
    seqlens, parts = [300, 0, 700, 129], 4
    block_table, max_blocks = random_block_table(seqlens, 3)
    metadata, num_splits, lines = walk(walker, seqlens, parts, block_table, max_blocks)
    check_trace(lines, seqlens, parts, metadata, num_splits, block_table)
    for what, bad in _mutations(lines):
        with pytest.raises(AssertionError):
            check_trace(bad, seqlens, parts, metadata, num_splits, block_table)
            pytest.fail(f"check_trace accepted a trace with: {what}")
