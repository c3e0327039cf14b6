"""CPU checks of benchmarks/power_row.py's nvidia-smi parsing and windowing (the replays need a GPU)."""
import importlib.util
import os
import time

_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "power_row.py")
_spec = importlib.util.spec_from_file_location("power_row", _PATH)
power_row = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(power_row)


def test_parse_samples_reads_stamp_clock_and_power():
    text = "2026/11/27 17:03:33.097, 1980, 512.40\n2026/11/27 17:03:33.203, 1455, 701.25\nnot a sample\n"
    samples = power_row.parse_samples(text)
    assert len(samples) == 2
    base = time.mktime(time.strptime("2026/11/27 17:03:33", "%Y/%m/%d %H:%M:%S"))
    assert abs(samples[0][0] - (base + 0.097)) < 1e-6 and samples[0][1:] == (1980.0, 512.4)
    assert abs(samples[1][0] - (base + 0.203)) < 1e-6 and samples[1][1:] == (1455.0, 701.25)


def test_window_means_only_inside_the_window():
    samples = [(10.0, 1980.0, 300.0), (10.5, 1500.0, 700.0), (11.0, 1300.0, 690.0), (11.5, 1900.0, 200.0)]
    mhz, watts = power_row.window_means(samples, 10.5, 11.5)
    assert (mhz, watts) == (1400.0, 695.0)
    assert power_row.window_means(samples, 12.0, 13.0) is None
