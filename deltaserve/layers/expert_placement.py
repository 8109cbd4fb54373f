"""`ExpertPlacement`: which routed experts a rank computes, of each what width, and (with EPLB) which copy of a
replicated expert serves which token."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from deltaserve.distributed import ParallelGroup, Shard, shard_range, split_along
from deltaserve.distributed.eplb import EPLBSettings, balanced_placement, initial_placement
from deltaserve.distributed.replica_experts import ReplicaExperts

logger = logging.getLogger(__name__)


class ExpertPlacement:
    """Where a MoE layer's routed experts live over the tensor-parallel ranks.

    Tensor parallelism (`expert_parallel=False`): every rank holds all `E` experts, `I / tp.size` of each one's
    intermediate width. Expert parallelism: the ranks hold `E + R` physical expert slots, `(E + R) / tp.size` each,
    every slot a whole expert (`R`: EPLB's redundant copies, else 0). The tokens are on every rank already (attention
    is tensor-parallel), so dispatch is choosing the (token, expert) pairs this rank's slots serve (`route`) and
    combine is the sum over ranks the layer does anyway. With EPLB, a token routed to an expert with several copies
    uses copy `token index mod copies`; every `step_interval` forwards the slots are reassigned from the counted
    load (`distributed.eplb`) and the weights moved by broadcast from a rank that holds them: each token still gets
    the same expert weights, so outputs do not change.

    With `replicas` (expert parallelism over data-parallel replicas) the slots are partitioned over every rank of
    every replica (`replicas.ep`) and the layer routes every replica's gathered tokens, the same on every rank.
    """

    def __init__(self, num_experts: int, intermediate_size: int, tp: ParallelGroup, expert_parallel: bool,
                 eplb: EPLBSettings | None = None, replicas: ReplicaExperts | None = None) -> None:
        self.tp, self.num_experts, self.full_intermediate_size = tp, num_experts, intermediate_size
        self.replicas = replicas
        self.group = group = tp if replicas is None else replicas.ep
        """The ranks the expert slots are partitioned over (under expert parallelism)."""
        self.expert_parallel = (expert_parallel or replicas is not None) and group.size > 1
        self.eplb = eplb if self.expert_parallel else None
        redundant = self.eplb.num_redundant_experts if self.eplb is not None else 0
        if self.expert_parallel:
            self.first, self.num_local = shard_range(num_experts + redundant, group.rank, group.size,
                                                     "n_routed_experts + num_redundant_experts")
            self.intermediate_size = intermediate_size
        else:
            self.first, self.num_local = 0, num_experts
            self.intermediate_size = shard_range(intermediate_size, tp.rank, tp.size, "moe_intermediate_size")[1]
        self.slots = initial_placement(num_experts, redundant)
        """Physical slot -> expert id, over all ranks (rank r's slots are `[r * num_local, (r + 1) * num_local)`)."""
        self.load = torch.zeros(num_experts, dtype=torch.long, device="cpu")
        """(Pair, expert) counts since the last rebalancing (EPLB only)."""
        self.forwards = 0
        self.rebalances = 0
        self._build_tables()

    def _build_tables(self) -> None:
        """The lookup tensors of `route` for the current `slots`."""
        copies: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, e in enumerate(self.slots):
            copies[e].append(slot)
        width = max(len(c) for c in copies)
        # Host tensors whatever the default device (a model is built under `torch.device(...)`); `route` moves them.
        self.copy_table = torch.tensor([c + c[:1] * (width - len(c)) for c in copies], device="cpu")  # [E, copies]
        self.copy_count = torch.tensor([len(c) for c in copies], device="cpu")
        slot_local = torch.full((len(self.slots),), -1, dtype=torch.long, device="cpu")
        slot_local[self.first:self.first + self.num_local] = torch.arange(self.num_local, device="cpu")
        self.slot_local = slot_local

    def local_slot(self, expert: int) -> int | None:
        """This rank's slot holding `expert` (the first, if several), or None."""
        for j in range(self.num_local):
            if self.slots[self.first + j] == expert:
                return j
        return None

    def split(self, target: torch.Tensor, dim: int, full: int) -> torch.Tensor | Shard:
        """Checkpoint target of one expert's tensor whose intermediate width lies along `dim` (`full` long in the
        checkpoint): a tensor-parallel rank's slice, or the whole tensor under expert parallelism."""
        if self.expert_parallel:
            return target
        return split_along(target, dim, full, self.tp.rank, self.tp.size)

    def route(self, ids: torch.Tensor, stacks: Sequence[torch.Tensor]) -> torch.Tensor:
        """Routed expert ids [T, k] -> this rank's slot indices, -1 where another rank serves the pair. With EPLB,
        counts the pairs first and, every `step_interval` calls, rebalances `stacks` (every tensor indexed by local
        slot, e.g. w13 and w2) in place before routing."""
        if not self.expert_parallel:
            return ids
        if self.eplb is not None:
            self.load += torch.bincount(ids.reshape(-1).cpu(), minlength=self.num_experts)
            self.forwards += 1
            if self.forwards % self.eplb.step_interval == 0:
                self.rebalance(stacks)
        device = ids.device
        copy = torch.arange(ids.shape[0], device=device)[:, None] % self.copy_count.to(device)[ids]
        return self.slot_local.to(device)[self.copy_table.to(device)[ids, copy]]

    def rebalance(self, stacks: Sequence[torch.Tensor]) -> None:
        """Reassign the slots from the counted load and move the weights (a collective: every rank calls it at the
        same forward). An expert a rank newly needs is broadcast from the lowest rank that held it."""
        assert self.eplb is not None
        new = balanced_placement(self.load.tolist(), self.eplb.num_redundant_experts, self.group.size)
        self.load.zero_()
        if new == self.slots:
            return
        n, old = self.num_local, self.slots
        holder = {e: min(s // n for s, x in enumerate(old) if x == e) for e in range(self.num_experts)}
        mine_old = {old[self.first + j]: j for j in reversed(range(n))}  # expert -> a local slot holding it
        new_local = [new[self.first + j] for j in range(n)]
        fresh = [stack.clone() for stack in stacks]
        for j, e in enumerate(new_local):
            if e in mine_old:
                for f, s in zip(fresh, stacks, strict=True):
                    f[j].copy_(s[mine_old[e]])
        # Experts some rank lacks: one broadcast each, in expert order on every rank.
        needed = {new[s] for s in range(len(new)) if new[s] not in old[(s // n) * n:(s // n + 1) * n]}
        for e in sorted(needed):
            src = holder[e]
            for f, s in zip(fresh, stacks, strict=True):
                buf = s[mine_old[e]].clone() if self.group.rank == src else torch.empty_like(s[0])
                self.group.broadcast(buf, src)
                for j, x in enumerate(new_local):
                    if x == e and e not in mine_old:
                        f[j].copy_(buf)
        with torch.no_grad():
            for f, s in zip(fresh, stacks, strict=True):
                s.copy_(f)
        self.slots = new
        self.rebalances += 1
        self._build_tables()
        logger.debug("EPLB: rebalance %d, %d expert(s) moved; slots %s", self.rebalances, len(needed), new)
