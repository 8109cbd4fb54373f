"""What a producer holds and for how long: ttl, max_bytes (oldest dropped), withdraw, close, and shared-memory
segments that never outlive their use (consumer gone, consumer stalled, producer closed)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import struct

import pytest

from deltaserve.kvtransfer.shm import ShmTransferServer
from deltaserve.kvtransfer.tcp import TcpTransferClient
from tests.kvtransfer import peer
from tests.kvtransfer.conftest import TRANSPORTS, FakeClock, client_for, in_process_server, segments, wait_until

MIB = 1 << 20


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_payload_past_ttl_is_gone(transport: str) -> None:
    clock = FakeClock()
    server = in_process_server(transport, max_bytes=64 * MIB, ttl_s=10.0, clock=clock)
    client = client_for(transport)
    try:
        server.publish("fresh", b"a" * MIB)
        server.publish("stale", b"b" * MIB)
        clock.now += 9.0
        assert client.fetch(server.address, "fresh", 10.0) == b"a" * MIB
        clock.now += 1.0
        assert client.fetch(server.address, "stale", 10.0) is None
        stats = server.stats()
        assert (stats.published, stats.served, stats.expired) == (2, 1, 1)
        assert segments(os.getpid()) == []
    finally:
        server.close()
        client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_max_bytes_drops_the_oldest(transport: str) -> None:
    server = in_process_server(transport, max_bytes=3 * MIB, ttl_s=600.0)
    client = client_for(transport)
    try:
        payloads = {f"p{i}": bytes([i]) * MIB for i in range(4)}
        for transfer_id, payload in payloads.items():
            server.publish(transfer_id, payload)
        assert server.held.held_bytes == 3 * MIB
        server.publish("too-big", b"x" * (3 * MIB + 1))  # larger than the whole budget: dropped alone
        assert client.fetch(server.address, "p0", 10.0) is None
        assert client.fetch(server.address, "too-big", 10.0) is None
        for transfer_id in ("p1", "p2", "p3"):
            assert client.fetch(server.address, transfer_id, 10.0) == payloads[transfer_id]
        assert server.stats().expired == 2
    finally:
        server.close()
        client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_withdraw_and_replace(transport: str) -> None:
    server = in_process_server(transport, max_bytes=64 * MIB, ttl_s=600.0)
    client = client_for(transport)
    try:
        server.publish("w", b"w" * 1000)
        server.withdraw("w")
        server.withdraw("never-published")
        assert client.fetch(server.address, "w", 10.0) is None
        server.publish("r", b"old" * 1000)
        server.publish("r", b"new" * 1000)
        assert client.fetch(server.address, "r", 10.0) == b"new" * 1000
        assert server.held.held_bytes == 0
    finally:
        server.close()
        client.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_close_frees_everything(transport: str) -> None:
    server = in_process_server(transport, max_bytes=64 * MIB, ttl_s=600.0)
    address = server.address
    for i in range(3):
        server.publish(f"c{i}", bytes([i]) * MIB)
    if transport == "shm":
        assert len(segments(os.getpid())) == 3
    server.close()
    server.close()  # idempotent
    assert len(server.held) == 0 and server.held.held_bytes == 0
    assert segments(os.getpid(), owner_files=True) == []
    assert TcpTransferClient().fetch(address, "c0", 5.0) is None
    server.publish("after-close", b"z" * 10)  # dropped, never held
    assert len(server.held) == 0 and segments(os.getpid()) == []


def _borrow(server: ShmTransferServer, transfer_id: str) -> tuple[mp.process.BaseProcess, str]:
    """A consumer process that borrows `transfer_id`'s segment and stalls; returns it and the segment name."""
    context = mp.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=peer.borrow_and_stall, args=(server.address, transfer_id, theirs), daemon=True)
    process.start()
    assert ours.poll(60)
    status, descriptor = ours.recv()
    assert status == 0
    return process, descriptor[struct.calcsize("<Q"):].decode()


def test_segment_of_a_consumer_that_died_mid_read_is_unlinked() -> None:
    server = ShmTransferServer("127.0.0.1", 0, max_bytes=64 * MIB, ttl_s=600.0)
    try:
        server.publish("dies", b"d" * (4 * MIB))
        process, name = _borrow(server, "dies")
        assert os.path.exists(f"/dev/shm/{name}")
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        assert wait_until(lambda: not os.path.exists(f"/dev/shm/{name}")), "segment outlived its consumer"
    finally:
        server.close()


def test_segment_of_a_stalled_consumer_is_unlinked_after_the_ttl() -> None:
    """The consumer stays alive but never releases: its connection is idle past ttl_s, the producer drops it."""
    clock = FakeClock()  # published entries never expire here: only the borrowed one's idle limit acts
    server = ShmTransferServer("127.0.0.1", 0, max_bytes=64 * MIB, ttl_s=0.5, clock=clock)
    process = None
    try:
        server.publish("stalls", b"s" * MIB)
        process, name = _borrow(server, "stalls")
        assert wait_until(lambda: not os.path.exists(f"/dev/shm/{name}")), "segment outlived the ttl"
        assert process.is_alive()
    finally:
        if process is not None:
            process.kill()
            process.join()
        server.close()
    assert segments(os.getpid()) == []


def test_server_survives_garbage_and_keeps_serving() -> None:
    server = in_process_server("tcp", max_bytes=MIB, ttl_s=600.0)
    try:
        host, port = server.address.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
            try:
                assert sock.recv(10) == b""  # the server hung up...
            except ConnectionResetError:
                pass  # ...with our unread bytes in its buffer, hence a reset
        server.publish("ok", b"fine")
        assert TcpTransferClient().fetch(server.address, "ok", 5.0) == b"fine"
    finally:
        server.close()


def test_shm_full_falls_back_to_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """No room in /dev/shm (a container's small default): the payload is held in memory and still arrives."""
    from deltaserve.kvtransfer import shm

    def full(name: str, nbytes: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm, "_reserve", full)
    server = shm.ShmTransferServer("127.0.0.1", 0, max_bytes=64 * MIB, ttl_s=600.0)
    try:
        server.publish("big", b"q" * (2 * MIB))
        assert segments(os.getpid()) == []
        assert shm.ShmTransferClient().fetch(server.address, "big", 10.0) == b"q" * (2 * MIB)
    finally:
        server.close()


def test_segment_unreadable_by_the_consumer_comes_over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer that cannot open the segment (another /dev/shm namespace) gets the lent bytes over TCP, and
    the producer still unlinks the segment."""
    from deltaserve.kvtransfer import shm

    def elsewhere(name: str, nbytes: int) -> bytes:
        raise FileNotFoundError(name)

    monkeypatch.setattr(shm, "read_segment", elsewhere)
    server = shm.ShmTransferServer("127.0.0.1", 0, max_bytes=64 * MIB, ttl_s=600.0)
    try:
        server.publish("ns", b"n" * MIB)
        assert len(segments(os.getpid())) == 1
        assert shm.ShmTransferClient().fetch(server.address, "ns", 10.0) == b"n" * MIB
        assert wait_until(lambda: segments(os.getpid()) == [])
    finally:
        server.close()
