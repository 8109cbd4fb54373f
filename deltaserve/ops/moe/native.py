"""Native CPU backend of `moe_experts` for a few routed pairs (`native.c`, built by `deltaserve.ops.native_backend`):
dense fp32 / bf16 SiLU-GLU experts, one C call for every pair, where the reference runs about nine PyTorch ops per
expert that received tokens. Each pair is computed alone, the same whatever else is in the batch, so a speculative
verify chunk gets the bits decode rows get.

Taken up to `MAX_PAIRS` routed pairs: it reads an expert's weights once per pair (GEMVs), which is what decode rows
need, while more pairs sharing experts want the GEMMs of the reference or `cpu_dense`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops import native_backend
from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.linear import PLAIN_LINEARS
from deltaserve.ops.native_backend import ptr

SOURCE = Path(__file__).with_name("native.c")
MAX_PAIRS = 16
"""Most (token, expert) pairs a call may have: a decode batch of 8 at top-2, or a verify chunk of 8 tokens."""
_MAX_TOP_K = 64  # MAX_TOP_K in native.c


def available() -> bool:
    """The kernel is built (or can be) here."""
    return _kernel() is not None


def supports(x: Tensor, w13: Any, w2: Any, topk_weights: Tensor | None = None, topk_ids: Tensor | None = None, *,
             act: Callable[[Tensor], Tensor] = silu_and_mul, linear: Callable[[Tensor, Any], Tensor] = F.linear,
             fp32_combine: bool = False) -> bool:
    """CPU tokens in fp32 / bf16, contiguous dense stacks of their dtype (`F.linear` or the dispatched `ops.linear`),
    SiLU-GLU, fp32 combine weights and at most `MAX_PAIRS` routed pairs."""
    if (x.device.type != "cpu" or linear not in PLAIN_LINEARS or act is not silu_and_mul or topk_ids is None
            or topk_weights is None or x.dtype not in (torch.float32, torch.bfloat16)):
        return False
    if not isinstance(w13, Tensor) or not isinstance(w2, Tensor) or w13.dim() != 3 or w2.dim() != 3:
        return False
    return (w13.dtype == x.dtype and w2.dtype == x.dtype and w13.is_contiguous() and w2.is_contiguous()
            and w13.shape[0] == w2.shape[0] and w13.shape[1] == 2 * w2.shape[2] and w2.shape[1] == w13.shape[2]
            and topk_weights.dtype == torch.float32 and topk_ids.numel() <= MAX_PAIRS
            and topk_ids.shape[-1] <= _MAX_TOP_K)


def moe_experts_native(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, *,
                       act: Callable[[Tensor], Tensor] = silu_and_mul,
                       linear: Callable[[Tensor, Any], Tensor] = F.linear, fp32_combine: bool = False) -> Tensor:
    """Same contract as `deltaserve.ops.moe.ref.moe_experts` (within its tolerance: the dot products sum in another
    order than the library's GEMMs; every rounding of the reference is kept)."""
    kernel = _kernel()
    assert kernel is not None, "native MoE kernel used where it is not available"
    tokens, top_k = topk_ids.shape
    num_experts, _, d = w13.shape
    xc = x.contiguous()
    ids = topk_ids.to(torch.int64).contiguous()
    weights = topk_weights.contiguous()
    threads, inter = torch.get_num_threads(), w2.shape[2]
    pair_out = torch.empty(tokens * top_k, d, dtype=torch.float32)
    scratch = torch.empty(threads, d + 3 * inter, dtype=torch.float32)  # per thread: a token, gate/up, hidden
    out = torch.empty(tokens, d, dtype=x.dtype)
    rc = kernel(ptr(xc), ptr(w13), ptr(w2), ptr(weights), ptr(ids), tokens, top_k, num_experts, d, inter,
                int(x.dtype == torch.bfloat16), int(fp32_combine), ptr(pair_out), ptr(scratch), ptr(out), threads)
    if rc == -2:
        raise IndexError(f"moe native kernel: an expert id is outside [-1, {num_experts})")
    if rc != 0:
        raise ValueError(f"moe native kernel: top_k {top_k} exceeds {_MAX_TOP_K}")
    return out


def _kernel() -> Callable[..., int] | None:
    return native_backend.function(str(SOURCE), "moe_experts_silu", [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 5
                                   + [ctypes.c_int] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int])
