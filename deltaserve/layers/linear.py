"""Parameter holders: a bias-free linear layer and a norm weight, allocated uninitialised (weights come from a file).

Each module exposes `checkpoint_tensors()`: checkpoint-relative tensor name -> the tensor (or view) it loads into.
Modules whose weights only ever feed `ops.linear` also have `prepack()` (see `prepack_weights`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from deltaserve.ops.linear import can_pack, linear, pack


@runtime_checkable
class Prepackable(Protocol):
    """A module that can repack its weights for the fast CPU linear after loading (`prepack_weights`)."""

    def prepack(self) -> int:
        """Repack in place; returns the number of tensors packed."""
        ...


def pack_parameter(module: nn.Module, name: str) -> int:
    """Replace the 2-D weight parameter `name` of `module` by its packed form (`ops.linear.pack`) when the CPU linear
    takes it; returns 1 if packed, 0 if left as it is."""
    weight = getattr(module, name)
    if not can_pack(weight):
        return 0
    setattr(module, name, nn.Parameter(pack(weight), requires_grad=False))
    return 1


def prepack_weights(model: nn.Module) -> int:
    """Repack, after loading, every weight that only feeds `ops.linear` into the layout of the CPU GEMM library
    (oneDNN), once: decode's few-row GEMMs then read weights at close to the memory bandwidth. Weights read directly
    (MLA's `kv_b`, a tied embedding) stay plain. Returns the number of tensors packed (0 where nothing can be)."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, Prepackable))


class Linear(nn.Module):
    """y = x W^T with W [out_features, in_features]; no bias (no Kimi projection has one). `packable=False` for a
    weight its owner reads directly (it then stays a plain tensor)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, packable: bool = True) -> None:
        super().__init__()
        self.packable = packable
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def prepack(self) -> int:
        return pack_parameter(self, "weight") if self.packable else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


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

    def prepack(self) -> int:
        return pack_parameter(self, "weight")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return linear(x, self.weight).split(self.sizes, dim=-1)
