"""CPU checks of benchmarks/kernel_times.py's accounting (the profiling itself needs a GPU)."""
import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "kernel_times.py")
_spec = importlib.util.spec_from_file_location("kernel_times", _PATH)
kernel_times = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_times)


def test_exposed_time_of_an_overlapping_dependent_is_its_tail():
    # split 0..100, combine launched early (PDL) 60..120, next split 125..225, its combine 200..240
    kernels = [("split", 0.0, 100.0), ("combine", 60.0, 120.0), ("split", 125.0, 225.0), ("combine", 200.0, 240.0)]
    rows, idle = kernel_times.exposed_times(kernels)
    assert [r[2] for r in rows] == [100.0, 20.0, 100.0, 15.0]
    assert [r[1] for r in rows] == [100.0, 60.0, 100.0, 40.0]
    assert idle == 5.0


def test_a_kernel_inside_another_exposes_nothing():
    rows, idle = kernel_times.exposed_times([("a", 0.0, 50.0), ("b", 10.0, 20.0), ("c", 30.0, 70.0)])
    assert [r[2] for r in rows] == [50.0, 0.0, 20.0] and idle == 0.0


def test_summary_per_call_and_order():
    kernels = [("split", 0.0, 100.0), ("combine", 60.0, 120.0), ("split", 125.0, 225.0), ("combine", 200.0, 240.0)]
    rows, idle = kernel_times.summarise(kernels, calls=2)
    assert [r[0] for r in rows] == ["split", "combine"]
    split, combine = rows
    assert split[1:] == (1.0, 100.0, 100.0)
    assert combine[1:] == (1.0, 50.0, pytest.approx(17.5))
    assert idle == 2.5
    assert sum(r[3] for r in rows) + idle == pytest.approx(240.0 / 2)


def test_short_name_drops_templates_and_arguments():
    name = "void flash_mla::splitkv_kernel<Traits<cutlass::bfloat16_t, 64> >(flash_mla::Params)"
    assert kernel_times.short_name(name) == "flash_mla::splitkv_kernel"
    anonymous = "void flash_mla::m::(anonymous namespace)::mla_combine_kernel<cutlass::bfloat16_t>(flash_mla::Params)"
    assert kernel_times.short_name(anonymous) == "flash_mla::m::mla_combine_kernel"
    assert kernel_times.short_name("x" * 100, width=20).startswith("...")


def test_launch_modes_and_the_gap_only_in_the_graph(monkeypatch, capsys):
    assert kernel_times.LAUNCH_MODES == ("graph", "graph-sync", "eager")
    monkeypatch.setattr("sys.argv", ["kernel_times.py", "--anchors", "nowhere", "--launch", "eager", "--gap-us", "5"])
    with pytest.raises(SystemExit) as exit_info:
        kernel_times.main()
    assert exit_info.value.code == 2
    assert "--gap-us applies to --launch graph only" in capsys.readouterr().err
