"""`GuardedStore`: a `KVStore` over any `Backend`, with the behaviour every backend shares."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from deltaserve.kvstore.backend import Backend, StoreOpError
from deltaserve.kvstore.backoff import Backoff
from deltaserve.kvstore.bounded import BoundedCaller
from deltaserve.kvstore.config import KVStoreConfig
from deltaserve.kvstore.entry import Refusal, decode_entry, encode_header, store_key
from deltaserve.kvstore.store import KVStoreStats

logger = logging.getLogger(__name__)
T = TypeVar("T")
_FAILED = object()  # the call reached the store (or its timeout) and failed
_SKIPPED = object()  # the call was not made: the store is closed or in its back-off


class GuardedStore:
    """Entries (`entry.py`: header, checksum, namespace, expiry) under `{namespace}/{key}` in `backend`; every
    call bounded by `config.timeout_s` on a worker thread; a failure is a miss, counted, with the store skipped
    for the back-off (`backoff.py`); corrupt and expired entries are deleted so a later put repairs them."""

    def __init__(self, backend: Backend, namespace: str, config: KVStoreConfig, *, workers: int = 4) -> None:
        store_key(namespace, "probe")  # validates the namespace
        self.namespace = namespace
        self.config = config
        self._backend = backend
        self._caller = BoundedCaller(f"kvstore-{type(backend).__name__}", workers)
        self._backoff = Backoff(backend.name, config.backoff_s, config.max_backoff_s)
        self._lock = threading.Lock()
        self._stats = KVStoreStats()
        self._closed = False

    # -- KVStore --------------------------------------------------------------------------------------------------

    def put(self, key: str, value: bytes) -> bool:
        if len(value) > self.config.max_entry_bytes:
            self._count(oversize=1)
            return False
        header = encode_header(self.namespace, key, value, ttl_s=self.config.ttl_s)
        ttl = self.config.ttl_s or None
        start = time.perf_counter()
        done = self._call("put", self._backend.put, store_key(self.namespace, key), (header, value), ttl)
        if done is _FAILED:
            self._count(put_failures=1)
        if done is _FAILED or done is _SKIPPED:
            return False
        elapsed = time.perf_counter() - start
        with self._lock:
            s = self._stats
            self._stats = replace(s, puts=s.puts + 1, put_bytes=s.put_bytes + len(value), put_calls=s.put_calls + 1,
                                  put_latency_s_sum=s.put_latency_s_sum + elapsed,
                                  put_latency_s_max=max(s.put_latency_s_max, elapsed))
        return True

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        full = [store_key(self.namespace, key) for key in keys]
        start = time.perf_counter()
        raws = self._call("get", self._backend.get_many, full)
        if raws is _FAILED or raws is _SKIPPED:
            return [None] * len(keys)
        elapsed = time.perf_counter() - start
        with self._lock:
            s = self._stats
            self._stats = replace(s, get_calls=s.get_calls + len(keys), get_round_trips=s.get_round_trips + 1,
                                  get_latency_s_sum=s.get_latency_s_sum + elapsed,
                                  get_latency_s_max=max(s.get_latency_s_max, elapsed))
        assert isinstance(raws, list) and len(raws) == len(keys)
        return [self._decode(key, name, raw) for key, name, raw in zip(keys, full, raws, strict=True)]

    def _decode(self, key: str, full: str, raw: bytes | None) -> bytes | None:
        """The payload of the entry `raw` read under `full` (None: absent, expired or corrupt, counted; a bad entry
        is deleted so that a later put repairs it)."""
        if raw is None:
            self._count(misses=1)
            return None
        payload, refusal = decode_entry(bytes(raw), self.namespace, key)
        if payload is not None:
            self._count(hits=1, hit_bytes=len(payload))
            return payload
        if refusal is Refusal.EXPIRED:
            self._count(misses=1, expired=1)
        else:
            self._count(corrupt=1)
            logger.warning("shared KV store %s: refused the entry %s (%s); deleted, recomputing",
                           self._backend.name, full, refusal.value if refusal else "?")
        self._call("delete", self._backend.delete, full)
        return None

    def contains(self, key: str) -> bool:
        found = self._call("contains", self._backend.exists, store_key(self.namespace, key))
        if found is _FAILED or found is _SKIPPED:
            return False
        self._count(contains_hits=1) if found else self._count(contains_misses=1)
        return bool(found)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._caller.call(self.config.timeout_s, self._backend.close)
        except Exception as exc:  # closing a dead store is not worth more than a debug line
            logger.debug("shared KV store %s: close: %r", self._backend.name, exc)
        self._caller.shutdown()

    @property
    def stats(self) -> KVStoreStats:
        with self._lock:
            return replace(self._stats, outages=self._backoff.outages, available=self._backoff.available)

    # -- helpers --------------------------------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[..., T], *args: object) -> T | object:
        """fn(*args) bounded by the timeout; _FAILED (an error or a timeout) or _SKIPPED (closed, or in the
        back-off), counted and logged."""
        if self._closed or not self._backoff.allow():
            self._count(unavailable_skips=1)
            return _SKIPPED
        try:
            result = self._caller.call(self.config.timeout_s, fn, *args)
        except StoreOpError as exc:
            self._count(errors=1)
            self._backoff.succeeded()  # it answered
            logger.debug("shared KV store %s: %s failed: %s", self._backend.name, what, exc)
            return _FAILED
        except Exception as exc:  # StoreUnavailable, CallTimeout, or anything a client library raised
            self._count(errors=1)
            self._backoff.failed(f"{what}: {type(exc).__name__}: {exc}")
            return _FAILED
        self._backoff.succeeded()
        return result

    def _count(self, **increments: int) -> None:
        with self._lock:
            s = self._stats
            self._stats = replace(s, **{name: getattr(s, name) + n for name, n in increments.items()})

    def __enter__(self) -> GuardedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
