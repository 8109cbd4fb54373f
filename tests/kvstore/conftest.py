"""Real store servers for the kvstore tests: `redis-server` and `mooncake_master` + a `mooncake_client` pool on
free loopback ports, one of each per test module; a test is skipped, with the reason, when one is not installed."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from deltaserve.kvstore.servers import LocalMooncake, LocalRedis, mooncake_binaries, redis_binary


@dataclass
class StoreServer:
    """A running store: its URL, a raw client of the backend's own library, and kill / restart."""

    kind: str
    url: str
    kill: Callable[[], None]
    restart: Callable[[], None]
    raw_set: Callable[[str, bytes], None]
    raw_get: Callable[[str], bytes | None]
    raw: Any


def _redis() -> Iterator[StoreServer]:
    if redis_binary() is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server)")
    try:
        redis = importlib.import_module("redis")
    except ImportError:
        pytest.skip("the redis package is not installed (pip install 'deltaserve[redis]')")
    server = LocalRedis()
    raw = redis.Redis.from_url(server.url)
    try:
        yield StoreServer("redis", server.url, server.kill, server.restart, lambda k, v: raw.set(k, v), raw.get, raw)
    finally:
        raw.close()
        server.stop()


def _mooncake() -> Iterator[StoreServer]:
    if mooncake_binaries() is None:
        pytest.skip("the Mooncake store is not installed (pip install 'deltaserve[mooncake]')")
    try:
        store_module = importlib.import_module("mooncake.store")
    except ImportError as exc:  # e.g. libibverbs1 missing
        pytest.skip(f"mooncake.store does not import: {exc}")
    server = LocalMooncake(pool_bytes=1 << 30)
    raw = store_module.MooncakeDistributedStore()
    # global_segment_size=0: the pool process holds every entry, so a writer's exit does not lose them.
    assert raw.setup("127.0.0.1", server.metadata_url, 0, 80 << 20, "tcp", "", f"127.0.0.1:{server.rpc_port}") == 0

    def raw_set(key: str, value: bytes) -> None:
        assert raw.upsert(key, value) == 0

    def raw_get(key: str) -> bytes | None:
        return bytes(raw.get(key)) or None

    try:
        yield StoreServer("mooncake", server.url(global_segment_size=0), server.kill, server.restart, raw_set,
                          raw_get, raw)
    finally:
        raw.close()  # while the master runs: without one, a close blocks for seconds
        server.stop()


@pytest.fixture(scope="module", params=["redis", "mooncake"])
def store_server(request: pytest.FixtureRequest) -> Iterator[StoreServer]:
    yield from (_redis() if request.param == "redis" else _mooncake())
