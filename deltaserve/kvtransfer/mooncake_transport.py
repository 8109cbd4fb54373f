"""The Mooncake Transfer Engine between processes (its TCP transport here; RDMA where the CUDA build and NICs
are). Address `mooncake+tcp://host:port`.

Both sides run a `TransferEngine` in P2PHANDSHAKE mode (no metadata server: peers exchange segment descriptors
directly on the engine's RPC port). The producer registers each published payload's memory (no copy: the bytes
object itself); a consumer LENDs it over the TCP control server (tcp.py), which hands out the engine's
`host:rpc_port`, the buffer's address and length; the consumer `transfer_sync_read`s it straight into the bytes
object it returns, then RELEASEs it and the producer unregisters it. The read cannot be interrupted, so it runs on
a worker thread the fetch stops waiting for at its deadline (the thread keeps the buffer until the engine lets go).
Imported only when used.
"""

from __future__ import annotations

import importlib
import struct
import threading
import time
from typing import Any

import numpy as np

from deltaserve.kvtransfer.buffers import ReceiveBuffer
from deltaserve.kvtransfer.counters import Counters
from deltaserve.kvtransfer.held import Held
from deltaserve.kvtransfer.lent_read import ReadFailed, fetch_from
from deltaserve.kvtransfer.tcp import TcpTransferServer
from deltaserve.kvtransfer.transport import Payload, TransportStats
from deltaserve.kvtransfer.wire import Deadline

_DESCRIPTOR = struct.Struct("<QQ")  # buffer address, payload length; then the engine's host:port


def import_mooncake() -> Any:
    """`mooncake.engine`; ImportError naming `kv_connector` and the install lines when it is missing."""
    try:
        return importlib.import_module("mooncake.engine")
    except ImportError as exc:
        raise ImportError(f"kv_transfer_config.kv_connector 'mooncake' needs the Mooncake Transfer Engine: pip "
                          f"install mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA), "
                          f"and Debian's libibverbs1 ({exc})") from exc


def start_engine(host: str) -> Any:
    """A TransferEngine on `host` in P2PHANDSHAKE mode over TCP; RuntimeError if it does not start."""
    engine = import_mooncake().TransferEngine()
    status = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if status != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', 'tcp') returned {status}")
    return engine


class MooncakeTransferServer(TcpTransferServer):
    """A producer rank's server whose payloads consumers read with the Mooncake engine (or FETCH over TCP)."""

    SCHEME = "mooncake+tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> None:
        self._engine = start_engine(host)
        self._target = f"{host}:{self._engine.get_rpc_port()}".encode()
        self._engine_lock = threading.Lock()
        super().__init__(host, port, **kwargs)

    def _hold(self, payload: bytes) -> Held:
        if not payload:
            return Held(payload)
        address = int(np.frombuffer(payload, dtype=np.uint8).ctypes.data)
        with self._engine_lock:
            status = self._engine.register_memory(address, len(payload))
        if status != 0:  # served over TCP only
            return Held(payload)

        def release() -> None:
            with self._engine_lock:
                self._engine.unregister_memory(address)

        return Held(payload, _DESCRIPTOR.pack(address, len(payload)) + self._target, release)


class MooncakeTransferClient:
    """Reads with the Mooncake engine from `mooncake+tcp` producers, over TCP from any other producer."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._engine = start_engine(host)
        self._lock = threading.Lock()
        self._counters = Counters()

    def fetch(self, address: str, transfer_id: str, timeout_s: float) -> Payload | None:
        return fetch_from(self._counters, address, transfer_id, timeout_s, MooncakeTransferServer.SCHEME, self._read)

    def stats(self) -> TransportStats:
        return self._counters.snapshot()

    def close(self) -> None:
        """The engine goes with the client (a read still running keeps its own buffer)."""

    def _read(self, descriptor: bytes, deadline: Deadline) -> Payload | None:
        remote_address, nbytes = _DESCRIPTOR.unpack_from(descriptor)
        target = descriptor[_DESCRIPTOR.size:].decode()
        buffer = ReceiveBuffer(nbytes)
        buffer.prefault()
        with self._lock:
            if self._engine.register_memory(buffer.address, nbytes) != 0:
                raise ReadFailed("Mooncake could not register the receive buffer")
        done = threading.Event()
        status: list[int] = []

        def read() -> None:  # owns `buffer` until the engine returns, whether or not anyone still waits
            try:
                status.append(self._engine.transfer_sync_read(target, buffer.address, remote_address, nbytes))
            finally:
                with self._lock:
                    self._engine.unregister_memory(buffer.address)
                done.set()

        threading.Thread(target=read, name="kvt-mooncake-read", daemon=True).start()
        if not done.wait(timeout=max(0.0, deadline.end - time.monotonic())):
            return None
        if status != [0]:
            raise ReadFailed(f"transfer_sync_read returned {status[0] if status else 'nothing'}")
        return buffer.take()

