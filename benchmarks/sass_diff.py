"""Opcode counts of our own Hopper kernels' SASS, one build against another, on any machine with nvcc (no GPU).

    python3 benchmarks/sass_diff.py csrc/kernels/splitkv_fp8_e4m3_scores.cu              # this tree's kernels
    python3 benchmarks/sass_diff.py --base /tmp/main csrc/kernels/splitkv_fp8_e4m3_scores.cu   # against a tree
    python3 benchmarks/sass_diff.py --cubins a.cubin b.cubin                              # two cubins
    python3 benchmarks/sass_diff.py --lines csrc/kernels/splitkv_sparse.cu                # where the code is

Each .cu file is compiled to a cubin for sm_90a with the flags setup.py builds with (ptxas -v: registers and
spills), in this tree and, with --base, in another checkout; `cuobjdump -sass` disassembles it (from the CUDA
toolkit, from Triton's wheel, which ships it and nvdisasm, or from the nvidia-cuda-cuobjdump wheel: set CUOBJDUMP to
its bin/cuobjdump). One block per kernel function: instructions, registers, spills, and every opcode whose count
differs (opcodes without their modifiers, `--modifiers` keeps them); one build alone prints its counts. The counts
are static: an instruction inside the pair loop weighs its trip count at run time, so read the diff next to the
change (the FP8 widening's selects, shifts and branches were found this way: docs/PERF.md, "FP8 cache"). Only for
our own kernels: the anchors are never disassembled.

--lines compiles with -lineinfo and disassembles with `nvdisasm --print-line-info` (NVDISASM, or beside cuobjdump):
per kernel function and warpgroup role (the code split at each setmaxnreg, as benchmarks/ncu_roles.py splits
ncu's counters; the code after the last EXIT apart: out-of-line wait loops and divergence fallbacks), the static
instruction count by source file and the source lines with the most instructions. Code size is worth watching:
the sparse kernel measured slower by 4-5 % when its epilogue grew it from 7,752 to 13,304 instructions, and faster
by 0.5 % when 448 dead ones went (docs/PERF.md, "What was tried").
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# "        /*3fc0*/                   F2FP.F16.E4M3.UNPACK_B R186, R189 ;" (a guard predicate may precede the opcode)
_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_FUNCTION = re.compile(r"\s*Function\s*:\s*(\S+)")


def parse_sass(text: str, modifiers: bool = False) -> dict[str, collections.Counter]:
    """{kernel function: Counter(opcode)} from `cuobjdump -sass` output."""
    kernels: dict[str, collections.Counter] = {}
    current = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = kernels.setdefault(m.group(1), collections.Counter())
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            current[m.group(1) if modifiers else m.group(1).split(".")[0]] += 1
    return kernels


def parse_ptxas(log: str) -> dict[str, tuple[int, int, int]]:
    """{kernel function: (registers, spill store bytes, spill load bytes)} from ptxas -v output."""
    out, current, spills = {}, None, (0, 0)
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current, spills = m.group(1), (0, 0)
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spills = (int(m.group(1)), int(m.group(2)))
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            out[current] = (int(m.group(1)), *spills)
    return out


def count_diff(base: collections.Counter, new: collections.Counter) -> list[tuple[str, int, int]]:
    """[(opcode, base count, new count)] for every opcode whose count differs, largest change first."""
    rows = [(op, base[op], new[op]) for op in set(base) | set(new) if base[op] != new[op]]
    return sorted(rows, key=lambda r: (-abs(r[2] - r[1]), r[0]))


def _bundled_with_triton(name: str) -> str | None:
    """Triton's wheel ships cuobjdump and nvdisasm (triton/backends/nvidia/bin): a CUDA toolkit without them (nvcc
    alone) then needs no download."""
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else None


def _first_existing(*candidates: str | None) -> str | None:
    return next((c for c in candidates if c and Path(c).exists()), None)


def find_tool(env: str, name: str) -> str | None:
    """A CUDA tool (`name`) from the environment variable `env`, PATH, /usr/local/cuda/bin or Triton's wheel."""
    return _first_existing(os.environ.get(env), shutil.which(name), f"/usr/local/cuda/bin/{name}",
                           _bundled_with_triton(name))


def _tool(env: str, name: str, hint: str) -> str:
    found = find_tool(env, name)
    if found is None:
        raise SystemExit(f"sass_diff: {name} not found: set {env}{hint}")
    return found


def _cutlass_include(tree: Path) -> str:
    sub = tree / "third_party" / "cutlass" / "include"
    if (sub / "cute" / "tensor.hpp").exists():
        return str(sub)
    import cutlass_library
    return str(Path(cutlass_library.__file__).parent / "source" / "include")


def compile_cubin(tree: Path, kernel: str, out: Path, lineinfo: bool = False) -> tuple[Path, str]:
    """The cubin of `kernel` (a path relative to the tree) and ptxas's -v report, with setup.py's flags (and
    -lineinfo, which setup.py also passes, when `lineinfo`: it does not change the code)."""
    nvcc = _tool("NVCC", "nvcc", "")
    cccl = Path(nvcc).resolve().parents[1] / "include" / "cccl"
    cubin = out / (Path(kernel).stem + ".cubin")
    cmd = [nvcc, "-std=c++17", "-O3", "-DNDEBUG", "--use_fast_math", "--expt-relaxed-constexpr",
           "-DCUTLASS_ENABLE_GDC_FOR_SM90", f"-I{_cutlass_include(tree)}", f"-I{tree / 'csrc' / 'kernels'}",
           f"-I{cccl}", "-gencode", "arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-cubin",
           *(["-lineinfo"] if lineinfo else []), str(tree / kernel), "-o", str(cubin)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"sass_diff: {tree / kernel} did not compile:\n{proc.stderr[-3000:]}")
    return cubin, proc.stderr


def disassemble(cubin: Path) -> str:
    cuobjdump = _tool("CUOBJDUMP", "cuobjdump",
                      " (pip download --no-deps nvidia-cuda-cuobjdump; unzip; nvidia/cu13/bin/cuobjdump)")
    proc = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"sass_diff: cuobjdump failed on {cubin}:\n{proc.stderr[-2000:]}")
    return proc.stdout


# nvdisasm --print-line-info: `//## File "/path/x.h", line 85` before the instructions it covers (innermost
# source line; no inlining chain), `.text.<function>:` at each function, instructions as cuobjdump prints them.
_LINE = re.compile(r'\s*//## File "(.*)", line (\d+)')
_TEXT = re.compile(r"^\.text\.(\S+):$")
_SETMAXNREG = re.compile(r"USETMAXREG\S*\s+(?:\S+,\s*)?(0x[0-9a-f]+|\d+)")


def parse_lines(text: str) -> dict[str, list[tuple[str, collections.Counter]]]:
    """{kernel function: [(region, Counter((file, line)))]}: the setup, one region per setmaxnreg (named by its
    register count) and the code after the function's last EXIT, in address order; instructions before any line
    annotation count under ("?", 0)."""
    functions: dict[str, list[tuple[int, str, tuple[str, int]]]] = {}
    current, where = None, ("?", 0)
    for line in text.splitlines():
        m = _TEXT.match(line)
        if m:
            current, where = functions.setdefault(m.group(1), []), ("?", 0)
            continue
        m = _LINE.match(line)
        if m:
            where = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m and current is not None and _INSTRUCTION.match(line):
            current.append((int(m.group(1), 16), m.group(2), where))
    out = {}
    for fn, instructions in functions.items():
        exits = [a for a, src, _ in instructions if re.match(r"(@!?U?P\w+\s+)?EXIT\b", src)]
        tail = exits[-1] if exits else None
        regions, name = [], "setup"
        counts: collections.Counter = collections.Counter()
        for address, src, where in instructions:
            m = _SETMAXNREG.search(src)
            after_tail = tail is not None and address > tail
            if (m and not after_tail) or (after_tail and name != "after the last EXIT"):
                regions.append((name, counts))
                counts = collections.Counter()
                name = "after the last EXIT" if after_tail else f"role of {int(m.group(1), 0)} registers"
            counts[where] += 1
        regions.append((name, counts))
        out[fn] = [(n, c) for n, c in regions if c]
    return out


def find_nvdisasm() -> str | None:
    """nvdisasm: NVDISASM, PATH, the one beside CUOBJDUMP (the nvidia-cuda-cuobjdump wheel ships both),
    /usr/local/cuda/bin or Triton's wheel."""
    beside = Path(os.environ.get("CUOBJDUMP", "/usr/local/cuda/bin/cuobjdump")).with_name("nvdisasm")
    return _first_existing(os.environ.get("NVDISASM"), shutil.which("nvdisasm"), str(beside),
                           _bundled_with_triton("nvdisasm"))


def disassemble_lines(cubin: Path) -> str:
    """`nvdisasm --print-line-info` of a cubin (find_nvdisasm)."""
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        raise SystemExit("sass_diff: nvdisasm not found: set NVDISASM (it ships beside cuobjdump)")
    proc = subprocess.run([nvdisasm, "--print-line-info", str(cubin)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"sass_diff: nvdisasm failed on {cubin}:\n{proc.stderr[-2000:]}")
    return proc.stdout


def report_lines(label: str, functions: dict, top: int, root: Path = ROOT) -> None:
    """Per function and region: instructions, the files they come from, the `top` source lines with the most."""
    sources: dict[str, list[str]] = {}

    def source(path: str, number: int) -> str:
        if path not in sources:
            try:
                sources[path] = Path(path).read_text().splitlines()
            except OSError:
                sources[path] = []
        lines = sources[path]
        return lines[number - 1].strip()[:80] if 0 < number <= len(lines) else ""

    def short(path: str) -> str:
        try:
            return str(Path(path).resolve().relative_to(root))
        except ValueError:
            return Path(path).name
    print(f"== {label}")
    for fn, regions in functions.items():
        print(fn)
        for name, counts in regions:
            files: collections.Counter = collections.Counter()
            for (path, _), count in counts.items():
                files[short(path)] += count
            print(f"  {name}: {sum(counts.values())} instructions; " +
                  ", ".join(f"{f} {c}" for f, c in files.most_common(6)))
            for (path, number), count in counts.most_common(top):
                print(f"    {count:5d}  {short(path)}:{number}  {source(path, number)}")


def _regs(table: dict, fn: str) -> str:
    return "{} registers, spills {}/{} bytes".format(*table[fn]) if fn in table else "registers ?"


def report(label: str, base: dict, new: dict, base_regs: dict, new_regs: dict) -> None:
    print(f"== {label}")
    for fn in sorted(set(base) | set(new)):
        b, n = base.get(fn, collections.Counter()), new.get(fn, collections.Counter())
        if base is new:                                      # one build: its counts, largest first
            print(f"{fn}\n  instructions {sum(n.values())}; {_regs(new_regs, fn)}")
            for op, count in n.most_common():
                print(f"  {op:<12} {count:6d}")
            continue
        print(f"{fn}\n  instructions {sum(b.values())} -> {sum(n.values())}; "
              f"{_regs(base_regs, fn)} -> {_regs(new_regs, fn)}")
        for op, before, after in count_diff(b, n):
            print(f"  {op:<12} {before:6d} -> {after:6d} ({after - before:+d})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kernels", nargs="*", help="kernel .cu files relative to the tree root (or two cubins)")
    ap.add_argument("--base", help="another checkout to compare against (default: this tree's counts alone)")
    ap.add_argument("--cubins", action="store_true", help="the two arguments are cubins: base, then new")
    ap.add_argument("--modifiers", action="store_true", help="count opcodes with their modifiers")
    ap.add_argument("--lines", action="store_true", help="instructions per role and source line (nvdisasm)")
    ap.add_argument("--top", type=int, default=15, help="with --lines: source lines listed per role")
    args = ap.parse_args(argv)
    if args.lines:
        if not args.kernels:
            raise SystemExit("sass_diff: name at least one kernel .cu file (e.g. csrc/kernels/splitkv_sparse.cu)")
        with tempfile.TemporaryDirectory() as tmp:
            for kernel in args.kernels:
                cubin, _ = compile_cubin(ROOT, kernel, Path(tmp), lineinfo=True)
                report_lines(kernel, parse_lines(disassemble_lines(cubin)), args.top)
        return 0
    if args.cubins:
        if len(args.kernels) != 2:
            raise SystemExit("sass_diff: --cubins takes exactly two cubins")
        base, new = (parse_sass(disassemble(Path(c)), args.modifiers) for c in args.kernels)
        report(f"{args.kernels[0]} -> {args.kernels[1]}", base, new, {}, {})
        return 0
    if not args.kernels:
        raise SystemExit("sass_diff: name at least one kernel .cu file (e.g. csrc/kernels/splitkv_bf16.cu)")
    with tempfile.TemporaryDirectory() as tmp:
        new_dir, base_dir = Path(tmp) / "new", Path(tmp) / "base"
        new_dir.mkdir()
        base_dir.mkdir()
        for kernel in args.kernels:
            cubin, log = compile_cubin(ROOT, kernel, new_dir)
            new, new_regs = parse_sass(disassemble(cubin), args.modifiers), parse_ptxas(log)
            if args.base:
                cubin, log = compile_cubin(Path(args.base).resolve(), kernel, base_dir)
                base, base_regs = parse_sass(disassemble(cubin), args.modifiers), parse_ptxas(log)
            else:
                base, base_regs = new, new_regs
            report(kernel, base, new, base_regs, new_regs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
