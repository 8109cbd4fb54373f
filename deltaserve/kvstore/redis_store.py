"""The Redis backend (`redis://HOST:PORT[/DB]`, `rediss://` for TLS; redis-py, imported when a store opens).

Entries are plain string values: `SET key value PX ttl` (Redis's own expiry, besides the entry header's), `GET`,
`EXISTS`, `DEL`. redis-py's socket timeouts are the store's timeout and its retries are off, so a dead or stalled
server answers in one timeout; the connection pool reconnects by itself when the server comes back. Redis caps a
value at 512 MB (`proto-max-bulk-len`); memory limits and eviction are the server's (`maxmemory`,
`maxmemory-policy allkeys-lru` suits a cache).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from deltaserve.kvstore.backend import StoreOpError, StoreUnavailable


def parse_redis_url(url: str) -> tuple[str, int, int]:
    """(host, port, db) of a `redis://` URL; ValueError naming `shared_cache_url` otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"shared_cache_url: expected redis://HOST:PORT[/DB], got {url!r}")
    try:
        port = parts.port or 6379
    except ValueError:
        raise ValueError(f"shared_cache_url: bad port in {url!r}") from None
    if not parts.hostname:
        raise ValueError(f"shared_cache_url: no host in {url!r} (expected redis://HOST:PORT[/DB])")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"shared_cache_url: the database must be a number, got {path!r} in {url!r}")
    return parts.hostname, port, int(path or 0)


class RedisBackend:
    """One redis-py client (a thread-safe connection pool) with the store's timeout on every socket operation."""

    def __init__(self, url: str, *, timeout_s: float) -> None:
        host, port, db = parse_redis_url(url)
        self.name = f"redis://{host}:{port}/{db}"
        try:
            redis = importlib.import_module("redis")
            retry = importlib.import_module("redis.retry")
            backoff = importlib.import_module("redis.backoff")
        except ImportError as exc:
            raise ImportError("shared_cache_url: redis:// needs the redis package: pip install 'deltaserve[redis]'"
                              ) from exc
        self._errors: Any = redis.exceptions
        # No retries inside redis-py: the store's back-off decides when to try again.
        self._client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry.Retry(backoff.NoBackoff(), 0),
            retry_on_timeout=False, health_check_interval=0)

    def put(self, key: str, parts: Sequence[bytes], ttl_s: float | None) -> None:
        value = parts[0] if len(parts) == 1 else b"".join(parts)
        px = max(1, int(ttl_s * 1000)) if ttl_s else None
        self._run(self._client.set, key, value, px=px)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values = self._run(self._client.mget, list(keys))
        return [None if v is None else bytes(v) for v in values]

    def exists(self, key: str) -> bool:
        return bool(self._run(self._client.exists, key))

    def delete(self, key: str) -> None:
        self._run(self._client.delete, key)

    def close(self) -> None:
        self._client.close()

    def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (self._errors.ConnectionError, self._errors.TimeoutError) as exc:
            raise StoreUnavailable(str(exc) or type(exc).__name__) from exc
        except self._errors.ResponseError as exc:  # e.g. OOM with maxmemory and no eviction policy
            raise StoreOpError(str(exc)) from exc
