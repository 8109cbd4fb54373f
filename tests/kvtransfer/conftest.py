"""Producers in their own processes (tests/kvtransfer/peer.py) and in this one, for every transport; NIXL and
Mooncake are skipped, with the reason, where their libraries do not import."""

from __future__ import annotations

import functools
import importlib
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from deltaserve.config.kv_transfer import KVTransferConfig
from deltaserve.kvtransfer.factory import make_client
from deltaserve.kvtransfer.transport import TransferClient, TransportStats
from tests.kvtransfer import peer

TRANSPORTS = ("tcp", "shm", "nixl", "mooncake")
_LIBRARIES = {"nixl": "nixl._api", "mooncake": "mooncake.engine"}


@functools.cache
def missing(transport: str) -> str | None:
    """Why `transport` cannot run here, or None."""
    library = _LIBRARIES.get(transport)
    if library is None:
        return None
    try:
        importlib.import_module(library)
    except ImportError as exc:
        return f"{library} does not import: {exc}"
    return None


def require(transport: str) -> None:
    reason = missing(transport)
    if reason is not None:
        pytest.skip(reason)


@dataclass
class Producer:
    """A producer process serving one transport."""

    transport: str
    address: str
    process: Any
    pipe: Any
    reached: Any
    """Set by the process just before it stops itself on purpose (peer.FAULTS)."""

    def publish(self, transfer_id: str, nbytes: int, seed: int = 0) -> bytes:
        """Publishes there; returns the payload it published."""
        self.pipe.send(("publish", transfer_id, nbytes, seed))
        assert self.pipe.recv() == "ok"
        return peer.payload(nbytes, seed)

    def stats(self) -> TransportStats:
        self.pipe.send(("stats",))
        stats: TransportStats = self.pipe.recv()
        return stats

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join()

    def close(self) -> None:
        """A clean close if it is running normally, else a kill."""
        if self.process.is_alive() and not self.reached.is_set():
            self.pipe.send(None)
            if self.pipe.poll(30):
                self.pipe.recv()
            self.process.join(30)
        self.kill()


def start_producer(transport: str, *, max_bytes: int = 1 << 30, ttl_s: float = 600.0,
                   fault: str = "none") -> Producer:
    require(transport)
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    reached = context.Event()
    process = context.Process(target=peer.serve, args=(transport, theirs, max_bytes, ttl_s, fault, reached),
                              daemon=True)
    process.start()
    if not ours.poll(60):
        process.kill()
        raise RuntimeError(f"{transport} producer did not start")
    return Producer(transport, ours.recv(), process, ours, reached)


@pytest.fixture(scope="module", params=TRANSPORTS)
def producer(request: pytest.FixtureRequest) -> Iterator[Producer]:
    """A well-behaved producer of each transport, shared by a module's tests (each uses its own ids)."""
    started = start_producer(request.param)
    try:
        yield started
    finally:
        started.close()


def client_for(transport: str) -> TransferClient:
    """The consumer a deployment with kv_connector=transport builds."""
    return make_client(KVTransferConfig(kv_connector=transport))


class FakeClock:
    """A monotonic clock the test advances."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def in_process_server(transport: str, **kwargs: Any) -> Any:
    """A producer server of `transport` in this process."""
    require(transport)
    module, name = peer.SERVERS[transport]
    return getattr(importlib.import_module(module), name)("127.0.0.1", 0, **kwargs)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Waits for a condition another process or thread brings about (checked every 10 ms, up to timeout_s)."""
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def segments(pid: int, owner_files: bool = False) -> list[str]:
    """The transfer segments process `pid` has in /dev/shm (with its owner files if asked)."""
    if not os.path.isdir("/dev/shm"):
        return []
    prefix = f"dskvt-{pid}-"
    return sorted(name for name in os.listdir("/dev/shm")
                  if name.startswith(prefix) and (owner_files or not name.endswith("-owner")))
