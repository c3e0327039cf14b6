"""The arithmetic of the Hopper sparse kernel's dequantisation (csrc/kernels/sparse_gather.h), modelled bit for bit
on the CPU: the GPU tests check the kernel's results, these check the design they rely on for every e4m3 code and
the whole float32 range of the group scales.

1. An e4m3 byte s.eeee.mmm moved into a bf16 as s.0000eeee.mmm0000 is exactly the e4m3 value times 2^-120
   (subnormals included); NaN codes are patched to NaN.
2. With C = scale * 2^60 split as C_hi = bf16(C) and C_lo = bf16(C - C_hi), bf16(x * C_hi + bf16(x * C_lo)) (one
   fma, one multiply) is bf16(value * scale * 2^-60): the dequantised key rounded once, up to one unit in the last
   place in rare cases (C_hi + C_lo is C to 16 bits, not exactly).
3. 2^-60 keeps C finite and normal for every scale from the quantiser's smallest (MIN_SCALE = 2^-126, a group of
   zeros) up to 2^68 (latent values up to ~10^23), so Q * 2^60 and out * 2^60 undo it exactly.
"""
import math

import torch

from flash_mla.sparse_fp8 import MIN_SCALE

K_SCALE = 2.0 ** 60


def e4m3_values() -> torch.Tensor:
    """The 256 e4m3 codes' float64 values (NaN for 0x7F / 0xFF)."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()


def kernel_bits_to_bf16(codes: torch.Tensor) -> torch.Tensor:
    """sparse_gather.h e4m3x2_to_bf16x2_scaled, one code at a time: (b & 0x80) << 8 | (b & 0x7F) << 4."""
    b = codes.to(torch.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4)
    bits = torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)
    return bits.view(torch.bfloat16).double()


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even in bf16 (every operand here is exact in float32 first, so one rounding)."""
    return x.float().bfloat16().double()


def kernel_dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: bf16 values (code * 2^-120); scale: float32 group scales. __hfma2(x, C_hi, __hmul2(x, C_lo))."""
    c = (scale.float() * K_SCALE).double()              # float32 product, exact (a power of two)
    c_hi = bf16(c)
    c_lo = bf16(c - c_hi)
    return bf16(x * c_hi + bf16(x * c_lo))


def test_bit_move_is_exact_for_every_code():
    values = e4m3_values()
    codes = torch.arange(256, dtype=torch.uint8)
    moved = kernel_bits_to_bf16(codes)
    finite = ~torch.isnan(values)
    assert int(finite.sum()) == 254
    assert torch.equal(moved[finite], values[finite] * 2.0 ** -120)
    subnormal = finite & (values != 0) & (values.abs() < 2.0 ** -6)
    assert int(subnormal.sum()) == 14                      # 7 per sign, exact too
    # NaN codes land on finite values (exponent 15, mantissa 7): the kernel's carry test must find exactly them
    assert torch.isfinite(moved[~finite]).all()
    low7 = codes.to(torch.int32) & 0x7F
    carries = ((low7 + 1) & 0x80) != 0
    assert torch.equal(carries, ~finite)


def test_scaled_product_rounds_once():
    g = torch.Generator().manual_seed(0)
    values = e4m3_values()
    finite = ~torch.isnan(values)
    codes = torch.arange(256)[finite]
    x = kernel_bits_to_bf16(codes.to(torch.uint8))
    exponents = torch.randint(-126, 64, (400,), generator=g).double()
    mantissas = 1.0 + torch.rand(400, generator=g, dtype=torch.float64)
    scales = (mantissas * 2.0 ** exponents).float()
    scales = torch.cat([scales, torch.tensor([MIN_SCALE, 1.0 / 448, 1.0, 2.0 ** 60, 2.0 ** 67], dtype=torch.float32)])
    got = kernel_dequantize(x[None, :], scales[:, None])                      # (scales, codes)
    want = bf16(values[finite][None, :] * scales.double()[:, None] * 2.0 ** -60)
    exact = got == want
    ulp = (want.abs() * 2.0 ** -7).clamp_min(2.0 ** -133)                      # bf16 spacing (8 significant bits)
    assert torch.isfinite(got).all()
    assert ((got - want).abs() <= ulp).all(), "more than one unit in the last place"
    assert exact.double().mean() > 0.99, f"only {exact.double().mean():.4f} rounded exactly once"


def test_offset_keeps_scales_in_range():
    # C = scale * 2^60 for the extreme scales: finite, normal, and its bf16 split finite; 2^68 is the limit.
    assert math.isinf(float(torch.tensor(2.0 ** 68, dtype=torch.float32) * K_SCALE))
    for scale in (MIN_SCALE, 1.99 * 2.0 ** 67):
        c = float(torch.tensor(scale, dtype=torch.float32) * K_SCALE)
        assert math.isfinite(c) and c >= torch.finfo(torch.float32).tiny
        assert math.isfinite(float(bf16(torch.tensor(c, dtype=torch.float64))))
    # Q's latent values times 2^60 and the output times 2^60 stay finite for |q| < 2^68 and any bf16 output.
    assert math.isfinite(2.0 ** 67 * K_SCALE) and K_SCALE * 2.0 ** -60 == 1.0
