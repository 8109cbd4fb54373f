"""Both real backends (Redis, the Mooncake Store) behind the one `KVStore` interface, against real servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltaserve.kvstore import encode, open_store, store_key
from deltaserve.kvstore.store import KVStore
from tests.kvstore.conftest import StoreServer
from tests.kvstore.peer import payload

REPO = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("peer.py")


def _open(server: StoreServer, namespace: str, **kwargs) -> KVStore:
    kwargs.setdefault("timeout_s", 5.0)  # generous for a loaded CI machine; the outage tests set their own
    return open_store(server.url, namespace, **kwargs)


def _peer(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(PEER), *args], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def _eventually(condition, deadline_s: float = 60.0) -> bool:
    """Polls `condition` until it holds or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_round_trip_of_a_few_mib(store_server: StoreServer) -> None:
    store = _open(store_server, "ns-roundtrip")
    value = os.urandom(3 << 20) + b"tail"
    assert store.put("kv/round", value)
    assert store.get("kv/round") == value
    assert store.put("kv/round", b"replaced")  # a put replaces
    assert store.get("kv/round") == b"replaced"
    stats = store.stats
    assert (stats.puts, stats.hits, stats.errors, stats.corrupt) == (2, 2, 0, 0)
    assert stats.put_bytes == len(value) + len(b"replaced")
    assert stats.get_calls == stats.get_round_trips == 2 and stats.get_latency_s_sum > 0
    store.close()


def test_get_many_reads_hits_misses_and_refusals_in_one_request(store_server: StoreServer) -> None:
    """One request for many entries (Redis MGET, Mooncake get_batch): each comes back as a single get would, a
    corrupt one refused and deleted without spoiling the others."""
    store = _open(store_server, "ns-many")
    values = {f"kv/{i}": os.urandom(1000 + i) for i in range(6)}
    for key, value in values.items():
        assert store.put(key, value)
    full = store_key("ns-many", "kv/3")
    raw = store_server.raw_get(full)
    assert raw is not None
    store_server.raw_set(full, raw[:-1] + bytes([raw[-1] ^ 1]))  # one bit of kv/3's payload flipped
    keys = [*values, "kv/absent"]
    got = store.get_many(keys)
    assert got == [None if k in ("kv/3", "kv/absent") else values.get(k) for k in keys]
    stats = store.stats
    assert (stats.get_calls, stats.get_round_trips) == (7, 1)
    assert (stats.hits, stats.misses, stats.corrupt, stats.errors) == (5, 1, 1, 0)
    assert not store.contains("kv/3")  # deleted, so that a recompute's put repairs it
    assert store.get_many([]) == [] and store.stats.get_round_trips == 1
    store.close()


def test_contains_and_miss(store_server: StoreServer) -> None:
    store = _open(store_server, "ns-contains")
    assert not store.contains("kv/absent")
    assert store.get("kv/absent") is None
    assert store.put("kv/present", b"x" * 100)
    assert store.contains("kv/present")
    stats = store.stats
    assert (stats.contains_hits, stats.contains_misses, stats.misses, stats.errors) == (1, 1, 1, 0)
    store.close()


def test_two_processes_share_entries(store_server: StoreServer) -> None:
    """A spawned process puts, this one gets the same bytes (the writer has exited); and the other way round."""
    assert _peer("put", store_server.url, "ns-peers", "kv/from-peer", str(2 << 20), "7") == "ok"
    store = _open(store_server, "ns-peers")
    assert store.get("kv/from-peer") == payload(2 << 20, 7)
    assert store.put("kv/from-parent", payload(1 << 20, 8))
    assert _peer("get", store_server.url, "ns-peers", "kv/from-parent", str(1 << 20), "8") == "ok SAME"
    assert _peer("get", store_server.url, "ns-other", "kv/from-parent", str(1 << 20), "8") == "ok MISS"
    store.close()


def test_corrupt_entry_is_refused_counted_and_deleted(store_server: StoreServer) -> None:
    store = _open(store_server, "ns-corrupt")
    value = os.urandom(1 << 20)
    assert store.put("kv/c", value)
    full = store_key("ns-corrupt", "kv/c")
    raw = store_server.raw_get(full)
    assert raw is not None and raw.endswith(value)
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0xFF
    store_server.raw_set(full, bytes(flipped))
    assert store.get("kv/c") is None
    store_server.raw_set(full, raw[: len(raw) // 2])  # truncated
    assert store.get("kv/c") is None
    assert store.stats.corrupt == 2 and store.stats.hits == 0
    assert not store.contains("kv/c")  # deleted, so that a recompute's put repairs it
    assert store.put("kv/c", value) and store.get("kv/c") == value
    store.close()


def test_other_namespace_is_a_miss_even_with_its_bytes(store_server: StoreServer) -> None:
    a, b = _open(store_server, "ns-a"), _open(store_server, "ns-b")
    assert a.put("kv/shared-hash", b"model A's block")
    assert b.get("kv/shared-hash") is None and b.stats.misses == 1
    # A's entry copied under B's key (a collision or a bug) is refused by its header.
    store_server.raw_set(store_key("ns-b", "kv/shared-hash"), store_server.raw_get(store_key("ns-a", "kv/shared-hash")))
    assert b.get("kv/shared-hash") is None and b.stats.corrupt == 1
    assert a.get("kv/shared-hash") == b"model A's block"
    a.close()
    b.close()


def test_expired_entry_is_a_miss(store_server: StoreServer) -> None:
    store = _open(store_server, "ns-ttl", ttl_s=3600.0)
    old = encode("ns-ttl", "kv/old", b"stale", ttl_s=10.0, now=time.time() - 60)
    store_server.raw_set(store_key("ns-ttl", "kv/old"), old)
    assert store.get("kv/old") is None
    assert (store.stats.expired, store.stats.misses, store.stats.corrupt) == (1, 1, 0)
    assert not store.contains("kv/old")
    store.close()


def test_redis_ttl_is_set_on_the_key(store_server: StoreServer) -> None:
    if store_server.kind != "redis":
        pytest.skip("Mooncake has no per-entry expiry (the header's expiry is checked on read: test above)")
    store = _open(store_server, "ns-redis-ttl", ttl_s=120.0)
    assert store.put("kv/t", b"v")
    pttl = store_server.raw.pttl(store_key("ns-redis-ttl", "kv/t"))
    assert 0 < pttl <= 120_000
    forever = _open(store_server, "ns-redis-ttl", ttl_s=None)
    assert forever.put("kv/f", b"v")
    assert store_server.raw.pttl(store_key("ns-redis-ttl", "kv/f")) == -1  # no expiry
    store.close()
    forever.close()


def test_server_killed_then_restarted(store_server: StoreServer) -> None:
    """Killed: calls fail soft and are counted. Restarted on the same port: used again after the back-off."""
    store = _open(store_server, "ns-outage", timeout_s=1.0, backoff_s=0.2, max_backoff_s=1.0)
    assert store.put("kv/before", b"before")
    store_server.kill()
    try:
        assert store.get("kv/before") is None
        assert store.put("kv/during", b"during") is False
        assert store.contains("kv/before") is False
        stats = store.stats
        assert stats.errors >= 1 and stats.outages == 1 and not stats.available
        assert stats.errors + stats.unavailable_skips >= 3
    finally:
        store_server.restart()
    assert _eventually(lambda: store.put("kv/after", b"after") and store.get("kv/after") == b"after")
    stats = store.stats
    assert stats.available and stats.outages == 1
    store.close()


@pytest.mark.parametrize("kind", ["redis", "mooncake"])
def test_a_silent_server_cannot_hang_the_caller(kind: str) -> None:
    """A listener that accepts connections and never answers: every call comes back, as a counted failure."""
    pytest.importorskip("redis" if kind == "redis" else "mooncake.store")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        url = (f"redis://127.0.0.1:{port}/0" if kind == "redis"
               else f"mooncake://127.0.0.1:{port}?metadata=http://127.0.0.1:{port}/metadata&global_segment_size=0")
        store = open_store(url, "ns-silent", timeout_s=0.5, backoff_s=0.05)
        assert store.get("kv/1") is None
        assert store.stats.errors == 1 and not store.stats.available
        assert _eventually(lambda: store.put("kv/1", b"v") is False and store.stats.errors >= 2)
        store.close()
