"""Native CPU backend of `linear` for a few rows (`native.c`, built by `deltaserve.ops.native_backend`), and the
`upcast` backend for bf16 GEMMs of more rows on CPUs without native bf16 arithmetic.

Measured on one core of a 2-core AMD EPYC (AVX2, no AVX512), a [4096, 1024] weight read from memory: `F.linear`
reads it at 18 GB/s for 1 fp32 row, 8.9 for 2 rows, 5.5 for 8 (each row costs another pass); bf16 runs at about 10
GFLOPS whatever the row count (1 row 9.7 GB/s, 8 rows 1.1 GB/s, 2,048 rows 1.7 s against 0.21 s in fp32). The C
kernel reads each weight tile once for all rows; the `upcast` backend runs a bf16 GEMM as fp32 (widened operands,
fp32 accumulation, one rounding: the reference's math in another summation order).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops import native_backend
from deltaserve.ops.linear import onednn
from deltaserve.ops.native_backend import ptr

SOURCE = Path(__file__).with_name("native.c")
MAX_ROWS = 16
"""Most rows a call may have (MAX_ROWS in native.c): decode batches and verify chunks; more rows are compute-bound
and go to the library's GEMM."""
DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """The kernel is built (or can be) here."""
    return _kernel() is not None


def supports(x: Tensor, weight: Tensor) -> bool:
    """A plain contiguous CPU weight of `x`'s dtype (fp32 / bf16), inputs a multiple of 8, at most `MAX_ROWS` rows."""
    if (x.device.type != "cpu" or weight.is_mkldnn or x.dtype not in DTYPES or weight.dtype != x.dtype
            or weight.dim() != 2 or not weight.is_contiguous()):
        return False
    k = weight.shape[1]
    return k % 8 == 0 and x.shape[-1] == k and 1 <= x.numel() // k <= MAX_ROWS


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `ref.linear` (within its tolerance: the dot products sum in another order than the library's
    GEMM); a row's bits do not depend on the other rows or the thread count."""
    kernel = _kernel()
    assert kernel is not None, "native linear kernel used where it is not available"
    n, k = weight.shape
    rows = x.reshape(-1, k).to(torch.float32).contiguous()  # bf16 widens exactly
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    rc = kernel(ptr(rows), ptr(weight), ptr(out), rows.shape[0], k, n, int(x.dtype == torch.bfloat16),
                torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"linear native kernel: {rows.shape[0]} rows of {k} (at most {MAX_ROWS} rows of a multiple "
                         "of 8)")
    return out


@functools.cache
def upcast_available() -> bool:
    """Whether bf16 GEMMs should run as fp32 here: a CPU whose oneDNN has no bf16 path (see `onednn.available`)."""
    return not onednn.available()


def upcast_supports(x: Tensor, weight: Tensor) -> bool:
    """A plain bf16 CPU weight and input."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and not weight.is_mkldnn)


def upcast_linear(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `ref.linear` for bf16: fp32 GEMM of the widened operands, rounded once to bf16."""
    return F.linear(x.float(), weight.float()).to(torch.bfloat16)


def _kernel() -> Callable[..., int] | None:
    return native_backend.function(str(SOURCE), "linear_rows", [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
                                   + [ctypes.c_int] * 2)
