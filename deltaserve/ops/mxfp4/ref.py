"""Reference OCP Microscaling (MX) formats (model-spec §10): MXFP4 weights (E2M1 elements) and MXFP8 activations
(E4M3 elements), each with one E8M0 scale per 32 consecutive elements along the reduction (last) dim.

Pure PyTorch; the specification and the test oracle for any fused dequant-GEMM kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK_SIZE = 32
"""Elements sharing one E8M0 scale (along the input dim)."""
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each 4-bit E2M1 code: bit 3 sign, bits 2..1 exponent, bit 0 mantissa; no inf or NaN."""
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_EMAX = 2
"""Exponent of the largest E2M1 value (6 = 1.5 * 2**2)."""
E4M3_EMAX = 8
"""Exponent of the largest E4M3 value (448 = 1.75 * 2**8)."""
E4M3_MAX = 448.0

# Scale byte s -> 2**(s - 127), built exactly in fp64 (s = 0 is the subnormal 2**-127); 0xFF is NaN.
_E8M0_LUT = torch.tensor([math.ldexp(1.0, s - E8M0_BIAS) for s in range(255)] + [math.nan], dtype=torch.float64)
_E2M1_LUT = torch.tensor(E2M1_VALUES, dtype=torch.float64)
# Byte b -> (value of its low nibble, value of its high nibble): one gather decodes two elements.
_E2M1_PAIRS = torch.stack((_E2M1_LUT[torch.arange(256) & 0x0F], _E2M1_LUT[torch.arange(256) >> 4]), dim=1)
# Rounding boundaries between consecutive E2M1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float64)


@dataclass(frozen=True, slots=True)
class MXFP4Tensor:
    """A (stack of) MXFP4 matrices in the compressed-tensors ``mxfp4-pack-quantized`` layout (spec §10.2).

    ``packed`` ``[..., out, in/2]`` uint8: byte ``j`` of row ``r`` holds column ``2j`` in its low nibble and column
    ``2j + 1`` in its high nibble. ``scale`` ``[..., out, in/32]`` uint8 E8M0: columns ``32b .. 32b+31`` of row ``r``
    are scaled by ``2**(scale[r, b] - 127)``. Indexing the leading dims (``w[e]``) indexes both tensors.
    """

    packed: Tensor
    scale: Tensor

    def __getitem__(self, index: int | slice | Tensor) -> MXFP4Tensor:
        return MXFP4Tensor(self.packed[index], self.scale[index])

    def __len__(self) -> int:
        """The size of the leading dim (the experts of a stack), as a tensor's ``len``."""
        return len(self.packed)

    @property
    def shape(self) -> torch.Size:
        """The logical (dequantised) shape ``[..., out, in]``."""
        return torch.Size((*self.packed.shape[:-1], 2 * self.packed.shape[-1]))


def e8m0_to_float(scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """E8M0 scale bytes -> ``2**(s - 127)`` in ``dtype`` (exact, 2**-127 included); ``0xFF`` -> NaN."""
    lut = _E8M0_LUT.to(device=scale.device, dtype=dtype)
    return lut.index_select(0, scale.reshape(-1).long()).view(scale.shape)


def _check_pair(packed: Tensor, scale: Tensor) -> None:
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 packed and scale tensors must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1] or packed.shape[-1] != scale.shape[-1] * (BLOCK_SIZE // 2):
        raise ValueError(
            f"MXFP4 shapes do not match: packed {list(packed.shape)} needs scale "
            f"{[*packed.shape[:-1], packed.shape[-1] // (BLOCK_SIZE // 2)]}, got {list(scale.shape)}"
        )


def mxfp4_dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Decode MXFP4: ``W[..., r, c] = E2M1(nibble(r, c)) * 2**(scale[..., r, c // 32] - 127)`` (spec §10.2).

    Args:
        packed: ``[..., out, in/2]`` uint8, low nibble = even column.
        scale: ``[..., out, in/32]`` uint8 E8M0.
        dtype: output dtype; the decode is exact in bf16, fp32 and fp64 (every value is a small integer times a
            power of two in the normal or subnormal range).

    Returns:
        ``[..., out, in]`` in ``dtype``.

    Raises:
        ValueError: a tensor is not uint8 or the shapes do not pair up.
    """
    _check_pair(packed, scale)
    pairs = _E2M1_PAIRS.to(device=packed.device, dtype=dtype)
    # int32 byte indices (2 bytes per weight) and the output are the only transients.
    values = F.embedding(packed.to(torch.int32), pairs).flatten(-2)  # [..., out, in], low nibble first
    values.unflatten(-1, (-1, BLOCK_SIZE)).mul_(e8m0_to_float(scale, dtype).unsqueeze(-1))
    return values


def _shared_exponent(blocks: Tensor, emax: int) -> Tensor:
    """``floor(log2(amax)) - emax`` per block of the last dim, clamped to the E8M0 range; all-zero blocks -> -127."""
    amax = blocks.abs().amax(-1)
    _, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1, exactly
    exp = torch.where(amax > 0, e - 1 - emax, torch.full_like(e, -E8M0_BIAS))
    return exp.clamp(-E8M0_BIAS, E8M0_BIAS)


def _blocks_fp64(x: Tensor) -> Tensor:
    if x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"the last dim ({x.shape[-1]}) must be a multiple of {BLOCK_SIZE}")
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantise NaN or infinite values")
    return x.to(torch.float64).unflatten(-1, (-1, BLOCK_SIZE))


def mxfp4_quantize(w: Tensor) -> MXFP4Tensor:
    """Encode ``[..., out, in]`` as MXFP4 (spec §10.1): per block of 32 along ``in`` the shared exponent is
    ``floor(log2(amax)) - 2``; elements are rounded to the nearest E2M1 value (ties to even code), saturating at 6.

    Error bound per element (``u = 2**exponent`` of its block): at most half the E2M1 step at its magnitude
    (``u/4`` below ``2u``, ``u/2`` below ``4u``, ``u`` up to ``6u``), and ``|x| - 6u < 2u`` in the saturated range
    ``(6u, 8u)``. Values already on the grid round-trip exactly.

    Raises:
        ValueError: ``in`` is not a multiple of 32, or ``w`` holds NaN/inf.
    """
    blocks = _blocks_fp64(w)  # [..., out, in/32, 32]
    exp = _shared_exponent(blocks, E2M1_EMAX)
    scaled = torch.ldexp(blocks, -exp.unsqueeze(-1).to(torch.float64)).abs()
    mids = _E2M1_MIDPOINTS.to(scaled.device)
    code = torch.bucketize(scaled, mids)  # lower code on an exact midpoint
    tie = scaled == mids[code.clamp(max=mids.numel() - 1)]
    code = code + (tie & (code % 2 == 1))  # round half to even code (even mantissa)
    code = code | (torch.signbit(blocks).long() << 3)
    codes = code.flatten(-2).to(torch.uint8)  # [..., out, in]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return MXFP4Tensor(packed.contiguous(), (exp + E8M0_BIAS).to(torch.uint8))


def mxfp8_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """Encode ``[..., K]`` as MXFP8 (spec §10.4): per block of 32 along ``K`` an E8M0 scale
    ``2**(floor(log2(amax)) - 8)`` and E4M3 elements (round to nearest even, saturating at 448).

    Returns:
        ``(values [..., K] torch.float8_e4m3fn, scale [..., K/32] uint8)``. Elements are rounded from fp32, so an
        fp64 input is first rounded to fp32.
    """
    blocks = _blocks_fp64(x)
    exp = _shared_exponent(blocks, E4M3_EMAX)
    scaled = torch.ldexp(blocks, -exp.unsqueeze(-1).to(torch.float64)).clamp(-E4M3_MAX, E4M3_MAX)
    values = scaled.to(torch.float32).to(torch.float8_e4m3fn).flatten(-2)
    return values, (exp + E8M0_BIAS).to(torch.uint8)


def mxfp8_dequantize(values: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``values [..., K]`` E4M3 and ``scale [..., K/32]`` E8M0 -> ``[..., K]`` in ``dtype``."""
    blocks = values.to(dtype).unflatten(-1, (-1, BLOCK_SIZE))
    return (blocks * e8m0_to_float(scale, dtype).unsqueeze(-1)).flatten(-2)


def mxfp8_fake_quantize(x: Tensor) -> Tensor:
    """Round activations through MXFP8 and back to ``x.dtype`` (what an MXFP4 x MXFP8 kernel sees)."""
    return mxfp8_dequantize(*mxfp8_quantize(x), dtype=x.dtype)


def mxfp4_linear(x: Tensor, weight: MXFP4Tensor, mxfp8_activations: bool = False) -> Tensor:
    """``y = x W^T`` with an MXFP4 weight, dequantised on the fly to ``x.dtype`` (bf16, fp32 or fp64).

    Args:
        x: ``[..., in]`` activations.
        weight: one MXFP4 matrix, logical shape ``[out, in]``.
        mxfp8_activations: first round ``x`` through MXFP8 (E4M3 with an E8M0 scale per 32 along ``in``),
            emulating a kernel with MXFP8 activations; ``in`` must then be a multiple of 32.

    Returns:
        ``[..., out]`` in ``x.dtype``. The transient dequantised weight is ``out * in`` values of ``x.dtype``.
    """
    w = mxfp4_dequantize(weight.packed, weight.scale, dtype=x.dtype)
    if mxfp8_activations:
        x = mxfp8_fake_quantize(x)
    return F.linear(x, w)
