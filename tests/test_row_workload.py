"""benchmarks/row_workload.py (the row that ncu_row.py, power_row.py and kernel_times.py run), on the CPU with a
stand-in for the referee's sxs.py: which inputs and implementations each flag combination gets, and what is
refused."""
import argparse
import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import kernel_times
import ncu_row
import power_row
import row_workload

FAKE_SXS = textwrap.dedent('''
    calls = []
    def make_workload(lens, s_q, h_q, h_kv, seed):
        calls.append(("dense", len(lens), lens[0], s_q, h_q, h_kv, seed))
        return "q", ["k0", "k1", "k2"], "bt", "seqlens"
    def table_workloads():
        return [("table", "b=128 L=4096f h=16 s=2", [4096] * 128, 2, 16),
                ("table", "b=128 L=4096v h=16 s=2", [4097 + i for i in range(128)], 2, 16)]
    def make_sparse_workload(b, s_q, h_q, topk, seed):
        calls.append(("sparse", b, s_q, h_q, topk, seed))
        return "q", ["k0", "k1"], "indices"
    class Impl:
        def __init__(self):
            self.prepared = None
        def prepare(self, q, ks):
            self.prepared = (q, list(ks))
    class FlashMLA(Impl): pass
    class FlashMLAFp8(Impl): pass
    class FlashMLASparse(Impl): pass
    class AnchorV1(Impl): pass
    class AnchorHead(Impl): pass
    class AnchorHeadSparse(Impl): pass
''')


@pytest.fixture
def anchors(tmp_path):
    (tmp_path / "sxs.py").write_text(FAKE_SXS)
    sys.modules.pop("sxs", None)
    yield str(tmp_path)
    sys.modules.pop("sxs", None)
    while str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def parse(*argv):
    ap = argparse.ArgumentParser()
    row_workload.add_row_arguments(ap)
    return ap.parse_args(list(argv))


def test_dense_row(anchors):
    args = parse("--anchors", anchors, "--impls", "flash_mla,v1,head", "--mean", "4096", "--h-q", "64", "--s-q", "1")
    q, _, bt, seqlens, causal, impls = row_workload.row_workload(args)
    import sxs
    assert sxs.calls == [("dense", 128, 4096, 1, 64, 1, 1)]
    assert (q, bt, seqlens, causal) == ("q", "bt", "seqlens", True)
    assert [type(i).__name__ for i in impls.values()] == ["FlashMLA", "AnchorV1", "AnchorHead"]
    assert all(i.prepared is None for i in impls.values())
    assert row_workload.row_label(args) == "b=128 L=4096f h=64 s=1"


def test_fp8_row_quantises_the_copies_it_uses(anchors):
    _, ks, _, _, _, impls = row_workload.row_workload(parse("--anchors", anchors, "--fp8"))
    assert type(impls["flash_mla"]).__name__ == "FlashMLAFp8"
    assert impls["flash_mla"].prepared == ("q", ks) and impls["head"].prepared is None
    _, ks, _, _, _, impls = row_workload.row_workload(parse("--anchors", anchors, "--fp8"), prepared_copies=1)
    assert impls["flash_mla"].prepared == ("q", ks[:1])


def test_sparse_row(anchors):
    args = parse("--anchors", anchors, "--sparse", "--topk", "512", "--h-q", "64", "--s-q", "1")
    _, _, bt, seqlens, causal, impls = row_workload.row_workload(args)
    import sxs
    assert sxs.calls == [("sparse", 128, 1, 64, 512, 1)]
    assert (bt, seqlens, causal) == ("indices", None, False)
    assert [type(i).__name__ for i in impls.values()] == ["FlashMLASparse", "AnchorHeadSparse"]
    assert row_workload.row_label(args) == "sparse b=128 topk=512 h=64 s=1"


@pytest.mark.parametrize("argv, words", [
    (["--sparse", "--impls", "flash_mla,v1"], "v1 not known"),
    (["--impls", "flash_mla,upstream"], "upstream not known"),
    (["--sparse", "--fp8"], "--sparse and --fp8"),
    (["--sparse", "--varied"], "--sparse and --varied"),
])
def test_refused_rows(anchors, argv, words):
    with pytest.raises(SystemExit, match=words):
        row_workload.row_workload(parse("--anchors", anchors, *argv))


def test_the_scripts_take_the_row_arguments():
    for script in (ncu_row, power_row, kernel_times):
        assert script.add_row_arguments is row_workload.add_row_arguments


def test_varied_row_takes_the_referees_lengths(anchors):
    args = parse("--anchors", anchors, "--fp8", "--mean", "4096", "--h-q", "16", "--s-q", "2", "--varied")
    row_workload.row_workload(args)
    import sxs
    assert sxs.calls == [("dense", 128, 4097, 2, 16, 1, 1)]       # the 'L=4096v' row's lengths, not 4096 each
    assert row_workload.row_label(args) == "b=128 L=4096v h=16 s=2 (flash_mla fp8)"
    with pytest.raises(SystemExit, match="no row 'b=128 L=2048v h=16 s=2'"):
        row_workload.row_workload(parse("--anchors", anchors, "--mean", "2048", "--h-q", "16", "--s-q", "2",
                                        "--varied"))
