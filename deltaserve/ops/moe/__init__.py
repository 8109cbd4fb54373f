"""MoE routing and grouped experts: the only entry points layers call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.moe import ref, sorted
from deltaserve.ops.moe.ref import moe_route


def moe_experts(x: Tensor, w13: Any, w2: Any, topk_weights: Tensor, topk_ids: Tensor, *,
                act: Callable[[Tensor], Tensor] = silu_and_mul, linear: Callable[[Tensor, Any], Tensor] = F.linear,
                fp32_combine: bool = False) -> Tensor:
    """Weighted sum of the chosen gated experts (contract: `ref.moe_experts`). Dense SiLU-GLU experts in fp32 /
    bf16 / fp16 with 16-byte aligned rows take the sorted grouped-GEMM path; other activations, weight formats
    (MXFP4), the fp32 combine, fp64 and odd sizes run the reference loop."""
    if act is silu_and_mul and linear is F.linear and not fp32_combine and sorted.supports(x, w13, w2):
        return sorted.moe_experts_sorted(x, w13, w2, topk_weights, topk_ids)
    return ref.moe_experts(x, w13, w2, topk_weights, topk_ids, act=act, linear=linear, fp32_combine=fp32_combine)


__all__ = ["moe_experts", "moe_route"]
