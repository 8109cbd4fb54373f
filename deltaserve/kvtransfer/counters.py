"""The mutable counters behind `TransportStats`, one per server or client, and the fetch wrapper that keeps the
protocol's promise: a fetch never raises on a transfer failure."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from deltaserve.kvtransfer.transport import Payload, TransportStats

logger = logging.getLogger(__name__)


class Counters:
    """Thread-safe cumulative counters; `snapshot()` is the frozen `TransportStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = TransportStats()

    def add(self, **deltas: float) -> None:
        """Adds each named delta to the TransportStats field of that name."""
        with self._lock:
            self._stats = dataclasses.replace(
                self._stats, **{name: getattr(self._stats, name) + delta for name, delta in deltas.items()})

    def snapshot(self) -> TransportStats:
        with self._lock:
            return self._stats


def counted_fetch(counters: Counters, what: str, fetch: Callable[[], Payload | None]) -> Payload | None:
    """`fetch()`, counted (fetched, bytes, failures, seconds); any exception becomes None (a recompute) and a log
    line, since a transfer failure must never reach the consumer's step loop as an exception."""
    start = time.monotonic()
    try:
        payload = fetch()
    except Exception as exc:  # noqa: BLE001 (the protocol's rule: failures are None, whatever the cause)
        logger.warning("kv transfer fetch %s failed: %s: %s", what, type(exc).__name__, exc)
        payload = None
    seconds = time.monotonic() - start
    if payload is None:
        counters.add(fetch_failures=1, fetch_seconds=seconds)
    else:
        counters.add(fetched=1, fetched_bytes=len(payload), fetch_seconds=seconds)
    return payload
