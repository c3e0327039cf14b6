"""The gate of scripts/gpu_ci.sh's pytest step: judges the output of `pytest -rs` run on a Hopper GPU host.

    python scripts/ci_pytest_gate.py [--exit-code N] LOG        (LOG "-": standard input)

It prints every skip reason of the run with its class, then a last line that starts "pytest gate: PASS" or
"pytest gate: FAIL: <why>", and exits 0 or 1. The run fails when

* pytest's exit status (--exit-code, as gpu_ci.sh passes it) is not 0: failed tests, an interrupted run (a
  collection error), an internal or usage error, or no tests collected;
* its closing line is missing, counts a failed test or an error, or counts no passed test ("no tests ran",
  "2 skipped, 8 deselected");
* a test was skipped for lack of what GPU CI exists to test: a CUDA GPU, the CUDA extension flash_mla._cuda, a
  Hopper (sm_90) GPU, nvcc and the CUDA toolkit, CUTLASS, or Triton (class "missing", below);
* the closing line counts skips that the short test summary does not list (pytest ran without -rs): a skip that
  cannot be read cannot be classified.

Classes of skip reasons, decided in this order:

* "expected": EXPECTED_ON_GPU_HOST, an explicit list of exact reasons of the tests that skip *because* the host has
  a GPU and the extension (a test of the CPU-only or no-extension code path, e.g. test_compat.py's "needs a CUDA GPU
  without the CUDA extension"). They are skipped on every good GPU host, so they pass.
* "missing": any other reason that names a part of the GPU stack (GPU_STACK below: GPU, CUDA, Hopper, sm_NN,
  nvcc, CUTLASS, NVIDIA, Triton, flash_mla._cuda, compute capability). On a GPU host such a skip can only mean that
  a part was absent, so the gate fails. Matching the vocabulary rather than known phrases ("needs a CUDA GPU",
  "nvcc not found", ...) fails closed: a new GPU skip reason is treated as a lack until it is added to
  EXPECTED_ON_GPU_HOST on purpose. Phrases cannot tell the two kinds apart: "without the CUDA extension" is in
  test_compat.py's expected reason and in test_custom_ops.py's "get_mla_metadata without the CUDA extension reads
  the lengths on the host", a lack; only the exact texts of the list pass.
* "other": reasons that name none of it (ruff, bash, a linter wheel, tomllib, the torch version, a host C++
  compiler): unrelated to the GPU, reported and allowed. A lack of the GPU stack worded without its vocabulary
  would pass here: tests/test_gpu_ci.py's table of every reason, checked on any machine, is the guard.

tests/test_gpu_ci.py feeds this gate pytest summaries on any machine, and holds the list of every skip reason in
tests/ with its class: a new skip reason is classified there first.
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field

# Exact reasons (as pytest prints them) of tests that skip on a GPU host *because* the GPU and the extension are
# there. Each is skipped on every good run of gpu_ci.sh; keep the entries verbatim with the tests' texts.
EXPECTED_ON_GPU_HOST = {
    # tests/test_compat.py: the host scheduler's "cannot plan while a CUDA graph is being captured" error is only
    # reachable without the extension (with it, planning runs on the device)
    "needs a CUDA GPU without the CUDA extension (the host scheduler)",
    # tests/test_triton_backend.py: Triton's CPU interpreter is tested on CPU-only hosts; on a GPU the same kernels
    # are tested compiled
    "interpreter tests run on CPU-only machines",
    "CPU-only interpreter test; when triton was imported before TRITON_INTERPRET was set, "
    "test_subprocess_runs_interpreter_tests runs it",
    # tests/test_triton_backend.py: the subprocess rerun of the interpreter tests, needed only when they could not
    # run in pytest's own process (always can on a GPU host)
    "the interpreter tests run in this process",
    # tests/test_fp8.py: the same two for the fp8 interpreter tests (skipped on any GPU host, whatever triton's state)
    "CPU-only interpreter test (needs triton; when triton was imported before TRITON_INTERPRET was set, "
    "test_subprocess_runs_interpreter_tests runs it)",
    "the interpreter tests run in this process (or need triton)",
}

# The vocabulary of the GPU stack, as whole words ("torch.cuda.is_available()" and "nvidia-cutlass" match: dots
# and dashes are word boundaries), so that e.g. torch.utils.cpp_extension does not.
GPU_STACK = re.compile(
    r"\bGPUs?\b|\bCUDA\b|\bHopper\b|\bsm_\d+|\bnvcc\b|\bCUTLASS\b|\bNVIDIA\b|\btriton\b|flash_mla\._cuda"
    r"|compute capability",
    re.IGNORECASE)

EXPECTED, MISSING, OTHER = "expected", "missing", "other"
LABEL = {EXPECTED: "expected on a GPU host", MISSING: "lack of the GPU stack", OTHER: "unrelated to the GPU"}

EXIT_STATUS = {1: "tests failed", 2: "the run was interrupted (e.g. a collection error)",
               3: "pytest had an internal error", 4: "pytest was called wrongly (usage error)",
               5: "no tests were collected"}

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# pytest's closing line: "660 passed, 33 skipped, 2 warnings in 301.20s (0:05:01)" (with -q), the same between
# "=" rulers (without), or "no tests ran in 0.61s"
CLOSING = re.compile(r"^=*\s*(?P<counts>no tests ran|\d+ \w+(?:, \d+ \w+)*) in \d+(?:\.\d+)?s\b.*?=*$")
COUNT = re.compile(r"(\d+) (\w+)")
SUMMARY_RULER = re.compile(r"^=+ short test summary info =+$")
# -rs lines: folded "SKIPPED [2] tests/test_x.py:23: reason" (the default), "SKIPPED [1] tests/test_x.py: reason"
# (no line number), or unfolded (--no-fold-skipped) "SKIPPED tests/test_x.py::test_y[a] - Skipped: reason" (a
# module-level skip: "SKIPPED tests/test_x.py - Skipped: reason")
FOLDED = re.compile(r"^SKIPPED \[(?P<n>\d+)\] (?P<where>\S+?(?::\d+)?): (?P<reason>.*)$")
UNFOLDED = re.compile(r"^SKIPPED (?P<where>[^\s\[]\S*)(?: - (?P<reason>.*))?$")


def classify(reason: str) -> str:
    """EXPECTED, MISSING or OTHER (see the module docstring)."""
    reason = reason.strip()
    if reason.startswith("Skipped: "):
        reason = reason[len("Skipped: "):]
    if reason in EXPECTED_ON_GPU_HOST:
        return EXPECTED
    if GPU_STACK.search(reason):
        return MISSING
    return OTHER


@dataclass
class Skip:
    count: int
    where: str
    reason: str

    @property
    def kind(self) -> str:
        return classify(self.reason)

    def __str__(self) -> str:
        return f"[{self.count}] {self.where}: {self.reason}"


@dataclass
class Run:
    counts: dict[str, int] | None = None      # None: no closing line
    closing: str = ""                         # the closing line's counts as pytest wrote them
    skips: list[Skip] = field(default_factory=list)
    has_summary: bool = False                 # a "short test summary info" section was printed


def _count_word(word: str) -> str:
    """pytest says "1 error" / "2 errors", "1 warning" / "2 warnings": one key each."""
    return {"error": "errors", "warning": "warnings"}.get(word, word)


def parse(text: str) -> Run:
    """The closing line (the last one: captured output of a nested pytest comes earlier) and the SKIPPED lines of the
    last short test summary before it."""
    lines = [ANSI.sub("", line).rstrip() for line in text.splitlines()]
    run = Run()
    end = None
    for i in range(len(lines) - 1, -1, -1):
        m = CLOSING.match(lines[i].strip())
        if m:
            end = i
            counts = run.closing = m.group("counts")
            run.counts = {} if counts == "no tests ran" else {
                _count_word(word): int(n) for n, word in COUNT.findall(counts)}
            break
    if end is None:
        return run
    start = next((i for i in range(end - 1, -1, -1) if SUMMARY_RULER.match(lines[i])), None)
    if start is None:
        return run
    run.has_summary = True
    for line in lines[start + 1:end]:
        m = FOLDED.match(line)
        if m:
            run.skips.append(Skip(int(m.group("n")), m.group("where"), m.group("reason")))
            continue
        m = UNFOLDED.match(line)
        if m:
            reason = m.group("reason") or ""
            if reason.startswith("Skipped: "):
                reason = reason[len("Skipped: "):]
            run.skips.append(Skip(1, m.group("where"), reason))
    return run


def judge(text: str, exit_code: int | None = None) -> tuple[bool, list[str]]:
    """(passed, report lines); the last line is the verdict."""
    run = parse(text)
    report: list[str] = []
    problems: list[str] = []
    if run.counts is None:
        problems.append("no closing line (N passed, ... in S s): pytest did not finish")
        counts = {}
    else:
        counts = run.counts
        report.append(f"pytest gate: pytest's closing line: {run.closing}")
        bad = [f"{counts[k]} {k if counts[k] > 1 or k == 'failed' else 'error'}" for k in ("failed", "errors")
               if counts.get(k)]
        if bad:
            problems.append(" and ".join(bad))
        if not counts.get("passed"):
            problems.append("no test passed")
    # the exit status, unless it is 1 and the closing line's failures or errors already say why
    if exit_code and not (exit_code == 1 and (counts.get("failed") or counts.get("errors"))):
        problems.insert(0, f"pytest exit status {exit_code}: {EXIT_STATUS.get(exit_code, 'pytest did not finish')}")
    by_kind: dict[str, list[Skip]] = {EXPECTED: [], MISSING: [], OTHER: []}
    for skip in run.skips:
        by_kind[skip.kind].append(skip)
    for kind in (MISSING, EXPECTED, OTHER):
        for skip in by_kind[kind]:
            report.append(f"  skip, {LABEL[kind]}: {skip}")
    listed = sum(s.count for s in run.skips)
    skipped = counts.get("skipped", 0)
    if skipped > listed:
        how = "" if run.has_summary else " (no short test summary: run pytest with -rs)"
        problems.append(f"{skipped} skipped but {listed} listed by SKIPPED lines{how}: the rest cannot be "
                        "classified")
    missing = by_kind[MISSING]
    if missing:
        n = sum(s.count for s in missing)
        shown = "; ".join(str(s) for s in missing[:3]) + ("; ..." if len(missing) > 3 else "")
        problems.append(f"{n} skipped for lack of the GPU stack (GPU, CUDA extension, Hopper, nvcc, CUTLASS or "
                        f"Triton): {shown}")
        report.append("pytest gate: a test meant to skip on a Hopper host with the extension needs its exact reason "
                      "in EXPECTED_ON_GPU_HOST of scripts/ci_pytest_gate.py (and in REASONS of tests/test_gpu_ci.py)")
    if run.skips:
        report.append("pytest gate: skips: " + ", ".join(
            f"{sum(s.count for s in by_kind[k])} {LABEL[k]}" for k in (EXPECTED, OTHER, MISSING)))
    if problems:
        report.append("pytest gate: FAIL: " + "; ".join(problems))
        return False, report
    report.append("pytest gate: PASS")
    return True, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help='the output of `python -m pytest -rs ...` ("-": standard input)')
    parser.add_argument("--exit-code", type=int, default=None, help="pytest's exit status")
    args = parser.parse_args(argv)
    if args.log == "-":
        text = sys.stdin.read()
    else:
        with open(args.log, encoding="utf-8", errors="replace") as f:
            text = f.read()
    passed, report = judge(text, args.exit_code)
    print("\n".join(report))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
