"""MoE routing and grouped experts: the only entry points layers call."""

from __future__ import annotations

from torch import Tensor

from deltaserve.ops.moe import dense, ref
from deltaserve.ops.moe.ref import moe_route


def moe_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """Weighted sum of the chosen SiLU-GLU experts (contract: `ref.moe_experts`); picks the dense path when it wins."""
    if dense.supports(x.shape[0], w13.shape[0], topk_ids.shape[1]):
        return dense.moe_experts_dense(x, w13, w2, topk_weights, topk_ids)
    return ref.moe_experts(x, w13, w2, topk_weights, topk_ids)


__all__ = ["moe_experts", "moe_route"]
