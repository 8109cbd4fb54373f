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


def checkpoint_tensors(module: nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """Default mapping: every parameter and buffer under its own dotted name."""
    named = dict(module.named_parameters(prefix=prefix.rstrip(".")))
    named.update(module.named_buffers(prefix=prefix.rstrip(".")))
    return named
