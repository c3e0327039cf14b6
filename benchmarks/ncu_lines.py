"""Where a kernel's warps spend their time, source line by source line, from ncu's per-instruction counters.

    ncu --profile-from-start off --section SourceCounters -k regex:transposed -c 1 -o rep \\
        python benchmarks/ncu_row.py --child --anchors .anchors --impls flash_mla --fp8 --mean 4096 --varied \\
        --h-q 32 --s-q 1
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
    nvcc <setup.py's flags> -cubin csrc/kernels/splitkv_fp8_transposed.cu -o k.cubin    # the same build's code
    nvdisasm -gi -c k.cubin > k.sass
    python benchmarks/ncu_lines.py src.csv k.sass --function 'transposed_kernelILi32ELb0E'
    python benchmarks/ncu_lines.py src.csv k.sass --function 'transposed_kernelILi32ELb0E' \\
        --under splitkv_fp8_transposed.cu:135        # one call site (the epilogue), line by line

ncu's source page (benchmarks/ncu_roles.py reads the same export) gives warp-state samples per SASS instruction;
`nvdisasm -gi` gives each instruction its chain of inlined source frames (innermost first). The two are matched by
position (the export holds one kernel; its instructions must be the disassembly's function's, opcode by opcode,
else the builds differ and nothing is printed). Two tables: the samples by call site (each instruction's outermost
frame, i.e. the line of the kernel's own body it belongs to), and by source line (the innermost frame in the files
named by --files, default every file; with --under, only the instructions inlined from that call site). Per row:
warp-state samples and their share of all, instructions executed (warp instructions), the largest stall reasons,
and the line's text where the file can be read. Each sample is one warp's state, so a role with more warps gets
more samples: read shares of one role's lines against each other.
"""
import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_roles import load

FRAME = re.compile(r'"([^"]+)", line (\d+)')
INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def disassembly(text, function):
    """[(offset, SASS, frames)] of the first function whose section name contains `function`, in address order;
    frames: ((file, line), ...) innermost first. nvdisasm -gi writes a block of '//## File' lines before an
    instruction whose source changes: the first names the innermost frame and its inlining chain, the next ones the
    outer frames; their union in that order is the chain."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(".text.") and function in line]
    if not starts:
        raise SystemExit(f"ncu_lines: no function matching {function!r} in the disassembly")
    out, frames, in_block = [], (), False
    for line in lines[starts[0] + 1:]:
        if line.startswith("//----") or line.startswith(".text."):
            break
        if line.lstrip().startswith("//## File"):
            found = tuple((os.path.basename(f), int(n)) for f, n in FRAME.findall(line))
            frames = found if not in_block else frames + tuple(f for f in found if f not in frames)
            in_block = True
            continue
        m = INSTRUCTION.match(line)
        if m:
            in_block = False
            out.append((int(m.group(1), 16), m.group(2), frames))
    return out


def opcode(sass):
    """The opcode of a SASS line, without its predicate."""
    words = sass.split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "")


def attribute(instructions, disassembled):
    """[(frames, stalls, executed)] per instruction: ncu's counters (ncu_roles.load) with the disassembly's frames.
    Raises ValueError when the two are not the same code."""
    if len(instructions) != len(disassembled):
        raise ValueError(f"{len(instructions)} instructions in the export, {len(disassembled)} in the disassembly")
    out = []
    for (_address, sass, stalls, executed, _w), (offset, dis, frames) in zip(instructions, disassembled):
        if opcode(sass) != opcode(dis):
            raise ValueError(f"instruction +0x{offset:x}: {sass!r} in the export, {dis!r} in the disassembly")
        out.append((frames, stalls, executed))
    return out


def tally(rows, key):
    """{key: (samples, executed, {reason: samples})} over rows whose key(frames) is not None."""
    table = collections.defaultdict(lambda: [0.0, 0.0, collections.Counter()])
    for frames, stalls, executed in rows:
        k = key(frames)
        if k is None:
            continue
        entry = table[k]
        entry[0] += sum(stalls.values())
        entry[1] += executed
        entry[2].update(stalls)
    return {k: (s, n, dict(r)) for k, (s, n, r) in table.items()}


def call_site(frames):
    return frames[-1] if frames else ("?", 0)


def innermost_in(files):
    """The innermost frame in one of `files` (all files when empty)."""
    def key(frames):
        for frame in frames:
            if not files or frame[0] in files:
                return frame
        return None
    return key


def under(site):
    """Only the instructions inlined from call site `site` ((file, line) in any frame)."""
    def keep(rows):
        return [r for r in rows if site in r[0]]
    return keep


class Sources:
    """The source lines of the files below `roots` by file name (the first found): the folders walked once, each
    file read once."""

    def __init__(self, roots):
        self.paths = {}
        for root in roots:
            for dirpath, _dirs, files in os.walk(root):
                for name in files:
                    self.paths.setdefault(name, os.path.join(dirpath, name))
        self.lines = {}

    def text(self, frame):
        name, line = frame
        if name not in self.lines:
            path = self.paths.get(name)
            if path is None:
                self.lines[name] = []
            else:
                with open(path) as f:
                    self.lines[name] = f.read().splitlines()
        lines = self.lines[name]
        return lines[line - 1].strip() if 0 < line <= len(lines) else ""


def print_table(title, table, total, top, sources):
    print(f"\n{title}\n")
    print("| source | samples (% of all) | instructions executed (k) | largest stall reasons | text |")
    print("|---|---|---|---|---|")
    for frame, (samples, executed, reasons) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
        largest = sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
        shares = " ".join(f"{r} {100 * v / samples:.0f}%" for r, v in largest if samples > 0)
        text = sources.text(frame)[:70].replace("|", "\\|")
        print(f"| {frame[0]}:{frame[1]} | {samples:.0f} ({100 * samples / total:.1f}) | {executed / 1e3:.0f} | "
              f"{shares} | `{text}` |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass")
    ap.add_argument("sass", help="nvdisasm -gi -c of the profiled build's cubin")
    ap.add_argument("--function", required=True, help="a substring of the kernel's mangled name (one instantiation)")
    ap.add_argument("--under", help="FILE:LINE, a call site: only the instructions inlined from it")
    ap.add_argument("--files", default="", help="comma-separated file names for the line table (default: all)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--src", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "csrc"),
                    help="comma-separated folders of the profiled build's sources, for the lines' text (default: "
                         "this tree's csrc; lines move between builds)")
    args = ap.parse_args()
    with open(args.csv) as f:
        instructions = load(f.read())
    with open(args.sass) as f:
        disassembled = disassembly(f.read(), args.function)
    try:
        rows = attribute(instructions, disassembled)
    except ValueError as e:
        sys.exit(f"ncu_lines: the export and the disassembly are not the same code: {e}")
    total = sum(sum(stalls.values()) for _f, stalls, _n in rows) or 1.0
    sources = Sources([r for r in args.src.split(",") if r])
    print_table("By call site (the kernel body's line each instruction belongs to)", tally(rows, call_site), total,
                args.top, sources)
    files = {f for f in args.files.split(",") if f}
    if args.under:
        name, line = args.under.rsplit(":", 1)
        rows = under((name, int(line)))(rows)
    print_table("By source line (innermost frame" + (f", under {args.under})" if args.under else ")"),
                tally(rows, innermost_in(files)), total, args.top, sources)


if __name__ == "__main__":
    main()
