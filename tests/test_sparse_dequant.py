"""The arithmetic of the Hopper sparse kernel's dequantisation (csrc/kernels/sparse_gather.h), modelled bit for bit
on the CPU: the GPU tests check the kernel's results, these check the design they rely on for every e4m3 code and
the whole float32 range of the group scales.

1. An e4m3 byte s.eeee.mmm moved into a bf16 as s.0000eeee.mmm0000 is exactly the e4m3 value times 2^-120
   (subnormals included); NaN codes are found by a carry test and patched to NaN through a prmt sign mask.
2. With C = bf16(scale * 2^60), bf16(x * C) (one bf16 multiply) is bf16(value * scale * 2^-60) to within one unit
   in the last place: the key is rounded twice (C, then the product), so its relative error stays below
   2^-7 + 2^-16, twice one rounding's 2^-8 (what flash_mla.testing.sparse_bf16_key_lse_bound allows for).
3. 2^-60 keeps C finite and normal for every scale from the quantiser's smallest (MIN_SCALE = 2^-126, a group of
   zeros) up to just below 2^68 (latent values up to ~10^23), so Q * 2^60 and out * 2^60 undo it exactly.
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
    return bf16_from_bits(((b & 0x80) << 8) | ((b & 0x7F) << 4)).double()


def bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 tensor of 16-bit patterns (0..0xFFFF) -> the bf16 values they encode."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to nearest even in bf16 (every operand here is exact in float32 first, so one rounding)."""
    return x.float().bfloat16().double()


def kernel_dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x: bf16 values (code * 2^-120); scale: float32 group scales. __hmul2(x, __float2bfloat162_rn(scale * 2^60))."""
    c = bf16((scale.float() * K_SCALE).double())        # the float32 product is exact (a power of two)
    return bf16(x * c)


def kernel_nan_patch(codes: torch.Tensor, dequantised_bits: torch.Tensor) -> torch.Tensor:
    """sparse_gather.h's NaN fix, one code at a time: the carry test's flag (bit 7 of (b & 0x7F) + 1), replicated
    into 16 bits by prmt's sign mode, ORs 0x7FFF into the code's bf16 half (exponent and mantissa all ones)."""
    b = codes.to(torch.int32)
    flag = ((b & 0x7F) + 1) & 0x80
    mask = torch.where(flag != 0, 0xFFFF, 0) & 0x7FFF
    return dequantised_bits | mask


def test_bit_move_is_exact_for_every_code():
    values = e4m3_values()
    codes = torch.arange(256, dtype=torch.uint8)
    moved = kernel_bits_to_bf16(codes)
    finite = ~torch.isnan(values)
    assert int(finite.sum()) == 254
    assert torch.equal(moved[finite], values[finite] * 2.0 ** -120)
    subnormal = finite & (values != 0) & (values.abs() < 2.0 ** -6)
    assert int(subnormal.sum()) == 14                      # 7 per sign, exact too
    # NaN codes land on finite values (exponent 15, mantissa 7): the kernel's carry test must find exactly them, and
    # its patch must turn them (after the multiply, whatever the scale made of them) into NaN and nothing else
    assert torch.isfinite(moved[~finite]).all()
    low7 = codes.to(torch.int32) & 0x7F
    carries = ((low7 + 1) & 0x80) != 0
    assert torch.equal(carries, ~finite)
    for scale in (MIN_SCALE, 1.0, 2.0 ** 40):
        product = kernel_dequantize(moved, torch.tensor(scale, dtype=torch.float32)).float().bfloat16()
        bits = product.view(torch.int16).to(torch.int32) & 0xFFFF
        patched = bf16_from_bits(kernel_nan_patch(codes, bits))
        assert torch.equal(torch.isnan(patched), ~finite)
        assert torch.equal(patched[finite].view(torch.int16), product[finite].view(torch.int16))


def test_scaled_product_within_one_unit_in_the_last_place():
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
    exact = values[finite][None, :] * scales.double()[:, None] * 2.0 ** -60
    want = bf16(exact)
    ulp = (want.abs() * 2.0 ** -7).clamp_min(2.0 ** -133)                      # bf16 spacing (8 significant bits)
    assert torch.isfinite(got).all()
    assert ((got - want).abs() <= ulp).all(), "more than one unit in the last place"
    normal = exact.abs() >= 2.0 ** -126
    relative = ((got - exact).abs() / exact.abs().clamp_min(1e-300))[normal & (exact != 0)]
    assert relative.max() <= 2.0 ** -7 + 2.0 ** -16, "beyond the two roundings the lse bound allows for"
    assert (got == want).double().mean() > 0.5


def test_offset_keeps_scales_in_range():
    # C = scale * 2^60 for the extreme scales: finite, normal, and its bf16 split finite; 2^68 is the limit.
    assert math.isinf(float(torch.tensor(2.0 ** 68, dtype=torch.float32) * K_SCALE))
    for scale in (MIN_SCALE, 1.99 * 2.0 ** 67):
        c = float(torch.tensor(scale, dtype=torch.float32) * K_SCALE)
        assert math.isfinite(c) and c >= torch.finfo(torch.float32).tiny
        assert math.isfinite(float(bf16(torch.tensor(c, dtype=torch.float64))))
    # Q's latent values times 2^60 and the output times 2^60 stay finite for |q| < 2^68 and any bf16 output.
    assert math.isfinite(2.0 ** 67 * K_SCALE) and K_SCALE * 2.0 ** -60 == 1.0
