"""Sparse FP8 decoding's time against where its index slots point: the referee's random tokens, the same tokens in
cache order, whole pages, both query tokens of a row on one token set, and a set small enough to stay in L2.

Run from the repository root with the referee copied into .anchors/ (docs/PERF.md, method):
    python3 benchmarks/sparse_locality.py --anchors .anchors [--rows b128h128s2,b128h64s1]

One row per (shape, pattern): flash_mla's and upstream head's median time per call (`sxs.time_graph`: one CUDA graph
of calls), their ratio (head / ours), and the rate at which each reads the distinct token bytes the call names.
If a kernel's time falls as the tokens move into L2 or into whole pages, the memory system bounds it at the
referee's pattern; if it does not, its on-chip path does.
"""
import argparse
import os
import sys

PATTERNS = ("random", "sorted", "whole-pages", "same-tokens-per-row", "in-l2")


def make_indices(pattern, b, s_q, topk, g, page=64, pool=32768):
    """(b, s_q, topk) int32 indices over a cache of b * pool / page pages (each sequence owns pool tokens in random
    pages, as the referee's workload), on g's device, and the number of distinct tokens they name."""
    import torch
    per, device = pool // page, g.device
    bt = torch.randperm(b * per, generator=g, device=device).view(b, per)
    if pattern == "in-l2":    # every row draws from sequence 0's first 2048 tokens (1.3 MB)
        pos = torch.rand(b * s_q, min(2048, pool), generator=g, device=device).topk(topk, dim=-1).indices
        bt = bt[:1].expand(b, per)
    elif pattern == "whole-pages":    # the sequence's first topk tokens: topk / 64 whole pages, in order
        pos = torch.arange(topk, device=device).expand(b * s_q, topk)
    else:
        pos = torch.rand(b * s_q, pool, generator=g, device=device).topk(topk, dim=-1).indices
        if pattern == "same-tokens-per-row":
            pos = pos.view(b, s_q, topk)[:, :1].expand(b, s_q, topk).reshape(b * s_q, topk)
        if pattern == "sorted":
            pos = pos.sort(dim=-1).values
    pos = pos.reshape(b, s_q * topk)
    idx = (torch.gather(bt, 1, pos // page) * page + pos % page).view(b, s_q, topk).to(torch.int32).contiguous()
    return idx, torch.unique(idx).numel()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", default=".anchors", help="folder with sxs.py and the anchors")
    ap.add_argument("--rows", default="b128h128s2,b128h64s1", help="comma-separated bBhHsS shapes (topk 2048)")
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    args = ap.parse_args()
    import torch
    sys.path.insert(0, os.path.abspath(args.anchors))
    import sxs

    impls = [sxs.FlashMLASparse(), sxs.AnchorHeadSparse()]
    print("shape,pattern,flash_mla_us,head_us,ratio,distinct_GB,flash_mla_GB/s,head_GB/s", flush=True)
    for shape in args.rows.split(","):
        b, rest = shape[1:].split("h")
        h_q, s_q = rest.split("s")
        b, h_q, s_q, topk = int(b), int(h_q), int(s_q), 2048
        for pattern in args.patterns.split(","):
            g = torch.Generator(device="cuda").manual_seed(7)
            k = sxs.make_v32_cache(b * 32768 // sxs.PAGE, g)
            idx, distinct = make_indices(pattern, b, s_q, topk, g, sxs.PAGE)
            q = torch.randn(b, s_q, h_q, sxs.D, generator=g, device="cuda").clamp_(-1, 1).to(torch.bfloat16)
            times = [sxs.time_graph(impl, q, [k], idx, None, False)[0] for impl in impls]
            gb = distinct * 656 / 1e9
            print(f"{shape},{pattern},{times[0] * 1e6:.1f},{times[1] * 1e6:.1f},{times[1] / times[0]:.3f},{gb:.3f},"
                  f"{gb / times[0]:.0f},{gb / times[1]:.0f}", flush=True)
            del k, idx, q
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
