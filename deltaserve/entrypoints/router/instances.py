"""Instances behind the router and their pools: health, requests in flight, least-in-flight selection."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Instance:
    """One `deltaserve serve` process the router sends requests to (mutable: its health and load change)."""

    url: str
    role: str
    """'prefill' or 'decode'."""
    index: int
    """Position in its pool (ties in the selection rotate over it)."""
    healthy: bool = True
    """False from a failed health check or request until the next /health that answers 200."""
    in_flight: int = 0
    """Router requests holding a lease on this instance."""
    down: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the instance is marked unhealthy; a lease keeps the event of its start, so the requests in flight
    on an instance that failed stop waiting for it (a new event replaces it on recovery)."""


class InstancePool:
    """The instances of one role. Selection: the healthy instance with the fewest requests in flight, ties taken
    in turn (the rotation moves on at every pick), so an idle pool spreads requests over its instances."""

    def __init__(self, role: str, urls: tuple[str, ...]) -> None:
        self.role = role
        self.instances = [Instance(url=url, role=role, index=i) for i, url in enumerate(urls)]
        self._turn = 0

    def __len__(self) -> int:
        return len(self.instances)

    @property
    def num_healthy(self) -> int:
        return sum(inst.healthy for inst in self.instances)

    def pick(self, exclude: set[str] | frozenset[str] = frozenset()) -> Instance | None:
        """The least loaded healthy instance whose URL is not in `exclude`, or None."""
        candidates = [inst for inst in self.instances if inst.healthy and inst.url not in exclude]
        if not candidates:
            return None
        n, turn = len(self.instances), self._turn
        self._turn += 1
        return min(candidates, key=lambda inst: (inst.in_flight, (inst.index - turn) % n))

    def acquire(self, instance: Instance) -> Lease:
        """Count one request in flight on `instance` until the lease is released."""
        instance.in_flight += 1
        return Lease(instance=instance, down=instance.down)

    def mark_down(self, instance: Instance, reason: str) -> None:
        """Skip `instance` until a health check passes, and stop the requests waiting on it."""
        if instance.healthy:
            logger.warning("%s instance %s is unhealthy (%s): skipped until its /health answers 200", self.role,
                           instance.url, reason)
        instance.healthy = False
        instance.down.set()

    def mark_up(self, instance: Instance) -> None:
        if instance.healthy:
            return
        logger.info("%s instance %s is healthy again", self.role, instance.url)
        instance.healthy = True
        instance.down = asyncio.Event()


@dataclass(slots=True, eq=False, kw_only=True)
class Lease:
    """One request's hold on an instance: counted in its `in_flight` until `release` (idempotent)."""

    instance: Instance
    down: asyncio.Event
    """The instance's `down` event when the lease began: set if the instance fails while the request runs."""
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.instance.in_flight -= 1


@dataclass(frozen=True, slots=True)
class Pools:
    """The router's two pools."""

    prefill: InstancePool
    decode: InstancePool

    def all(self) -> list[tuple[InstancePool, Instance]]:
        return [(pool, inst) for pool in (self.prefill, self.decode) for inst in pool.instances]
