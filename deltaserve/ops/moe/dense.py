"""Dense-batched experts: every expert on every token in two batched GEMMs, then a weighted combine.

A fast path for models with few experts (the tiny and embedded models) at decode-sized batches, where the
reference's per-expert loop is dominated by per-op overhead. It computes E/k times the FLOPs, so `supports`
admits it only when that waste is small; `ref.moe_experts` stays the specification (parity-tested).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deltaserve.ops.activation import silu_and_mul

MAX_WASTE = 4
"""Largest E / top_k (FLOPs computed per FLOP needed) the dense path accepts."""
MAX_PAIRS_PER_EXPERT = 16
"""Above this many (token, slot) pairs per expert, the grouped reference is faster (measured on CPU)."""


def supports(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether the dense path is expected to beat the grouped reference for this shape."""
    return num_experts <= MAX_WASTE * top_k and num_tokens * top_k <= MAX_PAIRS_PER_EXPERT * num_experts


def moe_experts_dense(x: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor) -> Tensor:
    """Same contract as `ref.moe_experts`: x [T, d], w13 [E, 2I, d], w2 [E, d, I], weights/ids [T, k] -> [T, d]."""
    hidden = silu_and_mul(torch.matmul(x, w13.transpose(1, 2)))  # [E, T, I]
    y = torch.bmm(hidden, w2.transpose(1, 2))  # [E, T, d]
    dense_w = torch.zeros(x.shape[0], w13.shape[0], dtype=topk_weights.dtype, device=x.device)
    dense_w.scatter_(1, topk_ids.long(), topk_weights)  # [T, E], zero for experts not chosen
    return torch.einsum("te,etd->td", dense_w.to(y.dtype), y).to(x.dtype)
