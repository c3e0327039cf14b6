"""The parts of benchmarks/bench_flash_mla.py (its command line and main() stay there), one module per concern:

    workloads  the workload groups (the SPEC reference table, long, skewed, specdec, short) and their targets
    timing     the hardware ceilings, repetition choice, timing a backend's calls, L2-defeating input copies
    backends   what is compared: flash_mla's backends, the torch baseline (baselines.py), FlashInfer
    checks     correctness against flash_mla or the float32 reference, with the test suite's tolerances
    progress   the progress bar (or log lines)
    measure    one workload: inputs, reference, check and time every backend, the figures of each row
    report     the table on stdout, the summary, the CSV (written and read back)
    plots      the two PNG plots (matplotlib), also from an earlier run's CSV

The modules import `flash_mla` (this checkout's when the package is not installed) and the sibling scripts of
benchmarks/ (baselines.py, ceilings.py), so both folders go on sys.path here.
"""
import os
import sys

_BENCHMARKS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _folder in (os.path.dirname(_BENCHMARKS), _BENCHMARKS):     # the repository (flash_mla), benchmarks/
    if _folder not in sys.path:
        sys.path.insert(0, _folder)
