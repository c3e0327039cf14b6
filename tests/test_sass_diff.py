"""benchmarks/sass_diff.py on the CPU: its SASS and ptxas parsers on captured text, the count diff, and, where nvcc
and cuobjdump are both found, a tiny kernel compiled and disassembled end to end."""
import collections
import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import sass_diff  # noqa: E402 (after the sys.path insert)

# Shaped as `cuobjdump -sass` prints it (encodings and blank lines included), two functions.
SASS = textwrap.dedent("""\

        code for sm_90a
                Function : _Z6kernelPf
        .headerflags    @"EF_CUDA_TEXMODE_UNIFIED EF_CUDA_64BIT_ADDRESS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
                /*0000*/                   LDC R1, c[0x0][0x28] ;                             /* 0x00000a00ff017b82 */
                                                                                              /* 0x000fe40000000800 */
                /*0010*/                   F2FP.F16.E4M3.UNPACK_B R186, R189 ;                /* 0x000000bdffba723e */
                /*0020*/                   F2FP.F16.E4M3.UNPACK_B R187, R189.H1 ;             /* 0x000000bdffbb723e */
                /*0030*/               @P0 BRA 0x40f0 ;                                       /* 0x0000000000000947 */
                /*0040*/              @!P1 SEL R2, R3, RZ, P2 ;                               /* 0x000000ff03027207 */
                /*0050*/                   EXIT ;                                             /* 0x000000000000794d */
                ..........

                Function : _Z5otherv
                /*0000*/                   EXIT ;                                             /* 0x000000000000794d */
        """)

PTXAS = textwrap.dedent("""\
    ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90a'
    ptxas info    : Function properties for _Z6kernelPf
        8 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
    ptxas info    : Used 255 registers, used 16 barriers, 8 bytes cumulative stack size
    ptxas info    : Compiling entry function '_Z5otherv' for 'sm_90a'
    ptxas info    : Function properties for _Z5otherv
        0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
    ptxas info    : Used 4 registers
    """)


def test_parse_sass_counts_opcodes_per_function():
    kernels = sass_diff.parse_sass(SASS)
    assert kernels == {"_Z6kernelPf": collections.Counter({"LDC": 1, "F2FP": 2, "BRA": 1, "SEL": 1, "EXIT": 1}),
                       "_Z5otherv": collections.Counter({"EXIT": 1})}
    with_modifiers = sass_diff.parse_sass(SASS, modifiers=True)["_Z6kernelPf"]
    assert with_modifiers["F2FP.F16.E4M3.UNPACK_B"] == 2 and with_modifiers["BRA"] == 1


def test_parse_ptxas_registers_and_spills():
    assert sass_diff.parse_ptxas(PTXAS) == {"_Z6kernelPf": (255, 12, 8), "_Z5otherv": (4, 0, 0)}


def test_count_diff_lists_changes_largest_first():
    base = collections.Counter({"SEL": 155, "STS": 74, "F2FP": 256, "NOP": 42})
    new = collections.Counter({"SEL": 27, "STS": 138, "F2FP": 256, "MOV": 11})
    assert sass_diff.count_diff(base, new) == [("SEL", 155, 27), ("STS", 74, 138), ("NOP", 42, 0), ("MOV", 0, 11)]
    assert sass_diff.count_diff(base, base) == []


def test_report_prints_both_builds(capsys):
    base = {"k": collections.Counter({"SEL": 2, "F2FP": 8})}
    new = {"k": collections.Counter({"F2FP": 8})}
    sass_diff.report("x.cu", base, new, {"k": (255, 12, 8)}, {"k": (255, 0, 0)})
    out = capsys.readouterr().out
    assert "instructions 10 -> 8" in out and "spills 12/8 bytes -> 255 registers, spills 0/0 bytes" in out
    assert "SEL" in out and "(-2)" in out and "F2FP" not in out


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="nvcc not found")
@pytest.mark.skipif(sass_diff.find_tool("CUOBJDUMP", "cuobjdump") is None,
                    reason="cuobjdump (CUDA toolkit) not found")
def test_end_to_end_on_a_tiny_kernel(tmp_path, capsys):
    pytest.importorskip("cutlass_library", reason="CUTLASS headers: pip install nvidia-cutlass")
    for name, body in (("base", "out[threadIdx.x] = in[threadIdx.x] * 2.f;"),
                       ("new", "out[threadIdx.x] = in[threadIdx.x] * 2.f + in[threadIdx.x + 1];")):
        kernels = tmp_path / name / "csrc" / "kernels"
        kernels.mkdir(parents=True)
        (kernels / "k.cu").write_text(f"__global__ void k(const float* in, float* out) {{ {body} }}\n")
    cubins = []
    for name in ("base", "new"):
        cubin, log = sass_diff.compile_cubin(tmp_path / name, "csrc/kernels/k.cu", tmp_path / name)
        assert sass_diff.parse_ptxas(log)["_Z1kPKfPf"][1:] == (0, 0)
        cubins.append(str(cubin))
    assert sass_diff.main(["--cubins", *cubins]) == 0
    out = capsys.readouterr().out
    assert "_Z1kPKfPf" in out
    assert any(line.split()[0] == "LDG" and line.endswith("(+1)") for line in out.splitlines()[2:]), out


# Shaped as `nvdisasm --print-line-info` prints it: a function of two setmaxnreg roles, an out-of-line wait loop.
LINES = textwrap.dedent("""\
    //--------------------- .text._Z1kv --------------------------
    \t.section\t.text._Z1kv,"ax",@progbits
    .text._Z1kv:
    \t//## File "/src/kernel.h", line 10
            /*0000*/                   LDC R1, c[0x0][0x28] ;
            /*0010*/                   S2R R0, SR_TID.X ;
    \t//## File "/src/kernel.h", line 20
            /*0020*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0 ;
    \t//## File "/src/epilogue.h", line 85
            /*0030*/              @!P0 STG.E desc[UR4][R2.64], R4 ;
            /*0040*/                   STG.E desc[UR4][R2.64+0x4], R5 ;
            /*0050*/                   EXIT ;
    .L_x_1:
    \t//## File "/src/kernel.h", line 30
            /*0060*/                   USETMAXREG.DEALLOC.CTAPOOL 0x40 ;
    \t//## File "/src/gather.h", line 7
            /*0070*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R6.64] ;
            /*0080*/                   EXIT ;
    .L_x_2:
    \t//## File "/src/barrier.h", line 424
            /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R2], R3 ;
            /*00a0*/              @!P0 BRA `(.L_x_2) ;
    """)


def test_parse_lines_splits_roles_and_counts_source_lines():
    functions = sass_diff.parse_lines(LINES)
    assert list(functions) == ["_Z1kv"]
    regions = functions["_Z1kv"]
    assert [name for name, _ in regions] == ["setup", "role of 240 registers", "role of 64 registers",
                                             "after the last EXIT"]
    setup, big, small, tail = (counts for _, counts in regions)
    assert setup == collections.Counter({("/src/kernel.h", 10): 2})
    assert big == collections.Counter({("/src/kernel.h", 20): 1, ("/src/epilogue.h", 85): 3})
    assert small == collections.Counter({("/src/kernel.h", 30): 1, ("/src/gather.h", 7): 2})
    assert tail == collections.Counter({("/src/barrier.h", 424): 2})


def test_report_lines_prints_regions_files_and_top_lines(capsys, tmp_path):
    src = tmp_path / "epilogue.h"
    src.write_text("\n" * 84 + "    store(x);\n")
    functions = {"_Z1kv": [("role of 240 registers",
                            collections.Counter({(str(src), 85): 3, ("/elsewhere/barrier.h", 424): 1}))]}
    sass_diff.report_lines("k.cu", functions, top=1, root=tmp_path)
    out = capsys.readouterr().out
    assert "role of 240 registers: 4 instructions; epilogue.h 3, barrier.h 1" in out
    listed = [line.split()[1] for line in out.splitlines() if line.startswith("    ")]
    assert listed == ["epilogue.h:85"] and "3  epilogue.h:85  store(x);" in out    # top=1: the largest line only


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="nvcc not found")
@pytest.mark.skipif(sass_diff.find_nvdisasm() is None, reason="nvdisasm (CUDA toolkit) not found")
def test_lines_end_to_end_on_a_tiny_kernel(tmp_path):
    pytest.importorskip("cutlass_library", reason="CUTLASS headers: pip install nvidia-cutlass")
    kernels = tmp_path / "csrc" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "k.cu").write_text("__global__ void k(const float* in, float* out) {\n"
                                  "  out[threadIdx.x] = in[threadIdx.x] * 2.f;\n}\n")
    cubin, _ = sass_diff.compile_cubin(tmp_path, "csrc/kernels/k.cu", tmp_path, lineinfo=True)
    regions = sass_diff.parse_lines(sass_diff.disassemble_lines(cubin))["_Z1kPKfPf"]
    assert regions[0][0] == "setup"
    assert any(path.endswith("k.cu") and line == 2 for _, counts in regions for path, line in counts)
