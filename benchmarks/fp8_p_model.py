"""What P V on the e4m3 tensor cores costs in accuracy: a float64 model of the split kernels' page loop.

    python benchmarks/fp8_p_model.py                    # L = 1024, 4096, 16384; 16 query rows; 3 draws each
    python benchmarks/fp8_p_model.py --lengths 4096 --rows 64 --draws 5

The data are the FP8 GPU tests' kind (tests/test_fp8.py): random q and cache, both rounded to e4m3, V = the cache's
first 512 columns, the default softmax scale. The loop is the kernels': pages of 64 keys, a lazy reference per row
(moved when a page's maximum passes it by 2^8), O and the sum rescaled when it moves, the sum from unrounded P. Per
form of P it prints the worst out rel-L2 over the draws against the exact softmax (the GPU tests' bound is 1e-2):
  fp16        P rounded to fp16 (the split-KV kernels)
  e4m3-row    P scaled so the page's row maximum is 448, rounded to e4m3, scaled back (a per-row scale of P)
  e4m3-fixed  P x 448 / 256 rounded to e4m3 (one scale: P <= 2^8 under the lazy reference)
  e4m3-two    x = fp16(1.75 P) as two e4m3 terms, hi = e4m3(x), lo = e4m3(x - hi) (1.75 P <= 448 under the
              lazy reference; the form measured in the transposed kernel, docs/PERF.md's tried table)
e4m3 keeps 3 mantissa bits (a relative rounding error up to 2^-4), which the weighted sum of random V carries
into out almost undamped: out's error is about the RMS of P's relative error, ~1-2 % (docs/PERF.md "FP8 cache").
The second term keeps 4 bits more: ~1e-3.
"""
import argparse
import math

import torch


def e4m3(x):
    return x.to(torch.float8_e4m3fn).to(torch.float64)


def out_error(length, rows, form, seed, page=64, lazy_log2=8.0):
    g = torch.Generator().manual_seed(seed)
    q = e4m3(torch.randn(rows, 576, generator=g, dtype=torch.float64))
    k = e4m3(torch.randn(length, 576, generator=g, dtype=torch.float64))
    v = k[:, :512]
    s = (q @ k.T) / math.sqrt(576)
    exact = torch.softmax(s, dim=-1) @ v
    o = torch.zeros(rows, 512, dtype=torch.float64)
    total = torch.zeros(rows, 1, dtype=torch.float64)
    ref = torch.full((rows, 1), -math.inf, dtype=torch.float64)
    for p0 in range(0, length, page):
        sp = s[:, p0:p0 + page]
        page_max = sp.max(dim=1, keepdim=True).values
        passed = (ref == -math.inf) | ((page_max - ref) * math.log2(math.e) > lazy_log2)
        moved = torch.where(passed, torch.maximum(ref, page_max), ref)
        factor = torch.where(ref == -math.inf, torch.zeros_like(ref), torch.exp(ref - moved))
        o, total, ref = o * factor, total * factor, moved
        p = torch.exp(sp - ref)
        if form == "fp16":
            rounded = p.to(torch.float16).to(torch.float64)
        elif form == "e4m3-row":
            scale = 448 / p.max(dim=1, keepdim=True).values.clamp_min(1e-300)
            rounded = e4m3(p * scale) / scale
        elif form == "e4m3-fixed":
            rounded = e4m3(p * (448 / 256)) / (448 / 256)
        elif form == "e4m3-two":
            x = (p * 1.75).to(torch.float16).to(torch.float64)
            hi = e4m3(x)
            rounded = (hi + e4m3(x - hi)) / 1.75
        else:
            raise ValueError(form)
        total += p.sum(dim=1, keepdim=True)
        o += rounded @ v[p0:p0 + page]
    o = o / total
    return ((o - exact).norm() / exact.norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--draws", type=int, default=3)
    args = ap.parse_args()
    forms = ("fp16", "e4m3-row", "e4m3-fixed", "e4m3-two")
    print("| L | " + " | ".join(f"{f} out rel-L2 (worst of {args.draws})" for f in forms) + " |")
    print("|---|" + "---|" * len(forms))
    for length in (int(x) for x in args.lengths.split(",")):
        worst = [max(out_error(length, args.rows, f, seed) for seed in range(args.draws)) for f in forms]
        print(f"| {length} | " + " | ".join(f"{w:.2e}" for w in worst) + " |")


if __name__ == "__main__":
    main()
