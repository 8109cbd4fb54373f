"""MXFP4 weights and MXFP8 activations (model-spec §10): the only names layers call. Today the pure-PyTorch
reference (dequantise on the fly); a fused dequant-GEMM backend will be dispatched from here."""

from deltaserve.ops.mxfp4.ref import (
    BLOCK_SIZE,
    MXFP4Tensor,
    e8m0_to_float,
    mxfp4_dequantize,
    mxfp4_linear,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_fake_quantize,
    mxfp8_quantize,
)

__all__ = [
    "BLOCK_SIZE",
    "MXFP4Tensor",
    "e8m0_to_float",
    "mxfp4_dequantize",
    "mxfp4_linear",
    "mxfp4_quantize",
    "mxfp8_dequantize",
    "mxfp8_fake_quantize",
    "mxfp8_quantize",
]
