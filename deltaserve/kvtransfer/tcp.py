"""The TCP transport, and the TCP control server every transport runs: a listener thread, a thread per
connection, each answering the request frames of `wire.py` from the rank's `HeldPayloads`. Address `tcp://host:port`.

Subclasses (shared memory, NIXL, Mooncake) change only how a published payload is held (`_hold`: a segment, a
registered buffer, and the descriptor a LEND hands out); the protocol, expiry and bounds live here once, and every
server also answers a plain FETCH, so a consumer without the producer's library still gets the payload over TCP.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from deltaserve.kvtransfer.address import Address, parse_address
from deltaserve.kvtransfer.buffers import ReceiveBuffer
from deltaserve.kvtransfer.counters import Counters, counted_fetch
from deltaserve.kvtransfer.held import Held, HeldPayloads
from deltaserve.kvtransfer.transport import Payload, TransportStats
from deltaserve.kvtransfer.wire import (
    Deadline,
    Op,
    ProtocolError,
    Request,
    Status,
    encode_request,
    read_reply_header,
    read_request,
    recv_into_exact,
    recv_small,
    send_reply,
)

logger = logging.getLogger(__name__)

_SWEEP_INTERVAL_S = 1.0
"""How often the listener drops expired payloads when nothing else happens (also bounded by ttl / 4)."""


class TcpTransferServer:
    """A producer rank's server: holds published payloads and answers fetches on (host, port) (port 0: a free one).

    Connections idle (or stalled mid-send) for `ttl_s` are closed, freeing what they had borrowed."""

    SCHEME = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, max_bytes: int, ttl_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._held = HeldPayloads(max_bytes, ttl_s, clock)
        self._idle_timeout_s = ttl_s
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self._host = _advertised_host(host)
        self._port = int(self._listener.getsockname()[1])
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the listener through it
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self._sweep_s = min(_SWEEP_INTERVAL_S, ttl_s / 4)
        self._listener_thread = threading.Thread(target=self._accept_loop, name=f"kvt-{self.SCHEME}-{self._port}",
                                                 daemon=True)
        self._listener_thread.start()

    @property
    def address(self) -> str:
        return str(Address(self.SCHEME, self._host, self._port))

    @property
    def held(self) -> HeldPayloads:
        """The payload table (tests, and subclasses' bookkeeping)."""
        return self._held

    def publish(self, transfer_id: str, payload: bytes) -> None:
        self._held.put(transfer_id, self._hold(payload))

    def withdraw(self, transfer_id: str) -> None:
        self._held.withdraw(transfer_id)

    def stats(self) -> TransportStats:
        return self._held.stats()

    def close(self) -> None:
        """Stops the listener, closes every connection (each frees what it had borrowed) and frees the table."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake_w.send(b"x")
        self._listener_thread.join()
        self._listener.close()
        with self._lock:
            connections = dict(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)  # wakes its thread from recv or sendall
            except OSError:
                pass
        for thread in connections.values():
            thread.join()
        self._held.close()
        self._wake_r.close()
        self._wake_w.close()

    def _hold(self, payload: bytes) -> Held:
        """How a published payload is kept (subclasses: in a segment, in registered memory, with a descriptor)."""
        return Held(payload)

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._listener, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while not self._closed:
                ready = selector.select(timeout=self._sweep_s)
                self._held.sweep()
                if any(key.fileobj is self._listener for key, _ in ready) and not self._closed:
                    self._accept()

    def _accept(self) -> None:
        try:
            connection, _ = self._listener.accept()
        except OSError:
            return
        connection.settimeout(self._idle_timeout_s)
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(target=self._serve, args=(connection,), name=f"kvt-{self.SCHEME}-conn", daemon=True)
        with self._lock:
            self._connections[connection] = thread
        thread.start()

    def _serve(self, connection: socket.socket) -> None:
        lent: Held | None = None
        try:
            while (request := read_request(connection)) is not None:
                lent = self._answer(connection, request, lent)
        except (OSError, ProtocolError, UnicodeDecodeError) as exc:  # the client went away, stalled or spoke garbage
            logger.debug("kv transfer connection closed: %s", exc)
        finally:
            if lent is not None:
                lent.free()
            with self._lock:
                self._connections.pop(connection, None)
            connection.close()

    def _answer(self, connection: socket.socket, request: Request, lent: Held | None) -> Held | None:
        """Answers one request; returns what this connection has borrowed afterwards."""
        if request.op is Op.FETCH:
            held = self._held.take(request.transfer_id)
            if held is None:
                send_reply(connection, Status.UNKNOWN)
                return lent
            try:
                send_reply(connection, Status.OK, held.view)
            finally:
                held.free()
        elif request.op is Op.LEND:
            if lent is not None:  # one loan per connection: a second LEND returns the first
                lent.free()
            lent = self._held.take(request.transfer_id)
            if lent is None:
                send_reply(connection, Status.UNKNOWN)
            elif not lent.descriptor:  # held without a zero-copy path: the client asks for the bytes (SEND)
                send_reply(connection, Status.UNSUPPORTED)
            else:
                send_reply(connection, Status.OK, lent.descriptor)
        elif request.op is Op.SEND:
            send_reply(connection, Status.UNKNOWN if lent is None else Status.OK, lent.view if lent else b"")
        elif request.op is Op.RELEASE and lent is not None:
            lent.free()
            lent = None
        return lent


class Channel:
    """A consumer's connection to a producer's control server, for one fetch; every call bounded by `deadline`."""

    def __init__(self, address: Address, deadline: Deadline) -> None:
        self.deadline = deadline
        self.sock = socket.create_connection((address.host, address.port), timeout=deadline.remaining())
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def ask(self, op: Op, transfer_id: str) -> tuple[Status, int]:
        """Sends a request; (status, body length) of the reply."""
        self.deadline.arm(self.sock)
        self.sock.sendall(encode_request(Request(op, transfer_id)))
        return read_reply_header(self.sock, self.deadline)

    def tell(self, op: Op, transfer_id: str) -> None:
        """Sends a request that has no reply (RELEASE)."""
        self.deadline.arm(self.sock)
        self.sock.sendall(encode_request(Request(op, transfer_id)))

    def read_payload(self, nbytes: int) -> Payload:
        """A reply body of `nbytes`, received straight into the buffer returned."""
        buffer = ReceiveBuffer(nbytes)
        recv_into_exact(self.sock, buffer.view, self.deadline)
        return buffer.take()

    def read_small(self, nbytes: int) -> bytes:
        return recv_small(self.sock, nbytes, self.deadline)

    def fetch_plain(self, op: Op, transfer_id: str) -> Payload | None:
        """FETCH (or SEND of what was lent): the payload over this connection, None if the server has none."""
        status, length = self.ask(op, transfer_id)
        return self.read_payload(length) if status is Status.OK else None

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TcpTransferClient:
    """Fetches over TCP from any producer (every transport's server answers a plain FETCH)."""

    def __init__(self) -> None:
        self._counters = Counters()

    def fetch(self, address: str, transfer_id: str, timeout_s: float) -> Payload | None:
        def fetch() -> Payload | None:
            deadline = Deadline(timeout_s)
            with Channel(parse_address(address), deadline) as channel:
                return channel.fetch_plain(Op.FETCH, transfer_id)

        return counted_fetch(self._counters, f"{transfer_id} from {address}", fetch)

    def stats(self) -> TransportStats:
        return self._counters.snapshot()

    def close(self) -> None:
        """Nothing to free: every fetch uses its own connection."""


def _advertised_host(host: str) -> str:
    """The host consumers dial: the bind address, or this machine's address when bound to all interfaces."""
    if host in ("", "0.0.0.0", "::"):
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"
    return host
