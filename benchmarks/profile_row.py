"""Run one reference-table row a few times, for ncu / compute-sanitizer.

    ncu --section SpeedOfLight -k regex:mla_splitkv python benchmarks/profile_row.py --mean 8192 --h-q 16 --s-q 1
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flash_mla
from flash_mla.testing import make_decode_batch, random_seqlens

parser = argparse.ArgumentParser()
parser.add_argument("--b", type=int, default=128)
parser.add_argument("--mean", type=int, default=8192)
parser.add_argument("--h-q", type=int, default=16)
parser.add_argument("--s-q", type=int, default=1)
parser.add_argument("--varlen", action="store_true")
parser.add_argument("--reps", type=int, default=3)
args = parser.parse_args()

seqlens = random_seqlens(args.b, args.mean, args.s_q, args.varlen, generator=torch.Generator().manual_seed(0))
batch = make_decode_batch(seqlens, s_q=args.s_q, h_q=args.h_q, device="cuda", causal=True,
                          generator=torch.Generator().manual_seed(0))
md, ns = flash_mla.get_mla_metadata(batch.cache_seqlens, args.s_q * args.h_q, 1)
for _ in range(args.reps):
    out, lse = flash_mla.flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512,
                                                md, ns, causal=True)
torch.cuda.synchronize()
print("done", tuple(out.shape), bool(torch.isfinite(out).all()))
