"""The arithmetic of the Hopper sparse kernel's dequantisation (csrc/kernels/sparse_gather.h), modelled bit for bit
on the CPU: the GPU tests check the kernel's results, these check the design they rely on for every e4m3 code and
the whole float32 range of the group scales.

1. `cvt.rn.f16x2.e4m3x2` widens every e4m3 code to fp16 exactly, NaN codes to NaN (no test or patch needed).
2. A page's exponent E (page_exponent) is the exponent of its largest scale magnitude rounded up, within
   [-60, 126]: every scale times 2^-E is at most 1 (at least 1/2 for the largest, unless clamped), so the factor
   c = fp16(s 2^-E) and the keys code * c stay finite in fp16 (|code| <= 448), 2^-E and 2^E are normal float32
   numbers, and S's RoPE part times 2^-E stays finite below 2^68.
3. Where c is a normal fp16 number (scales down to 2^-14 of the page's largest), fp16(code * c) (one fp16 multiply)
   is within one unit in the last place of fp16(value * s * 2^-E): the key is rounded twice (c, then the product),
   relative error below 2^-10 + 2^-22 where the key is a normal fp16 number (what the GPU tests' lse bound allows
   for: flash_mla.testing.sparse_fp16_key_lse_bound). Below that, c loses precision to
   fp16's subnormals: the key is off by at most 448 * 2^-25 (c) + 448 * 2^-14 * 2^-11 (the product) in the 2^-E
   frame, about 2^-15 where the page's largest scale makes keys of up to 448.
4. The frames of P and O (mainloop.h) move by exact powers of two.
"""
import torch

from flash_mla.sparse_fp8 import MIN_SCALE


def e4m3_values() -> torch.Tensor:
    """The 256 e4m3 codes' float64 values (NaN for 0x7F / 0xFF)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def fp16(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even in fp16 (subnormals kept; every operand here is exact in float32 first)."""
    return x.float().half().double()


MIN_PAGE_EXPONENT = -60      # sparse_gather.h kMinPageExponent


def kernel_page_exponent(max_scale: float) -> int:
    """sparse_gather.h page_exponent: from the float32 bits of the page's largest scale magnitude."""
    bits = int(torch.tensor(max_scale, dtype=torch.float32).view(torch.int32)) & 0xFFFFFFFF
    e = (bits >> 23) - 127 + (1 if bits & 0x7FFFFF else 0)
    return min(max(e, MIN_PAGE_EXPONENT), 126)


def kernel_dequantize(codes: torch.Tensor, scale: torch.Tensor, exponent: int) -> torch.Tensor:
    """codes: uint8 e4m3 codes; scale: float32 group scales. __hmul2(cvt(code), __float2half2_rn(scale * 2^-E))."""
    widened = codes.view(torch.float8_e4m3fn).half().double()           # exact, NaN stays NaN
    c = fp16((scale.float() * 2.0 ** -exponent).double())               # the float32 product is exact (power of two)
    return fp16(widened * c)


def test_widening_is_exact_for_every_code():
    values = e4m3_values()
    codes = torch.arange(256, dtype=torch.uint8)
    widened = codes.view(torch.float8_e4m3fn).half().double()
    finite = ~torch.isnan(values)
    assert int(finite.sum()) == 254
    assert torch.equal(widened[finite], values[finite])
    assert torch.equal(torch.isnan(widened), ~finite)
    subnormal = finite & (values != 0) & (values.abs() < 2.0 ** -6)
    assert int(subnormal.sum()) == 14                      # 7 per sign, exact too
    for exponent in (-126, 0, 126):                        # NaN times any factor stays NaN, finite codes stay finite
        got = kernel_dequantize(codes, torch.tensor(2.0 ** exponent, dtype=torch.float32), exponent)
        assert torch.equal(torch.isnan(got), ~finite) and torch.isfinite(got[finite]).all()


def test_page_exponent_bounds_every_scale():
    g = torch.Generator().manual_seed(1)
    exponents = torch.randint(-126, 127, (500,), generator=g).double()
    mantissas = 1.0 + torch.rand(500, generator=g, dtype=torch.float64)
    scales = (mantissas * 2.0 ** exponents).float()
    scales = torch.cat([scales, torch.tensor([MIN_SCALE, 1.0 / 448, 1.0, 2.0 ** 60, 2.0 ** -126, 3.0e38],
                                             dtype=torch.float32)])
    for s in scales.tolist():
        e = kernel_page_exponent(s)
        assert MIN_PAGE_EXPONENT <= e <= 126
        ratio = s * 2.0 ** -e
        if MIN_PAGE_EXPONENT < e < 126:
            assert 0.5 < ratio <= 1.0, (s, e)               # the largest scale lands in (1/2, 1]
        assert ratio <= 4.0                                 # E = 126 clamps scales up to 2^128: c < 4
        # 2^-E and 2^E are normal float32 numbers (the kernel builds them from the exponent bits), and S's RoPE part
        # times 2^-E stays finite up to 2^68
        assert torch.finfo(torch.float32).tiny <= 2.0 ** -e <= torch.finfo(torch.float32).max
        assert 2.0 ** 67.9 * 2.0 ** -e < float(torch.finfo(torch.float32).max)
    assert kernel_page_exponent(0.0) == MIN_PAGE_EXPONENT   # a page with no token: every scale 0
    assert kernel_page_exponent(MIN_SCALE) == MIN_PAGE_EXPONENT
    assert kernel_page_exponent(float("inf")) == 126        # an infinite scale stays infinite in its factor


def test_scaled_product_within_one_unit_in_the_last_place():
    g = torch.Generator().manual_seed(0)
    values = e4m3_values()
    finite = ~torch.isnan(values)
    codes = torch.arange(256, dtype=torch.uint8)[finite]
    checked = 0
    for _ in range(40):
        # a page's scales: one largest (sets E), the others up to 2^30 below it
        top = float((1.0 + torch.rand(1, generator=g, dtype=torch.float64)) *
                    2.0 ** torch.randint(-126, 100, (1,), generator=g).double())
        e = kernel_page_exponent(float(torch.tensor(top, dtype=torch.float32)))
        scales = torch.tensor(top, dtype=torch.float64) * 2.0 ** -(30 * torch.rand(64, generator=g,
                                                                                    dtype=torch.float64))
        scales = scales.float()
        got = kernel_dequantize(codes[None, :], scales[:, None], e)             # (scales, codes): 2^-E keys
        exact = values[finite][None, :] * scales.double()[:, None] * 2.0 ** -e
        want = fp16(exact)
        assert torch.isfinite(got).all() and got.abs().max() <= 448.0
        c_normal = (scales.double() * 2.0 ** -e >= 2.0 ** -14)[:, None].expand_as(got)
        ulp = (want.abs() * 2.0 ** -10).clamp_min(2.0 ** -24)                   # fp16 spacing (11 significant bits)
        assert ((got - want).abs() <= ulp)[c_normal].all(), "more than one unit in the last place"
        normal = c_normal & (want.abs() >= 2.0 ** -14) & (exact != 0)
        relative = ((got - exact).abs() / exact.abs().clamp_min(1e-300))[normal]
        assert relative.numel() == 0 or relative.max() <= 2.0 ** -10 + 2.0 ** -22, "beyond two fp16 roundings"
        assert (got - exact).abs()[~c_normal].max() <= 897.0 * 2.0 ** -25, "subnormal factors: absolute bound"
        checked += int(normal.sum())
    assert checked > 100_000                                 # most pages above the clamp: the relative bound ran


def test_frames_move_by_exact_powers_of_two():
    # P times 2^(E - frame) and O times 2^(frame_old - frame) are exact for every difference the kernel forms
    # (frame_factor: 0 past -126); the sums are taken back by 2^-offset, offset >= -100.
    p = torch.rand(1000, dtype=torch.float32) * 256
    for d in (0, -1, -24, -100, -126):
        f = torch.tensor(2.0 ** d, dtype=torch.float32)
        assert torch.equal((p * f).double(), p.double() * 2.0 ** d)
    for offset in (0, -37, -100):
        back = torch.tensor(2.0 ** -offset, dtype=torch.float32)
        assert torch.isfinite(back) and float(back) == 2.0 ** -offset


def test_lse_bound_covers_the_kernels_rounding():
    """The kernel's keys and q emulated in float64 (per row, per page of 64 index slots: the page exponent, fp16
    factors and products; q's latent values rounded to fp16; the RoPE part exact) move each row's lse by no more than
    flash_mla.testing.sparse_fp16_key_lse_bound says, on groups whose magnitudes differ by up to 2^36."""
    from flash_mla.sparse_fp8 import ROPE_OFFSET, SCALES_OFFSET, quantize_kv_cache_v32, sparse_decode_reference
    from flash_mla.testing import sparse_fp16_key_lse_bound
    g = torch.Generator().manual_seed(3)
    num_blocks, page, b, s_q, h_q, topk = 8, 64, 2, 2, 16, 200
    x = torch.randn(num_blocks, page, 1, 576, generator=g)
    exponent = torch.tensor([-30.0, -8.0, 0.0, 6.0])[torch.randint(0, 4, (num_blocks, page, 1, 4), generator=g)]
    x[..., :512] *= (2.0 ** exponent).repeat_interleave(128, dim=-1)
    k_cache = quantize_kv_cache_v32(x)
    indices = torch.randint(0, num_blocks * page, (b, s_q, topk), generator=g).int()
    indices[torch.rand(b, s_q, topk, generator=g) < 0.1] = -1
    q = torch.randn(b, s_q, h_q, 576, generator=g)
    q[..., :512] *= 2.0 ** -6                                 # scores of a few units beside the 2^6 groups
    q = q.bfloat16()
    _, ref_lse = sparse_decode_reference(q, k_cache, indices, compute_dtype=torch.float64)
    bound = sparse_fp16_key_lse_bound(q, k_cache, indices).double()

    raw = k_cache.reshape(-1, k_cache.shape[-1])
    codes = raw[:, :512].contiguous()
    scales = raw[:, SCALES_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32)                  # (tokens, 4)
    rope = raw[:, ROPE_OFFSET:].contiguous().view(torch.bfloat16).double()                       # (tokens, 64)
    q16 = q.float().half().double()
    scale = 576 ** -0.5
    worst = 0.0
    for i in range(b):
        for s in range(s_q):
            slots = indices[i, s].long()
            valid = slots >= 0
            pos, tok = torch.arange(topk)[valid], slots[valid]
            keys = torch.empty(len(tok), 512, dtype=torch.float64)
            for p0 in range(0, topk, 64):
                sel = (pos >= p0) & (pos < p0 + 64)
                if not sel.any():
                    continue
                e = kernel_page_exponent(float(scales[tok[sel]].abs().max()))
                k16 = kernel_dequantize(codes[tok[sel]].view(-1, 4, 128),
                                        scales[tok[sel]][:, :, None].expand(-1, 4, 128), e)
                keys[sel] = k16.reshape(-1, 512) * 2.0 ** e
            scores = (q16[i, s, :, :512] @ keys.T + q[i, s, :, 512:].double() @ rope[tok].T) * scale
            lse = torch.logsumexp(scores, dim=-1)                                                   # (h_q,)
            move = (lse - ref_lse[i, :, s]).abs()
            assert (move <= bound[i, :, s] + 1e-9).all(), (move.max(), bound[i, :, s].min())
            assert (bound[i, :, s] < 2e-2).all()                 # and the bound stays meaningful
            worst = max(worst, float((move / bound[i, :, s]).max()))
    assert worst > 1e-3                                          # not vacuous either: the moves are of its order
