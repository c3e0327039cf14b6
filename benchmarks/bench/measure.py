"""One workload of benchmarks/bench_flash_mla.py: build its inputs and the float32 reference, check every backend
(a backend that fails is not timed), time the ones that pass, and fill in the row's figures (bandwidth, FLOP
rate, fractions of the ceilings, time over the bytes floor, the target, speedups between backends)."""
from __future__ import annotations

import torch

from flash_mla.testing import make_decode_batch, reference_for

from .backends import Backend, FlashMLABackend, Inputs, TorchBackend
from .checks import device_compare, verdict
from .progress import Progress
from .timing import rotation_copies, time_runner
from .workloads import FLOOR_LIMIT, Workload, spec_target

OOM_ERRORS = tuple(e for e in (getattr(torch, "OutOfMemoryError", None),
                               getattr(torch.cuda, "OutOfMemoryError", None)) if e is not None)


def free_device(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_workload(wl: Workload, backends: list[Backend], ceil: dict[str, float], args,
                 device: torch.device, progress: Progress) -> list[dict]:
    free_device(device)
    flops, nbytes = wl.flops_bytes()
    floor_s = nbytes / (ceil["copy_GBps"] * 1e9)
    roof_s = max(floor_s, flops / (ceil["matmul_TFLOPs"] * 1e12))
    base = {"group": wl.group, "workload": wl.name, "b": wl.b, "s_q": wl.s_q, "h_q": wl.h_q, "h_kv": wl.h_kv,
            "mean_L": wl.mean, "sum_L": sum(wl.seqlens), "max_L": max(wl.seqlens), "varlen": wl.varlen,
            "causal": wl.causal, "floor_us": floor_s * 1e6, "roof_us": roof_s * 1e6,
            "copy_GBps": ceil["copy_GBps"], "matmul_TFLOPs": ceil["matmul_TFLOPs"]}
    results = {be.name: dict(base, backend=be.name, status="", note="") for be in backends}

    def finish():
        return [results[be.name] for be in backends]

    progress.set(f"{wl.name}: inputs")
    try:
        batch = make_decode_batch(wl.seqlens, s_q=wl.s_q, h_q=wl.h_q, h_kv=wl.h_kv, device=device,
                                  causal=wl.causal, generator=torch.Generator().manual_seed(wl.seed))
        n_copies = rotation_copies(nbytes, device)
        copies = [(batch.q, batch.k_cache)] + [(batch.q.clone(), batch.k_cache.clone()) for _ in range(n_copies - 1)]
        inputs = Inputs(copies, batch.block_table, batch.cache_seqlens)
        ref = None
        if not args.no_reference:
            progress.set(f"{wl.name}: fp32 reference")
            ref = reference_for(batch, on_device=device.type == "cuda")
    except OOM_ERRORS:
        for r in results.values():
            r.update(status="OOM", note="building the inputs / reference ran out of memory")
        batch = copies = inputs = ref = None
        free_device(device)
        return finish()

    anchor = None          # (name, out, lse) of the flash_mla backend that passed its check
    for be in backends:
        r = results[be.name]
        r["input_copies"] = n_copies
        progress.set(f"{wl.name}: {be.name} check")
        runner = None
        try:
            runner = be.prepare(wl, inputs)
            out, lse = runner(0)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if isinstance(be, TorchBackend):
                r["note"] = be.last_plan
            checks = []        # flash_mla's output first, then the fp32 reference
            if anchor is not None:
                checks.append(anchor)
            if ref is not None:
                checks.append(("fp32 reference", *ref))
            if not checks:
                r["checked_against"] = "nothing (--no-reference)"
            failures = []
            for against, ref_out, ref_lse in checks:
                m = device_compare(out, lse if be.compare_lse else ref_lse, ref_out, ref_lse)
                why = verdict(m, batch.q.dtype)
                if why is None or not failures:
                    r.update(out_rel_l2=m["out_rel_l2"], lse_rel_l2=m["lse_rel_l2"], cos_diff=m["cos_diff"],
                             checked_against=against)
                if why is None:
                    break
                # two bf16 results each within tolerance of the reference can differ by about twice that: a
                # backend that misses against flash_mla but is within tolerance of the reference passes
                failures.append(f"vs {against}: {why}")
            if checks and len(failures) == len(checks):
                r.update(status="FAIL", note="; ".join(failures))
                del out, lse
                continue
            if failures:
                r["note"] = (r["note"] + "; " if r["note"] else "") + failures[0] + " (passes vs the reference)"
            if anchor is None and isinstance(be, FlashMLABackend) and be.name in ("cuda", "cpu"):
                anchor = (f"flash_mla {be.name}", out, lse)
            else:
                del out, lse
        except OOM_ERRORS:
            r.update(status="OOM", note="out of memory in the first call")
            runner = None
            free_device(device)
            continue
        except Exception as e:   # noqa: BLE001  (a backend that cannot run this shape is reported, not fatal)
            r.update(status="ERROR", note=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            runner = None
            free_device(device)
            continue
        progress.set(f"{wl.name}: {be.name} timing")
        try:
            t, reps, calls = time_runner(runner, n_copies, device, args.budget_s)
        except OOM_ERRORS:
            r.update(status="OOM", note="out of memory while timing")
            free_device(device)
            continue
        except Exception as e:   # noqa: BLE001
            r.update(status="ERROR", note=f"timing: {type(e).__name__}: {str(e)[:160]}")
            free_device(device)
            continue
        runner = None
        gbps, tflops = nbytes / t / 1e9, flops / t / 1e12
        r.update(status="OK", time_us=t * 1e6, GBps=gbps, TFLOPs=tflops, pct_copy=100 * gbps / ceil["copy_GBps"],
                 pct_matmul=100 * tflops / ceil["matmul_TFLOPs"], t_over_floor=t / floor_s, t_over_roof=t / roof_s,
                 reps=reps, calls_per_rep=calls)
        target = spec_target(wl)
        if target is not None:
            unit, value = target
            got = gbps if unit == "GB/s" else tflops
            r.update(target=f">={value:.0f} {unit}", target_met=got >= value)
        else:
            r.update(target=f"<={FLOOR_LIMIT}x floor", target_met=t / floor_s <= FLOOR_LIMIT)
    anchor = batch = copies = inputs = ref = None
    free_device(device)
    timed = sorted((r for r in results.values() if r["status"] == "OK"), key=lambda r: r["time_us"])
    for k, r in enumerate(timed):
        r["x_vs_best"] = r["time_us"] / timed[0]["time_us"]
        if k + 1 < len(timed):
            r["speedup_vs_next"] = timed[k + 1]["time_us"] / r["time_us"]
    return finish()
