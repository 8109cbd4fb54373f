"""CPU backend of `moe_experts` for small expert stacks under many routed pairs: every expert on every token, as two
batched matmuls, with the routing applied as a dense [T, E] weight matrix (zero where a token did not pick an expert).

On a CPU a tiny model's MoE layer is per-op overhead: the reference runs about nine ops per expert that received
tokens, and a speculative verify step of 8 tokens with top-2 of 8 experts reaches every expert (~0.7 ms a layer on the
embedded model). This path is about ten ops whatever the routing, at the price of computing every (token, expert)
pair; it is taken only where that waste is small in absolute terms (`DENSE_MACS`) and the pairs would reach most
experts anyway, so decode rows of real checkpoints (hundreds of experts) never come here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from deltaserve.ops.activation import silu_and_mul
from deltaserve.ops.linear import PLAIN_LINEARS

DENSE_MACS = 1 << 23
"""Most multiply-adds a call may spend on all (token, expert) pairs: ~8M, well under a millisecond on one core."""


def supports(x: Tensor, w13: Any, w2: Any, topk_weights: Tensor | None = None, topk_ids: Tensor | None = None, *,
             act: Callable[[Tensor], Tensor] = silu_and_mul, linear: Callable[[Tensor, Any], Tensor] = F.linear,
             fp32_combine: bool = False) -> bool:
    """CPU tokens, dense fp32 / bf16 stacks of x's dtype (`F.linear` or the dispatched `ops.linear`), at least as
    many routed pairs as experts, and every pair's work within `DENSE_MACS`."""
    if (x.device.type != "cpu" or linear not in PLAIN_LINEARS or not isinstance(w13, Tensor)
            or not isinstance(w2, Tensor) or topk_ids is None or x.dtype not in (torch.float32, torch.bfloat16)):
        return False
    if w13.dim() != 3 or w2.dim() != 3 or w13.dtype != x.dtype or w2.dtype != x.dtype:
        return False
    num_experts, two_i, d = w13.shape
    tokens = x.shape[0]
    return (tokens * topk_ids.shape[1] >= num_experts
            and num_experts * tokens * (two_i + w2.shape[-1]) * d <= DENSE_MACS)


def moe_experts_dense(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, *,
                      act: Callable[[Tensor], Tensor] = silu_and_mul,
                      linear: Callable[[Tensor, Any], Tensor] = F.linear, fp32_combine: bool = False) -> Tensor:
    """Same contract as `deltaserve.ops.moe.ref.moe_experts` (within its tolerance: the combine sums in one pass,
    where the reference adds expert by expert)."""
    num_experts, tokens = w13.shape[0], x.shape[0]
    gate_up = torch.matmul(x.unsqueeze(0), w13.transpose(1, 2))  # [E, T, 2I]
    hidden = act(gate_up.view(num_experts * tokens, -1)).view(num_experts, tokens, -1)  # [E, T, I]
    y = torch.bmm(hidden, w2.transpose(1, 2))  # [E, T, d]
    held = topk_ids >= 0  # -1: an expert another expert-parallel rank holds
    weights = torch.zeros(tokens, num_experts, dtype=topk_weights.dtype).scatter_add_(
        1, topk_ids.clamp(min=0).to(torch.long), topk_weights * held)  # [T, E]
    weighted = y * weights.t().unsqueeze(-1)  # promoted, as the reference's weighted outputs
    return (weighted if fp32_combine else weighted.to(x.dtype)).sum(0).to(x.dtype)
