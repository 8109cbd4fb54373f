"""MXFP4 weights and MXFP8 activations (model-spec §10): the only names layers call. `mxfp4_linear` is dispatched
(today only the reference, dequantising on the fly; a fused dequant-GEMM backend registers here); the format helpers
(quantise, dequantise) are the reference's own functions, used by the loader and tests."""

from deltaserve.ops import dispatch
from deltaserve.ops.mxfp4 import ref
from deltaserve.ops.mxfp4.ref import (
    BLOCK_SIZE,
    MXFP4Tensor,
    e8m0_to_float,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_fake_quantize,
    mxfp8_quantize,
)

mxfp4_linear = dispatch.op("mxfp4_linear", ref.mxfp4_linear)

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
