"""The control frames every transport speaks over TCP, and socket I/O bounded by a deadline.

Request: magic `DSKT`, op (u8), transfer-id length (u16), body length (u32), the id (UTF-8), the body.
Reply: magic `DSKR`, status (u8), body length (u64), the body (a payload, or a transport's descriptor).
One connection carries one fetch: FETCH, or LEND then RELEASE (and SEND in between when the zero-copy path fails).
"""

from __future__ import annotations

import enum
import socket
import struct
import time
from dataclasses import dataclass

REQUEST_MAGIC, REPLY_MAGIC = b"DSKT", b"DSKR"
_REQUEST = struct.Struct("<4sBHI")
_REPLY = struct.Struct("<4sBQ")
MAX_REQUEST_BODY = 1 << 20
"""A server refuses larger request bodies (requests carry ids and small descriptors, never payloads)."""


class Op(enum.IntEnum):
    FETCH = 1
    """Take the payload and send its bytes in the reply."""
    LEND = 2
    """Take the payload, keep it for this connection, reply with the transport's descriptor (a zero-copy read
    follows), or UNSUPPORTED when the payload is held without one (the client then asks for it with SEND)."""
    SEND = 3
    """Send the bytes of the payload lent on this connection (it has no zero-copy path, or the read failed)."""
    RELEASE = 4
    """The client is done with the payload lent on this connection (no reply)."""


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN = 1
    """No such payload (never published, already fetched, withdrawn, expired or dropped)."""
    UNSUPPORTED = 2
    ERROR = 3


@dataclass(frozen=True, slots=True)
class Request:
    op: Op
    transfer_id: str
    body: bytes = b""


class ProtocolError(Exception):
    """A frame that is not ours, or a peer that closed mid-frame."""


class Deadline:
    """An overall time limit over several socket calls."""

    def __init__(self, timeout_s: float) -> None:
        self.end = time.monotonic() + timeout_s

    def remaining(self) -> float:
        """Seconds left; TimeoutError once none are."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError("transfer deadline passed")
        return left

    def arm(self, sock: socket.socket) -> None:
        """Makes the socket's next call time out when the deadline does."""
        sock.settimeout(self.remaining())


def encode_request(request: Request) -> bytes:
    transfer_id = request.transfer_id.encode()
    return _REQUEST.pack(REQUEST_MAGIC, request.op, len(transfer_id), len(request.body)) + transfer_id + request.body


def read_request(sock: socket.socket) -> Request | None:
    """The next request on a server connection, or None when the client closed it between requests. Socket
    timeouts propagate (the server's idle limit)."""
    header = _recv_exact(sock, _REQUEST.size, None, eof_ok=True)
    if header is None:
        return None
    magic, op, id_length, body_length = _REQUEST.unpack(header)
    if magic != REQUEST_MAGIC or op not in Op.__members__.values() or body_length > MAX_REQUEST_BODY:
        raise ProtocolError("not a transfer request")
    rest = _recv_exact(sock, id_length + body_length, None) or b""
    return Request(Op(op), rest[:id_length].decode(), rest[id_length:])


def send_reply(sock: socket.socket, status: Status, body: bytes | memoryview = b"") -> None:
    header = _REPLY.pack(REPLY_MAGIC, status, len(body))
    if len(body) <= 64 << 10:
        sock.sendall(header + bytes(body))  # one segment for control replies
    else:
        sock.sendall(header)
        sock.sendall(body)


def read_reply_header(sock: socket.socket, deadline: Deadline) -> tuple[Status, int]:
    """(status, body length) of the next reply."""
    magic, status, length = _REPLY.unpack(_recv_exact(sock, _REPLY.size, deadline) or b"")
    if magic != REPLY_MAGIC or status not in Status.__members__.values():
        raise ProtocolError("not a transfer reply")
    return Status(status), length


def recv_into_exact(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    """Fills `view` from the socket, each call bounded by what is left of the deadline."""
    got = 0
    while got < len(view):
        deadline.arm(sock)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ProtocolError(f"peer closed after {got} of {len(view)} bytes")
        got += n


def recv_small(sock: socket.socket, nbytes: int, deadline: Deadline) -> bytes:
    """A small body (a descriptor) read whole."""
    return _recv_exact(sock, nbytes, deadline) or b""


def _recv_exact(sock: socket.socket, nbytes: int, deadline: Deadline | None, eof_ok: bool = False) -> bytes | None:
    buffer = bytearray(nbytes)
    view, got = memoryview(buffer), 0
    while got < nbytes:
        if deadline is not None:
            deadline.arm(sock)
        n = sock.recv_into(view[got:])
        if n == 0:
            if got == 0 and eof_ok:
                return None
            raise ProtocolError(f"peer closed after {got} of {nbytes} bytes")
        got += n
    return bytes(buffer)
