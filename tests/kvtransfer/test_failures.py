"""A producer that stalls or dies mid-transfer never hangs a consumer: the fetch returns None within its timeout
(a killed producer: at once). Each producer here stops itself at a chosen point and says so before it does."""

from __future__ import annotations

import threading
import time

import pytest

from deltaserve.kvtransfer.shm import unlink_orphans
from tests.kvtransfer.conftest import TRANSPORTS, client_for, segments, start_producer

TIMEOUT_S = 1.5
SLACK_S = 5.0
"""A bound on the time past the timeout (thread start-up on a loaded machine), far under a hang."""

CASES = [(transport, "stop_before_reply") for transport in TRANSPORTS] + [("tcp", "half_then_stop")] + [
    (transport, "stop_after_lend") for transport in ("nixl", "mooncake")]


def _fetch_in_thread(client: object, address: str, transfer_id: str, timeout_s: float) -> tuple[threading.Thread,
                                                                                              list[object]]:
    result: list[object] = []

    def fetch() -> None:
        start = time.monotonic()
        result.append(client.fetch(address, transfer_id, timeout_s))  # type: ignore[attr-defined]
        result.append(time.monotonic() - start)

    thread = threading.Thread(target=fetch, daemon=True)
    thread.start()
    return thread, result


@pytest.mark.parametrize(("transport", "fault"), CASES)
def test_stalled_producer_fetch_returns_none_within_timeout(transport: str, fault: str) -> None:
    producer = start_producer(transport, fault=fault)
    try:
        client = client_for(transport)
        producer.publish("stuck", 8 << 20, seed=1)
        thread, result = _fetch_in_thread(client, producer.address, "stuck", TIMEOUT_S)
        assert producer.reached.wait(60), "the producer never reached its fault"
        thread.join(TIMEOUT_S + SLACK_S)
        assert not thread.is_alive(), "fetch hung past its timeout"
        payload, elapsed = result
        assert payload is None and isinstance(elapsed, float) and elapsed < TIMEOUT_S + SLACK_S
        assert client.stats().fetch_failures == 1
    finally:
        producer.kill()


@pytest.mark.parametrize(("transport", "fault"), CASES)
def test_producer_killed_mid_transfer_fetch_returns_none(transport: str, fault: str) -> None:
    """SIGKILL while the transfer is stuck: the fetch ends with None (long timeout: it must not need it)."""
    producer = start_producer(transport, fault=fault)
    try:
        client = client_for(transport)
        producer.publish("killed", 8 << 20, seed=2)
        thread, result = _fetch_in_thread(client, producer.address, "killed", 60.0)
        assert producer.reached.wait(60), "the producer never reached its fault"
        producer.kill()
        thread.join(60.0)
        assert not thread.is_alive(), "fetch hung after the producer died"
        assert result[0] is None
        if transport == "shm":  # the next producer on the host unlinks a killed producer's segments
            assert producer.process.pid is not None and segments(producer.process.pid) != []
            unlink_orphans()
            assert segments(producer.process.pid, owner_files=True) == []
    finally:
        producer.kill()


def test_unreachable_producer_is_none() -> None:
    """Nothing listens there (a free port) or the address is malformed: None, counted, no exception."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for transport in ("tcp", "shm"):
        client = client_for(transport)
        assert client.fetch(f"tcp://127.0.0.1:{port}", "x", 2.0) is None
        assert client.fetch(f"shm+tcp://127.0.0.1:{port}", "x", 2.0) is None
        assert client.fetch("no-scheme-here", "x", 2.0) is None
        assert client.stats().fetch_failures == 3
