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
