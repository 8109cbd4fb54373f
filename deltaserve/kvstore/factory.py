"""`open_store`: a `KVStore` for a `--shared-cache-url`, by its scheme."""

from __future__ import annotations

from urllib.parse import urlsplit

from deltaserve.kvstore.backend import Backend
from deltaserve.kvstore.config import DEFAULT_MAX_ENTRY_BYTES, KVStoreConfig
from deltaserve.kvstore.guarded import GuardedStore
from deltaserve.kvstore.store import KVStore

SCHEMES = ("redis", "rediss", "mooncake")


def make_backend(config: KVStoreConfig) -> Backend:
    """The backend for `config.url` (its client library imported now: ImportError naming the extra to install)."""
    scheme = urlsplit(config.url).scheme
    if scheme in ("redis", "rediss"):
        from deltaserve.kvstore.redis_store import RedisBackend

        return RedisBackend(config.url, timeout_s=config.timeout_s)
    if scheme == "mooncake":
        from deltaserve.kvstore.mooncake_store import MooncakeBackend

        return MooncakeBackend(config.url, max_entry_bytes=config.max_entry_bytes, timeout_s=config.timeout_s)
    raise ValueError(f"shared_cache_url: unknown scheme {scheme!r} in {config.url!r} (expected one of {SCHEMES})")


def open_config(config: KVStoreConfig, namespace: str) -> KVStore:
    """A store for `config` bound to `namespace` (`entry.fingerprint` of the model and cache layout). Connects
    lazily: an unreachable store opens fine and its calls miss until it answers."""
    return GuardedStore(make_backend(config), namespace, config)


def open_store(url: str, namespace: str, *, ttl_s: float | None = 24 * 3600.0,
               max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES, timeout_s: float = 1.0, backoff_s: float = 1.0,
               max_backoff_s: float = 30.0) -> KVStore:
    """`open_config` from keyword settings (see `KVStoreConfig` for each)."""
    config = KVStoreConfig(url=url, ttl_s=ttl_s, max_entry_bytes=max_entry_bytes, timeout_s=timeout_s,
                           backoff_s=backoff_s, max_backoff_s=max_backoff_s)
    return open_config(config, namespace)
