"""The FP8 cache with both forms of q, against the anchors' bf16 kernels on the same shapes, in one process.

    python3 benchmarks/fp8_q_forms.py --anchors .anchors                        # the referee's h_q 16, s_q 1 rows
    python3 benchmarks/fp8_q_forms.py --anchors .anchors --rows "h=16 s=1,h=32 s=1"

vLLM calls the FP8 cache with an e4m3 q and both descales, or with a bf16 q and descale_k only. The referee
(`sxs.py --fp8`) times the first; this times both on the referee's table rows (its workloads, cache copies and
CUDA-graph timing, `sxs.time_graph`, imported from the anchors folder), the cache quantised per tensor as the
referee does and q left in bf16 for the second form. Prints one row per workload: us per call of each form and of
the faster anchor (bf16 cache, bf16 q), and the anchor's time over each form's.
"""
from __future__ import annotations

import argparse
import os
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", required=True, help="folder with the referee's sxs.py and compressed anchors")
    ap.add_argument("--rows", default="h=16 s=1", help="comma-separated label substrings of the table's workloads")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.anchors))
    import sxs    # the referee's workloads and timing

    class Bf16QFp8Cache(sxs.FlashMLAFp8):
        """flash_mla on the same quantised cache copies, with the bf16 q and descale_k only."""
        name = "flash_mla bf16 q"

        def decode(self, q, k, bt, seqlens, plan, causal):
            md, ns = plan
            k8, dk = self.k8[k.data_ptr()]
            return self.api.flash_mla_with_kvcache(q, k8, bt, seqlens, sxs.DV, md, ns, causal=causal,
                                                   is_fp8_kvcache=True, descale_k=dk)

    impls = [sxs.FlashMLAFp8(), Bf16QFp8Cache(), sxs.AnchorV1(), sxs.AnchorHead()]
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    print("workload,fp8_q_us,bf16_q_us,anchor_bf16_us,ratio_fp8_q,ratio_bf16_q")
    for wi, (_, label, lens, s_q, h_q) in enumerate(sxs.table_workloads()):
        if not any(w in label for w in wanted):
            continue
        q, ks, bt, seqlens = sxs.make_workload(lens, s_q, h_q, 1, seed=1000 + wi)
        us = [sxs.time_graph(impl, q, ks, bt, seqlens, True)[0] * 1e6 for impl in impls]
        anchor = min(us[2:])
        print(f"{label},{us[0]:.1f},{us[1]:.1f},{anchor:.1f},{anchor / us[0]:.3f},{anchor / us[1]:.3f}", flush=True)


if __name__ == "__main__":
    main()
