"""benchmarks/bench_flash_mla.py and its PyTorch baseline (benchmarks/baselines.py), on the CPU.

* the torch baseline against the float32 reference on ragged batches (L = 0, 1, 63, 64, 65, ...), causal and
  not, s_q 1..3, one and two KV heads, float32 and bf16, one chunk and many;
* the workload definitions (the SPEC reference table, the skewed batch's exact lengths, the group sizes);
* the bookkeeping: FAIL / OOM reporting (a failing backend is not timed), repetition choice;
* the whole script end to end (`--device cpu --smoke`) in a subprocess, writing CSV and PNG files.
"""
import csv
import importlib.util
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from flash_mla import mla_decode_reference
from flash_mla.testing import assert_close, compare, make_decode_batch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import baselines
import bench_flash_mla as bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_DIR = os.path.join(ROOT, "benchmarks")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

RAGGED = [0, 1, 63, 64, 65, 130, 0, 2]


def run_baseline(batch, chunk_budget_bytes=baselines.DEFAULT_CHUNK_BUDGET_BYTES, softmax_scale=None):
    s_q, h_q, h_kv = (batch.shape[k] for k in ("s_q", "h_q", "h_kv"))
    plan = baselines.plan_torch_mla(batch.cache_seqlens.tolist(), s_q, h_q, h_kv, dtype=batch.q.dtype,
                                    chunk_budget_bytes=chunk_budget_bytes, causal=batch.causal)
    out, lse = baselines.torch_mla_decode(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, plan,
                                          softmax_scale=softmax_scale, causal=batch.causal)
    return plan, out, lse


def reference(batch, softmax_scale=None):
    return mla_decode_reference(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512, softmax_scale,
                                batch.causal)


# ------------------------------------------------------------------------------------------------------------------
# the torch baseline
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s_q", [1, 2, 3])
@pytest.mark.parametrize("budget", ["one chunk", "many chunks"])
def test_baseline_matches_reference(dtype, causal, s_q, budget):
    batch = make_decode_batch(RAGGED, s_q=s_q, h_q=16, dtype=dtype, causal=causal,
                              generator=torch.Generator().manual_seed(s_q + 10 * causal))
    plan, out, lse = run_baseline(batch, chunk_budget_bytes=1 if budget == "many chunks" else 1 << 30)
    if budget == "many chunks":
        assert len(plan.chunks) == sum(L > 0 for L in RAGGED)
    ref_out, ref_lse = reference(batch)
    assert out.dtype == dtype and out.shape == (len(RAGGED), s_q, 16, 512)
    assert lse.dtype == torch.float32 and lse.shape == (len(RAGGED), 16, s_q)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
        finite = torch.isfinite(ref_lse)
        assert torch.equal(finite, torch.isfinite(lse))
        torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)
    else:
        assert_close(compare(out, lse, ref_out, ref_lse), dtype, f"baseline causal={causal} s_q={s_q}")
    # L = 0 (and, causal, rows before the cache starts): out 0, lse -inf, exactly
    empty = torch.isneginf(ref_lse)                          # (b, h_q, s_q)
    assert torch.all(torch.isneginf(lse[empty]))
    assert torch.all(out.permute(0, 2, 1, 3)[empty] == 0)
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("causal", [False, True])
def test_baseline_two_kv_heads_row_packing(causal):
    batch = make_decode_batch([0, 65, 700, 129], s_q=2, h_q=32, h_kv=2, dtype=torch.float32, causal=causal,
                              generator=torch.Generator().manual_seed(7))
    _, out, lse = run_baseline(batch, softmax_scale=0.05)
    ref_out, ref_lse = reference(batch, softmax_scale=0.05)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], rtol=1e-5, atol=1e-5)


def test_baseline_all_empty():
    batch = make_decode_batch([0, 0, 0], s_q=2, h_q=16, causal=True)
    plan, out, lse = run_baseline(batch)
    assert plan.chunks == [] and plan.has_empty
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


def test_baseline_ignores_garbage_past_each_length():
    """NaN in the unused slots and blocks (make_decode_batch's default), and block_table -1 past each sequence's
    pages: nothing of it reaches the result."""
    batch = make_decode_batch([5, 64, 200], s_q=1, h_q=16, dtype=torch.bfloat16,
                              generator=torch.Generator().manual_seed(3))
    assert torch.isnan(batch.k_cache).any() and (batch.block_table == -1).any()
    _, out, lse = run_baseline(batch)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_plan_covers_every_sequence_once_longest_first():
    lens = [0, 300, 5000, 64, 0, 4097, 1, 129]
    plan = baselines.plan_torch_mla(lens, 2, 16, chunk_budget_bytes=16 << 20)
    seen = [s for c in plan.chunks for s in c.seqs]
    assert sorted(seen) == [i for i, L in enumerate(lens) if L > 0]
    assert [lens[s] for s in seen] == sorted((L for L in lens if L > 0), reverse=True)
    held, _ = baselines._bytes_per_token(32, 1, 2)
    for c in plan.chunks:
        assert c.lpad == -(-max(lens[s] for s in c.seqs) // 64) * 64
        assert c.n == 1 or c.n * c.lpad * held <= 16 << 20
        assert c.seq_idx is not None and c.seq_idx.tolist() == c.seqs
    assert plan.has_empty and plan.anchor_seq == 2


def test_plan_equal_lengths_one_chunk_in_order():
    plan = baselines.plan_torch_mla([512] * 8, 1, 128, causal=True)
    assert len(plan.chunks) == 1 and plan.chunks[0].seq_idx is None and not plan.chunks[0].needs_mask
    assert not plan.has_empty


def test_plan_mismatch_raises():
    batch = make_decode_batch([10, 20], s_q=1, h_q=16)
    plan = baselines.plan_torch_mla([10, 20], 2, 16)
    with pytest.raises(ValueError, match="plan is for"):
        baselines.torch_mla_decode(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, plan)


# ------------------------------------------------------------------------------------------------------------------
# workload definitions
# ------------------------------------------------------------------------------------------------------------------

def test_skewed_batch_exact():
    (wl,) = bench.skewed_workloads()
    assert wl.seqlens == [4641, 45118, 1730, 1696]
    assert (wl.b, wl.s_q, wl.h_q, wl.h_kv, wl.causal) == (4, 4, 16, 1, True)
    assert bench.skewed_workloads(smoke=True)[0].seqlens == [L // 16 for L in wl.seqlens]


def test_reference_sweep_matches_spec():
    rows = bench.reference_workloads()
    assert len(rows) == 48
    assert {(w.mean, w.h_q, w.s_q, w.varlen) for w in rows} == {
        (m, h, s, v) for m in (4096, 8192, 16384) for h in (16, 32, 64, 128) for s in (1, 2) for v in (False, True)}
    for i, w in enumerate(rows):
        assert w.seed == i and w.b == 128 and w.h_kv == 1 and w.causal
        assert min(w.seqlens) >= w.s_q
        if not w.varlen:
            assert w.seqlens == [w.mean] * 128
    # same lengths as `python tests/test_flash_mla.py` (row i: random_seqlens with seed i)
    from flash_mla.testing import random_seqlens
    w = rows[5]
    assert w.seqlens == random_seqlens(128, w.mean, w.s_q, w.varlen, generator=torch.Generator().manual_seed(5))
    quick = bench.reference_workloads(quick=True)
    assert len(quick) == 4
    assert {bench.spec_target(w)[0] for w in quick} == {"GB/s", "TFLOP/s"}


def test_other_groups():
    long = bench.long_context_workloads()
    assert sorted((w.h_q, w.b, w.seqlens[0]) for w in long) == sorted(
        (h, b, L) for h in (16, 128) for b in (1, 4, 16) for L in (32768, 65536, 131072))
    assert all(w.s_q == 1 and len(set(w.seqlens)) == 1 for w in long)
    spec = bench.specdec_workloads()
    assert [w.s_q for w in spec] == list(range(1, 9)) and all(w.b == 32 and w.seqlens[0] == 8192 for w in spec)
    short = bench.short_workloads()
    assert [(w.b, w.seqlens[0], w.h_q, w.s_q) for w in short] == [(1024, 512, 16, 1), (1024, 512, 128, 1)]
    assert len(bench.build_workloads(bench.GROUPS)) == 48 + 18 + 1 + 8 + 2
    assert len(bench.build_workloads(["reference", "skewed"], quick=True)) == 5
    with pytest.raises(ValueError, match="unknown workload group"):
        bench.build_workloads(["nope"])


def test_spec_targets_and_figures():
    rows = {(w.mean, w.h_q, w.s_q): w for w in bench.reference_workloads() if not w.varlen}
    assert bench.spec_target(rows[4096, 16, 1]) == ("GB/s", 2750.0)
    assert bench.spec_target(rows[8192, 32, 2]) == ("GB/s", 2900.0)
    assert bench.spec_target(rows[4096, 64, 2]) == ("TFLOP/s", 520.0)
    assert bench.spec_target(rows[16384, 128, 1]) == ("TFLOP/s", 560.0)
    assert bench.spec_target(bench.skewed_workloads()[0]) is None
    flops, nbytes = rows[4096, 16, 1].flops_bytes()
    assert flops == 2 * 1 * 128 * 4096 * 16 * (576 + 512)
    assert nbytes == 2 * (128 * 4096 * 576 + 128 * 16 * 576 + 128 * 16 * 512)


def test_choose_reps():
    assert bench.choose_reps(1e-4, 0.75) == (15, 10)           # the test suite's 15 x 10
    reps, calls = bench.choose_reps(0.02, 0.75)
    assert reps == 15 and 1 <= calls < 10 and reps * calls * 0.02 <= 0.75
    assert bench.choose_reps(1.0, 0.75) == (5, 1)               # never fewer than 5 x 1


def test_device_compare_agrees_with_testing_compare():
    g = torch.Generator().manual_seed(0)
    ref_out, out = torch.randn(2, 1, 4, 512, generator=g), torch.randn(2, 1, 4, 512, generator=g)
    ref_lse = torch.randn(2, 4, 1, generator=g)
    ref_lse[0, 1, 0] = -math.inf
    lse = ref_lse + 0.01
    a, b = bench.device_compare(out, lse, ref_out, ref_lse), compare(out, lse, ref_out, ref_lse)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-9), k


# ------------------------------------------------------------------------------------------------------------------
# bookkeeping: FAIL and OOM are reported, not timed
# ------------------------------------------------------------------------------------------------------------------

class _Broken(bench.Backend):
    name = "broken"

    def prepare(self, wl, inputs):
        def run(i):
            q = inputs.copies[i][0]
            return (torch.ones(q.shape[0], q.shape[1], q.shape[2], 512, dtype=q.dtype),
                    torch.zeros(q.shape[0], q.shape[2], q.shape[1]))
        return run


class _OutOfMemory(bench.Backend):
    name = "oom"

    def prepare(self, wl, inputs):
        def run(i):
            raise torch.OutOfMemoryError("pretend")
        return run


def test_failing_backend_reported_and_not_timed():
    wl = bench.Workload("skewed", "tiny", [70, 3], 2, 16, seed=1, mean=36)
    args = types.SimpleNamespace(no_reference=False, budget_s=0.01)
    ceil = {"copy_GBps": 10.0, "matmul_TFLOPs": 1.0}
    backends = [bench.FlashMLABackend("cpu"), bench.TorchBackend(), _Broken(), _OutOfMemory()]
    rows = bench.run_workload(wl, backends, ceil, args, torch.device("cpu"), bench.Progress(1, enabled=False))
    by = {r["backend"]: r for r in rows}
    assert by["cpu"]["status"] == "OK" and by["cpu"]["checked_against"] == "fp32 reference"
    assert by["torch"]["status"] == "OK" and by["torch"]["checked_against"] == "flash_mla cpu"
    assert by["broken"]["status"] == "FAIL" and "time_us" not in by["broken"]
    assert by["oom"]["status"] == "OOM" and "time_us" not in by["oom"]
    for name in ("cpu", "torch"):
        r = by[name]
        assert r["time_us"] > 0 and r["t_over_floor"] == pytest.approx(r["time_us"] / r["floor_us"])
        assert r["target"] == "<=1.6x floor"
    fast, slow = sorted((by["cpu"], by["torch"]), key=lambda r: r["time_us"])
    assert fast["speedup_vs_next"] == pytest.approx(slow["time_us"] / fast["time_us"])
    assert "speedup_vs_next" not in slow and slow["x_vs_best"] >= 1
    for r in rows:
        line = bench.format_row(r)
        assert r["backend"] in line and r["status"] in line


# ------------------------------------------------------------------------------------------------------------------
# end to end
# ------------------------------------------------------------------------------------------------------------------

def test_smoke_run_writes_csv_and_plots(tmp_path):
    out_dir = tmp_path / "results"
    cmd = [sys.executable, os.path.join(BENCH_DIR, "bench_flash_mla.py"), "--device", "cpu", "--smoke", "--quick",
           "--workloads", ",".join(bench.GROUPS), "--backends", "cpu,torch,triton", "--budget-s", "0.02",
           "--out-dir", str(out_dir)]
    # without TRITON_INTERPRET the triton backend cannot run CPU tensors: skipped, saying how it could run
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    skip_line = next((line for line in proc.stdout.splitlines() if "backend triton: skipped" in line), None)
    assert skip_line is not None and "CUDA tensors" in skip_line and "TRITON_INTERPRET=1" in skip_line, proc.stdout
    assert "total elapsed" in proc.stdout and "ceilings: copy" in proc.stdout
    with open(out_dir / "bench_flash_mla.csv") as f:
        rows = list(csv.DictReader(f))
    assert set(rows[0]) == set(bench.CSV_FIELDS)
    n_workloads = len(bench.build_workloads(bench.GROUPS, quick=True, smoke=True))
    assert len(rows) == 2 * n_workloads
    assert {r["group"] for r in rows} == set(bench.GROUPS)
    assert all(r["status"] == "OK" for r in rows), [(r["workload"], r["backend"], r["note"]) for r in rows]
    assert all(float(r["time_us"]) > 0 and float(r["t_over_floor"]) > 0 for r in rows)
    if importlib.util.find_spec("matplotlib") is not None:
        for name in ("gbps_vs_context.png", "tflops_vs_rows.png"):
            path = out_dir / name
            assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # the plots again from the CSV alone (how a GPU run without matplotlib gets its plots)
        again = tmp_path / "again"
        assert bench.main(["--plot-from", str(out_dir / "bench_flash_mla.csv"), "--out-dir", str(again)]) == 0
        assert (again / "gbps_vs_context.png").exists() and (again / "tflops_vs_rows.png").exists()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_smoke_run_with_the_triton_interpreter(tmp_path):
    """TRITON_INTERPRET=1: the triton backend runs (interpreted) on the CPU, is checked against the reference, and
    the run says that its times are the interpreter's."""
    cmd = [sys.executable, os.path.join(BENCH_DIR, "bench_flash_mla.py"), "--device", "cpu", "--smoke", "--quick",
           "--workloads", "short", "--backends", "triton", "--budget-s", "0.02", "--out-dir", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_INTERPRET="1")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "backend triton: skipped" not in proc.stdout and "Triton's interpreter" in proc.stdout
    with open(tmp_path / "bench_flash_mla.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and all(r["backend"] == "triton" and r["status"] == "OK" for r in rows), rows


# ------------------------------------------------------------------------------------------------------------------
# benchmarks/ncu_row.py: which metric rows survive an ncu that does not know some names


def test_ncu_row_keeps_known_metrics_and_launch_attributes():
    import ncu_row
    shown = {**ncu_row.METRICS, **ncu_row.LAUNCH_METRICS, **ncu_row.PIPE_METRICS}
    known = ["gpu__time_duration", "smsp__inst_executed", "smsp__inst_executed_pipe_alu"]
    kept, dropped = ncu_row.known_metrics(shown, known)
    assert set(kept) | set(dropped) == set(shown) and not set(kept) & set(dropped)
    assert "duration (us)" in kept and "instructions, alu pipe (M)" in kept
    assert "instructions, fma pipe (M)" in dropped and "DRAM bytes read / cache bytes" in dropped
    # launch attributes are never listed by --query-metrics and are always kept
    assert all(label in kept for label in ncu_row.LAUNCH_METRICS) and "grid size (CTAs)" in kept
    # --balance: min / avg / max of one metric share its base name, so one known name keeps all three
    kept, dropped = ncu_row.known_metrics(ncu_row.BALANCE_METRICS, ["sm__cycles_active"])
    assert [label for label in kept] == ["SM active cycles, min (k)", "SM active cycles, avg (k)",
                                         "SM active cycles, max (k)"]
    assert dropped == ["SM elapsed cycles (k)"]


# ------------------------------------------------------------------------------------------------------------------
# benchmarks/ncu_roles.py: an ncu source export split at each setmaxnreg and at the last EXIT


def test_ncu_roles_splits_at_setmaxnreg_and_the_last_exit():
    import ncu_roles
    header = ('"Address","Source","Instructions Executed","L1 Wavefronts Shared","L1 Wavefronts Shared Ideal",'
              '"stall_long_sb","stall_wait","stall_wait (Not Issued)"')
    rows = [("0x100", "S2R R0, SR_TID.X", 10, 0, 0, 1, 0),
            ("0x110", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8", 4, 0, 0, 0, 0),
            ("0x120", "HGMMA.64x64x16.F32.BF16 R152, gdesc[UR12], RZ", 100, 800, 800, 30, 10),
            ("0x130", "EXIT", 4, 0, 0, 0, 0), ("0x140", "USETMAXREG.DEALLOC.CTAPOOL 0x38", 4, 0, 0, 0, 0),
            ("0x150", "LDGSTS.E.BYPASS.128 [R1], [R2]", 50, 525, 200, 5, 15),
            ("0x158", "LDS.64 R4, [R5]", 20, 80, 40, 0, 0),
            ("0x160", "EXIT", 4, 0, 0, 0, 0),
            ("0x170", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1], R2", 1000, 0, 0, 0, 1)]
    text = '"Kernel Name","k"\n' + header + "\n" + "\n".join(
        f'"{a}","{src}","{n}","{wf}","{wi}","{lsb}","{w}","0"' for a, src, n, wf, wi, lsb, w in rows) + "\n"
    got = [(name, len(ins), ncu_roles.summary(name, ins)) for name, ins in ncu_roles.regions(ncu_roles.load(text))]
    assert [(name, count) for name, count, _s in got] == [
        ("setup", 1), ("role at +0x10 (232 registers)", 3), ("role at +0x40 (56 registers)", 4),
        ("after the last EXIT (mbarrier wait retries)", 1)]
    role_a, gather, retries = got[1][2], got[2][2], got[3][2]
    assert role_a["instructions"] == 108 and role_a["samples"] == 40 and role_a["stalls"].startswith("long_sb 75%")
    assert (role_a["wavefronts"], role_a["ideal"]) == (800, 800)
    assert gather["samples"] == 20 and gather["stalls"].startswith("wait 75%")
    assert (gather["wavefronts"], gather["ideal"]) == (605, 240)
    assert retries["instructions"] == 1000
    # the instructions beyond their ideal, the largest excess first, per execution
    assert ncu_roles.excess(ncu_roles.load(text)) == [(0x150, "LDGSTS.E.BYPASS.128 [R1], [R2]", 50, 10.5, 4.0),
                                                     (0x158, "LDS.64 R4, [R5]", 20, 4.0, 2.0)]


# ------------------------------------------------------------------------------------------------------------------
# benchmarks/ncu_lines.py: ncu's per-instruction samples mapped to nvdisasm -gi's inlined source frames

_NCU_LINES_SASS = """
//--------------------- .text._Z6kernelv --------------------------
.text._Z6kernelv:
	//## File "/src/k.cu", line 10
        /*0000*/                   S2R R0, SR_TID.X ;
	//## File "/inc/barrier.h", line 5 inlined at "/src/epi.h", line 7
	//## File "/src/epi.h", line 7 inlined at "/src/k.cu", line 20
	//## File "/src/k.cu", line 20
        /*0010*/              @!P0 BRA `(.L_x_1) ;
	//## File "/src/epi.h", line 8 inlined at "/src/k.cu", line 20
	//## File "/src/k.cu", line 20
        /*0020*/                   STG.E [R2.64], R4 ;
        /*0030*/                   EXIT ;
//--------------------- .text._Z5otherv --------------------------
.text._Z5otherv:
        /*0000*/                   NOP ;
"""


def _ncu_lines_export(rows):
    header = '"Address","Source","Instructions Executed","L1 Wavefronts Shared","L1 Wavefronts Shared Ideal",' \
             '"stall_long_sb","stall_wait"'
    return '"Kernel Name","k"\n' + header + "\n" + "\n".join(
        f'"{a}","{src}","{n}","0","0","{lsb}","{w}"' for a, src, n, lsb, w in rows) + "\n"


def test_ncu_lines_maps_samples_to_inlined_source_lines():
    import ncu_lines
    import ncu_roles
    dis = ncu_lines.disassembly(_NCU_LINES_SASS, "_Z6kernelv")
    assert [(o, ncu_lines.opcode(s)) for o, s, _f in dis] == [
        (0, "S2R"), (0x10, "BRA"), (0x20, "STG.E"), (0x30, "EXIT")]
    assert dis[1][2] == (("barrier.h", 5), ("epi.h", 7), ("k.cu", 20))     # innermost first, the block's union
    assert dis[2][2] == dis[3][2] == (("epi.h", 8), ("k.cu", 20))          # a line's frames hold until the next block
    export = _ncu_lines_export([("0x7f00", "S2R R0, SR_TID.X", 4, 1, 0), ("0x7f10", "@!P0 BRA `(.L_x_1)", 40, 30, 2),
                                ("0x7f20", "STG.E [R2.64], R4", 8, 5, 3), ("0x7f30", "EXIT", 4, 0, 1)])
    rows = ncu_lines.attribute(ncu_roles.load(export), dis)
    sites = ncu_lines.tally(rows, ncu_lines.call_site)
    assert {k: (s, n) for k, (s, n, _r) in sites.items()} == {("k.cu", 10): (1, 4), ("k.cu", 20): (41, 52)}
    assert sites[("k.cu", 20)][2] == {"long_sb": 35, "wait": 6}
    lines = ncu_lines.tally(rows, ncu_lines.innermost_in({"epi.h"}))      # barrier.h's wait counts as its caller's
    assert {k: s for k, (s, _n, _r) in lines.items()} == {("epi.h", 7): 32, ("epi.h", 8): 9}
    assert {k for k, _v in ncu_lines.tally(rows, ncu_lines.innermost_in(set())).items()} == {
        ("k.cu", 10), ("barrier.h", 5), ("epi.h", 8)}
    assert len(ncu_lines.under(("k.cu", 20))(rows)) == 3
    with pytest.raises(ValueError, match="STG"):      # another build's code: nothing is attributed
        ncu_lines.attribute(ncu_roles.load(export.replace("STG.E [R2.64], R4", "LDG.E R4, [R2.64]")), dis)
    with pytest.raises(ValueError, match="3 instructions"):
        ncu_lines.attribute(ncu_roles.load(export)[:3], dis)
    with pytest.raises(SystemExit):
        ncu_lines.disassembly(_NCU_LINES_SASS, "_Z7missingv")


# ------------------------------------------------------------------------------------------------------------------
# benchmarks/fp8_p_model.py: P rounded to e4m3 in the kernels' page loop, against the exact softmax


def test_fp8_p_model_e4m3_p_is_far_outside_fp16s_error():
    import fp8_p_model
    fp16 = fp8_p_model.out_error(1024, 8, "fp16", seed=0)
    row = fp8_p_model.out_error(1024, 8, "e4m3-row", seed=0)
    fixed = fp8_p_model.out_error(1024, 8, "e4m3-fixed", seed=0)
    two = fp8_p_model.out_error(1024, 8, "e4m3-two", seed=0)
    assert fp16 < 1e-3 < 5e-3 < row < fixed     # e4m3's 3 mantissa bits reach out almost undamped
    assert fp16 < two < 3e-3 < 3 * two < row    # a second e4m3 term: well inside the 1e-2 bound, above fp16
    with pytest.raises(ValueError):
        fp8_p_model.out_error(64, 2, "e5m2", seed=0)


# ------------------------------------------------------------------------------------------------------------------
# benchmarks/sparse_locality.py: index patterns over the referee's cache layout (each sequence owns its pages)


@pytest.mark.parametrize("pattern", ["random", "sorted", "whole-pages", "same-tokens-per-row", "in-l2"])
def test_sparse_locality_patterns(pattern):
    import sparse_locality
    b, s_q, topk, page, pool = 3, 2, 128, 64, 1024
    g = torch.Generator().manual_seed(5)
    idx, distinct = sparse_locality.make_indices(pattern, b, s_q, topk, g, page, pool)
    assert idx.shape == (b, s_q, topk) and idx.dtype == torch.int32
    assert 0 <= int(idx.min()) and int(idx.max()) < b * pool
    assert distinct == torch.unique(idx).numel()
    for i in range(b):
        for s in range(s_q):
            assert torch.unique(idx[i, s]).numel() == topk     # a row never names a token twice
    pages = idx.long() // page
    if pattern == "in-l2":     # every row inside sequence 0's first 2048 tokens' pages: few distinct pages
        assert torch.unique(pages).numel() <= 2048 // page
    else:                      # each sequence's tokens lie in pages of its own
        owners = [set(pages[i].flatten().tolist()) for i in range(b)]
        assert all(not owners[i] & owners[j] for i in range(b) for j in range(i + 1, b))
    if pattern in ("whole-pages", "same-tokens-per-row"):
        assert torch.equal(idx[:, 0], idx[:, 1])
    if pattern == "whole-pages":    # topk / page whole pages, each page's 64 slots in order
        assert distinct == b * topk and torch.equal(idx.long() % page, (torch.arange(topk) % page).expand_as(idx))
    if pattern == "sorted":     # the same draw as random, in pool order
        rnd, _ = sparse_locality.make_indices("random", b, s_q, topk, torch.Generator().manual_seed(5), page, pool)
        assert torch.equal(torch.sort(idx, dim=-1).values, torch.sort(rnd, dim=-1).values)


# ------------------------------------------------------------------------------------------------------------------
# benchmarks/plan_policy.py --sparse: each query token's indices are distinct tokens of its own row's pool


def test_plan_policy_sparse_indices():
    import plan_policy
    b, s_q, topk, pool = 3, 2, 40, 64
    idx = plan_policy.sparse_indices(b, s_q, topk, pool, torch.Generator().manual_seed(3))
    assert idx.shape == (b, s_q, topk) and idx.dtype == torch.int32
    for i in range(b):
        for s in range(s_q):
            row = idx[i, s].tolist()
            assert len(set(row)) == topk and all(i * pool <= x < (i + 1) * pool for x in row)
    assert not torch.equal(idx[0, 0], idx[0, 1])      # each query token draws its own set


def test_plan_policy_checks_its_plans_before_the_gpu(capsys):
    """--min-payloads takes integers, each maybe followed by t (the tight payload); anything else is refused with
    or without a GPU, and a CPU-only machine then skips cleanly."""
    import plan_policy
    for bad in ("7,x", "t", "7tt", "-1"):
        with pytest.raises(SystemExit) as exc:
            plan_policy.main(["--sparse", "--min-payloads", bad])
        assert exc.value.code == 2, bad
        assert "--min-payloads: expected integers" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert plan_policy.main(["--sparse", "--min-payloads", "7,7t"]) == 0
        assert "skipped" in capsys.readouterr().out
