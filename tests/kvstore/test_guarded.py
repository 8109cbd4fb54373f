"""`GuardedStore` over fake backends (no server): timeouts, back-off, once-per-outage logging, limits; and the
URL and config validation of `open_store`."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import pytest

from deltaserve.kvstore import KVStoreConfig, open_store
from deltaserve.kvstore.backend import StoreOpError, StoreUnavailable
from deltaserve.kvstore.backoff import Backoff
from deltaserve.kvstore.guarded import GuardedStore
from deltaserve.kvstore.mooncake_store import parse_mooncake_url
from deltaserve.kvstore.redis_store import parse_redis_url


class DictBackend:
    """An in-memory backend that can be switched to failing, or to blocking until released."""

    name = "fake://dict"

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.fail: Exception | None = None
        self.release = threading.Event()
        self.block = False
        self.blocked = threading.Event()

    def _gate(self) -> None:
        if self.block:
            self.blocked.set()
            self.release.wait()
        if self.fail is not None:
            raise self.fail

    def put(self, key: str, parts: Sequence[bytes], ttl_s: float | None) -> None:
        self._gate()
        self.data[key] = b"".join(parts)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self._gate()
        return [self.data.get(key) for key in keys]

    def exists(self, key: str) -> bool:
        self._gate()
        return key in self.data

    def delete(self, key: str) -> None:
        self._gate()
        self.data.pop(key, None)

    def close(self) -> None:
        pass


def _store(backend: DictBackend, **kwargs) -> GuardedStore:
    config = KVStoreConfig(url="fake://x", **{"timeout_s": 0.2, "backoff_s": 0.05, "max_backoff_s": 0.2, **kwargs})
    return GuardedStore(backend, "ns", config)


def test_round_trip_and_oversize() -> None:
    backend = DictBackend()
    store = _store(backend, max_entry_bytes=10)
    assert store.put("kv/1", b"0123456789") and store.get("kv/1") == b"0123456789"
    assert not store.put("kv/2", b"01234567890")
    assert store.stats.oversize == 1 and store.stats.puts == 1 and "ns/kv/2" not in backend.data


def test_a_blocked_backend_cannot_hang_the_caller() -> None:
    """Every call returns while the backend is still stuck (it is released only at the end)."""
    backend = DictBackend()
    store = _store(backend, backoff_s=1000.0, max_backoff_s=1000.0)
    backend.block = True
    try:
        assert store.get("kv/1") is None
        assert backend.blocked.is_set() and not backend.release.is_set()
        assert store.put("kv/1", b"v") is False  # skipped: in its back-off
        assert store.contains("kv/1") is False
        stats = store.stats
        assert (stats.errors, stats.unavailable_skips, stats.outages, stats.available) == (1, 2, 1, False)
    finally:
        backend.release.set()
    store.close()


def test_logs_once_per_outage_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    backend = DictBackend()
    store = _store(backend)
    backend.fail = StoreUnavailable("connection refused")
    with caplog.at_level(logging.INFO, logger="deltaserve.kvstore"):
        deadline = time.monotonic() + 30
        while store.stats.errors < 4 and time.monotonic() < deadline:  # failed probes after each back-off
            assert store.get("kv/1") is None
            time.sleep(0.01)
        backend.fail = None
        deadline = time.monotonic() + 30
        while not store.put("kv/1", b"v") and time.monotonic() < deadline:
            time.sleep(0.01)
    assert store.get("kv/1") == b"v"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r for r in caplog.records if r.levelno == logging.INFO and "available again" in r.getMessage()]
    assert len(warnings) == 1 and "connection refused" in warnings[0].getMessage()
    assert len(infos) == 1
    stats = store.stats
    assert stats.errors >= 4 and stats.outages == 1 and stats.available and stats.unavailable_skips >= 1


def test_an_op_error_is_counted_without_back_off() -> None:
    backend = DictBackend()
    store = _store(backend)
    backend.fail = StoreOpError("no space")
    assert store.put("kv/1", b"v") is False
    backend.fail = None
    assert store.put("kv/1", b"v") is True  # no back-off: the store answered
    stats = store.stats
    assert (stats.errors, stats.put_failures, stats.outages, stats.unavailable_skips) == (1, 1, 0, 0)


def test_closed_store_misses() -> None:
    backend = DictBackend()
    store = _store(backend)
    assert store.put("kv/1", b"v")
    store.close()
    store.close()
    assert store.get("kv/1") is None and store.put("kv/2", b"v") is False
    assert store.stats.unavailable_skips == 2


def test_backoff_grants_one_probe_and_doubles() -> None:
    now = [0.0]
    backoff = Backoff("x", 1.0, 4.0, clock=lambda: now[0])
    assert backoff.allow()
    backoff.failed("down")
    assert not backoff.allow()
    now[0] = 1.0
    assert backoff.allow() and not backoff.allow()  # one probe, the others skip
    backoff.failed("still down")  # next try 2 s later
    now[0] = 2.9
    assert not backoff.allow()
    now[0] = 3.0
    assert backoff.allow()
    backoff.succeeded()
    assert backoff.available and backoff.allow() and backoff.allow()
    assert backoff.outages == 1


@pytest.mark.parametrize("url, fragment", [
    ("localhost:6379", "shared_cache_url"),
    ("memcached://h:1", "unknown scheme"),
    ("redis://:6379", "no host"),
    ("redis://h:port", "bad port"),
    ("redis://h:1/zero", "database"),
    ("mooncake://h", "HOST:PORT"),
    ("mooncake://h:1", "metadata"),
    ("mooncake://h:1?metadata=http://m:2/metadata&segment=1", "unknown mooncake"),
    ("mooncake://h:1?metadata=http://m:2/metadata&global_segment_size=1GB", "byte count"),
])
def test_bad_urls_name_the_field(url: str, fragment: str) -> None:
    with pytest.raises(ValueError, match="shared_cache_url") as info:
        open_store(url, "ns")
    assert fragment in str(info.value)


def test_url_parsing() -> None:
    assert parse_redis_url("redis://10.0.0.5:7000/3") == ("10.0.0.5", 7000, 3)
    assert parse_redis_url("redis://cache") == ("cache", 6379, 0)
    address = parse_mooncake_url("mooncake://10.0.0.1:50051?metadata=http://10.0.0.1:8080/metadata"
                                 "&global_segment_size=0&protocol=rdma")
    assert (address.master, address.metadata, address.global_segment_size, address.protocol) == (
        "10.0.0.1:50051", "http://10.0.0.1:8080/metadata", 0, "rdma")


@pytest.mark.parametrize("field, kwargs", [
    ("shared_cache_timeout_s", {"timeout_s": 0.0}),
    ("shared_cache_max_entry_bytes", {"max_entry_bytes": 0}),
    ("shared_cache_ttl_s", {"ttl_s": -1.0}),
    ("shared_cache_backoff_s", {"backoff_s": 10.0, "max_backoff_s": 1.0}),
])
def test_config_errors_name_the_field(field: str, kwargs: dict) -> None:
    with pytest.raises(ValueError, match=field):
        KVStoreConfig(url="redis://h:1", **kwargs)
