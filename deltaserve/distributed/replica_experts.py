"""Expert parallelism over data-parallel replicas (vLLM's DP attention + EP): the process groups, and a MoE layer's
token exchange.

Every worker rank of every replica joins one process group (replica-major ranks: replica r's tensor-parallel rank t
is `r * tp + t`); each replica's tensor-parallel ranks form a subgroup of it. Attention, dense MLPs and the LM head
stay within a replica; the routed experts are partitioned over all ranks. A MoE layer gathers every replica's
tokens (an all-gather of rows padded to the longest replica's count; the tensor-parallel ranks of a replica hold the
same tokens, so one copy per replica is kept), each rank runs its own experts on all of them, and one all-reduce
sums the ranks' partial outputs, of which a replica keeps its own rows (vLLM's "naive" all-gather / reduce
dispatch; an all-to-all that moves only the routed pairs is the next step). Because every forward exchanges with
every replica, the replicas step in lockstep: one with nothing to run still joins each exchange with no tokens
(`engine/dp_lockstep.py`, the model's `idle_experts`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deltaserve.config.dp_experts import ExpertReplicas
from deltaserve.distributed.group import SINGLE, ParallelGroup, join_world


class ReplicaExperts:
    """The token exchange of MoE layers whose experts span `replicas` replicas; `ep` holds every rank of every
    replica (`tp_size` per replica), this rank in replica `replica`.

    Every replica's token count for a forward is exchanged once, by `begin_step` before its first MoE layer (one
    collective per step on host integers, instead of one per layer followed by a device-to-host read); the layers'
    `gather` then sizes its exchange from it."""

    __slots__ = ("ep", "replica", "replicas", "tp_size", "_counts")

    def __init__(self, ep: ParallelGroup, replica: int, replicas: int, tp_size: int) -> None:
        self.ep, self.replica, self.replicas, self.tp_size = ep, replica, replicas, tp_size
        self._counts: list[int] | None = None

    def begin_step(self, num_tokens: int, device: torch.device | str) -> None:
        """Learn every replica's token count for the coming forward (this replica runs `num_tokens`). A collective:
        every rank of every replica calls it once per forward, idle replicas with 0."""
        count = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        self._counts = self.ep.all_gather(count, dim=0)[:: self.tp_size].tolist()

    def gather(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """Every replica's rows of `x` ``[T_r, d]`` in replica order, and where this replica's start and how many
        there are. A collective: every rank of every replica calls it at the same layer (with 0 rows when idle)."""
        counts = self._counts
        if counts is None or counts[self.replica] != x.shape[0]:
            raise RuntimeError(f"ReplicaExperts.gather got {x.shape[0]} rows, but begin_step announced "
                               f"{None if counts is None else counts[self.replica]} for this forward")
        start, width = sum(counts[: self.replica]), max(counts)
        if width == 0:  # the same on every rank: nothing to exchange
            return x, 0, 0
        padded = x if x.shape[0] == width else torch.cat([x, x.new_zeros(width - x.shape[0], *x.shape[1:])])
        rows = self.ep.all_gather(padded, dim=0).view(self.ep.size, width, *x.shape[1:])[:: self.tp_size]
        return torch.cat([rows[r, :n] for r, n in enumerate(counts)]), start, counts[self.replica]

    def combine(self, y: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """The sum over every rank of `y` (each rank's partial outputs for the gathered rows), this replica's rows."""
        if y.shape[0] == 0:  # `gather` found no rows anywhere
            return y
        return self.ep.all_reduce(y)[start: start + count]


def init_replica_groups(replicas: ExpertReplicas, tp_rank: int, tp_size: int, device: str
                        ) -> tuple[ParallelGroup, ReplicaExperts]:
    """Join the group of every replica's ranks at `replicas.workers_address`; this replica's tensor-parallel group
    (a subgroup; `SINGLE` for one rank) and the experts' exchange."""
    world, rank = replicas.size * tp_size, replicas.rank * tp_size + tp_rank
    join_world(rank, world, replicas.workers_address, device)
    tp = SINGLE
    for r in range(replicas.size):  # every rank creates every subgroup, in the same order (torch.distributed's rule)
        group = dist.new_group(list(range(r * tp_size, (r + 1) * tp_size))) if tp_size > 1 else None
        if r == replicas.rank and group is not None:
            tp = ParallelGroup(rank=tp_rank, size=tp_size, group=group)
    ep = ParallelGroup(rank=rank, size=world, group=dist.group.WORLD)
    return tp, ReplicaExperts(ep=ep, replica=replicas.rank, replicas=replicas.size, tp_size=tp_size)
