"""Small GPU workloads for NVIDIA compute-sanitizer (scripts/sanitize.sh runs them; see docs/HARDENING.md).

    python3 tests/sanitizer_driver.py padded [--backends cuda,triton]   memcheck: padded + ragged batches
    python3 tests/sanitizer_driver.py small  [--backends cuda]          racecheck / synccheck / initcheck

`padded`: real sequences mixed with L = 0 padding rows whose block-table rows are -1 or garbage and whose q is
NaN; ragged lengths around page boundaries; metadata planned for few SMs as well, so sequences are cut into
many pieces and the combine kernel runs. Pages are laid out in order with no spare blocks, so the last page of
the last sequence ends exactly at the end of the cache allocation (run with PYTORCH_NO_CUDA_MEMORY_CACHING=1:
every tensor is then its own cudaMalloc, and any read past a tensor is outside an allocation).
`small`: b = 2, L ~ 200, h_q in {16, 128}, s_q in {1, 2}: cheap enough for racecheck.
Both end with b = 1 cut into 43-64 pieces (the combine's CTA items at each of their widths).
Sparse FP8 decoding (indices over 656-byte tokens, the cache's last token indexed so that a read past its end
leaves the allocation) runs in `padded` on both backends and in `small` on cuda (its gather: cp.async and the
per-unit mbarriers, its in-place dequantisation); the cuda kernel takes h_q 64 and 128 only.
Both include cases with an attention sink (attn_sink), applied in the split kernel's epilogue for whole sequences
and in the combine kernel for cut ones, and FP8 caches (e4m3 and bf16 q; NaN / +-448 codes past every sequence's
end) for the fp8 kernel and its in-place widening.

Every result is also checked against the float32 reference (on the CPU, so no cuBLAS runs under the tool); with
--lse-only only lse is, and out is never read: initcheck does not see the TMA stores that write out for 128 query
heads or more (epilogue.h) and reports any later read of it, by a kernel or a copy to the host, as uninitialised
(docs/HARDENING.md). The other three tools' runs compare out too.
Prints one line per case and "DRIVER OK" at the end; exit status 1 on a wrong result, 2 without a GPU.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

# this checkout's flash_mla when the package is not installed (the script's own directory is tests/)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
GARBAGE = (-1, 2 ** 31 - 1, -(2 ** 31), 77777)


LSE_ONLY = False    # --lse-only: out is not read (initcheck)


def run_case(name, seqlens, s_q, h_q, backend, causal=True, pad_garbage=None, num_sms=None, seed=0,
             dtype=torch.bfloat16, sink=False, fp8_q=None):
    """fp8_q: None for a `dtype` cache, else the q dtype (float8_e4m3fn or bf16) of an FP8 cache."""
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    from flash_mla.testing import (assert_close, compare, make_attn_sink, make_decode_batch, make_fp8_decode_batch,
                                   reference_for)

    layout = dict(device="cuda", causal=causal, generator=torch.Generator().manual_seed(seed), shuffle_pages=False,
                  extra_blocks=0 if any(seqlens) else 1)
    fp8 = fp8_q is not None
    if fp8:
        quantized = make_fp8_decode_batch(seqlens, s_q=s_q, h_q=h_q, q_dtype=fp8_q, descale_q=0.01, descale_k=37.0,
                                          **layout)
        batch, descales = quantized, dict(is_fp8_kvcache=True, descale_q=quantized.descale_q,
                                          descale_k=quantized.descale_k)
        out_dtype = torch.bfloat16
    else:
        batch, descales, out_dtype = make_decode_batch(seqlens, s_q=s_q, h_q=h_q, dtype=dtype, **layout), {}, dtype
    padding = batch.cache_seqlens == 0
    if pad_garbage is not None:
        batch.block_table[padding] = pad_garbage
        if not fp8:
            batch.q[padding] = math.nan
    attn_sink = make_attn_sink(h_q, torch.Generator().manual_seed(seed), device="cuda") if sink else None
    md, ns = get_mla_metadata(batch.cache_seqlens, s_q * h_q, 1, num_sms=num_sms)
    out, lse = flash_mla_with_kvcache(batch.q, batch.k_cache, batch.block_table, batch.cache_seqlens, 512, md, ns,
                                      causal=causal, attn_sink=attn_sink, backend=backend, **descales)
    torch.cuda.synchronize()
    ref_out, ref_lse = reference_for(batch.dequantized() if fp8 else batch, attn_sink=attn_sink)
    padding = padding.cpu()
    if LSE_ONLY:
        # out as the reference's (never read), so that only lse is compared
        metrics = compare(ref_out, lse, ref_out, ref_lse)
        assert_close(metrics, out_dtype, name)
        assert bool(torch.isneginf(lse.cpu()[padding]).all()), f"{name}: padding rows"
        print(f"ok  {name:<76} parts={md.shape[0]:<3} lse_err={metrics['lse_rel_l2']:.1e}", flush=True)
        return
    metrics = compare(out, lse, ref_out, ref_lse)
    assert_close(metrics, out_dtype, name)
    out, lse = out.cpu(), lse.cpu()
    assert bool((out[padding] == 0).all()) and bool(torch.isneginf(lse[padding]).all()), f"{name}: padding rows"
    splits = int(ns[-1]) - len(seqlens)
    print(f"ok  {name:<76} parts={md.shape[0]:<3} extra pieces={splits:<3} out_err={metrics['out_rel_l2']:.1e}",
          flush=True)


def case(name, seqlens, s_q, h_q, **options):
    """One workload: run_case(backend, name, seqlens, s_q, h_q, **options)."""
    return name, seqlens, s_q, h_q, options


def padded_cases(backend):
    real = [1000, 1, 63, 64, 65, 0, 200]
    for i, (s_q, h_q, causal) in enumerate([(1, 16, True), (2, 64, True), (1, 128, False), (4, 16, True)]):
        garbage = GARBAGE[i % len(GARBAGE)]
        seqlens = real + [0] * 9
        yield case(f"{backend} padded s_q={s_q} h_q={h_q} causal={causal} table={garbage}", seqlens, s_q, h_q,
                   causal=causal, pad_garbage=garbage, seed=i)
        yield case(f"{backend} padded, 8-SM plan, s_q={s_q} h_q={h_q} table={garbage}", seqlens, s_q, h_q,
                   causal=causal, pad_garbage=garbage, num_sms=8, seed=i)
    ragged = [0, 1, 2, 63, 64, 65, 127, 128, 129, 4097, 0, 0]
    yield case(f"{backend} ragged s_q=2 h_q=32", ragged, 2, 32, seed=9)
    yield case(f"{backend} ragged fp16 s_q=3 h_q=16 3-SM plan", ragged, 3, 16, num_sms=3, dtype=torch.float16,
               seed=10)
    yield case(f"{backend} all padding", [0] * 5, 1, 16, pad_garbage=-1, seed=11)
    yield case(f"{backend} last page ends the cache", [64, 130, 64 * 7], 1, 64, seed=12)
    yield case(f"{backend} padded + attn_sink s_q=2 h_q=64", [1000, 1, 63, 64, 65, 0, 200] + [0] * 9, 2, 64,
               pad_garbage=-1, sink=True, seed=13)
    yield case(f"{backend} ragged + attn_sink, 8-SM plan", ragged, 2, 32, num_sms=8, sink=True, seed=14)
    yield from fp8_cases(backend, ragged)
    yield case(f"{backend} fp8 padded, 8-SM plan", [1000, 1, 63, 64, 65, 0, 200] + [0] * 9, 2, 64, pad_garbage=-1,
               num_sms=8, fp8_q=torch.float8_e4m3fn, seed=15)
    yield case(f"{backend} fp8 padded, 16 rows, 8-SM plan", [1000, 1, 63, 64, 65, 0, 200] + [0] * 9, 1, 16,
               pad_garbage=-1, num_sms=8, fp8_q=torch.float8_e4m3fn, sink=True, seed=16)
    yield from long_cases(backend)


def small_cases(backend):
    for s_q in (1, 2):
        for h_q in (16, 128):
            yield case(f"{backend} small b=2 s_q={s_q} h_q={h_q}", [200, 137], s_q, h_q, seed=s_q * 1000 + h_q)
    yield case(f"{backend} small, 1-SM plan (whole sequences)", [200, 137], 2, 16, num_sms=1)
    yield case(f"{backend} small + attn_sink (cut sequences: combine)", [200, 137], 2, 64, sink=True, seed=5)
    yield case(f"{backend} small + attn_sink, 1-SM plan (whole: split epilogue)", [200, 137], 2, 64, num_sms=1,
               sink=True, seed=6)
    yield from fp8_cases(backend, [200, 137])
    yield from long_cases(backend)


def fp8_cases(backend, seqlens):
    """FP8 caches: e4m3 q (the transposed kernel at <= 32 rows, else S on e4m3 and V widened) and bf16 / fp16 q
    (the transposed kernel with three e4m3 terms at <= 32 rows, two S tiles above 16, else widened to fp16), one
    and several row tiles, cut and whole."""
    for i, (q_dtype, s_q, h_q, num_sms) in enumerate([(torch.float8_e4m3fn, 1, 16, None), (torch.bfloat16, 2, 64, 1),
                                                      (torch.float8_e4m3fn, 2, 128, 3), (torch.float8_e4m3fn, 2, 8, 1),
                                                      (torch.float8_e4m3fn, 3, 4, 3), (torch.float8_e4m3fn, 2, 16, 1),
                                                      (torch.float8_e4m3fn, 3, 8, 3), (torch.bfloat16, 1, 16, 3),
                                                      (torch.float16, 2, 8, 1), (torch.bfloat16, 2, 16, 3),
                                                      (torch.float16, 3, 8, 1)]):
        name = f"{backend} fp8 cache, {str(q_dtype).split('.')[-1]} q, s_q={s_q} h_q={h_q} num_sms={num_sms}"
        yield case(name, seqlens, s_q, h_q, num_sms=num_sms, fp8_q=q_dtype, seed=30 + i)


def run_sparse_case(name, s_q, h_q, topk, num_blocks, backend, num_sms=None, seed=0, sink=False):
    """Sparse FP8 decoding (656-byte tokens): ragged topk_length (0 included), -1 slots interleaved and a row of
    only -1, repeated indices, and the cache's last token indexed, whose bytes end exactly at the end of the
    cache allocation (a read past it is out of bounds under memcheck)."""
    from flash_mla import flash_mla_with_kvcache, get_mla_metadata, quantize_kv_cache_v32, sparse_decode_reference
    from flash_mla.backends import select_sparse_backend
    from flash_mla.testing import assert_sparse_close, make_attn_sink, sparse_fp16_key_lse_bound

    g = torch.Generator().manual_seed(seed)
    b, tokens = 3, num_blocks * 64
    k_cache = quantize_kv_cache_v32((torch.randn(num_blocks, 64, 1, 576, generator=g) / 4).clamp(-1, 1)).cuda()
    indices = torch.randint(0, tokens, (b, s_q, topk), generator=g, dtype=torch.int32)
    indices[0, :, ::3] = -1                          # interleaved unused slots
    indices[1, 0, :] = -1                            # a query token with no valid index
    indices[2, :, 0] = tokens - 1                    # the last token of the cache
    indices[2, :, 1] = tokens - 1                    # ... twice
    topk_length = torch.tensor([topk, topk - 5, 0 if topk > 1 else 1], dtype=torch.int32)
    q = torch.randn(b, s_q, h_q, 576, generator=g).to(torch.bfloat16)
    attn_sink = make_attn_sink(h_q, torch.Generator().manual_seed(seed), device="cpu") if sink else None
    schedule, _ = get_mla_metadata(num_sms=num_sms) if num_sms else get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q.cuda(), k_cache, None, None, 512, schedule, None, is_fp8_kvcache=True,
                                      indices=indices.cuda(), topk_length=topk_length.cuda(),
                                      attn_sink=None if attn_sink is None else attn_sink.cuda(), backend=backend)
    torch.cuda.synchronize()
    ref_out, ref_lse = sparse_decode_reference(q, k_cache.cpu(), indices, topk_length, attn_sink=attn_sink)
    bound = None       # the cuda kernel rounds the dequantised keys to bf16 (flash_mla.testing)
    if select_sparse_backend(out.device, backend, q.dtype, h_q) == "cuda":
        bound = sparse_fp16_key_lse_bound(q, k_cache, indices, topk_length)
    assert_sparse_close(out, lse, ref_out, ref_lse, name, lse_bound=bound)
    err = ((out.float().cpu() - ref_out).norm() / ref_out.norm()).item()
    print(f"ok  {name:<76} out_err={err:.1e}", flush=True)


def sparse_cases(backend):
    for i, (s_q, h_q, topk, num_sms, sink) in enumerate([(1, 64, 200, None, False), (2, 128, 130, 8, True),
                                                         (2, 16, 64, 1, False)]):
        yield (f"{backend} sparse s_q={s_q} h_q={h_q} topk={topk} num_sms={num_sms} sink={sink}",
               dict(s_q=s_q, h_q=h_q, topk=topk, num_blocks=5 + i, num_sms=num_sms, seed=40 + i, sink=sink))


def long_cases(backend):
    # b = 1 cut into 64 / 64 / 43 pieces: the combine's CTA items, 64 / 128 / 256 columns wide at h_q 16 / 64 / 128
    # (tests/test_flash_mla.py cta_item_cols); a partial last page.
    for h_q, length in ((16, 4069), (64, 4069), (128, 8165)):
        yield case(f"{backend} long b=1 h_q={h_q} (combine CTA items)", [length], 1, h_q, seed=20 + h_q)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", choices=("padded", "small"))
    parser.add_argument("--backends", default="cuda", help="comma-separated: cuda, triton (default: cuda)")
    parser.add_argument("--lse-only", action="store_true", help="compare lse only and never read out (initcheck)")
    args = parser.parse_args()
    global LSE_ONLY
    LSE_ONLY = args.lse_only
    if not torch.cuda.is_available():
        print("skipped: needs a CUDA GPU")
        return 2
    from flash_mla.backends import _unavailable_reason

    for backend in args.backends.split(","):
        why = _unavailable_reason(backend, torch.device("cuda"))
        if why is not None:
            print(f"skip {backend}: {why}")
            continue
        cases = padded_cases(backend) if args.workload == "padded" else small_cases(backend)
        for name, seqlens, s_q, h_q, options in cases:
            run_case(name, seqlens, s_q, h_q, backend, **options)
        # Sparse decoding: memcheck (padded) on both backends; the cuda kernel also under racecheck, synccheck and
        # initcheck (small). The cuda kernel takes h_q multiples of 64.
        if args.workload == "padded" or backend == "cuda":
            for name, options in sparse_cases(backend):
                if backend == "cuda" and options["h_q"] % 64:
                    continue
                run_sparse_case(name, backend=backend, **options)
    print("DRIVER OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
