"""`ParallelGroup`: one replica's tensor-parallel ranks and the three collectives the model needs.

The group is passed explicitly to every layer that splits its work (no global state), so a model built for one rank
is the same code path with every collective a no-op (`SINGLE`).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

INIT_TIMEOUT_S = 120.0
"""How long a rank waits for the others to join (and, later, for a collective) before raising: a rank that died
leaves the others with an error, never a hang."""


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """Rank `rank` of `size` ranks; `group` is the torch.distributed process group (None for one rank)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks (in place); every rank gets the sum. One rank: `x` itself."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order (all ranks' `x` have the same shape)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """`src`'s `x` on every rank (in place); `src` is a rank of this group (a subgroup's too)."""
        if self.size > 1:
            dist.broadcast(x, group_src=src, group=self.group)
        return x


SINGLE = ParallelGroup()
"""One rank: every collective is the identity."""


def init_parallel_group(rank: int, size: int, init_method: str, device: str) -> ParallelGroup:
    """Join the process group of `size` ranks at `init_method` ('tcp://HOST:PORT') as `rank`: NCCL on CUDA, gloo on
    a CPU. Raises RuntimeError (naming the address) when the other ranks do not join within `INIT_TIMEOUT_S`."""
    if size == 1:
        return SINGLE
    join_world(rank, size, init_method, device)
    return ParallelGroup(rank=rank, size=size, group=dist.group.WORLD)


def join_world(rank: int, size: int, init_method: str, device: str) -> None:
    """`init_parallel_group`'s join of the default process group (NCCL on CUDA, gloo on a CPU)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = datetime.timedelta(seconds=INIT_TIMEOUT_S)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=timeout)
    except Exception as e:
        raise RuntimeError(f"rank {rank}/{size} could not join the {backend} group at {init_method}: {e}") from e
    logger.info("rank %d of %d joined the %s group at %s", rank, size, backend, init_method)
