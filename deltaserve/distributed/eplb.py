"""Expert-parallel load balancing (EPLB): from the tokens routed to each expert, which physical expert slots hold
which expert. Pure and deterministic: every rank computes the same placement from the same counts (the router runs
whole on every rank, so the counts agree without a collective)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EPLBSettings:
    """`--enable-eplb` with `--num-redundant-experts` extra slots, rebalanced every `step_interval` forwards."""

    num_redundant_experts: int
    step_interval: int


def initial_placement(num_experts: int, num_redundant: int) -> list[int]:
    """Physical slot -> expert before any counts: experts in order, then copies of experts 0..R-1. With R <= E no
    rank holds two copies of one expert (slot E + j is at least a rank's slot count after slot j)."""
    if num_redundant > num_experts:
        raise ValueError(f"num_redundant_experts={num_redundant} exceeds the {num_experts} routed experts")
    return list(range(num_experts)) + list(range(num_redundant))


def balanced_placement(load: Sequence[int], num_redundant: int, num_ranks: int) -> list[int]:
    """Physical slot -> expert, rank r holding slots `[r * S, (r + 1) * S)` with `S = (E + R) / num_ranks`.

    The `R` extra copies go one at a time to the expert with the most tokens per copy (at most one copy per rank);
    then the copies, heaviest first (each carrying its expert's tokens divided by its copies), go to the least
    loaded rank with a free slot, preferring a rank without a copy of that expert. Within a rank, slots are in
    expert order."""
    num_experts = len(load)
    slots = (num_experts + num_redundant) // num_ranks
    copies = [1] * num_experts
    for _ in range(num_redundant):
        e = max((e for e in range(num_experts) if copies[e] < num_ranks),
                key=lambda e: (load[e] / copies[e], -e))
        copies[e] += 1
    items = sorted(((load[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
                   key=lambda item: (-item[0], item[1]))
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    rank_load = [0.0] * num_ranks
    for weight, e in items:
        free = [r for r in range(num_ranks) if len(held[r]) < slots]
        fresh = [r for r in free if e not in held[r]] or free
        r = min(fresh, key=lambda r: (rank_load[r], r))
        held[r].append(e)
        rank_load[r] += weight
    return [e for rank in held for e in sorted(rank)]
