#!/usr/bin/env bash
# Run the flash_mla kernels under NVIDIA compute-sanitizer on a GPU machine (docs/HARDENING.md).
#
#   scripts/sanitize.sh [TOOL ...]        TOOL: memcheck racecheck synccheck initcheck (default: all four)
#
#   memcheck   tests/sanitizer_driver.py padded: padded batches (L = 0 rows, block tables of -1 / garbage, NaN q),
#              ragged lengths, split plans; cuda and triton backends (triton also sparse FP8 decoding); all kernels
#              checked; caching allocator off
#              (PYTORCH_NO_CUDA_MEMORY_CACHING=1) and 256 bytes of padding after every allocation, so a read
#              past any tensor is out of bounds
#   racecheck  tests/sanitizer_driver.py small (b = 2, L ~ 200, h_q 16/128, s_q 1/2; b = 1 in 43-64 pieces),
#              cuda backend, the flash_mla kernels only (shared-memory hazards)
#   synccheck  the same, barrier misuse
#   initcheck  the same, reads of uninitialised global memory (all kernels: writes by unchecked kernels would
#              not be seen); the driver compares lse only and never reads out, whose TMA stores initcheck does
#              not see
#
# Environment: PYTHON (default python3), OUT_DIR (logs, default sanitizer-logs), COMPUTE_SANITIZER (default
# $CUDA_HOME/bin/compute-sanitizer, else compute-sanitizer on PATH), SANITIZER_KERNELS (kernel filter of
# racecheck/synccheck, default kns=mla_: mla_metadata_kernel, mla_splitkv_kernel, mla_splitkv_fp8_transposed_kernel,
# mla_combine_kernel),
# MEMCHECK_BACKENDS (default cuda,triton).
# Prints one line per tool with its ERROR SUMMARY (and RACECHECK SUMMARY); exits 1 if any tool reported an
# error or the driver failed (wrong result, crash), 2 if compute-sanitizer is missing.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

PYTHON="${PYTHON:-python3}"
OUT_DIR="${OUT_DIR:-sanitizer-logs}"
SANITIZER_KERNELS="${SANITIZER_KERNELS:-kns=mla_}"
MEMCHECK_BACKENDS="${MEMCHECK_BACKENDS:-cuda,triton}"
if [[ -n "${COMPUTE_SANITIZER:-}" ]]; then
    SANITIZER="$COMPUTE_SANITIZER"
elif [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/compute-sanitizer" ]]; then
    SANITIZER="$CUDA_HOME/bin/compute-sanitizer"
elif [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
    SANITIZER=/usr/local/cuda/bin/compute-sanitizer
else
    SANITIZER="$(command -v compute-sanitizer || true)"
fi
if [[ -z "$SANITIZER" || ! -x "$SANITIZER" ]]; then
    echo "sanitize: compute-sanitizer not found (set COMPUTE_SANITIZER or CUDA_HOME)" >&2
    exit 2
fi

TOOLS=("$@")
if [[ ${#TOOLS[@]} -eq 0 ]]; then
    TOOLS=(memcheck racecheck synccheck initcheck)
fi

mkdir -p "$OUT_DIR"
echo "sanitizer: $SANITIZER ($("$SANITIZER" --version 2>/dev/null | grep -m1 -i version || echo 'version unknown'))"
echo "logs: $OUT_DIR/"
status=0

# run NAME TOOL [sanitizer options ...] -- DRIVER ARGS ...
run() {
    local name="$1" tool="$2"
    shift 2
    local opts=()
    while [[ $# -gt 0 && "$1" != "--" ]]; do
        opts+=("$1")
        shift
    done
    shift
    local log="$OUT_DIR/$name.log"
    local start=$SECONDS
    "$SANITIZER" --tool "$tool" --error-exitcode 99 --print-limit 100 ${opts[@]+"${opts[@]}"} \
        "$PYTHON" tests/sanitizer_driver.py "$@" >"$log" 2>&1
    local rc=$?
    local errors races driver verdict="ok"
    errors="$(grep -E 'ERROR SUMMARY: [0-9]+ error' "$log" | tail -n 1 | sed -E 's/^=+ *//')"
    races="$(grep -E 'RACECHECK SUMMARY' "$log" | tail -n 1 | sed -E 's/^=+ *//')"
    driver="$(grep -c '^DRIVER OK' "$log")"
    if [[ $rc -ne 0 ]]; then
        verdict="FAIL (exit $rc)"
    elif [[ "$driver" -eq 0 ]]; then
        verdict="FAIL (driver did not finish)"
    elif [[ -n "$errors" && ! "$errors" =~ ERROR\ SUMMARY:\ 0\ errors ]]; then
        verdict="FAIL"
    elif [[ -n "$races" && ! "$races" =~ \(0\ errors ]]; then
        verdict="FAIL"
    elif [[ -z "$errors" && -z "$races" ]]; then
        verdict="FAIL (no summary line)"
    fi
    [[ "$verdict" == ok ]] || status=1
    printf '%-10s %-34s %4ss  %s%s\n' "$name" "$verdict" "$((SECONDS - start))" \
        "${errors:-no ERROR SUMMARY line}" "${races:+; $races}"
}

for tool in "${TOOLS[@]}"; do
    case "$tool" in
        memcheck)
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 run memcheck memcheck --padding 256 --leak-check no \
                -- padded --backends "$MEMCHECK_BACKENDS" ;;
        racecheck)
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 run racecheck racecheck --kernel-name "$SANITIZER_KERNELS" \
                --racecheck-report all -- small --backends cuda ;;
        synccheck)
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 run synccheck synccheck --kernel-name "$SANITIZER_KERNELS" \
                -- small --backends cuda ;;
        initcheck)
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 run initcheck initcheck -- small --backends cuda --lse-only ;;
        *)
            echo "sanitize: unknown tool '$tool' (memcheck racecheck synccheck initcheck)" >&2
            status=1 ;;
    esac
done

if [[ $status -eq 0 ]]; then
    echo "sanitize: all clean"
else
    echo "sanitize: FAILED (see $OUT_DIR/*.log)"
fi
exit "$status"
