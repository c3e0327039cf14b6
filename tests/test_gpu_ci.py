"""The gate of scripts/gpu_ci.sh's pytest step (scripts/ci_pytest_gate.py), checked on any machine.

* Every skip reason the test suite can give (the literal ones of tests/, the ones its `_*reason()` helpers return,
  and the ones of flash_mla's backend availability checks that tests pass on as skip reasons) is listed here with
  its class, and the gate classifies each so: "expected" on a Hopper host with the extension (the test skips
  because the GPU and the extension are there), "missing" (a lack of the GPU stack: fails GPU CI) or "other"
  (unrelated to the GPU). A skip reason added to tests/ or to those checks must be added to REASONS: the scan
  below fails until it is (so a lack worded without GPU words cannot pass the gate as "other" unseen).
* The gate on real pytest output: the installed pytest is run on a small generated module (folded and unfolded
  -rs summaries, colour), and on summaries as the GPU runner printed them. A good GPU run with its expected skips
  passes; a skip for lack of a GPU, of the extension, of a Hopper GPU, of nvcc or of Triton fails; so do failed
  tests, errors, pytest exit statuses 1-5, a run that passed nothing, a missing closing line, and skips that the
  output does not list (no -rs).
* The wiring: gpu_ci.sh's pytest step run with a stand-in interpreter that prints a canned pytest run, so the step's
  PASS/FAIL, its banner, its log and summary.txt come from the script itself.
"""
from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GPU_CI = ROOT / "scripts" / "gpu_ci.sh"
sys.path.insert(0, str(ROOT / "scripts"))

import ci_pytest_gate as gate  # noqa: E402 (after the sys.path insert)

EXPECTED, MISSING, OTHER = gate.EXPECTED, gate.MISSING, gate.OTHER

# ----------------------------------------------------------------------------------------------------------------
# every skip reason of the test suite, with its class ("{}": a value filled in at run time)
# ----------------------------------------------------------------------------------------------------------------

REASONS = {
    # meant to skip on a Hopper host with the extension: the test needs the GPU or the extension to be absent (or,
    # for fp8 on the cuda backend, a kernel the product does not have)
    "needs a CUDA GPU without the CUDA extension (the host scheduler)": EXPECTED,                  # test_compat
    "interpreter tests run on CPU-only machines": EXPECTED,                                        # test_triton_backend
    "CPU-only interpreter test; when triton was imported before TRITON_INTERPRET was set, "
    "test_subprocess_runs_interpreter_tests runs it": EXPECTED,                                    # test_triton_backend
    "the interpreter tests run in this process": EXPECTED,                                         # test_triton_backend
    # tests/test_fp8.py: the same two for the fp8 interpreter tests (their "needs triton" part is for CPU hosts: on
    # a GPU host they skip whatever triton's state)
    "CPU-only interpreter test (needs triton; when triton was imported before TRITON_INTERPRET was set, "
    "test_subprocess_runs_interpreter_tests runs it)": EXPECTED,
    "the interpreter tests run in this process (or need triton)": EXPECTED,
    # a lack of the GPU stack: on the GPU runner, a test that should have run did not
    "needs a CUDA GPU": MISSING,
    "needs a CUDA GPU (torch.cuda.is_available() is False)": MISSING,
    "needs the CUDA extension flash_mla._cuda (pip install --no-build-isolation -e . with nvcc)": MISSING,
    "needs a Hopper (sm_90) GPU": MISSING,
    "planning inside a CUDA graph needs the CUDA extension (device scheduler)": MISSING,
    "get_mla_metadata runs on the device only with the CUDA extension (else it reads the lengths)": MISSING,
    # "without the CUDA extension" here describes the lack, unlike test_compat's reason above
    "get_mla_metadata without the CUDA extension reads the lengths on the host": MISSING,
    "nvcc not found": MISSING,
    "cuobjdump (CUDA toolkit) not found": MISSING,                                               # test_sass_diff
    "nvdisasm (CUDA toolkit) not found": MISSING,                                                # test_sass_diff
    "no CUDA runtime headers under {}": MISSING,
    "CUTLASS headers: pip install nvidia-cutlass": MISSING,
    "triton is not installed": MISSING,
    "the Triton sparse kernel flash_mla/triton_sparse.py is not in this tree": MISSING,           # test_sparse
    "needs a Hopper GPU and the compiled extension": MISSING,                                     # test_sparse
    "inductor on CUDA needs triton": MISSING,
    # flash_mla's availability checks, passed on as skip reasons (tests/test_gpu_hardening.py, test_custom_ops.py,
    # test_compat.py, test_attn_sink.py)
    "the CUDA extension flash_mla._cuda is not available ({}); reinstall with nvcc and a CUDA build of PyTorch: "
    "pip install --no-build-isolation -e .": MISSING,
    "the cuda backend needs a Hopper GPU (sm_90), {} is sm_{}{}": MISSING,
    "the triton backend could not be imported ({})": MISSING,
    "triton is not importable ({}); install it with `pip install triton`": MISSING,
    "torch.cuda.is_available() is False: no usable CUDA GPU or driver": MISSING,
    "the triton backend needs an NVIDIA GPU of compute capability 8.0 or newer, {} is sm_{}{}": MISSING,
    "the triton backend runs fp8 KV caches on compute capability 8.9 or newer (Ada, Hopper), {} is sm_{}{}": MISSING,
    "the {} backend needs CUDA tensors, q is on {}": MISSING,
    "the triton backend needs CUDA tensors, got tensors on {}": MISSING,
    "the triton backend needs CUDA tensors, q is on {} (to run its kernels on CPU tensors in Triton's interpreter, "
    "set TRITON_INTERPRET=1 before triton is first imported)": MISSING,
    "the triton backend needs CUDA tensors, got tensors on {} (Triton's interpreter runs the kernels on CPU tensors "
    "only when TRITON_INTERPRET=1 is set before triton is first imported; in this process "
    "flash_mla.triton_backend was imported without it)": MISSING,
    "the triton backend cannot run tensors on {}: TRITON_INTERPRET=1 was set after triton was imported, so "
    "triton.language's own helpers (tl.sum, tl.max, ...) were compiled for a GPU while flash_mla's kernels are "
    "interpreted; set TRITON_INTERPRET=1 before the first import of triton (e.g. in the environment of the "
    "process)": MISSING,
    # unrelated to the GPU: allowed on the GPU runner
    "the cpu backend needs CPU tensors, q is on {}": OTHER,        # never a skip reason: tests ask cuda and triton
    "torch.library.custom_op needs torch >= 2.4": OTHER,
    "flash_mla_with_kvcache takes no attn_sink here (an older binding)": OTHER,
    "no host C++ compiler": OTHER,
    "no C++ compiler": OTHER,
    "could not import 'torch.utils.cpp_extension': {}": OTHER,     # importorskip without a reason
    "ruff is not installed: pip install -e '.[test]' (the test extra pins it), then rerun": OTHER,
    "tomllib needs Python >= 3.11": OTHER,
    "bash is not installed": OTHER,
    "--no-fold-skipped needs pytest >= 8.3": OTHER,                  # this file
    "{} is not installed and FLASH_MLA_LINTERS_OPTIONAL=1": OTHER,
    "{}: {} ships no binary wheel for {}/{}": OTHER,
}

# the functions of the package whose answers tests pass on as skip reasons
PACKAGE_REASON_FUNCTIONS = {"flash_mla/backends.py": "_unavailable_reason",
                            "flash_mla/triton_backend.py": "unavailable_reason"}


def _text(node, constants: dict[str, str]) -> str | None:
    """A string literal, an f-string with "{}" for each value, or the name of a module-level string constant; None
    for anything computed."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def _constants(tree: ast.Module) -> dict[str, str]:
    """The module-level `NAME = "string"` assignments of a module."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            text = _text(node.value, {})
            if text is not None:
                found[node.targets[0].id] = text
    return found


def _returned_texts(function: ast.FunctionDef, constants: dict[str, str]) -> set[str]:
    found = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Return) and node.value is not None:
            values = [node.value.body, node.value.orelse] if isinstance(node.value, ast.IfExp) else [node.value]
            found.update(t for t in (_text(v, constants) for v in values) if t is not None)
    return found


def _skip_reasons(tree: ast.Module) -> set[str]:
    """The literal reasons of pytest.skip / mark.skip / mark.skipif / importorskip calls, and the strings that
    functions named *reason return (the test modules' skip conditions)."""
    constants = _constants(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name not in ("skip", "skipif", "importorskip"):
                continue
            values = [k.value for k in node.keywords if k.arg == "reason"]
            if name == "skip" and node.args:
                values.append(node.args[0])
            if name == "importorskip" and not values and node.args:
                module = _text(node.args[0], constants)
                found.add(f"could not import '{module}': {{}}")
            found.update(t for t in (_text(v, constants) for v in values) if t)
        elif isinstance(node, ast.FunctionDef) and node.name.endswith("reason"):
            found.update(_returned_texts(node, constants))
    return found


def suite_skip_reasons() -> dict[str, str]:
    """reason -> where it was found."""
    found = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name.startswith("test_") or path.name == "conftest.py":
            for reason in _skip_reasons(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                found.setdefault(reason, f"tests/{path.name}")
    for rel, name in PACKAGE_REASON_FUNCTIONS.items():
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"), rel)
        functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
        assert functions, f"{rel} has no function {name}: update PACKAGE_REASON_FUNCTIONS"
        for reason in _returned_texts(functions[0], _constants(tree)):
            found.setdefault(reason, f"{rel} {name}()")
    return found


def test_every_skip_reason_of_the_suite_is_classified():
    found = suite_skip_reasons()
    unlisted = {r: where for r, where in found.items() if r not in REASONS}
    assert not unlisted, (
        "skip reasons that tests/test_gpu_ci.py's REASONS does not classify (add each with its class: EXPECTED when "
        "the test is meant to skip on a Hopper host with the extension, which also needs the exact text in "
        "EXPECTED_ON_GPU_HOST of scripts/ci_pytest_gate.py; MISSING when it lacks a part of the GPU stack; OTHER "
        "when unrelated to the GPU):\n" + "\n".join(f"  {where}: {r!r}" for r, where in sorted(unlisted.items())))
    # the scan sees the reasons this file's classes rest on (a broken scan would find nothing to check)
    for reason in ("needs a CUDA GPU", "needs a CUDA GPU without the CUDA extension (the host scheduler)",
                   "nvcc not found", "the cuda backend needs a Hopper GPU (sm_90), {} is sm_{}{}"):
        assert reason in found, reason


@pytest.mark.parametrize("reason", sorted(REASONS))
def test_gate_classifies_each_reason(reason):
    assert gate.classify(reason) == REASONS[reason]
    assert gate.classify("Skipped: " + reason) == REASONS[reason]     # the unfolded -rs form


def test_expected_list_matches_the_table():
    """EXPECTED_ON_GPU_HOST holds exactly the table's expected reasons, matched exactly. (A reworded expected reason
    is caught by the scan above: its new text is not in the table.)"""
    assert gate.EXPECTED_ON_GPU_HOST == {r for r, kind in REASONS.items() if kind == EXPECTED}
    assert gate.classify("needs a CUDA GPU without the CUDA extension") == MISSING      # not the exact text
    assert gate.classify("needs an sm_100 GPU") == MISSING                                # new GPU reasons fail closed


# ----------------------------------------------------------------------------------------------------------------
# the gate on pytest summaries
# ----------------------------------------------------------------------------------------------------------------

# As a Hopper runner with the extension prints them (`python -m pytest -q -rs`, pytest 9): the expected skips only.
GOOD_GPU_RUN = """\
........................................................................ [ 10%]
.............ssssssssssssssssssssssssss.s............................... [ 21%]
........................................................................ [ 98%]
.............                                                            [100%]
=============================== warnings summary ===============================
tests/test_custom_ops.py::test_gpu_compile_with_cuda_graphs[cuda]
  /opt/venv/lib/python3.10/site-packages/torch/_inductor/compile_fx.py:236: UserWarning: TensorFloat32 ...

-- Docs: https://docs.pytest.org/en/stable/how-to/capture-warnings.html
=========================== short test summary info ============================
SKIPPED [1] tests/test_compat.py:419: needs a CUDA GPU without the CUDA extension (the host scheduler)
SKIPPED [24] tests/test_triton_backend.py:160: interpreter tests run on CPU-only machines
SKIPPED [6] tests/test_triton_backend.py:231: CPU-only interpreter test; when triton was imported before \
TRITON_INTERPRET was set, test_subprocess_runs_interpreter_tests runs it
SKIPPED [1] tests/test_triton_backend.py:151: the interpreter tests run in this process
SKIPPED [1] tests/test_docker.py:66: hadolint is not installed and FLASH_MLA_LINTERS_OPTIONAL=1
660 passed, 33 skipped, 1 warning in 812.33s (0:13:32)
"""


def _with(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new)


def test_good_gpu_run_passes():
    passed, report = gate.judge(GOOD_GPU_RUN, exit_code=0)
    assert passed, report
    assert report[-1] == "pytest gate: PASS"
    assert "pytest gate: skips: 32 expected on a GPU host, 1 unrelated to the GPU, 0 lack of the GPU stack" in report


def test_the_old_grep_case_passes():
    """The case that turned a good Hopper run red: the one expected skip names a CUDA GPU and the extension."""
    text = ".s..\n=========================== short test summary info ============================\n" \
           "SKIPPED [1] tests/test_compat.py:419: needs a CUDA GPU without the CUDA extension (the host scheduler)\n" \
           "3 passed, 1 skipped in 2.01s\n"
    assert gate.judge(text, exit_code=0)[0]


@pytest.mark.parametrize("line, words", [
    ("SKIPPED [12] tests/test_gpu_hardening.py:34: needs a CUDA GPU", "needs a CUDA GPU"),
    ("SKIPPED [40] tests/test_flash_mla.py:42: needs the CUDA extension flash_mla._cuda (pip install "
     "--no-build-isolation -e . with nvcc)", "needs the CUDA extension"),
    ("SKIPPED [40] tests/test_flash_mla.py:42: needs a Hopper (sm_90) GPU", "needs a Hopper"),
    ("SKIPPED [9] tests/test_compile.py:26: nvcc not found", "nvcc not found"),
    ("SKIPPED [3] tests/test_custom_ops.py:259: inductor on CUDA needs triton", "needs triton"),
    ("SKIPPED [2] tests/test_gpu_hardening.py:44: the cuda backend needs a Hopper GPU (sm_90), NVIDIA A100-SXM4-80GB "
     "is sm_80", "sm_80"),
    ("SKIPPED [1] tests/test_custom_ops.py:237: get_mla_metadata without the CUDA extension reads the lengths on the "
     "host", "reads the lengths on the host"),
])
def test_a_gpu_test_skipped_for_a_lack_fails(line, words):
    n = int(re.search(r"\[(\d+)\]", line).group(1))
    text = _with(GOOD_GPU_RUN, "660 passed, 33 skipped", f"660 passed, {33 + n} skipped")
    text = _with(text, "SKIPPED [1] tests/test_docker.py", line + "\nSKIPPED [1] tests/test_docker.py")
    passed, report = gate.judge(text, exit_code=0)
    assert not passed
    assert report[-1].startswith("pytest gate: FAIL: ") and "lack of the GPU stack" in report[-1]
    assert words in report[-1], report[-1]
    assert any(r.startswith("  skip, lack of the GPU stack: ") and words in r for r in report), report


@pytest.mark.parametrize("closing, exit_code, words", [
    ("2 failed, 658 passed, 33 skipped in 800.00s (0:13:20)", 1, "2 failed"),
    ("658 passed, 33 skipped, 2 errors in 800.00s (0:13:20)", 1, "2 errors"),
    ("1 failed, 659 passed, 33 skipped, 1 error in 800.00s", 1, "1 failed and 1 error"),
    ("660 passed, 33 skipped, 1 error in 12.00s", 2, "interrupted"),
    ("2 failed, 658 passed, 33 skipped in 800.00s", 0, "2 failed"),        # even if the exit status said 0
])
def test_failures_and_errors_fail(closing, exit_code, words):
    text = _with(GOOD_GPU_RUN, "660 passed, 33 skipped, 1 warning in 812.33s (0:13:32)", closing)
    passed, report = gate.judge(text, exit_code=exit_code)
    assert not passed and words in report[-1], report


def test_exit_status_alone_fails():
    for status, words in ((1, "tests failed"), (2, "interrupted"), (3, "internal error"), (4, "usage error"),
                          (5, "no tests were collected"), (137, "did not finish")):
        passed, report = gate.judge(GOOD_GPU_RUN, exit_code=status)
        assert not passed and f"pytest exit status {status}: " in report[-1] and words in report[-1], report


@pytest.mark.parametrize("text", [
    "\nno tests ran in 0.61s\n",
    "ss\n=========================== short test summary info ============================\n"
    "SKIPPED [1] tests/test_compat.py:419: needs a CUDA GPU without the CUDA extension (the host scheduler)\n"
    "SKIPPED [1] tests/test_repo_hygiene.py:94: tomllib needs Python >= 3.11\n"
    "2 skipped, 690 deselected in 3.10s\n",
    "=================== 0 passed, 4 deselected in 0.12s ===================\n",
])
def test_nothing_passed_fails(text):
    passed, report = gate.judge(text, exit_code=0)
    assert not passed and "no test passed" in report[-1], report


def test_no_closing_line_fails():
    text = GOOD_GPU_RUN.rsplit("660 passed", 1)[0] + "Killed\n"
    passed, report = gate.judge(text, exit_code=None)
    assert not passed and "no closing line" in report[-1], report


def test_skips_without_their_reasons_fail():
    """Without -rs the skips cannot be classified."""
    text = GOOD_GPU_RUN.split("=========================== short test summary info", 1)[0]
    text += "660 passed, 33 skipped, 1 warning in 812.33s (0:13:32)\n"
    passed, report = gate.judge(text, exit_code=0)
    assert not passed and "33 skipped but 0 listed" in report[-1] and "-rs" in report[-1], report


def test_only_the_last_run_counts():
    """A nested pytest's output earlier in the log (captured output of a test, say) is not the run's."""
    nested = ("=========================== short test summary info ============================\n"
              "SKIPPED [5] tests/test_x.py:3: needs a CUDA GPU\n"
              "1 failed, 5 skipped in 0.50s\n")
    assert gate.judge(nested + GOOD_GPU_RUN, exit_code=0)[0]
    assert not gate.judge(GOOD_GPU_RUN + nested, exit_code=0)[0]


def test_command_line(tmp_path, capsys):
    log = tmp_path / "pytest.log"
    log.write_text(GOOD_GPU_RUN)
    assert gate.main(["--exit-code", "0", str(log)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "pytest gate: PASS"
    assert gate.main(["--exit-code", "1", str(log)]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("pytest gate: FAIL: pytest exit status 1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ci_pytest_gate.py"), "-"], input=GOOD_GPU_RUN,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == "pytest gate: PASS", proc.stdout + proc.stderr


# ---- the installed pytest's own output -------------------------------------------------------------------------

SAMPLE_MODULE = """\
import pytest


def test_passes():
    pass


@pytest.mark.skipif(True, reason={expected!r})
def test_expected():
    pass


@pytest.mark.parametrize("x", [1, 2])
def test_gpu(x):
    pytest.skip({gpu!r})


@pytest.mark.skipif(True, reason={extension!r})
def test_extension():
    pass


def test_unrelated():
    pytest.importorskip("no_such_module_for_the_gate")


def test_fails():
    assert 1 == 2


@pytest.fixture
def broken():
    raise RuntimeError("fixture error")


def test_errors(broken):
    pass
"""


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gate_sample")
    (folder / "test_sample.py").write_text(SAMPLE_MODULE.format(
        expected="needs a CUDA GPU without the CUDA extension (the host scheduler)", gpu="needs a CUDA GPU",
        extension="needs the CUDA extension flash_mla._cuda (pip install --no-build-isolation -e . with nvcc)"))
    (folder / "pytest.ini").write_text("[pytest]\n")       # this folder is the rootdir, not the repository

    def run(*args):
        env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PY_COLORS", "FORCE_COLOR")}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                              cwd=folder, capture_output=True, text=True, env=env, timeout=120)
        return proc.returncode, proc.stdout + proc.stderr
    return run


@pytest.mark.parametrize("select, extra, verdict, words", [
    ("passes or expected or unrelated", (), True, "PASS"),
    ("passes or expected", ("--color=yes",), True, "PASS"),
    ("passes or gpu", (), False, "2 skipped for lack of the GPU stack"),
    ("passes or extension", (), False, "needs the CUDA extension"),
    ("passes or gpu", ("--no-fold-skipped",), False, "test_sample.py::test_gpu[1]: needs a CUDA GPU"),
    ("passes or fails", (), False, "1 failed"),
    ("passes or errors", (), False, "1 error"),
    ("expected", (), False, "no test passed"),
    ("nothing_is_called_so", (), False, "no tests were collected"),
])
def test_gate_on_real_pytest_output(sample, select, extra, verdict, words):
    if "--no-fold-skipped" in extra and tuple(int(p) for p in pytest.__version__.split(".")[:2]) < (8, 3):
        pytest.skip("--no-fold-skipped needs pytest >= 8.3")
    status, output = sample("-k", select, *extra)
    if select == "expected":
        assert status == 0    # pytest itself is content with a run that skipped everything
    if "--color=yes" in extra:
        assert "\x1b[" in output
    passed, report = gate.judge(output, exit_code=status)
    assert passed is verdict and words in report[-1], output + "\n".join(report)


def test_real_short_summary_format(sample):
    """The lines the gate reads, as the installed pytest writes them."""
    _, output = sample("-k", "passes or expected or gpu")
    assert re.search(r"^SKIPPED \[2\] test_sample\.py:\d+: needs a CUDA GPU$", output, re.M), output
    assert re.search(r"^SKIPPED \[1\] test_sample\.py:\d+: needs a CUDA GPU without the CUDA extension "
                     r"\(the host scheduler\)$", output, re.M), output
    assert re.search(r"^1 passed, 3 skipped, \d+ deselected in [\d.]+s$", output, re.M), output
    run = gate.parse(output)
    assert run.counts["passed"] == 1 and run.counts["skipped"] == 3 and sum(s.count for s in run.skips) == 3


# ----------------------------------------------------------------------------------------------------------------
# the wiring: gpu_ci.sh's pytest step with a stand-in for the interpreter's pytest
# ----------------------------------------------------------------------------------------------------------------

def _bash():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    return bash


def run_pytest_step(tmp_path, pytest_output: str, pytest_status: int):
    """gpu_ci.sh --steps pytest, with PYTHON a script that prints `pytest_output` for `-m pytest` and runs this
    interpreter for everything else (the gate)."""
    bash = _bash()
    canned = tmp_path / "pytest_output.txt"
    canned.write_text(pytest_output)
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!{bash}
        if [[ "${{1:-}}" == "-m" && "${{2:-}}" == "pytest" ]]; then
            echo "pytest arguments: ${{*:3}}"
            cat {str(canned)!r}
            exit {pytest_status}
        fi
        exec {sys.executable!r} "$@"
        """))
    fake.chmod(0o755)
    out = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLASH_MLA_CI_", "CUTLASS_WHEEL_DIR"))}
    env.update(PYTHON=str(fake), OUT_DIR=str(out))
    proc = subprocess.run([bash, str(GPU_CI), "--steps", "pytest"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    summary = (out / "summary.txt").read_text()
    logs = sorted(out.glob("*-pytest.log"))
    assert len(logs) == 1, sorted(out.iterdir())
    return proc, summary, logs[0].read_text()


def test_gpu_ci_pytest_step_passes_a_good_run(tmp_path):
    proc, summary, log = run_pytest_step(tmp_path, GOOD_GPU_RUN, 0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pytest arguments: -q -rs" in log            # the gate needs -rs
    assert re.search(r"^==== PASS pytest ", proc.stdout, re.M), proc.stdout
    assert re.search(r"^pytest\s+PASS\s", summary, re.M) and "gpu_ci: all selected steps passed" in summary
    assert log.rstrip().endswith("pytest gate: PASS") and "skip, expected on a GPU host" in log


def test_gpu_ci_pytest_step_fails_a_gpu_skip(tmp_path):
    text = _with(GOOD_GPU_RUN, "660 passed, 33 skipped", "620 passed, 73 skipped")
    text = _with(text, "SKIPPED [1] tests/test_docker.py",
                 "SKIPPED [40] tests/test_flash_mla.py:42: needs a CUDA GPU\nSKIPPED [1] tests/test_docker.py")
    proc, summary, log = run_pytest_step(tmp_path, text, 0)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    banner = re.search(r"^==== FAIL pytest .*$", proc.stdout, re.M)
    assert banner and "40 skipped for lack of the GPU stack" in banner.group(0), proc.stdout
    assert re.search(r"^pytest\s+FAIL\s", summary, re.M) and "gpu_ci: FAILED: pytest" in summary
    assert "skip, lack of the GPU stack: [40] tests/test_flash_mla.py:42: needs a CUDA GPU" in log


def test_gpu_ci_pytest_step_fails_failed_tests(tmp_path):
    text = _with(GOOD_GPU_RUN, "660 passed", "1 failed, 659 passed")
    proc, summary, _ = run_pytest_step(tmp_path, text, 1)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    banner = re.search(r"^==== FAIL pytest .*$", proc.stdout, re.M)
    assert banner and "exit status 1" in banner.group(0) and "1 failed" in banner.group(0), proc.stdout
    assert "gpu_ci: FAILED: pytest" in summary


def test_gpu_ci_help_names_the_gate():
    proc = subprocess.run([_bash(), str(GPU_CI), "--help"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and "scripts/ci_pytest_gate.py" in proc.stdout, proc.stdout + proc.stderr
    assert "scripts/ci_pytest_gate.py" in GPU_CI.read_text().split("check_pytest() {", 1)[1].split("\n}\n", 1)[0]


def test_gpu_ci_picks_the_quick_benchmark(tmp_path):
    """pick_bench greps benchmarks/bench_flash_mla.py for "--quick" and "--out-dir": both are still its options
    (its command line stays in that file), and the env step shows the command the bench step will run."""
    out = tmp_path / "logs"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLASH_MLA_CI_", "CUTLASS_WHEEL_DIR")) and k != "BENCH_CMD"}
    env.update(PYTHON=sys.executable, OUT_DIR=str(out))
    proc = subprocess.run([_bash(), str(GPU_CI), "--steps", "env"], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr      # 1: a CPU-only PyTorch fails the env step
    log = (out / "01-env.log").read_text()
    assert f"benchmark: {sys.executable} benchmarks/bench_flash_mla.py --quick --out-dir {out}/bench" in log, log
    usage = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_flash_mla.py"), "--help"],
                           capture_output=True, text=True, timeout=120)
    assert usage.returncode == 0 and "--quick" in usage.stdout and "--out-dir" in usage.stdout, usage.stderr
