"""The shared store's settings: what the engine will hold for `--shared-cache-url` and its companions."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_MAX_ENTRY_BYTES = 64 << 20


@dataclass(frozen=True)
class KVStoreConfig:
    """Where the shared store (L3) is and how long the engine waits for it. Errors name the engine's fields."""

    url: str
    """`redis://HOST:PORT[/DB]` or `mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata` (see
    `factory.open_store` for the optional query fields)."""
    ttl_s: float | None = 24 * 3600.0
    """Seconds an entry stays valid after its last put; None or 0: no expiry (the store's own eviction only)."""
    max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES
    """Largest payload written; a larger put is refused (False, counted in `oversize`)."""
    timeout_s: float = 1.0
    """The most one call (put, get, contains, close) waits for the store; past it the call is a failure."""
    backoff_s: float = 1.0
    """After a failure the store is skipped this long, then tried again; doubles while it keeps failing."""
    max_backoff_s: float = 30.0
    """The longest back-off."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or "://" not in self.url:
            raise ValueError(f"shared_cache_url: expected redis://HOST:PORT or mooncake://HOST:PORT?metadata=URL, "
                             f"got {self.url!r}")
        if self.ttl_s is not None and not (math.isfinite(self.ttl_s) and self.ttl_s >= 0):
            raise ValueError(f"shared_cache_ttl_s: must be >= 0 or None, got {self.ttl_s!r}")
        if self.max_entry_bytes <= 0:
            raise ValueError(f"shared_cache_max_entry_bytes: must be > 0, got {self.max_entry_bytes!r}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"shared_cache_timeout_s: must be > 0, got {self.timeout_s!r}")
        if not (self.backoff_s > 0 and self.max_backoff_s >= self.backoff_s):
            raise ValueError(f"shared_cache_backoff_s: must be > 0 and <= max_backoff_s ({self.max_backoff_s}), "
                             f"got {self.backoff_s!r}")
