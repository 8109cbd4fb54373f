"""The payloads a producer rank holds for consumers: each until fetched once, withdrawn or `ttl_s` old, at most
`max_bytes` of them (the oldest dropped past it). Transport-neutral: an entry carries its bytes as TCP sends them,
the descriptor a zero-copy transport hands out, and what to free when the entry goes."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.kvtransfer.counters import Counters
from deltaserve.kvtransfer.transport import TransportStats

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Held:
    """One payload as a transport holds it."""

    view: bytes | memoryview
    """The payload's bytes (sent as is by a plain TCP fetch)."""
    descriptor: bytes = b""
    """What a zero-copy fetch (LEND) is told: a segment name, a registered buffer...; empty: TCP only."""
    release: Callable[[], None] | None = None
    """Frees what the transport set up for it (unlinks a segment, deregisters memory); called once."""
    deadline: float = field(default=0.0)
    """Monotonic time past which the entry is dropped (set by `HeldPayloads.put`)."""

    @property
    def nbytes(self) -> int:
        return len(self.view)

    def free(self) -> None:
        """Release, once; errors are logged (a payload that cannot be freed must not stop the others)."""
        release, self.release = self.release, None
        if release is not None:
            try:
                release()
            except Exception:  # noqa: BLE001
                logger.exception("kv transfer: releasing a held payload failed")


class HeldPayloads:
    """The table of published payloads, oldest first. Thread-safe; entries are freed outside the lock."""

    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.ttl_s, self.clock = int(max_bytes), float(ttl_s), clock
        self._entries: OrderedDict[str, Held] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._closed = False
        self.counters = Counters()

    def put(self, transfer_id: str, held: Held) -> None:
        """Holds `held` under `transfer_id` (replacing an earlier entry), dropping the oldest entries past
        `max_bytes`; an entry larger than `max_bytes` alone is dropped at once (its fetch fails)."""
        held.deadline = self.clock() + self.ttl_s
        dropped: list[Held] = []
        with self._lock:
            self.counters.add(published=1, published_bytes=held.nbytes)
            if self._closed or held.nbytes > self.max_bytes:
                dropped.append(held)
            else:
                dropped += self._pop([transfer_id] if transfer_id in self._entries else [])
                self._entries[transfer_id] = held
                self._bytes += held.nbytes
                while self._bytes > self.max_bytes:
                    dropped += self._pop([next(iter(self._entries))])
            dropped += self._pop(self._expired())
        self._drop(dropped)

    def take(self, transfer_id: str) -> Held | None:
        """Removes and returns the entry (the caller sends it and frees it), or None if unknown or expired."""
        with self._lock:
            dropped = self._pop(self._expired())
            held = self._entries.pop(transfer_id, None)
            if held is not None:
                self._bytes -= held.nbytes
                self.counters.add(served=1)
        self._drop(dropped)
        return held

    def withdraw(self, transfer_id: str) -> None:
        with self._lock:
            dropped = self._pop([transfer_id] if transfer_id in self._entries else [])
        for held in dropped:
            held.free()

    def sweep(self) -> None:
        """Drops the entries past their ttl (the server calls this periodically)."""
        with self._lock:
            dropped = self._pop(self._expired())
        self._drop(dropped)

    def close(self) -> None:
        """Frees every entry; later puts are dropped."""
        with self._lock:
            self._closed = True
            dropped = self._pop(list(self._entries))
        for held in dropped:
            held.free()

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> TransportStats:
        return self.counters.snapshot()

    def _expired(self) -> list[str]:
        # Deadlines grow in insertion order (one ttl, a monotonic clock), so the expired entries are a prefix.
        now, expired = self.clock(), []
        for transfer_id, held in self._entries.items():
            if held.deadline > now:
                break
            expired.append(transfer_id)
        return expired

    def _pop(self, transfer_ids: list[str]) -> list[Held]:
        popped = [self._entries.pop(transfer_id) for transfer_id in transfer_ids]
        self._bytes -= sum(held.nbytes for held in popped)
        return popped

    def _drop(self, dropped: list[Held]) -> None:
        if dropped:
            self.counters.add(expired=len(dropped))
        for held in dropped:
            held.free()
