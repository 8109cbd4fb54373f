"""Dense linears on pre-packed weights through oneDNN (PyTorch's mkldnn ops), for CPUs.

A weight reordered once at load time into oneDNN's blocked layout (`pack`) is read at close to the memory bandwidth
by the small-row GEMMs of a decode step: measured on one Sapphire Rapids core for a [4096, 1024] weight, bf16 at
12.4 GB/s against 9.6 for `F.linear` (1 row) and fp32 at 14.1 against 7.7 GB/s (4 rows) and 11.6 against 5.7 (8 rows);
fp32 with 1 row is 14.0 against 15.3 (the one case it loses). Large row counts (prefill) are compute-bound and tie.
Results do not depend on the row count in bf16; in fp32 neither oneDNN nor MKL's GEMM promises that.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

DTYPES = (torch.bfloat16,)
"""What is packed (fp64 and fp16 stay plain tensors and take the reference)."""

ROWS_HINT = 8
"""The row count oneDNN picks its blocking for (decode batches); measured within 2% of the best for 1 to 32 rows."""


@functools.cache
def available() -> bool:
    """Whether this torch has the oneDNN linear ops and this CPU runs them in bf16 (oneDNN's bf16 path needs AVX512
    BW/VL/DQ or AVX-NE-CONVERT; on other x86 CPUs the reorder raises, so nothing is packed there)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


def can_pack(weight: Tensor) -> bool:
    """Whether `pack` takes this weight: a 2-D CPU tensor of fp32 or bf16 (with oneDNN present)."""
    return available() and weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in DTYPES


def pack(weight: Tensor) -> Tensor:
    """``W [out, in]`` -> the same matrix in oneDNN's blocked layout (a tensor with ``is_mkldnn``), for `linear`."""
    if not can_pack(weight):
        raise ValueError(f"cannot pack a {weight.dim()}-D {weight.dtype} weight on {weight.device}")
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def supports(x: Tensor, weight: Tensor) -> bool:
    """A packed weight and a CPU input of its dtype."""
    return weight.is_mkldnn and x.device.type == "cpu" and x.dtype == weight.dtype


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `ref.linear` for a packed weight."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, None, "none", [], "")
