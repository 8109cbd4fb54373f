"""What a store backend implements: raw bytes under full keys, raising on failure. `GuardedStore` turns it into a
`KVStore` (entries, namespaces, limits, timeouts, back-off, counters)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class StoreUnavailable(Exception):
    """The store cannot be reached or does not answer (an outage: the store is skipped for its back-off)."""


class StoreOpError(Exception):
    """The store answered but refused this one call (e.g. out of space): counted, no back-off."""


class Backend(Protocol):
    """Raw operations. Each may block (the caller bounds it with a timeout on a worker thread) and raises
    StoreUnavailable or StoreOpError (any other exception is treated as StoreUnavailable)."""

    name: str
    """For logs: the backend and its address, without credentials."""

    def put(self, key: str, parts: Sequence[bytes], ttl_s: float | None) -> None:
        """Stores the concatenation of `parts` under `key`, replacing any value; `ttl_s`: the store's own expiry
        where it has one (None: none)."""
        ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value (None: absent), in one round trip where the store allows (Redis MGET, Mooncake
        get_batch): a prefix hit reads tens of blocks, and one request per block would pay a round trip each. An
        entry the store has but cannot return raises for the whole batch (a miss of all of them, counted once)."""
        ...

    def exists(self, key: str) -> bool:
        ...

    def delete(self, key: str) -> None:
        """Removes the key (absent: no error)."""
        ...

    def close(self) -> None:
        ...
