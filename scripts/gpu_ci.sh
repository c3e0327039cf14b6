#!/usr/bin/env bash
# GPU CI for flash_mla on a Hopper (sm_90) runner: build the CUDA extension, prove it is the one under test, run
# the whole test suite with the GPU tests, the full reference sweep, the main job and a short benchmark.
#
#   scripts/gpu_ci.sh [--offline] [--wheel-dir DIR] [--out DIR] [--skip-build] [--quick] [--steps LIST]
#
# Options (each has an environment variable; the option wins):
#   --offline          FLASH_MLA_OFFLINE=1     install with --no-deps --no-index (no package index reachable)
#   --wheel-dir DIR    CUTLASS_WHEEL_DIR=DIR   first install the carried nvidia_cutlass-*.whl from DIR (no deps);
#                                              implies --offline
#   --out DIR          OUT_DIR=DIR             logs: one per step plus summary.txt (default: ci-logs)
#   --skip-build       FLASH_MLA_CI_SKIP_BUILD=1  keep the installed build (the Docker image was built with it)
#   --quick            FLASH_MLA_CI_QUICK=1    the reference sweep's --quick rows instead of the full sweep
#   --steps LIST       FLASH_MLA_CI_STEPS=LIST comma-separated subset of the steps below, in their order
# Other environment:
#   PYTHON             the interpreter that has the CUDA PyTorch (default: python3); always used as
#                      "$PYTHON -m pip" and "$PYTHON -m pytest"
#   BENCH_CMD          the benchmark command line, split on spaces (default: benchmarks/bench_flash_mla.py --quick
#                      when that script has --quick, else benchmarks/bench_backends.py --quick; see pick_bench)
#   MAX_JOBS           parallel nvcc jobs of the build (default: the CPU count, at most 8)
#
# Steps: env build extension gpu pytest sweep main bench. The first four are gates: when one fails the rest are
# skipped. The others all run, and the script exits 1 if any step failed. Each step prints one PASS/FAIL/SKIP
# banner; summary.txt gets one line per step (status, seconds, log) as the step ends, so a run cut short still
# leaves the lines of the steps it finished. The pytest step is judged by scripts/ci_pytest_gate.py: it fails on
# failed tests or errors, on a run that passed no test, and on tests skipped for lack of a GPU, the extension, a
# Hopper GPU, nvcc, CUTLASS or Triton; not on the tests meant to skip on a GPU host with the extension.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

ALL_STEPS="env,build,extension,gpu,pytest,sweep,main,bench"
GATES=" env build extension gpu "

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --offline) FLASH_MLA_OFFLINE=1 ;;
        --wheel-dir) CUTLASS_WHEEL_DIR="${2:?--wheel-dir needs a folder}"; shift ;;
        --wheel-dir=*) CUTLASS_WHEEL_DIR="${1#*=}" ;;
        --out) OUT_DIR="${2:?--out needs a folder}"; shift ;;
        --out=*) OUT_DIR="${1#*=}" ;;
        --skip-build) FLASH_MLA_CI_SKIP_BUILD=1 ;;
        --quick) FLASH_MLA_CI_QUICK=1 ;;
        --steps) FLASH_MLA_CI_STEPS="${2:?--steps needs a list}"; shift ;;
        --steps=*) FLASH_MLA_CI_STEPS="${1#*=}" ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_ci: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
    shift
done

PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT_DIR:-ci-logs}"
CUTLASS_WHEEL_DIR="${CUTLASS_WHEEL_DIR:-}"
FLASH_MLA_OFFLINE="${FLASH_MLA_OFFLINE:-0}"
[[ -n "$CUTLASS_WHEEL_DIR" ]] && FLASH_MLA_OFFLINE=1
FLASH_MLA_CI_SKIP_BUILD="${FLASH_MLA_CI_SKIP_BUILD:-0}"
FLASH_MLA_CI_QUICK="${FLASH_MLA_CI_QUICK:-0}"
STEPS=",${FLASH_MLA_CI_STEPS:-$ALL_STEPS},"

for step in ${STEPS//,/ }; do
    if [[ ",$ALL_STEPS," != *",$step,"* ]]; then
        echo "gpu_ci: unknown step '$step' (steps: $ALL_STEPS)" >&2
        exit 2
    fi
done

if ! command -v "$PYTHON" >/dev/null 2>&1; then
    echo "gpu_ci: PYTHON=$PYTHON is not an executable on PATH" >&2
    exit 2
fi

# Parallel nvcc jobs for PyTorch's ninja build.
if [[ -z "${MAX_JOBS:-}" ]]; then
    MAX_JOBS="$(nproc 2>/dev/null || echo 4)"
    (( MAX_JOBS > 8 )) && MAX_JOBS=8
fi
export MAX_JOBS
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
export PYTHONUNBUFFERED=1
# GPU CI tests the automatic backend choice: a forced backend would hide a missing cuda backend.
unset FLASH_MLA_BACKEND
# Dockerfile/shell linting is the CPU CI's job (.ci/run); tests/test_docker.py may skip it here.
export FLASH_MLA_LINTERS_OPTIONAL="${FLASH_MLA_LINTERS_OPTIONAL:-1}"

mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
SUMMARY="$OUT_DIR/summary.txt"
{
    echo "# flash_mla GPU CI  $(date -u +%Y-%m-%dT%H:%M:%SZ)  $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')"
    printf '%-10s %-6s %8s  %s\n' step status seconds log
} >"$SUMMARY"

# ------------------------------------------------------------------------------------------------------------
# the benchmark: the quick mode of benchmarks/bench_flash_mla.py when there is one, else bench_backends.py's
# ------------------------------------------------------------------------------------------------------------
BENCH=()
pick_bench() {
    if [[ -n "${BENCH_CMD:-}" ]]; then
        read -r -a BENCH <<<"$BENCH_CMD"
    elif [[ -f benchmarks/bench_flash_mla.py ]] && grep -q -- '"--quick"' benchmarks/bench_flash_mla.py; then
        BENCH=("$PYTHON" benchmarks/bench_flash_mla.py --quick)
        # its CSV and plots go with the logs
        if grep -q -- '"--out-dir"' benchmarks/bench_flash_mla.py; then
            BENCH+=(--out-dir "$OUT_DIR/bench")
        fi
    else
        BENCH=("$PYTHON" benchmarks/bench_backends.py --quick --csv "$OUT_DIR/bench_backends.csv")
    fi
}
pick_bench

# ------------------------------------------------------------------------------------------------------------
# step runner
# ------------------------------------------------------------------------------------------------------------
STEP_NO=0
FAILED=()
GATE_FAILED=""

banner() {  # banner STATUS STEP SECONDS DETAIL
    printf '==== %-4s %-10s %5ss  %s\n' "$1" "$2" "$3" "$4"
}

record() {  # record STEP STATUS SECONDS LOG
    printf '%-10s %-6s %8s  %s\n' "$1" "$2" "$3" "$4" >>"$SUMMARY"
}

# run_step NAME CHECK -- COMMAND...: COMMAND's output goes to the console and to the step's log; the step passes
# when COMMAND exits 0 and CHECK (a function given the log path and COMMAND's exit status, or "-" for none) prints
# nothing. CHECK runs whatever the exit status, so that its message also explains a failed COMMAND.
run_step() {
    local name="$1" check="$2"
    shift 3
    STEP_NO=$((STEP_NO + 1))
    local log
    log="$OUT_DIR/$(printf '%02d' "$STEP_NO")-$name.log"
    if [[ "$STEPS" != *",$name,"* ]]; then
        banner SKIP "$name" 0 "not in the selected steps"
        record "$name" SKIP 0 "-"
        return 0
    fi
    if [[ -n "$GATE_FAILED" ]]; then
        banner SKIP "$name" 0 "the $GATE_FAILED step failed"
        record "$name" SKIP 0 "-"
        return 0
    fi
    echo "---- $name: $*"
    local start rc=0 why=""
    start=$(date +%s)
    set +e
    (set -e; "$@") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    set -e
    local check_why=""
    if [[ "$check" != "-" ]]; then
        check_why="$("$check" "$log" "$rc")" || true
    fi
    if [[ $rc -ne 0 ]]; then
        why="exit status $rc${check_why:+: $check_why}"
    else
        why="$check_why"
    fi
    local seconds=$(( $(date +%s) - start ))
    if [[ -z "$why" ]]; then
        banner PASS "$name" "$seconds" "$log"
        record "$name" PASS "$seconds" "$log"
    else
        echo "$why" >>"$log"
        echo "---- last lines of $log:"
        tail -n 25 "$log"
        banner FAIL "$name" "$seconds" "$why"
        record "$name" FAIL "$seconds" "$log"
        FAILED+=("$name")
        if [[ "$GATES" == *" $name "* ]]; then
            GATE_FAILED="$name"
        fi
    fi
}

# ------------------------------------------------------------------------------------------------------------
# steps
# ------------------------------------------------------------------------------------------------------------
step_env() {
    echo "repo:      $ROOT ($(git rev-parse HEAD 2>/dev/null || echo 'not a git checkout'))"
    echo "python:    $(command -v "$PYTHON") ($("$PYTHON" --version 2>&1))"
    local nvcc="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
    command -v nvcc >/dev/null 2>&1 && nvcc="$(command -v nvcc)"
    if [[ -x "$nvcc" ]]; then
        echo "nvcc:      $nvcc: $("$nvcc" --version | tail -n 1)"
    else
        echo "nvcc:      not found (set CUDA_HOME or put nvcc on PATH)"
    fi
    echo "MAX_JOBS=$MAX_JOBS TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST offline=$FLASH_MLA_OFFLINE" \
         "skip_build=$FLASH_MLA_CI_SKIP_BUILD quick=$FLASH_MLA_CI_QUICK"
    echo "benchmark: ${BENCH[*]}"
    "$PYTHON" - <<'EOF'
import sys
try:
    import torch
except ImportError as e:
    sys.exit(f"PyTorch is not importable by {sys.executable}: {e} (set PYTHON to the interpreter that has it)")
print(f"torch:     {torch.__version__} (CUDA {torch.version.cuda}) at {torch.__file__}")
if torch.version.cuda is None:
    sys.exit(f"PyTorch {torch.__version__} is a CPU-only build: GPU CI needs a CUDA build of PyTorch")
EOF
}

check_build() {
    if grep -q "the CUDA extension was not built" "$1"; then
        echo "setup.py says $(grep -o "the CUDA extension was not built: [^;]*" "$1" | head -n 1)"
    fi
}

step_build() {
    if [[ "${FLASH_MLA_SKIP_CUDA_BUILD:-0}" == "1" ]]; then
        echo "FLASH_MLA_SKIP_CUDA_BUILD=1 would install flash_mla without its CUDA extension: unset it for GPU CI" >&2
        return 1
    fi
    if [[ "$FLASH_MLA_CI_SKIP_BUILD" == "1" ]]; then
        echo "FLASH_MLA_CI_SKIP_BUILD=1: keeping the installed build; the extension step checks it"
        return 0
    fi
    local pip_flags=(--no-build-isolation -v)
    if [[ "$FLASH_MLA_OFFLINE" == "1" ]]; then
        pip_flags+=(--no-deps --no-index)
        if [[ -n "$CUTLASS_WHEEL_DIR" ]]; then
            local wheels=("$CUTLASS_WHEEL_DIR"/nvidia_cutlass-*.whl)
            if [[ ! -f "${wheels[0]}" ]]; then
                echo "no nvidia_cutlass-*.whl in CUTLASS_WHEEL_DIR=$CUTLASS_WHEEL_DIR" >&2
                return 1
            fi
            "$PYTHON" -m pip install --no-deps --no-index "${wheels[@]}"
        fi
    fi
    "$PYTHON" -m pip install "${pip_flags[@]}" -e .
}

step_extension() {
    "$PYTHON" - <<'EOF'
import importlib
import os
import sys

import flash_mla

print(f"flash_mla {flash_mla.__version__} at {os.path.dirname(flash_mla.__file__)}")
try:
    ext = importlib.import_module("flash_mla._cuda")
except ImportError as e:
    note = os.path.join(os.path.dirname(flash_mla.__file__), "_build_note.txt")
    why = open(note).read().strip() if os.path.exists(note) else "no build note"
    sys.exit(f"FAIL: the CUDA extension flash_mla._cuda does not import: {e} ({why}). GPU CI must test the "
             "compiled kernels, not the Triton/CPU fallbacks: build it with nvcc and a CUDA PyTorch")
print(f"flash_mla._cuda: {ext.__file__}")
EOF
}

step_gpu() {
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L || { echo "nvidia-smi sees no GPU" >&2; return 1; }
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    else
        echo "nvidia-smi: not found (checking with PyTorch only)"
    fi
    "$PYTHON" - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("FAIL: torch.cuda.is_available() is False: no GPU is visible to PyTorch "
             "(driver, CUDA_VISIBLE_DEVICES, or `docker run --gpus all`)")
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}  {torch.cuda.get_device_name(i)}  sm_{''.join(map(str, torch.cuda.get_device_capability(i)))}")
if torch.cuda.get_device_capability(0) != (9, 0):
    sys.exit(f"FAIL: cuda:0 ({torch.cuda.get_device_name(0)}) is not a Hopper (sm_90) GPU: the cuda backend and "
             "its tests would be skipped")
EOF
}

# pytest: scripts/ci_pytest_gate.py reads the run's -rs output (tests/test_gpu_ci.py tests it on any machine). It
# fails on pytest's exit status, on failed tests or errors, on a run that passed no test, and on tests skipped for
# lack of the GPU stack: any skip reason that names a GPU, CUDA, Hopper, nvcc, CUTLASS or Triton, except the exact
# reasons of its EXPECTED_ON_GPU_HOST list (tests that skip *because* the GPU and the extension are here, such as
# test_compat.py's "needs a CUDA GPU without the CUDA extension"). Its report goes to the log and the console;
# its last line is the step's reason for failing.
check_pytest() {
    local report gate_rc=0
    report="$("$PYTHON" scripts/ci_pytest_gate.py --exit-code "$2" "$1" 2>&1)" || gate_rc=$?
    printf '%s\n' "$report" >>"$1"
    printf '%s\n' "$report" >&2
    if [[ $gate_rc -ne 0 ]]; then
        if [[ -n "$report" ]]; then
            tail -n 1 <<<"$report"
        else
            echo "scripts/ci_pytest_gate.py exited with status $gate_rc"
        fi
    fi
}

check_sweep() {
    if grep -q '^skipped:' "$1"; then
        echo "the reference sweep was skipped: $(grep '^skipped:' "$1" | head -n 1)"
    elif ! grep -q '^ALL ROWS PASSED' "$1"; then
        echo "the reference sweep did not print ALL ROWS PASSED"
    fi
}

check_main() {
    if ! grep -q 'backend: cuda ' "$1"; then
        echo "python -m flash_mla did not run the cuda backend: $(grep -m 1 'backend:' "$1" || echo 'no backend line')"
    elif ! grep -q '^check     PASS' "$1"; then
        echo "python -m flash_mla did not print check PASS"
    fi
}

SWEEP=("$PYTHON" tests/test_flash_mla.py)
[[ "$FLASH_MLA_CI_QUICK" == "1" ]] && SWEEP+=(--quick)

run_step env - -- step_env
run_step build check_build -- step_build
run_step extension - -- step_extension
run_step gpu - -- step_gpu
run_step pytest check_pytest -- "$PYTHON" -m pytest -q -rs
run_step sweep check_sweep -- "${SWEEP[@]}"
run_step main check_main -- "$PYTHON" -m flash_mla
run_step bench - -- "${BENCH[@]}"

echo
echo "==== summary ($SUMMARY)"
cat "$SUMMARY"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "gpu_ci: FAILED: ${FAILED[*]}" | tee -a "$SUMMARY"
    exit 1
fi
echo "gpu_ci: all selected steps passed" | tee -a "$SUMMARY"
