"""Correctness of benchmarks/bench_flash_mla.py's rows: the test suite's metrics and tolerances, computed on the
device (flash_mla.testing.compare moves the tensors to the host)."""
from __future__ import annotations

import torch

from flash_mla.testing import COS_TOLERANCE, TOLERANCE


def device_compare(out, lse, ref_out, ref_lse) -> dict[str, float]:
    """Same figures as flash_mla.testing.compare, without moving the tensors to the host."""
    out, lse, ref_out, ref_lse = out.float(), lse.float(), ref_out.float(), ref_lse.float()
    eps = 1e-12
    finite = torch.isfinite(ref_lse)
    d, r = out.double().flatten(), ref_out.double().flatten()
    r_norm, d_norm = r.norm(), d.norm()
    cos = (d @ r) / (d_norm * r_norm).clamp_min(eps)
    lse_err = ((lse[finite] - ref_lse[finite]).norm() / ref_lse[finite].norm().clamp_min(eps)).item() \
        if bool(finite.any()) else 0.0
    if r_norm > 0:
        cos_diff = (1 - cos).item()
    else:
        cos_diff = 0.0 if d_norm == 0 else 1.0
    return {"out_rel_l2": ((out - ref_out).norm() / ref_out.norm().clamp_min(eps)).item(),
            "lse_rel_l2": lse_err,
            "cos_diff": cos_diff,
            "nan": int(torch.isnan(out).sum() + torch.isnan(lse).sum()),
            "inf_mismatch": int((torch.isneginf(lse) != torch.isneginf(ref_lse)).sum())}


def verdict(m: dict[str, float], dtype: torch.dtype) -> str | None:
    """None when within the test suite's tolerances (flash_mla.testing.assert_close), else why not."""
    tol = TOLERANCE[dtype]
    if m["nan"]:
        return f"{m['nan']} NaN"
    if m["inf_mismatch"]:
        return f"lse -inf pattern differs in {m['inf_mismatch']} rows"
    if m["out_rel_l2"] >= tol:
        return f"out rel-L2 {m['out_rel_l2']:.2e} >= {tol}"
    if m["lse_rel_l2"] >= tol:
        return f"lse rel-L2 {m['lse_rel_l2']:.2e} >= {tol}"
    if m["cos_diff"] >= COS_TOLERANCE:
        return f"cos diff {m['cos_diff']:.2e} >= {COS_TOLERANCE}"
    return None
