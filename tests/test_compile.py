"""Compile check of the Hopper kernels on any machine with nvcc (no GPU needed).

Every csrc/kernels/*.cu is compiled for sm_90a with the flags setup.py uses; ptxas's register and spill report is
printed; the split-KV attention kernels (the transposed FP8 one too) must not spill, and the transposed kernel's SASS
must hold every WGMMA its source issues (with cuobjdump). The host-side shared-memory layout check
(csrc/checks/smem_layout_check.cu) is compiled and run. Skips when nvcc is absent.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = sorted((ROOT / "csrc" / "kernels").glob("*.cu"))
sys.path.insert(0, str(ROOT))

from flash_mla.testing import find_nvcc  # noqa: E402 (after the sys.path insert)

sys.path.insert(0, str(ROOT / "benchmarks"))
import sass_diff  # noqa: E402 (after the sys.path insert)

NVCC = find_nvcc()
CUOBJDUMP = sass_diff.find_tool("CUOBJDUMP", "cuobjdump")
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


def cutlass_include() -> str:
    sub = ROOT / "third_party" / "cutlass" / "include"
    if (sub / "cute" / "tensor.hpp").exists():
        return str(sub)
    cutlass_library = pytest.importorskip("cutlass_library", reason="CUTLASS headers: pip install nvidia-cutlass")
    return str(Path(cutlass_library.__file__).parent / "source" / "include")


def cuda_include_cccl() -> str:
    # CUDA 13 keeps libcu++ (which CUTLASS includes) under include/cccl
    return str(Path(NVCC).resolve().parents[1] / "include" / "cccl")


def _flags():
    # -DCUTLASS_ENABLE_GDC_FOR_SM90 as in setup.py: without it the split kernel's PDL trigger compiles to nothing.
    return ["-std=c++17", "-O3", "-DNDEBUG", "--use_fast_math", "--expt-relaxed-constexpr",
            "-DCUTLASS_ENABLE_GDC_FOR_SM90",
            f"-I{cutlass_include()}", f"-I{ROOT / 'csrc' / 'kernels'}", f"-I{cuda_include_cccl()}"]


def compile_kernel(cu: Path, out_dir: Path):
    cmd = [NVCC, *_flags(), "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-c", str(cu),
           "-o", str(out_dir / (cu.stem + ".o"))]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return cu, proc


def parse_ptxas(log: str):
    """[(kernel, registers, spill_store_bytes, spill_load_bytes)] from ptxas -v output."""
    rows, current, spills = [], None, (0, 0)
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spills = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            rows.append((current, int(m.group(1)), *spills))
            current = None
    return rows


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("kernels")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return list(pool.map(lambda cu: compile_kernel(cu, out_dir), KERNELS))


def test_every_kernel_compiles_for_sm90a(compiled):
    assert KERNELS, "no kernels found under csrc/kernels"
    for cu, proc in compiled:
        assert proc.returncode == 0, f"{cu.name} failed to compile:\n{proc.stderr[-4000:]}"
        for name, regs, st, ld in parse_ptxas(proc.stderr):
            print(f"{cu.name}: {name[:70]}: {regs} registers, {st} B spill stores, {ld} B spill loads")


@pytest.mark.parametrize("kernel", ["mla_splitkv_kernel", "mla_splitkv_fp8_transposed_kernel", "mla_combine_kernel"],
                         ids=["splitkv", "transposed", "combine"])
def test_attention_kernels_do_not_spill(compiled, kernel):
    """Every instantiation: split-KV bf16, fp16, fp8 cache (16-bit q, e4m3 q) and sparse fp8 cache; the transposed
    FP8 kernel (e4m3 q and a 16-bit q, each at 16 and 32 rows: a split-KV kernel whose name does not contain
    mla_splitkv_kernel); combine bf16 and fp16."""
    expected = {"mla_splitkv_kernel": 5, "mla_splitkv_fp8_transposed_kernel": 4, "mla_combine_kernel": 2}[kernel]
    found = 0
    for _, proc in compiled:
        for name, regs, stores, loads in parse_ptxas(proc.stderr):
            if kernel in name:
                found += 1
                assert stores == 0 and loads == 0, (f"{name}: {stores} B spill stores, {loads} B spill loads "
                                                    f"({regs} registers)")
    assert found == expected, f"expected {expected} {kernel} instantiations in the ptxas report, found {found}"


@pytest.mark.skipif(CUOBJDUMP is None, reason="cuobjdump (CUDA toolkit) not found")
def test_transposed_fp8_kernel_keeps_every_wgmma(compiled):
    """ptxas has left S^T WGMMAs out of the SASS while their PTX was there (14 of 18 with a conditional first
    assignment of the sum, 20 of 36 with one accumulator shared by two S tiles; 2026-11-29), silently: each
    instantiation must issue S^T's 18 e4m3 WGMMAs a page and S tile (K steps of 32: 4 + 4 + 4 + 4 + 2 over the five
    units; a 16-bit q at 32 rows has two S tiles) and O^T's 64 (4 key blocks x 8 dim blocks, in the partial-page and
    full-page forms)."""
    objects = [proc.args[proc.args.index("-o") + 1] for cu, proc in compiled if cu.name == "splitkv_fp8_transposed.cu"]
    assert len(objects) == 1 and Path(objects[0]).exists(), "splitkv_fp8_transposed.cu was not compiled"
    sass = subprocess.run([CUOBJDUMP, "-sass", objects[0]], capture_output=True, text=True)
    assert sass.returncode == 0, sass.stderr[-2000:]
    counts, current = {}, None
    for line in sass.stdout.splitlines():
        m = re.search(r"Function\s*:\s*(\S+)", line)
        if m:
            current = counts.setdefault(m.group(1), {"S": 0, "O": 0})
        elif current is not None and re.search(r"\bQGMMA\.64x\d+x32\.F32\.E4M3\.E4M3\b", line):
            current["S"] += 1
        elif current is not None and re.search(r"\bHGMMA\.64x\d+x16\.F32\b", line):    # not ptxas's F16 dummy
            current["O"] += 1
    transposed = {name: c for name, c in counts.items() if "mla_splitkv_fp8_transposed_kernel" in name}
    assert len(transposed) == 4, f"expected 4 transposed kernel instantiations, found {sorted(counts)}"
    for name, c in transposed.items():
        rows, wide_q = (int(x) for x in re.search(r"ILi(\d+)ELb([01])E", name).groups())    # <kRows, kWideQ>
        s_tiles = 2 if wide_q and rows == 32 else 1
        assert c == {"S": 18 * s_tiles, "O": 64}, (f"{name}: {c['S']} S^T and {c['O']} O^T WGMMAs, expected "
                                                   f"{18 * s_tiles} and 64")


@pytest.mark.parametrize("program", sorted((ROOT / "benchmarks").glob("*.cu")), ids=lambda p: p.name)
def test_benchmark_programs_compile(program, tmp_path):
    """The stand-alone GPU programs under benchmarks/ (page streaming, instruction rates, WGMMA rates) compile for
    sm_90a with the command their headers give (those that include CuTe with its include paths, and the kernels'
    headers: wgmma_rates.cu times the FP8 widening's own code), so that a lent GPU's time is not spent on a build
    error."""
    cute = "#include <cute/" in program.read_text()
    extra = ["--expt-relaxed-constexpr", f"-I{cutlass_include()}", f"-I{cuda_include_cccl()}",
             f"-I{ROOT / 'csrc' / 'kernels'}"] if cute else []
    proc = subprocess.run([NVCC, "-O3", "-std=c++17", *extra, "-gencode", "arch=compute_90a,code=sm_90a", "-c",
                           str(program), "-o", str(tmp_path / (program.stem + ".o"))], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_programmatic_dependent_launch_is_compiled(tmp_path):
    """The combine kernel waits in griddepcontrol.wait, and the split kernel's trigger (CUTLASS's
    launch_dependent_grids, a no-op unless CUTLASS_ENABLE_GDC_FOR_SM90 is defined) really is an instruction under
    the flags setup.py builds with. A cheap probe stands in for the split kernel (its PTX takes a minute)."""
    assert "-DCUTLASS_ENABLE_GDC_FOR_SM90" in (ROOT / "setup.py").read_text()
    probe = tmp_path / "trigger_probe.cu"
    probe.write_text("#include <cutlass/arch/grid_dependency_control.h>\n"
                     "__global__ void probe() { cutlass::arch::launch_dependent_grids(); }\n")
    for src, instruction in ((probe, "griddepcontrol.launch_dependents"),
                             (ROOT / "csrc" / "kernels" / "combine.cu", "griddepcontrol.wait")):
        ptx = tmp_path / (src.stem + ".ptx")
        proc = subprocess.run([NVCC, *_flags(), "-gencode", "arch=compute_90a,code=sm_90a", "-ptx", str(src),
                               "-o", str(ptx)], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert instruction in ptx.read_text(), f"{src.name}: no {instruction} in the PTX"


def test_no_serialized_wgmma(compiled):
    # ptxas falls back to waiting for every WGMMA when it cannot prove an asynchronous pipeline safe (C7510 and
    # friends: "wgmma.mma_async instructions are serialized"); that would silently cost most of the overlap.
    for cu, proc in compiled:
        assert "instructions are serialized" not in proc.stderr, f"{cu.name}: {proc.stderr[-2000:]}"


def test_shared_memory_layout_facts(tmp_path):
    exe = tmp_path / "smem_layout_check"
    src = ROOT / "csrc" / "checks" / "smem_layout_check.cu"
    proc = subprocess.run([NVCC, *_flags(), "-O1", str(src), "-o", str(exe)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    print(run.stdout)
    assert run.returncode == 0 and "OK" in run.stdout, run.stdout + run.stderr


# The binding is host C++ against PyTorch's CUDA headers. A CPU build of PyTorch ships those headers but not the
# CUDA math libraries' headers they include (cuBLAS, cuSPARSE, cuSOLVER) nor c10's generated CUDA macro header, so
# the syntax check below supplies minimal stand-ins for the few declarations the headers need. It catches errors
# in csrc/flash_mla_api.cpp (which otherwise only compiles on a GPU machine) without generating code.
_STUB_HEADERS = {
    "cusparse.h": "typedef struct cusparseContext* cusparseHandle_t;\n"
                  "typedef enum { CUSPARSE_STATUS_SUCCESS = 0 } cusparseStatus_t;\n"
                  "const char* cusparseGetErrorString(cusparseStatus_t);\n",
    "cublas_v2.h": "typedef struct cublasContext* cublasHandle_t;\n"
                   "typedef enum { CUBLAS_STATUS_SUCCESS = 0 } cublasStatus_t;\n",
    "cublasLt.h": "typedef struct cublasLtContext* cublasLtHandle_t;\n",
    "cusolverDn.h": "typedef struct cusolverDnContext* cusolverDnHandle_t;\n",
    "cusolver_common.h": "typedef enum { CUSOLVER_STATUS_SUCCESS = 0 } cusolverStatus_t;\n",
    "c10/cuda/impl/cuda_cmake_macros.h": "",
}


def test_binding_compiles(tmp_path):
    import sysconfig

    torch_ext = pytest.importorskip("torch.utils.cpp_extension")
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    for name, text in _STUB_HEADERS.items():
        path = tmp_path / "stubs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#pragma once\n" + text)
    cuda_include = Path(os.environ.get("CUDA_HOME") or torch_ext.CUDA_HOME or "/usr/local/cuda") / "include"
    if not (cuda_include / "cuda_runtime_api.h").exists():
        pytest.skip(f"no CUDA runtime headers under {cuda_include}")
    includes = [f"-I{p}" for p in torch_ext.include_paths()]
    # Real headers first where they exist (a CUDA build of PyTorch, a full toolkit); the stand-ins only fill gaps.
    cmd = [cxx, "-std=c++17", "-fsyntax-only", *includes, f"-I{sysconfig.get_paths()['include']}",
           f"-I{cuda_include}", f"-I{tmp_path / 'stubs'}", f"-I{ROOT / 'csrc'}", "-DTORCH_EXTENSION_NAME=_cuda",
           str(ROOT / "csrc" / "flash_mla_api.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
