"""NIXL (NVIDIA's transfer library, over UCX) between CPU processes. Address `nixl+tcp://host:port`.

The producer registers each published payload's memory with its NIXL agent (no copy: the bytes object itself);
a consumer LENDs it over the TCP control server (tcp.py), which hands out the agent's metadata for that buffer and
the buffer's descriptor; the consumer's agent READs it straight into the bytes object it returns, then RELEASEs it
and the producer deregisters it. Imported only when used; the library imports torch (to find CUDA) at import.
"""

from __future__ import annotations

import importlib
import logging
import os
import struct
import threading
import time
import uuid
from typing import Any

import numpy as np

from deltaserve.kvtransfer.buffers import ReceiveBuffer
from deltaserve.kvtransfer.counters import Counters
from deltaserve.kvtransfer.held import Held
from deltaserve.kvtransfer.lent_read import ReadFailed, fetch_from
from deltaserve.kvtransfer.tcp import TcpTransferServer
from deltaserve.kvtransfer.transport import Payload, TransportStats
from deltaserve.kvtransfer.wire import Deadline

logger = logging.getLogger(__name__)

_DESCRIPTOR = struct.Struct("<QI")  # payload length, agent metadata length; then the metadata, then the descriptors
_INFINIBAND = "/sys/class/infiniband"
_POLL_S = 0.0002
"""Pause between polls of a transfer's state (a busy loop would take a core from the transfer itself)."""


def import_nixl() -> Any:
    """The `nixl._api` module; ImportError naming `kv_connector` and the install line when it is missing."""
    _skip_unused_infiniband()
    try:
        return importlib.import_module("nixl._api")
    except ImportError as exc:
        raise ImportError(f"kv_transfer_config.kv_connector 'nixl' needs the NIXL library: "
                          f"pip install -c constraints.txt nixl ({exc})") from exc


def _skip_unused_infiniband() -> None:
    """On a machine without InfiniBand devices, keeps UCX from loading its ib module (unless UCX_MODULES is set).

    The NIXL wheel's UCX ib module pulls in the system's libnl-route-3 beside the copy bundled in the wheel, and
    the two crash in their exit-time destructors: every process that created a NIXL agent then ends with SIGSEGV
    (status 139) after its last line of Python, here with Debian's libibverbs1 installed (which Mooncake needs).
    Without devices the module has nothing to offer; with them it is left alone."""
    has_devices = os.path.isdir(_INFINIBAND) and bool(os.listdir(_INFINIBAND))
    if not has_devices and "UCX_MODULES" not in os.environ:
        os.environ["UCX_MODULES"] = "^ib"
        logger.info("kv transfer: no InfiniBand devices: UCX_MODULES=^ib (NIXL's UCX then exits cleanly)")


def _agent(api: Any) -> Any:
    return api.nixl_agent(f"dskvt-{uuid.uuid4().hex}", api.nixl_agent_config(backends=["UCX"]))


def _region(address: int, nbytes: int) -> list[tuple[int, int, int]]:
    return [(address, nbytes, 0)]  # device 0 of DRAM


class NixlTransferServer(TcpTransferServer):
    """A producer rank's server whose payloads consumers READ with NIXL (or FETCH over TCP)."""

    SCHEME = "nixl+tcp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._api = import_nixl()
        self._agent = _agent(self._api)
        self._agent_lock = threading.Lock()  # publish and the connection threads' releases share the agent
        super().__init__(*args, **kwargs)

    def _hold(self, payload: bytes) -> Held:
        if not payload:
            return Held(payload)
        address = int(np.frombuffer(payload, dtype=np.uint8).ctypes.data)
        (region,) = _region(address, len(payload))
        with self._agent_lock:
            registered = self._agent.get_reg_descs([(*region, "")], "DRAM")
            try:
                self._agent.register_memory(registered)
            except Exception as exc:  # noqa: BLE001 (e.g. the same bytes object published twice: TCP then)
                logger.warning("kv transfer: NIXL did not register a %d-byte payload (%s): sent over TCP",
                               len(payload), exc)
                return Held(payload)
            # the metadata for this buffer only (its remote key), with how to connect to this agent
            metadata = self._agent.get_partial_agent_metadata(registered, inc_conn_info=True)
            descs = self._agent.get_serialized_descs(self._agent.get_xfer_descs([region], "DRAM"))

        def release() -> None:
            with self._agent_lock:
                self._agent.deregister_memory(registered)

        return Held(payload, _DESCRIPTOR.pack(len(payload), len(metadata)) + metadata + descs, release)


class NixlTransferClient:
    """Reads with NIXL from `nixl+tcp` producers, over TCP from any other producer."""

    def __init__(self) -> None:
        self._api = import_nixl()
        self._agent = _agent(self._api)
        self._lock = threading.Lock()
        self._counters = Counters()
        self._abandoned: list[tuple[Any, Any, ReceiveBuffer]] = []
        """Transfers given up at their deadline: their buffers stay registered and alive until the library lets
        go of the handle (a late write must land in memory we still own)."""

    def fetch(self, address: str, transfer_id: str, timeout_s: float) -> Payload | None:
        return fetch_from(self._counters, address, transfer_id, timeout_s, NixlTransferServer.SCHEME, self._read)

    def stats(self) -> TransportStats:
        return self._counters.snapshot()

    def close(self) -> None:
        with self._lock:
            self._retry_abandoned()

    def _read(self, descriptor: bytes, deadline: Deadline) -> Payload | None:
        nbytes, metadata_length = _DESCRIPTOR.unpack_from(descriptor)
        metadata = descriptor[_DESCRIPTOR.size:_DESCRIPTOR.size + metadata_length]
        buffer = ReceiveBuffer(nbytes)
        (region,) = _region(buffer.address, nbytes)
        with self._lock:
            self._retry_abandoned()
            remote_agent = self._agent.add_remote_agent(metadata)  # adds or updates what we know of that agent
            remote = self._agent.deserialize_descs(descriptor[_DESCRIPTOR.size + metadata_length:])
            registered = self._agent.get_reg_descs([(*region, "")], "DRAM")
            self._agent.register_memory(registered)
            try:
                handle = self._agent.initialize_xfer("READ", self._agent.get_xfer_descs([region], "DRAM"), remote,
                                                     remote_agent)
                state = self._agent.transfer(handle)
            except Exception as exc:
                self._agent.deregister_memory(registered)
                raise ReadFailed(f"NIXL could not start the read: {exc}") from exc
        while state not in ("DONE", "ERR") and time.monotonic() < deadline.end:
            time.sleep(_POLL_S)
            with self._lock:
                state = self._agent.check_xfer_state(handle)
        with self._lock:
            if state != "DONE" and state != "ERR":
                self._abandoned.append((handle, registered, buffer))
                self._retry_abandoned()
                return None
            self._agent.release_xfer_handle(handle)
            self._agent.deregister_memory(registered)
        if state == "ERR":
            raise ReadFailed("NIXL reported the read failed")
        return buffer.take()

    def _retry_abandoned(self) -> None:
        """Releases abandoned transfers the library has finished with (caller holds the lock)."""
        still = []
        for handle, registered, buffer in self._abandoned:
            try:
                if self._agent.check_xfer_state(handle) == "PROC":
                    still.append((handle, registered, buffer))
                    continue
                self._agent.release_xfer_handle(handle)
                self._agent.deregister_memory(registered)
            except Exception:  # noqa: BLE001 (a handle the library refuses to release stays abandoned)
                still.append((handle, registered, buffer))
        self._abandoned = still
