"""The other processes of the transfer tests (started with multiprocessing's spawn): a producer that serves one
transport and publishes on request, optionally misbehaving at a chosen point, and a consumer that borrows a
payload and then stalls."""

from __future__ import annotations

import os
import random
import signal
import struct
import threading
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from typing import Any, NoReturn

from deltaserve.kvtransfer.address import parse_address
from deltaserve.kvtransfer.tcp import Channel, TcpTransferServer
from deltaserve.kvtransfer.wire import Deadline, Op, Request

SERVERS = {
    "tcp": ("deltaserve.kvtransfer.tcp", "TcpTransferServer"),
    "shm": ("deltaserve.kvtransfer.shm", "ShmTransferServer"),
    "nixl": ("deltaserve.kvtransfer.nixl_transport", "NixlTransferServer"),
    "mooncake": ("deltaserve.kvtransfer.mooncake_transport", "MooncakeTransferServer"),
}
FAULTS = ("none", "stop_before_reply", "half_then_stop", "stop_after_lend")
"""stop_before_reply: SIGSTOP itself on a FETCH or LEND before answering; half_then_stop: answer a FETCH with half
the payload, then SIGSTOP; stop_after_lend: SIGSTOP right after answering a LEND (the zero-copy read then stalls).
Each sets the `reached` event just before it stops, so the test knows the transfer is stuck there."""


def payload(nbytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def serve(transport: str, pipe: Connection, max_bytes: int, ttl_s: float, fault: str, reached: Event) -> None:
    """Serves `transport`; requests on the pipe: ("publish", id, nbytes, seed) -> "ok", ("stats",) -> stats,
    None -> close and exit."""
    import importlib

    module, name = SERVERS[transport]
    _install_fault(fault, reached)
    server = getattr(importlib.import_module(module), name)("127.0.0.1", 0, max_bytes=max_bytes, ttl_s=ttl_s)
    pipe.send(server.address)
    while (request := pipe.recv()) is not None:
        if request[0] == "publish":
            _, transfer_id, nbytes, seed = request
            server.publish(transfer_id, payload(nbytes, seed))
            pipe.send("ok")
        elif request[0] == "stats":
            pipe.send(server.stats())
    server.close()
    pipe.send("closed")


def _install_fault(fault: str, reached: Event) -> None:
    if fault == "none":
        return
    original = TcpTransferServer._answer

    def stop() -> NoReturn:
        reached.set()
        os.kill(os.getpid(), signal.SIGSTOP)
        # A process-directed SIGSTOP may be taken by another thread while this one runs on for a moment (it once
        # sent the reply it was meant to withhold): it never goes on, stopped or not.
        threading.Event().wait()
        raise AssertionError("unreachable")

    def answer(self: TcpTransferServer, connection: Any, request: Request, lent: Any) -> Any:
        if fault == "stop_before_reply" and request.op in (Op.FETCH, Op.LEND):
            stop()
        if fault == "half_then_stop" and request.op is Op.FETCH:
            held = self.held.take(request.transfer_id)
            assert held is not None
            connection.sendall(struct.pack("<4sBQ", b"DSKR", 0, held.nbytes))
            connection.sendall(held.view[:held.nbytes // 2])
            stop()
        result = original(self, connection, request, lent)
        if fault == "stop_after_lend" and request.op is Op.LEND:
            stop()
        return result

    TcpTransferServer._answer = answer  # type: ignore[method-assign]


def borrow_and_stall(address: str, transfer_id: str, pipe: Connection) -> None:
    """A consumer that LENDs a payload, reports the descriptor and then waits forever (to be killed, or to be
    dropped by the producer's idle limit)."""
    channel = Channel(parse_address(address), Deadline(3600.0))
    status, length = channel.ask(Op.LEND, transfer_id)
    pipe.send((int(status), channel.read_small(length)))
    # Not pipe.recv(): the test's end of the pipe may be closed meanwhile, and EOF would end this process early.
    threading.Event().wait()  # the test kills this process or lets the producer time it out
