"""Transfer throughput of each transport between two real processes:
`python -m deltaserve.kvtransfer.bench [--sizes 1M,64M,512M] [--transports shm,tcp,nixl,mooncake] [--json]`.

A server process per transport publishes a fresh payload each round; this process fetches it with the client
`make_client` builds and checks its CRC-32. Rounds alternate between the transports (this machine's speed drifts),
the first round of each size is a warm-up, and the figures are medians: fetch GB/s (10^9 bytes per second of the
consumer's wait, connection and control exchange included) and publish GB/s (the producer's `publish`: a copy into
shared memory, a memory registration for NIXL and Mooncake, nothing for TCP).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

from deltaserve.config.kv_transfer import KVTransferConfig
from deltaserve.kvtransfer.factory import make_client, make_server

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True, slots=True)
class Figure:
    """One transport at one payload size."""

    transport: str
    size_bytes: int
    rounds: int
    fetch_gbps: float
    """Median over the rounds."""
    fetch_gbps_min: float
    fetch_gbps_max: float
    fetch_ms: float
    publish_gbps: float


def parse_size(text: str) -> int:
    """'64M' -> 64 MiB; K, M, G are powers of 1024; a bare number is bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def _serve(transport: str, max_bytes: int, pipe: Connection) -> None:
    """The producer process: publishes a payload per request, reports its CRC-32 and the publish time."""
    try:
        server = make_server(KVTransferConfig(kv_connector=transport, kv_buffer_size=max_bytes,
                                              transfer_ttl_s=3600.0), rank=0)
    except Exception as exc:  # noqa: BLE001 (reported as a skipped transport)
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    pipe.send(("ready", server.address))
    bases: dict[int, bytes] = {}
    while (request := pipe.recv()) is not None:
        transfer_id, size, round_index = request
        if size not in bases:
            bases = {size: bytes(range(256)) * (size // 256) + bytes(size % 256)}
        payload = bases[size][:-1] + bytes([round_index % 256]) if size else b""  # a fresh object each round
        start = time.perf_counter()
        server.publish(transfer_id, payload)
        publish_s = time.perf_counter() - start
        pipe.send((zlib.crc32(payload), publish_s))
    server.close()
    pipe.send(server.stats())


def measure(transports: list[str], sizes: list[int], rounds: int,
            timeout_s: float = 120.0) -> tuple[list[Figure], dict[str, str]]:
    """The figures of each transport that starts, and why the others did not."""
    context = mp.get_context("spawn")
    servers: dict[str, tuple[Any, Connection, str]] = {}
    skipped: dict[str, str] = {}
    for transport in transports:
        ours, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(transport, 2 * max(sizes) + (1 << 20), theirs), daemon=True)
        process.start()
        status, detail = ours.recv()
        if status == "ready":
            servers[transport] = (process, ours, detail)
        else:
            skipped[transport] = detail
            process.join()
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    clients = {transport: make_client(KVTransferConfig(kv_connector=transport)) for transport in servers}
    try:
        for size in sizes:
            for round_index in range(rounds + 1):  # round 0 warms connections and caches up
                for transport, (_, pipe, address) in servers.items():
                    transfer_id = f"bench-{size}-{round_index}"
                    pipe.send((transfer_id, size, round_index))
                    crc, publish_s = pipe.recv()
                    start = time.perf_counter()
                    payload = clients[transport].fetch(address, transfer_id, timeout_s)
                    fetch_s = time.perf_counter() - start
                    if payload is None or len(payload) != size or zlib.crc32(payload) != crc:
                        raise RuntimeError(f"{transport}: fetch of {size} bytes failed or differs "
                                           f"({clients[transport].stats()})")
                    del payload
                    if round_index:
                        samples.setdefault((transport, size), []).append((fetch_s, publish_s))
    finally:
        for process, pipe, _ in servers.values():
            pipe.send(None)
            process.join(timeout=30)
        for client in clients.values():
            client.close()
    return [_figure(transport, size, timings) for (transport, size), timings in samples.items()], skipped


def _figure(transport: str, size: int, timings: list[tuple[float, float]]) -> Figure:
    fetch = [size / max(s, 1e-9) / 1e9 for s, _ in timings]
    publish = [size / max(s, 1e-9) / 1e9 for _, s in timings]
    return Figure(transport, size, len(timings), statistics.median(fetch), min(fetch), max(fetch),
                  1000 * statistics.median(s for s, _ in timings), statistics.median(publish))


def format_table(figures: list[Figure]) -> str:
    lines = [f"{'transport':<10} {'size':>8} {'fetch GB/s':>11} {'(min-max)':>13} {'fetch ms':>9} {'publish GB/s':>13}"]
    for figure in figures:
        size = next((f"{figure.size_bytes // unit}{name}" for name, unit in reversed(_UNITS.items())
                     if figure.size_bytes >= unit and figure.size_bytes % unit == 0), f"{figure.size_bytes}B")
        lines.append(f"{figure.transport:<10} {size:>8} {figure.fetch_gbps:>11.2f} "
                     f"{f'({figure.fetch_gbps_min:.2f}-{figure.fetch_gbps_max:.2f})':>13} {figure.fetch_ms:>9.1f} "
                     f"{figure.publish_gbps:>13.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", default="1M,64M,512M",
                        help="payload sizes, K/M/G = KiB/MiB/GiB (default 1M,64M,512M)")
    parser.add_argument("--transports", default="shm,tcp,nixl,mooncake", help="default shm,tcp,nixl,mooncake")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per size (default 5; plus a warm-up)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs INFO lines to stdout (the --json output)
    sizes = [parse_size(size) for size in args.sizes.split(",")]
    figures, skipped = measure(args.transports.split(","), sizes, args.rounds)
    figures.sort(key=lambda figure: (figure.size_bytes, -figure.fetch_gbps))
    if args.json:
        print(json.dumps({"figures": [asdict(figure) for figure in figures], "skipped": skipped}, indent=2))
    else:
        print(format_table(figures))
        for transport, reason in skipped.items():
            print(f"{transport}: skipped ({reason})", file=sys.stderr)


if __name__ == "__main__":
    main()
