"""Put / get throughput of the shared store: `python -m deltaserve.kvstore.bench [--url URL ...]`.

Without `--url` it starts a local `redis-server` and a local Mooncake master + pool (servers.py) and measures
both. Each size is put `--repeat` times under distinct keys, then read back; the figure is payload bytes over wall
time, through the `KVStore` (entry header, CRC-32, bounded calls) and through the bare backend (the client library
alone), so the difference is this package's overhead. Then a prefix hit's read: `--blocks` entries of
`--block-kib` each, read one request per entry and in one `get_many` request, side by side.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

from deltaserve.kvstore.config import KVStoreConfig
from deltaserve.kvstore.entry import store_key
from deltaserve.kvstore.factory import make_backend
from deltaserve.kvstore.guarded import GuardedStore
from deltaserve.kvstore.servers import LocalMooncake, LocalRedis

MIB = 1 << 20


@dataclass(frozen=True)
class Throughput:
    """One backend, one size, one path: GB/s (10^9 bytes per second) of put and of get."""

    url: str
    path: str
    size_mib: int
    put_gbps: float
    get_gbps: float


def measure(url: str, sizes_mib: list[int], repeat: int) -> list[Throughput]:
    """The throughput of `url` at each size, through the KVStore and through the bare backend."""
    config = KVStoreConfig(url=url, ttl_s=3600.0, max_entry_bytes=max(sizes_mib) * MIB, timeout_s=60.0)
    store = GuardedStore(make_backend(config), "bench", config)
    raw = make_backend(config)
    results = []
    try:
        for size in sizes_mib:
            value = os.urandom(size * MIB)
            keys = [f"bench/{size}/{i}" for i in range(repeat)]
            for path, put, get in (("KVStore", store.put, store.get),
                                   ("backend", lambda k, v: raw.put(k, (v,), None), lambda k: raw.get_many([k])[0])):
                put(keys[0] + "-warm", value)
                start = time.perf_counter()
                for key in keys:
                    if put(key, value) is False:
                        raise RuntimeError(f"{url}: put of {size} MiB failed: {store.stats}")
                put_s = time.perf_counter() - start
                start = time.perf_counter()
                for key in keys:
                    if get(key) is None:
                        raise RuntimeError(f"{url}: get of {size} MiB missed: {store.stats}")
                get_s = time.perf_counter() - start
                total = size * MIB * repeat
                results.append(Throughput(url.split("?")[0], path, size, total / put_s / 1e9, total / get_s / 1e9))
                for key in [*keys, keys[0] + "-warm"]:
                    raw.delete(key)
                    raw.delete(f"bench/{key}")
    finally:
        store.close()
        raw.close()
    return results


@dataclass(frozen=True)
class BatchedRead:
    """Reading `count` entries of `size_kib` KiB: one get per entry vs one get_many, best of the repeats."""

    url: str
    count: int
    size_kib: int
    one_by_one_s: float
    batched_s: float


def measure_batched(url: str, count: int, size_kib: int, repeat: int) -> BatchedRead:
    """The time to read `count` entries one request each and all in one request, through the KVStore."""
    config = KVStoreConfig(url=url, ttl_s=3600.0, max_entry_bytes=size_kib << 10, timeout_s=60.0)
    store = GuardedStore(make_backend(config), "bench-batched", config)
    raw = make_backend(config)
    keys = [f"kv/{i}" for i in range(count)]
    try:
        for key in keys:
            if not store.put(key, os.urandom(size_kib << 10)):
                raise RuntimeError(f"{url}: put of {size_kib} KiB failed: {store.stats}")
        one_by_one, batched = float("inf"), float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            singles = [store.get(key) for key in keys]
            one_by_one = min(one_by_one, time.perf_counter() - start)
            start = time.perf_counter()
            together = store.get_many(keys)
            batched = min(batched, time.perf_counter() - start)
            if singles != together or any(v is None for v in together):
                raise RuntimeError(f"{url}: the batched read differs from the single reads: {store.stats}")
    finally:
        for key in keys:  # a shared store (--url) keeps nothing of the benchmark's
            raw.delete(store_key(store.namespace, key))
        store.close()
        raw.close()
    return BatchedRead(url.split("?")[0], count, size_kib, one_by_one, batched)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", action="append", help="a store URL (repeatable); default: local Redis and Mooncake")
    parser.add_argument("--sizes-mib", default="1,16,64", help="value sizes in MiB (default 1,16,64)")
    parser.add_argument("--repeat", type=int, default=5, help="values per size and path (default 5)")
    parser.add_argument("--blocks", type=int, default=64, help="entries in the batched-read comparison (default 64)")
    parser.add_argument("--block-kib", type=int, default=64, help="KiB per entry there (default 64)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    servers: list[LocalRedis | LocalMooncake] = []
    urls = args.url
    if not urls:
        redis, mooncake = LocalRedis(), LocalMooncake(pool_bytes=2 << 30)
        servers = [redis, mooncake]
        urls = [redis.url, mooncake.url(global_segment_size=0)]
    try:
        print(f"{'store':<40} {'path':<8} {'MiB':>4} {'put GB/s':>9} {'get GB/s':>9}")
        for url in urls:
            for r in measure(url, sizes, args.repeat):
                print(f"{r.url:<40} {r.path:<8} {r.size_mib:>4} {r.put_gbps:>9.2f} {r.get_gbps:>9.2f}", flush=True)
        print(f"\n{'store':<40} {'entries':>7} {'KiB':>5} {'one by one ms':>13} {'get_many ms':>11} {'ratio':>6}")
        for url in urls:
            b = measure_batched(url, args.blocks, args.block_kib, args.repeat)
            print(f"{b.url:<40} {b.count:>7} {b.size_kib:>5} {b.one_by_one_s * 1e3:>13.1f} {b.batched_s * 1e3:>11.1f} "
                  f"{b.one_by_one_s / b.batched_s:>5.2f}x", flush=True)
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    main()
