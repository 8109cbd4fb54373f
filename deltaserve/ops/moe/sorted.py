"""Sorted grouped experts: the (token, slot) pairs are gathered once in expert order, one grouped GEMM per
projection (`torch.nn.functional.grouped_mm`, each expert's rows times its weight) covers every expert, and one
activation and one weighted scatter-add finish the layer.

A fast path beside `ref.moe_experts` (same contract, parity-tested: bit-identical on the CPU). The reference
gathers, activates and scatters per expert and needs the rows per expert on the host; here the group offsets are
computed and kept on the device. On a GPU that makes a MoE layer sync-free with a fixed number of kernels only where
torch's grouped GEMM has its fast kernel (bf16 on sm90 / sm100, e.g. an H200); elsewhere (fp32, other GPUs) torch
falls back to one matmul per expert after copying the offsets to the host (one sync per call, as the reference).
It computes only the T * k rows needed (no padded [E, m, d] batch: group-limited top-k routing is rarely balanced).
CPU calls take the reference instead: torch's CPU grouped GEMM is a loop over every expert, empty ones included (256
per layer for Kimi Linear 48B, of which a decode token uses 8), where the reference loops over the experts with rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops.activation import silu_and_mul

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What `grouped_mm` takes (not float64: tests in fp64 run the reference)."""


def available() -> bool:
    """Whether this torch has `grouped_mm`."""
    return hasattr(F, "grouped_mm")


def supports(x: Tensor, w13: Any, w2: Any, topk_weights: Tensor | None = None, topk_ids: Tensor | None = None, *,
             act: Callable[[Tensor], Tensor] = silu_and_mul, linear: Callable[[Tensor, Any], Tensor] = F.linear,
             fp32_combine: bool = False) -> bool:
    """Whether a `moe_experts` call can take this path: a GPU tensor (see the module docstring for CPUs), dense
    SiLU-GLU experts (the default `act` and `linear`, no fp32 combine), a dtype `grouped_mm` takes, and rows of a
    multiple of 16 bytes in both GEMMs' inner dimension (hidden size and expert intermediate size), which its kernels
    require."""
    if x.device.type == "cpu" or act is not silu_and_mul or linear is not F.linear or fp32_combine:
        return False
    if x.dtype not in DTYPES:
        return False
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, w13, w2))


def moe_experts_sorted(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, *,
                       act: Callable[[Tensor], Tensor] = silu_and_mul,
                       linear: Callable[[Tensor, Any], Tensor] = F.linear, fp32_combine: bool = False) -> Tensor:
    """Same contract as `ref.moe_experts` for the calls `supports` accepts (SiLU-GLU, dense weights): x [T, d],
    w13 [E, 2I, d], w2 [E, d, I], weights/ids [T, k] -> [T, d]."""
    top_k = topk_ids.shape[1]
    # A pair of another expert-parallel rank's expert (id -1) runs through expert 0 with weight 0: no host sync to
    # drop it, and its contribution is exactly zero.
    skipped = topk_ids < 0
    topk_weights = topk_weights.masked_fill(skipped, 0.0)
    experts, order = torch.sort(topk_ids.clamp(min=0).reshape(-1).long(), stable=True)  # by expert, tokens in order
    token = order // top_k
    # The end row of each expert's group. Not bincount: on CUDA it reads min / max back to the host (a sync).
    ends = torch.searchsorted(experts, torch.arange(w13.shape[0], device=experts.device), right=True)
    ends = ends.to(torch.int32)
    xs = x.index_select(0, token)  # [P, d]
    # w.transpose(-2, -1) is the column-major [E, in, out] operand the grouped GEMM kernels want (no copy).
    hidden = silu_and_mul(F.grouped_mm(xs, w13.transpose(-2, -1), offs=ends))
    y = F.grouped_mm(hidden, w2.transpose(-2, -1), offs=ends)
    out = torch.zeros_like(x)
    # As the reference: weight each expert output (promoted to fp32), round to x's dtype, then accumulate.
    out.index_add_(0, token, (y * topk_weights.reshape(-1)[order, None]).to(x.dtype))
    return out
