"""Same-host transfer through POSIX shared memory. Address `shm+tcp://host:port`.

The producer writes each published payload once into its own segment (`/dev/shm/dskvt-...`, space reserved up
front so a full /dev/shm is a fallback to TCP, not a SIGBUS); a consumer on the same host LENDs it over the TCP
control server (tcp.py), maps the segment read-only, copies it out and RELEASEs it, and the producer unlinks it. The
producer unlinks a segment whatever happens: on RELEASE, when the borrowing connection closes (a consumer that died
mid-read), when it is idle past the ttl (a stalled consumer), on expiry, and on close. A producer that is killed
leaves its segments behind; each producer holds an flock on an owner file in /dev/shm while it lives, and the next
producer to start on the host unlinks the segments of every owner whose lock is free (dead, in whatever pid
namespace), as does multiprocessing's resource tracker when the process tree that started the producer ends. A
consumer on another host, or one that cannot open the segment (another /dev/shm namespace), gets the bytes over
the same connection instead.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import uuid
from multiprocessing import shared_memory
from typing import Any, cast

from deltaserve.kvtransfer.buffers import ReceiveBuffer
from deltaserve.kvtransfer.counters import Counters
from deltaserve.kvtransfer.held import Held
from deltaserve.kvtransfer.lent_read import ReadFailed, fetch_from
from deltaserve.kvtransfer.tcp import TcpTransferServer
from deltaserve.kvtransfer.transport import Payload, TransportStats

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "dskvt-"
_OWNER = "owner"
_DESCRIPTOR = struct.Struct("<Q")  # payload length, then the segment name


class ShmTransferServer(TcpTransferServer):
    """A producer rank's server that holds payloads in shared-memory segments (TCP for remote consumers)."""

    SCHEME = "shm+tcp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._owner = _Owner() if os.path.isdir(SHM_DIR) else None
        self._fell_back = False
        if self._owner is not None:
            unlink_orphans()
        super().__init__(*args, **kwargs)

    def close(self) -> None:
        super().close()
        if self._owner is not None:
            self._owner.close()

    def _fall_back(self, why: str) -> None:
        """Logs, once per server, that payloads are held in process memory and sent over TCP (a small /dev/shm,
        as containers have by default, would otherwise log on every publish)."""
        if not self._fell_back:
            self._fell_back = True
            logger.warning("kv transfer: %s: payloads that do not fit are held in process memory and sent over TCP "
                           "(logged once)", why)

    def _hold(self, payload: bytes) -> Held:
        if not payload or self._owner is None:
            return Held(payload)
        name = f"{self._owner.prefix}{uuid.uuid4().hex[:16]}"
        try:
            segment = shared_memory.SharedMemory(name=name, create=True, size=len(payload))
        except OSError as exc:
            self._fall_back(f"no shared-memory segment for {len(payload)} bytes ({exc})")
            return Held(payload)
        try:
            _reserve(name, len(payload))
        except OSError as exc:
            segment.close()
            segment.unlink()
            self._fall_back(f"no room for {len(payload)} bytes in {SHM_DIR} ({exc})")
            return Held(payload)
        view = cast(memoryview, segment.buf)[:len(payload)]  # None only after close
        view[:] = payload

        def release() -> None:
            view.release()  # SharedMemory.close refuses while views of its buffer are alive
            segment.close()
            segment.unlink()

        return Held(view, _DESCRIPTOR.pack(len(payload)) + name.encode(), release)


class ShmTransferClient:
    """Fetches through shared memory from a `shm+tcp` producer on this host, over TCP from any other producer."""

    def __init__(self) -> None:
        self._counters = Counters()

    def fetch(self, address: str, transfer_id: str, timeout_s: float) -> Payload | None:
        return fetch_from(self._counters, address, transfer_id, timeout_s, ShmTransferServer.SCHEME,
                          lambda descriptor, _deadline: _read_descriptor(descriptor), local_only=True)

    def stats(self) -> TransportStats:
        return self._counters.snapshot()

    def close(self) -> None:
        """Nothing to free: segments belong to the producer."""


def _read_descriptor(descriptor: bytes) -> Payload:
    (nbytes,) = _DESCRIPTOR.unpack_from(descriptor)
    try:
        return read_segment(descriptor[_DESCRIPTOR.size:].decode(), nbytes)
    except OSError as exc:  # not our /dev/shm after all (another host or namespace): the bytes come over TCP
        raise ReadFailed(str(exc)) from exc


def read_segment(name: str, nbytes: int) -> Payload:
    """A copy of the first `nbytes` of segment `name` (read through its file, never registered with this process's
    resource tracker, which would unlink the producer's segment when this process exits)."""
    if not name.startswith(SEGMENT_PREFIX) or "/" in name or name in (".", ".."):
        raise OSError(f"not a transfer segment: {name!r:.80}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < nbytes:  # mapping past the end would SIGBUS on the copy
            raise OSError(f"segment {name} is shorter than {nbytes} bytes")
        # pread straight into the returned buffer: one copy, and no page faults on a mapping of the segment
        buffer, got = ReceiveBuffer(nbytes), 0
        while got < nbytes:
            n = os.preadv(fd, [buffer.view[got:]], got)
            if n == 0:
                raise OSError(f"segment {name} ended after {got} of {nbytes} bytes")
            got += n
        return buffer.take()
    finally:
        os.close(fd)


def _reserve(name: str, nbytes: int) -> None:
    """Allocates the segment's pages now: writing into an unbacked tmpfs page when /dev/shm is full is a SIGBUS."""
    path = os.path.join(SHM_DIR, name)
    if hasattr(os, "posix_fallocate") and os.path.exists(path):
        fd = os.open(path, os.O_RDWR)
        try:
            os.posix_fallocate(fd, 0, nbytes)
        finally:
            os.close(fd)


class _Owner:
    """A producer's claim on its segments (all named `prefix...`): an owner file it holds an flock on while alive.
    The kernel drops the lock when the process dies, however it dies."""

    def __init__(self) -> None:
        self.prefix = f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        self._path = os.path.join(SHM_DIR, self.prefix + _OWNER)
        claiming = self._path + ".new"  # locked before it gets the name sweepers look for
        self._fd = os.open(claiming, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.rename(claiming, self._path)

    def close(self) -> None:
        """Gives the claim up (idempotent)."""
        if self._fd < 0:
            return
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1


def unlink_orphans() -> list[str]:
    """Unlinks the segments of producers that died without closing (their owner file's lock is free); returns
    the names unlinked."""
    unlinked = []
    names = os.listdir(SHM_DIR)
    for owner in (name for name in names if name.startswith(SEGMENT_PREFIX) and name.endswith("-" + _OWNER)):
        try:
            fd = os.open(os.path.join(SHM_DIR, owner), os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # its producer is alive
        prefix = owner[:-len(_OWNER)]
        for name in [name for name in names if name.startswith(prefix)]:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                unlinked.append(name)
            except FileNotFoundError:
                pass
        os.close(fd)
    if unlinked:
        logger.warning("kv transfer: unlinked %d shared-memory files of dead producers", len(unlinked))
    return unlinked
