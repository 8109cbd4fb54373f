"""MXFP4 / MXFP8 reference ops against the OCP MX definitions written out in model-spec §10 (hand-written tables)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops.mxfp4 import (
    MXFP4Tensor,
    e8m0_to_float,
    mxfp4_dequantize,
    mxfp4_linear,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_fake_quantize,
    mxfp8_quantize,
)

# model-spec §10.1, typed from the text: codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 their negatives.
SPEC_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def one_block(codes: list[int], scale_byte: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """A [1, 32] MXFP4 matrix from 32 codes, packed by hand: low nibble = even column."""
    packed = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
    return torch.tensor([packed], dtype=torch.uint8), torch.tensor([[scale_byte]], dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
def test_mxfp4_dequantize_all_16_codes(dtype: torch.dtype) -> None:
    """Every E2M1 code decodes to the spec value (signed zero included), at scale 1, in the low and high nibble."""
    codes = list(range(16)) + list(range(16))
    w = mxfp4_dequantize(*one_block(codes), dtype=dtype)[0]
    assert w.dtype == dtype
    for col, code in enumerate(codes):
        got = w[col].item()
        assert got == SPEC_E2M1[code], (code, got)
        assert math.copysign(1.0, got) == math.copysign(1.0, SPEC_E2M1[code]), f"sign of code {code}"


@pytest.mark.parametrize("scale_byte", [0, 1, 64, 120, 126, 127, 128, 130, 200, 254])
def test_mxfp4_dequantize_e8m0_scales(scale_byte: int) -> None:
    """Scale byte s multiplies the block by exactly 2**(s - 127), down to the subnormal 2**-127."""
    w = mxfp4_dequantize(*one_block(list(range(16)) * 2, scale_byte), dtype=torch.float64)[0]
    expected = torch.tensor([math.ldexp(SPEC_E2M1[c], scale_byte - 127) for c in list(range(16)) * 2],
                            dtype=torch.float64)
    assert torch.equal(w, expected)
    assert e8m0_to_float(torch.tensor([scale_byte], dtype=torch.uint8)).item() == math.ldexp(1.0, scale_byte - 127)


def test_e8m0_0xff_is_nan() -> None:
    """Scale byte 0xFF is NaN (E8M0 has no infinity or zero)."""
    assert torch.isnan(e8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()


def test_mxfp4_packing_low_nibble_first() -> None:
    """Byte 0x21 holds column 0 = code 1 (0.5) and column 1 = code 2 (1.0); quantise packs the same way."""
    packed = torch.full((1, 16), 0x21, dtype=torch.uint8)
    w = mxfp4_dequantize(packed, torch.tensor([[127]], dtype=torch.uint8))
    assert w[0, :4].tolist() == [0.5, 1.0, 0.5, 1.0]
    row = torch.tensor([[0.5, 1.0, -6.0, 3.0] + [0.0] * 28])  # amax 6 -> exponent 0, scale byte 127
    q = mxfp4_quantize(row)
    assert q.scale.tolist() == [[127]]
    assert q.packed[0, :2].tolist() == [0x21, 0x5F]  # (code 1 | code 2 << 4), (code 15 | code 5 << 4)
    assert torch.equal(mxfp4_dequantize(q.packed, q.scale), row)


def quantisation_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per element: half the E2M1 step at |x| in units u = 2**exponent, or the saturation distance above 6u."""
    u = e8m0_to_float(scale, torch.float64).repeat_interleave(32, dim=-1)
    a = x.abs().double() / u
    half_step = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))
    return torch.where(a > 6, a - 6, half_step) * u


@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (3, 5, 64)], ids=["1x32", "7x96", "3x5x64"])
def test_mxfp4_quantize_dequantize_error_bound(shape: tuple[int, ...]) -> None:
    """Round-trip error stays within the format's bound; the shared exponent is floor(log2(amax)) - 2."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(*shape[:-1], shape[-1] // 32, 1, generator=g)
                                                     ).repeat_interleave(32, -1).squeeze(-1).view(shape)
    q = mxfp4_quantize(x)
    assert q.packed.shape == (*shape[:-1], shape[-1] // 2) and q.scale.shape == (*shape[:-1], shape[-1] // 32)
    err = (mxfp4_dequantize(q.packed, q.scale, torch.float64) - x.double()).abs()
    assert (err <= quantisation_bound(x, q.scale) + 1e-300).all()
    amax = x.double().unflatten(-1, (-1, 32)).abs().amax(-1)
    assert torch.equal(q.scale.long() - 127, torch.floor(torch.log2(amax)).long() - 2)


def test_mxfp4_quantize_exact_on_grid_and_ties_to_even() -> None:
    """Grid values round-trip exactly; a midpoint rounds to the even code (1.25 -> 1.0, 1.75 -> 2.0); zero blocks
    get scale byte 0 (2**-127) and decode to zero."""
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (4, 64), generator=g)
    codes[:, 0] = 7  # a +-6 in every block fixes the exponent at 0
    codes[:, 32] = 15
    grid = torch.tensor(SPEC_E2M1)[codes] * 2.0**-3
    q = mxfp4_quantize(grid)
    assert torch.equal(mxfp4_dequantize(q.packed, q.scale), grid)
    ties = torch.tensor([[6.0, 1.25, 1.75, 2.5, 3.5, 5.0, 0.25, 0.75] + [0.0] * 24])
    assert mxfp4_dequantize(*(lambda t: (t.packed, t.scale))(mxfp4_quantize(ties)))[0, :8].tolist() == [
        6.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 1.0]
    zero = mxfp4_quantize(torch.zeros(2, 32))
    assert zero.scale.tolist() == [[0], [0]] and not mxfp4_dequantize(zero.packed, zero.scale).any()


def test_mxfp4_gpt_oss_blocks_decode_identically() -> None:
    """gpt-oss `_blocks [out, in/32, 16]` / `_scales [out, in/32]` are the compressed-tensors bytes regrouped:
    decoding the blocks as written by hand (byte j of block b = elements 32b + 2j, 32b + 2j + 1) gives the same W."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 128, generator=g)
    q = mxfp4_quantize(w)
    blocks = q.packed.view(6, 4, 16)
    by_hand = torch.empty(6, 128, dtype=torch.float64)
    lut = torch.tensor(SPEC_E2M1, dtype=torch.float64)
    for b in range(4):
        for j in range(16):
            byte = blocks[:, b, j].long()
            scale = torch.tensor([math.ldexp(1.0, s - 127) for s in q.scale[:, b].tolist()], dtype=torch.float64)
            by_hand[:, 32 * b + 2 * j] = lut[byte & 15] * scale
            by_hand[:, 32 * b + 2 * j + 1] = lut[byte >> 4] * scale
    assert torch.equal(mxfp4_dequantize(blocks.reshape(6, 64), q.scale, torch.float64), by_hand)


def test_mxfp4_shape_and_dtype_errors() -> None:
    """Mismatched packed/scale shapes, float tensors and non-multiple-of-32 inputs are refused with a message."""
    with pytest.raises(ValueError, match="scale"):
        mxfp4_dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        mxfp4_dequantize(torch.zeros(2, 16), torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(torch.zeros(2, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_linear_matches_dense_linear(dtype: torch.dtype) -> None:
    """The on-the-fly dequant GEMM equals F.linear with the dequantised weight (stacks index per expert)."""
    g = torch.Generator().manual_seed(3)
    stack = mxfp4_quantize(torch.randn(3, 40, 64, generator=g))
    x = torch.randn(5, 64, generator=g).to(dtype)
    w1 = stack[1]
    assert isinstance(w1, MXFP4Tensor) and w1.shape == (40, 64)
    ref = F.linear(x, mxfp4_dequantize(w1.packed, w1.scale, dtype))
    assert torch.equal(mxfp4_linear(x, w1), ref)


def test_mxfp8_quantize_scale_and_error_bound() -> None:
    """MXFP8: exponent floor(log2(amax)) - 8, E4M3 elements (3 mantissa bits: relative error <= 2**-4 in the normal
    range), saturation at 448 * 2**e; E4M3 grid values round-trip exactly; fake-quantise keeps the dtype."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 96, generator=g) * 10
    values, scale = mxfp8_quantize(x)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.uint8 and scale.shape == (4, 3)
    amax = x.unflatten(-1, (-1, 32)).abs().amax(-1)
    assert torch.equal(scale.long() - 127, torch.floor(torch.log2(amax)).long() - 8)
    back = mxfp8_dequantize(values, scale, torch.float64)
    u = e8m0_to_float(scale, torch.float64).repeat_interleave(32, -1)
    normal = x.abs().double() >= u * 2.0**-6  # E4M3 normal range starts at 2**-6
    saturated = x.abs().double() > u * 448
    assert saturated.any() and torch.equal(back[saturated], (u * 448 * x.sign())[saturated])
    rel = ((back - x.double()).abs() / x.abs().double())[normal & ~saturated]
    assert rel.max() <= 2.0**-4
    assert ((back - x.double()).abs()[~normal] <= u[~normal] * 2.0**-10).all()  # subnormal spacing 2**-9
    grid = torch.tensor([[448.0, -1.5, 0.875, 2.0**-9] + [0.0] * 28])
    assert torch.equal(mxfp8_fake_quantize(grid), grid)
    assert mxfp8_fake_quantize(x.bfloat16()).dtype == torch.bfloat16


def test_mxfp4_linear_with_mxfp8_activations() -> None:
    """With the flag, activations are rounded through MXFP8 before the GEMM (and only then)."""
    g = torch.Generator().manual_seed(5)
    w = mxfp4_quantize(torch.randn(8, 64, generator=g))
    x = torch.randn(3, 64, generator=g)
    dense = mxfp4_dequantize(w.packed, w.scale)
    assert torch.equal(mxfp4_linear(x, w, mxfp8_activations=True), F.linear(mxfp8_fake_quantize(x), dense))
    assert not torch.equal(mxfp4_linear(x, w, mxfp8_activations=True), mxfp4_linear(x, w))
