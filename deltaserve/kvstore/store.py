"""The shared store's interface (the L3 tier): a byte store keyed by strings, that never raises on a failure.

A failing, slow or unreachable store is a miss (get -> None, put / contains -> False), logged once per outage and
counted in `stats`, so the engine recomputes instead of failing; every call is bounded by the store's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class KVStoreStats:
    """A snapshot of one store's counters since it was opened (they only grow)."""

    puts: int = 0
    """Entries written."""
    put_bytes: int = 0
    """Payload bytes written (without the entry headers)."""
    put_failures: int = 0
    """Puts that reached the store and failed (an error or a timeout: also counted in `errors`)."""
    oversize: int = 0
    """Puts refused before reaching the store: the value is over `max_entry_bytes`."""
    hits: int = 0
    """Gets that returned an entry."""
    hit_bytes: int = 0
    """Payload bytes returned by gets."""
    misses: int = 0
    """Gets that found no entry, or an expired one (`expired`)."""
    expired: int = 0
    """Entries found past their TTL (counted as misses too; the entry is deleted)."""
    corrupt: int = 0
    """Entries refused by `entry.decode`: truncated, a bad checksum, or another namespace's or key's (deleted)."""
    contains_hits: int = 0
    contains_misses: int = 0
    errors: int = 0
    """Calls that failed in the backend or ran past the timeout (any operation)."""
    unavailable_skips: int = 0
    """Calls answered without trying the store, because it failed recently and its back-off has not run out."""
    outages: int = 0
    """Times the store went from available to unavailable."""
    get_calls: int = 0
    """Entries asked of the store by gets that reached it (hits, misses and refused entries)."""
    get_round_trips: int = 0
    """Requests those gets took (`get_many` asks for several entries in one): the denominator of
    `get_latency_s_sum` and `get_latency_s_max`."""
    get_latency_s_sum: float = 0.0
    get_latency_s_max: float = 0.0
    put_calls: int = 0
    """Puts that reached the store (the denominator of `put_latency_s_sum`)."""
    put_latency_s_sum: float = 0.0
    put_latency_s_max: float = 0.0
    available: bool = True
    """False during an outage: from a failed call until a call succeeds again."""


@runtime_checkable
class KVStore(Protocol):
    """A shared byte store, already bound to one namespace (a model / config fingerprint).

    Keys are the caller's `{kind}/{hash}` (e.g. `kv/<chained block hash>`, `state/<hash>`); the store prefixes its
    namespace, so stores of different models never see each other's entries. Thread-safe. No method raises on a
    store failure: see the module docstring.
    """

    namespace: str

    def put(self, key: str, value: bytes) -> bool:
        """Writes (or replaces) the entry; True once the store has it, False on any failure or an oversize value."""
        ...

    def get(self, key: str) -> bytes | None:
        """The entry's bytes, or None: absent, expired, corrupt, or the store failing (see `stats` for which)."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """`get` of each key, in as few requests as the store allows (`GuardedStore`: `GET_BATCH` entries each), each
        bounded by the timeout; a failed request misses all of its entries."""
        ...

    def contains(self, key: str) -> bool:
        """Whether the entry exists, without moving its bytes (for the scheduler's prefix lookup); False on failure.
        A True may still be followed by a get miss (eviction, expiry, a corrupt entry)."""
        ...

    def close(self) -> None:
        """Releases the connection; later calls are misses. Bounded by the timeout, idempotent."""
        ...

    @property
    def stats(self) -> KVStoreStats:
        """A frozen snapshot of the counters."""
        ...
