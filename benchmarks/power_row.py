"""Sustained speed, SM clock and energy per call of flash_mla and the anchors on one row, under the power cap.

    python benchmarks/power_row.py --anchors .anchors --b 128 --mean 8192 --h-q 128 --s-q 2
    python benchmarks/power_row.py --anchors .anchors --sparse --h-q 128 --s-q 2 --seconds 3
    python benchmarks/power_row.py --anchors .anchors --fp8 --h-q 16 --s-q 1      # flash_mla's FP8 path

The referee times each implementation for ~0.1 s after a pause. On the H100 the compute-bound rows draw the board's
~700 W limit: the SM clock falls from 1.98 GHz to 1.3-1.8 GHz within a run (nvidia-smi reports the software power
cap as the reason), and what ran first after a pause ran at a higher clock (docs/PERF.md, "Device and method").
This script replays each implementation's CUDA graph (the referee's: N calls over N cache copies) 12 times after a
one-second pause (the referee's burst), then back to back for `--seconds`, samples nvidia-smi every 50 ms
meanwhile, and prints per implementation: the burst's time per call, the time per call over the steady part (the
first `--settle` seconds dropped), the mean SM clock, the mean board power, energy per call (power x time),
and the time per call scaled to 1.98 GHz (what the same kernels would take unthrottled, were they clock-bound).
Implementations run in the order given, then again in reverse, and each row is the mean of both passes.

Two builds compare as two processes, head as the control in each (A B A B; energy per call repeats within ~0.5 %):

    for t in /tmp/e0 /tmp/e1 /tmp/e0 /tmp/e1; do PYTHONPATH=$t python3 benchmarks/power_row.py --anchors .anchors; done
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from row_workload import FULL_CLOCK_MHZ, add_row_arguments, capture_graph, row_label, row_workload


def parse_samples(text):
    """(seconds since the epoch, SM MHz, watts) per line of `nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw
    --format=csv,noheader,nounits` output (lines that do not parse are skipped)."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3:
            continue
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
            out.append((stamp, float(parts[1]), float(parts[2])))
        except (ValueError, IndexError):
            continue
    return out


def window_means(samples, start, end):
    """Mean SM clock (MHz) and power (W) of the samples with start <= time < end; None without samples."""
    inside = [(mhz, watts) for t, mhz, watts in samples if start <= t < end]
    if not inside:
        return None
    return sum(m for m, _ in inside) / len(inside), sum(w for _, w in inside) / len(inside)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_row_arguments(ap)
    ap.add_argument("--seconds", type=float, default=3.0, help="replay time per implementation and pass")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds dropped at the start of each replay")
    args = ap.parse_args()

    import torch
    q, ks, bt, seqlens, causal, impls = row_workload(args)
    names = list(impls)

    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                            "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    windows = []     # (name, start, end, seconds per call over the steady part, seconds per call in the burst)
    for order in (names, names[::-1]):
        for name in order:
            graph, calls, outs = capture_graph(impls[name], q, ks, bt, seqlens, causal)
            time.sleep(1.0)     # the same pause before each implementation
            burst_start = time.perf_counter()
            for _ in range(12):    # the referee's 12 timed replays, right after a pause
                graph.replay()
            torch.cuda.synchronize()
            burst = (time.perf_counter() - burst_start) / 12 / calls
            start = time.time()
            settled, replays, t0 = None, 0, None
            while time.time() - start < args.seconds:
                graph.replay()
                torch.cuda.synchronize()
                if settled is None and time.time() - start >= args.settle:
                    settled, t0 = time.time(), time.perf_counter()
                elif settled is not None:
                    replays += 1
            end = time.time()
            windows.append((name, settled, end, (time.perf_counter() - t0) / max(replays, 1) / calls, burst))
            del graph, outs
    time.sleep(0.2)
    smi.terminate()
    samples = parse_samples(smi.communicate()[0])

    print(f"# {torch.cuda.get_device_name()}: {row_label(args)}; {args.seconds:g} s per implementation and pass, "
          f"the first {args.settle:g} s dropped; mean of the given order and its reverse")
    print("impl,burst_us_per_call,us_per_call,sm_mhz,watts,mJ_per_call,us_at_1980MHz")
    for name in names:
        rows = []
        for n, start, end, per_call, burst in windows:
            means = window_means(samples, start, end) if n == name else None
            if means is not None:
                rows.append((per_call, burst, *means))
        if not rows:
            print(f"{name},no nvidia-smi samples")
            continue
        per_call, burst, mhz, watts = (sum(r[i] for r in rows) / len(rows) for i in range(4))
        print(f"{name},{burst * 1e6:.1f},{per_call * 1e6:.1f},{mhz:.0f},{watts:.0f},{per_call * watts * 1e3:.3f},"
              f"{per_call * 1e6 * mhz / FULL_CLOCK_MHZ:.1f}")

if __name__ == "__main__":
    main()
