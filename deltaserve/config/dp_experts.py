"""`ExpertReplicas`: where the replicas of a data-parallel engine meet when their routed experts form one
expert-parallel group (vLLM's `--data-parallel-size N --enable-expert-parallel`: attention data-parallel, experts
partitioned over every rank of every replica). Set by the data-parallel client on each replica's config, never by
a user."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.config.fields import check_field_types


@dataclass(frozen=True, slots=True, kw_only=True)
class ExpertReplicas:
    """Replica `rank` of `size`; `workers_address` ('tcp://HOST:PORT') is where every worker rank of every replica
    joins one process group (replica-major ranks), `engines_address` where the replicas' engine processes join the
    CPU group that keeps their steps in lockstep (a forward exchanges tokens with every other replica)."""

    rank: int
    size: int
    workers_address: str
    engines_address: str

    def __post_init__(self) -> None:
        check_field_types(self)
        if not 0 <= self.rank < self.size:
            raise ValueError(f"expert replica rank {self.rank} is not in [0, {self.size})")
