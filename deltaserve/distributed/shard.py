"""How a checkpoint tensor is split over tensor-parallel ranks: a layer says which slice of the unsharded tensor
its local parameter holds, and the loader reads only that slice from the file."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Shard:
    """Load `target` from rows `[start, start + target.shape[dim])` along `dim` of the checkpoint tensor (whose
    full size along `dim` is `full`)."""

    target: torch.Tensor
    dim: int
    start: int
    full: int

    def full_shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape."""
        shape = list(self.target.shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def index(self) -> tuple[slice, ...]:
        """The slice of the checkpoint tensor that lands in `target`."""
        return (*[slice(None)] * self.dim, slice(self.start, self.start + self.target.shape[self.dim]))


def shard_range(n: int, rank: int, size: int, what: str) -> tuple[int, int]:
    """`(start, length)` of rank `rank`'s equal part of `n` items; ValueError naming `what` when `size` does not
    divide `n`."""
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={size}")
    length = n // size
    return rank * length, length


def split_along(target: torch.Tensor, dim: int, full: int, rank: int, size: int) -> torch.Tensor | Shard:
    """The checkpoint target of rank `rank`'s equal part (`target`, already of the local size) of a tensor whose size
    along `dim` is `full`: `target` itself for one rank."""
    if size == 1:
        return target
    return Shard(target, dim, rank * target.shape[dim], full)
