"""CPU checks of benchmarks/sxs_variants.py's run order (the timing itself needs the H100 and the referee)."""
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "sxs_variants.py")
_spec = importlib.util.spec_from_file_location("sxs_variants", _PATH)
sxs_variants = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sxs_variants)


def test_same_process_repeats_rotate_the_order():
    runs = sxs_variants.timing_runs(["m", "ex", "x"], ["/t/m", "/t/ex", "/t/x"], 3, same_process=True)
    assert [[n for n, _f in run] for run in runs] == [["m", "ex", "x"], ["ex#2", "x#2", "m#2"], ["x#3", "m#3", "ex#3"]]
    assert [run[0][1] for run in runs] == ["/t/m", "/t/ex", "/t/x"]    # every variant first once
    for run in runs:                                                  # names stay with their folders
        assert all(f == "/t/" + n.split("#")[0] for n, f in run)


def test_separate_processes_one_variant_each():
    runs = sxs_variants.timing_runs(["a", "b"], ["/t/a", "/t/b"], 2, same_process=False)
    assert runs == [[("a", "/t/a")], [("b", "/t/b")], [("a#2", "/t/a")], [("b#2", "/t/b")]]


def test_repeat_summary_means_each_variants_repeats_per_group_and_row_class():
    names = ["a", "b", "b#2", "a#2"]
    rows = [("memory", 16, [2.0, 1.0, 1.0, 2.0]),
            ("memory", 32, [1.0, 4.0, 1.0, 1.0]),
            ("compute", 128, [1.0, 1.0, 2.0, 4.0]),
            ("spec", 16, [1.0, 1.0, 1.0, 1.0])]
    lines = sxs_variants.repeat_summary(rows, names)
    assert lines == [
        # memory: a's repeats' geomeans sqrt(2 * 1) and sqrt(2 * 1); b's sqrt(1 * 4) and sqrt(1 * 1)
        "# mean over repeats, memory (2 rows): a 1.414 (1.414-1.414, 2), b 1.500 (1.000-2.000, 2)",
        "# mean over repeats, 16 query rows a KV head (1 rows): a 2.000 (2.000-2.000, 2), b 1.000 (1.000-1.000, 2)",
        "# mean over repeats, 32 query rows a KV head (1 rows): a 1.000 (1.000-1.000, 2), b 2.500 (1.000-4.000, 2)",
        "# mean over repeats, compute (1 rows): a 2.500 (1.000-4.000, 2), b 1.500 (1.000-2.000, 2)",
        "# mean over repeats, 128 query rows a KV head (1 rows): a 2.500 (1.000-4.000, 2), b 1.500 (1.000-2.000, 2)",
        "# mean over repeats, spec (1 rows): a 1.000 (1.000-1.000, 2), b 1.000 (1.000-1.000, 2)",
    ]
    assert sxs_variants.repeat_summary(rows, ["a", "b", "c", "d"]) == []    # one repeat each: nothing to add
