"""Native CPU backend of `linear`: a C kernel for a few rows (`native.c`, built by `deltaserve.ops.native_backend`), and
bf16 GEMMs of more rows as fp32 on CPUs without native bf16 arithmetic.

Measured on one core of a 2-core AMD EPYC (AVX2, no AVX512), a [4096, 1024] weight read from memory: `F.linear`
reads it at 18 GB/s for 1 fp32 row, 8.9 for 2 rows, 5.5 for 8 (each row costs another pass); bf16 runs at about 10
GFLOPS whatever the row count (1 row 9.7 GB/s, 8 rows 1.1 GB/s, 2,048 rows 1.7 s against 0.21 s in fp32). The C
kernel reads each weight tile once for all rows; bf16 GEMMs it does not take run as fp32 (`upcast_linear`: widened
operands, fp32 accumulation, one rounding: the reference's math in another summation order).
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
MIN_WEIGHT = 1 << 20
"""Fewest weight elements the kernel takes in fp32 (and for one bf16 row): below that the weight stays in the CPU's
caches between steps, where the library's GEMM is as fast and a C call's ~5-20 us overhead is not worth paying (the
embedded model's [480, 160] projection at 8 rows: 28 us in `F.linear`, 47 us here). On CPUs without a bf16 path, bf16
GEMMs of 2+ rows are taken at any size: the library runs them at about 10 GFLOPS there."""


def available() -> bool:
    """The kernel is built (or can be) here."""
    return _kernel() is not None


def supports(x: Tensor, weight: Tensor) -> bool:
    """Called before every dense linear, so it fails fast on the common small fp32 weight. Takes CPU calls with a
    plain weight of x's dtype: fp32 weights of at least `MIN_WEIGHT` elements under at most `MAX_ROWS` rows (inputs a
    multiple of 8); bf16 weights only where the CPU has no bf16 path (`upcast_available`: AVX2 without AVX512-BF16),
    under any number of rows. Where it has one, oneDNN's bf16 GEMM is fast and is what packed weights run
    (`onednn.py`): a plain bf16 weight then takes the library too, so packing changes no bit (2026-12-07: on an
    AVX512-BF16 Xeon the kernel's other summation order made a packed model's logits differ from the plain one's)."""
    dtype = weight.dtype
    if dtype is torch.float32:
        return weight.numel() >= MIN_WEIGHT and _kernel_takes(x, weight)
    if dtype is not torch.bfloat16 or x.dtype is not dtype or x.device.type != "cpu" or weight.is_mkldnn:
        return False
    return upcast_available()


def _kernel_takes(x: Tensor, weight: Tensor) -> bool:
    """The C kernel computes this call: a plain contiguous CPU weight of x's dtype, at most `MAX_ROWS` rows of a
    multiple of 8 inputs."""
    k = weight.shape[-1]
    return (x.dtype is weight.dtype and x.device.type == "cpu" and not weight.is_mkldnn and weight.dim() == 2
            and weight.is_contiguous() and k % 8 == 0 and x.shape[-1] == k and 1 <= x.numel() // k <= MAX_ROWS)


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `ref.linear` (within its tolerance: the dot products sum in another order than the library's
    GEMM), for what `supports` takes: the C kernel where it computes the call (a row's bits then do not depend on the
    other rows or the thread count), except one bf16 row of a small weight (the library's GEMV is as fast without the
    call's overhead); bf16 otherwise as an fp32 GEMM (`upcast_linear`)."""
    if weight.dtype is torch.float32 or (_kernel_takes(x, weight) and (x.numel() > weight.shape[1]
                                                                       or weight.numel() >= MIN_WEIGHT)):
        return kernel_linear(x, weight)  # fp32: `supports` took it only for the kernel
    return upcast_linear(x, weight) if upcast_available() else F.linear(x, weight)


def kernel_linear(x: Tensor, weight: Tensor) -> Tensor:
    """``x W^T`` by the C kernel (`_kernel_takes` must hold)."""
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


def upcast_linear(x: Tensor, weight: Tensor) -> Tensor:
    """Same contract as `ref.linear` for bf16: fp32 GEMM of the widened operands, rounded once to bf16."""
    return F.linear(x.float(), weight.float()).to(torch.bfloat16)


def _kernel() -> Callable[..., int] | None:
    return native_backend.function(str(SOURCE), "linear_rows", [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
                                   + [ctypes.c_int] * 2)
