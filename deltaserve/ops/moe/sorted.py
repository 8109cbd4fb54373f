"""Sorted grouped experts: the (token, slot) pairs are gathered once in expert order, one grouped GEMM per
projection (`torch.nn.functional.grouped_mm`, each expert's rows times its weight) covers every expert, and one
activation and one weighted scatter-add finish the layer.

A fast path beside `ref.moe_experts` (same contract, parity-tested: bit-identical on the CPU). The reference
gathers, activates and scatters per expert and needs the rows per expert on the host; here the group offsets stay
on the device, so a MoE layer makes no device-to-host copy (no stream sync on a GPU) and launches a fixed number of
kernels whatever the routing. It computes only the T * k rows needed (no padded [E, m, d] batch: group-limited
top-k routing is rarely balanced).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops.activation import silu_and_mul

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""What `grouped_mm` takes (not float64: tests in fp64 run the reference)."""


def supports(dtype: torch.dtype) -> bool:
    return dtype in DTYPES


def moe_experts_sorted(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """Same contract as `ref.moe_experts` (SiLU-GLU, dense weights): x [T, d], w13 [E, 2I, d], w2 [E, d, I],
    weights/ids [T, k] -> [T, d]."""
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, token order inside
    token = order // top_k
    ends = torch.bincount(flat, minlength=w13.shape[0]).cumsum(0).to(torch.int32)  # end row of each expert
    xs = x.index_select(0, token)  # [P, d]
    # w.transpose(-2, -1) is the column-major [E, in, out] operand the grouped GEMM kernels want (no copy).
    hidden = silu_and_mul(F.grouped_mm(xs, w13.transpose(-2, -1), offs=ends))
    y = F.grouped_mm(hidden, w2.transpose(-2, -1), offs=ends)
    out = torch.zeros_like(x)
    # As the reference: weight each expert output (promoted to fp32), round to x's dtype, then accumulate.
    out.index_add_(0, token, (y * topk_weights.reshape(-1)[order, None]).to(x.dtype))
    return out
