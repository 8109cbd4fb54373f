"""Parameter holders: a bias-free linear layer and a norm weight, allocated uninitialised (weights come from a file).

Each module exposes `checkpoint_tensors()`: checkpoint-relative tensor name -> the tensor (or view) it loads into.
Modules whose weights only ever feed `ops.linear` also have `prepack()` (see `prepack_weights`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from deltaserve.distributed import SINGLE, ParallelGroup, Shard, shard_range, split_along
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
    weight its owner reads directly (it then stays a plain tensor).

    Tensor parallelism (`tp` of several ranks): `parallel="column"` holds this rank's rows of W (its share of the
    output features; the output stays split), `parallel="row"` its columns (the input arrives split; the partial
    products are summed over the ranks unless `reduce=False`, for an owner that sums several first); None: the
    whole W on every rank."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, packable: bool = True, *,
                 tp: ParallelGroup = SINGLE, parallel: str | None = None, reduce: bool = True) -> None:
        super().__init__()
        if parallel not in (None, "column", "row"):
            raise ValueError(f"parallel={parallel!r}: expected None, 'column' or 'row'")
        self.packable, self.tp, self.parallel, self.reduce = packable, tp, parallel, reduce
        self.full_shape = (out_features, in_features)
        if parallel == "column":
            out_features = shard_range(out_features, tp.rank, tp.size, "output features")[1]
        elif parallel == "row":
            in_features = shard_range(in_features, tp.rank, tp.size, "input features")[1]
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard]:
        """`weight` -> the weight, or this rank's slice of it."""
        if self.parallel is None:
            return {"weight": self.weight}
        dim = 0 if self.parallel == "column" else 1
        return {"weight": split_along(self.weight, dim, self.full_shape[dim], self.tp.rank, self.tp.size)}

    def prepack(self) -> int:
        return pack_parameter(self, "weight") if self.packable else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        return self.tp.all_reduce(y) if self.parallel == "row" and self.reduce else y


class NormWeight(nn.Module):
    """The weight vector of an RMSNorm; the math lives in `ops.norm`."""

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)


class FusedLinear(nn.Module):
    """Several bias-free projections of the same input as one GEMM; each loads from its own checkpoint tensor.

    `forward` returns the outputs split in the order given. Fusing matters most for decode, where a step is a
    few tokens and per-GEMM overhead dominates. With `tp` of several ranks, the parts named in `sharded` are
    column-parallel (this rank's share of their rows), the others whole on every rank.
    """

    def __init__(self, in_features: int, parts: list[tuple[str, int]], dtype: torch.dtype, *,
                 tp: ParallelGroup = SINGLE, sharded: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.tp = tp
        self.names = [name for name, _ in parts]
        self.full_sizes = [size for _, size in parts]
        self.sharded = [name in sharded for name in self.names]
        self.sizes = [shard_range(size, tp.rank, tp.size, f"{name} rows")[1] if split else size
                      for (name, size), split in zip(parts, self.sharded, strict=True)]
        self.weight = nn.Parameter(torch.empty(sum(self.sizes), in_features, dtype=dtype), requires_grad=False)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor | Shard]:
        """`{name}.weight` -> its row slice of the fused weight (a `Shard` for a sharded part)."""
        return {
            f"{name}.weight": split_along(part, 0, full, self.tp.rank, self.tp.size) if split else part
            for name, part, full, split in zip(self.names, self.weight.split(self.sizes), self.full_sizes,
                                               self.sharded, strict=True)
        }

    def prepack(self) -> int:
        return pack_parameter(self, "weight")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return linear(x, self.weight).split(self.sizes, dim=-1)
