"""MoE routing and grouped experts: the only entry points layers call."""

from __future__ import annotations

import torch
from torch import Tensor

from deltaserve.ops.moe import padded, ref
from deltaserve.ops.moe.ref import moe_route


def moe_experts(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """Weighted sum of the chosen SiLU-GLU experts (contract: `ref.moe_experts`); picks the padded batched path
    when routing is balanced enough for it to win."""
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=w13.shape[0]).cpu()
    if padded.supports(counts, topk_ids.numel()):
        return padded.moe_experts_padded(x, w13, w2, topk_weights, topk_ids, counts.to(x.device))
    return ref.moe_experts(x, w13, w2, topk_weights, topk_ids)


__all__ = ["moe_experts", "moe_route"]
