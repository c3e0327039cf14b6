"""Where a warp-specialised kernel's warps spend their time, role by role, from ncu's per-instruction counters.

    ncu --profile-from-start off --section SourceCounters -k regex:splitkv_kernel -c 1 -o rep \\
        python benchmarks/ncu_row.py --child --anchors .anchors --impls flash_mla --sparse --h-q 128 --s-q 2
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
    python benchmarks/ncu_roles.py src.csv

Each role of the split kernel begins at its setmaxnreg (USETMAXREG in SASS), so the code splits there: the setup
before the first one, then one region per role in address order. ptxas places the retry loops of mbarrier waits
out of line after the kernel's last EXIT, shared by every role: they form a region of their own (their
instructions are polls, not work). Per region: warp-state samples (each sample is one warp's state; a role whose
warps live through the whole kernel gets samples in proportion to its warps), instructions executed, and the
largest stall reasons as shares of the region's samples, and the shared-memory wavefronts its instructions cost
against ncu's ideal for their access pattern (bank conflicts, or global sectors a cp.async writes one by one).
Then the instructions with the most wavefronts beyond their ideal. The registers a role asked for name it (the
sparse split kernel: kPageA 240, kPageB 200, the gather warpgroup 64; splitkv_traits.h).
"""
import argparse
import csv
import io
import re


def load(text):
    """(address, SASS, {stall reason: samples}, instructions executed, (shared wavefronts, ideal)) per instruction
    of an export's text, in address order (wavefronts 0 where the export has no such column)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    reasons = [h for h in rows[0] if h.startswith("stall_") and "(Not Issued)" not in h] if rows else []

    def number(x):
        try:
            return float(str(x).replace(",", ""))
        except ValueError:
            return 0.0
    out = []
    for r in rows:
        address = r.get("Address", "")
        if not address.startswith("0x"):
            continue
        out.append((int(address, 16), r["Source"].strip(), {k[len("stall_"):]: number(r[k]) for k in reasons},
                    number(r.get("Instructions Executed", 0)),
                    (number(r.get("L1 Wavefronts Shared", 0)), number(r.get("L1 Wavefronts Shared Ideal", 0)))))
    out.sort()
    return out


def regions(instructions):
    """[(name, instructions)]: setup, one region per setmaxnreg, and the waits' retry loops after the last EXIT."""
    if not instructions:
        return []
    base = instructions[0][0]
    exits = [a for a, src, *_ in instructions if re.fullmatch(r"(@!?U?P\w+\s+)?EXIT", src)]
    tail = exits[-1] if exits else None
    marks = [(a, src) for a, src, *_ in instructions if "USETMAXREG" in src and (tail is None or a < tail)]
    bounds = [(base, "setup")] + [(a, f"role at +0x{a - base:x} ({int(src.split()[-1], 0)} registers)")
                                  for a, src in marks]
    out = []
    for k, (start, name) in enumerate(bounds):
        end = bounds[k + 1][0] if k + 1 < len(bounds) else (tail + 1 if tail is not None else float("inf"))
        out.append((name, [i for i in instructions if start <= i[0] < end]))
    if tail is not None:
        out.append(("after the last EXIT (mbarrier wait retries)", [i for i in instructions if i[0] > tail]))
    return out


def summary(name, instructions, top=5):
    samples = {}
    for _a, _src, stalls, _n, _w in instructions:
        for reason, v in stalls.items():
            samples[reason] = samples.get(reason, 0.0) + v
    total = sum(samples.values())
    executed = sum(n for _a, _src, _s, n, _w in instructions)
    wavefronts = sum(w[0] for *_rest, w in instructions)
    ideal = sum(w[1] for *_rest, w in instructions)
    largest = sorted(samples.items(), key=lambda kv: -kv[1])[:top]
    shares = " ".join(f"{reason} {100 * v / total:.0f}%" for reason, v in largest if total > 0)
    return {"region": name, "samples": total, "instructions": executed, "stalls": shares, "wavefronts": wavefronts,
            "ideal": ideal}


def excess(instructions, top=8):
    """[(address, SASS, executions, wavefronts per execution, ideal per execution)] of the `top` instructions with
    the most shared-memory wavefronts beyond their ideal."""
    rows = [(a, src, n, w[0], w[1]) for a, src, _s, n, w in instructions if n > 0 and w[0] > w[1]]
    rows.sort(key=lambda r: -(r[3] - r[4]))
    return [(a, src, n, wf / n, wi / n) for a, src, n, wf, wi in rows[:top]]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass")
    args = ap.parse_args()
    with open(args.csv) as f:
        instructions = load(f.read())
    rows = [summary(name, ins) for name, ins in regions(instructions)]
    all_samples = sum(r["samples"] for r in rows) or 1.0
    print("| region | samples (% of all) | instructions executed (M) | shared wavefronts (M; ideal) | "
          "largest stall reasons |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['region']} | {r['samples']:.0f} ({100 * r['samples'] / all_samples:.1f}) | "
              f"{r['instructions'] / 1e6:.1f} | {r['wavefronts'] / 1e6:.2f} ({r['ideal'] / 1e6:.2f}) | {r['stalls']} |")
    print("\n| address | instruction | executions (k) | shared wavefronts each (ideal) |")
    print("|---|---|---|---|")
    base = instructions[0][0] if instructions else 0
    for a, src, n, wf, wi in excess(instructions):
        print(f"| +0x{a - base:x} | `{src[:60]}` | {n / 1e3:.0f} | {wf:.1f} ({wi:.1f}) |")


if __name__ == "__main__":
    main()
