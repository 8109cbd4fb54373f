"""Parameter holders: a bias-free linear layer and a norm weight, allocated uninitialised (weights come from a file).

Each module exposes `checkpoint_tensors()`: checkpoint-relative tensor name -> the tensor (or view) it loads into.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T with W [out_features, in_features]; no bias (no Kimi projection has one)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class NormWeight(nn.Module):
    """The weight vector of an RMSNorm; the math lives in `ops.norm`."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)


class FusedLinear(nn.Module):
    """Several bias-free projections of the same input as one GEMM; each loads from its own checkpoint tensor.

    `forward` returns the outputs split in the order given. Fusing matters most for decode, where a step is a
    few tokens and per-GEMM overhead dominates.
    """

    def __init__(self, in_features: int, parts: list[tuple[str, int]], dtype: torch.dtype) -> None:
        super().__init__()
        self.names = [name for name, _ in parts]
        self.sizes = [size for _, size in parts]
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features, dtype=dtype), requires_grad=False)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """`{name}.weight` -> its row slice of the fused weight."""
        return {f"{name}.weight": part for name, part in zip(self.names, self.weight.split(self.sizes), strict=True)}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight).split(self.sizes, dim=-1)
