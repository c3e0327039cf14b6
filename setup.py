"""Build script. Metadata lives in pyproject.toml; this file only decides whether to build the CUDA extension.

The extension (flash_mla._cuda, Hopper sm_90a kernels) is built when PyTorch has CUDA and nvcc is found, unless
FLASH_MLA_SKIP_CUDA_BUILD=1. Otherwise the pure-Python package installs (CPU and Triton backends) and one line
says why. Install with:  pip install --no-build-isolation -e .
"""
import os
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def log(msg: str) -> None:
    print(f"flash_mla setup: {msg}", file=sys.stderr)


def cutlass_include() -> str:
    """third_party/cutlass/include when the submodule is checked out, else the nvidia-cutlass wheel's headers."""
    submodule = ROOT / "third_party" / "cutlass" / "include"
    if (submodule / "cute" / "tensor.hpp").exists():
        return str(submodule)
    try:
        import cutlass_library
    except ImportError:
        raise SystemExit("flash_mla setup: CUTLASS headers not found: check out the third_party/cutlass submodule "
                         "or `pip install nvidia-cutlass` first (the build runs without isolation)") from None
    return str(Path(cutlass_library.__file__).parent / "source" / "include")


def cuda_skip_reason():
    """None when the CUDA extension should be built, else why not."""
    if os.environ.get("FLASH_MLA_SKIP_CUDA_BUILD", "0") == "1":
        return "FLASH_MLA_SKIP_CUDA_BUILD=1"
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME
    except ImportError:
        return "PyTorch is not installed"
    if torch.version.cuda is None:
        return f"PyTorch {torch.__version__} is a CPU-only build"
    if CUDA_HOME is None or not (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return "nvcc was not found (set CUDA_HOME)"
    return None


BUILD_NOTE = ROOT / "flash_mla" / "_build_note.txt"   # read by flash_mla.backends to explain a missing extension


def extensions():
    reason = cuda_skip_reason()
    if reason is not None:
        note = f"the CUDA extension was not built: {reason}"
        log(f"{note}; installing the pure-Python package (CPU and Triton backends)")
        BUILD_NOTE.write_text(note + "\n")
        return [], {}
    BUILD_NOTE.unlink(missing_ok=True)
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension, CUDA_HOME

    kernels = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "kernels").glob("*.cu"))
    nvcc_flags = [
        "-O3", "-std=c++17", "-DNDEBUG", "-lineinfo", "--use_fast_math", "--expt-relaxed-constexpr",
        "-gencode", "arch=compute_90a,code=sm_90a",
        # cutlass::arch::launch_dependent_grids() (the split kernel's PDL trigger) compiles to nothing without it.
        "-DCUTLASS_ENABLE_GDC_FOR_SM90",
        # PyTorch disables the CUDA half/bf16 operators by default; CUTLASS's numeric types need them.
        "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ]
    cxx_flags = ["-O3", "-std=c++17"]
    # A build meant to be timed beside others in one process names its symbols apart (csrc/kernels/variant.h).
    variant = os.environ.get("FLASH_MLA_VARIANT", "")
    if variant:
        if not variant.isidentifier():
            raise SystemExit(f"FLASH_MLA_VARIANT: expected a C++ identifier, got {variant!r}")
        nvcc_flags.append(f"-DFLASH_MLA_VARIANT={variant}")
        cxx_flags.append(f"-DFLASH_MLA_VARIANT={variant}")
    include_dirs = [str(ROOT / "csrc"), str(ROOT / "csrc" / "kernels"), cutlass_include(),
                    str(Path(CUDA_HOME) / "include" / "cccl")]
    log(f"building the CUDA extension for sm_90a ({len(kernels)} kernel files)")
    ext = CUDAExtension(
        name="flash_mla._cuda",
        sources=["csrc/flash_mla_api.cpp"] + kernels,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
