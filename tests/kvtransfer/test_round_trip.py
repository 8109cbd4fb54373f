"""Each transport between two real processes: payloads of several sizes arrive intact, an id is served once,
unknown ids and concurrent fetches behave, and any client fetches from any producer."""

from __future__ import annotations

import threading

import pytest

from deltaserve.config.kv_transfer import KVTransferConfig
from deltaserve.kvtransfer.address import parse_address
from deltaserve.kvtransfer.factory import make_client
from deltaserve.kvtransfer.tcp import TcpTransferClient
from tests.kvtransfer.conftest import TRANSPORTS, Producer, client_for, require

MIB = 1 << 20


@pytest.mark.parametrize("nbytes", [0, 1, 4097, MIB, 64 * MIB])
def test_round_trip(producer: Producer, nbytes: int) -> None:
    """0 bytes is a valid payload (an empty bytes object arrives); 1 byte, odd sizes, 1 and 64 MiB arrive whole."""
    client = client_for(producer.transport)
    sent = producer.publish(f"rt-{nbytes}", nbytes, seed=nbytes)
    got = client.fetch(producer.address, f"rt-{nbytes}", timeout_s=60)
    assert got is not None and len(got) == nbytes and got == sent
    stats = client.stats()
    assert (stats.fetched, stats.fetched_bytes, stats.fetch_failures) == (1, nbytes, 0)
    client.close()


def test_fetched_payload_is_gone_and_unknown_ids_are_none(producer: Producer) -> None:
    client = client_for(producer.transport)
    sent = producer.publish("once", 1000, seed=7)
    assert client.fetch(producer.address, "once", timeout_s=30) == sent
    assert client.fetch(producer.address, "once", timeout_s=30) is None
    assert client.fetch(producer.address, "never-published", timeout_s=30) is None
    assert client.stats().fetch_failures == 2
    server = producer.stats()
    assert server.served >= 1 and server.published >= 1
    client.close()


def test_concurrent_fetches_from_threads(producer: Producer) -> None:
    """Eight threads of one client fetch eight payloads at once; each gets its own."""
    client = client_for(producer.transport)
    sent = {f"cc-{i}": producer.publish(f"cc-{i}", MIB + i, seed=100 + i) for i in range(8)}
    got: dict[str, bytes | None] = {}
    start = threading.Barrier(len(sent))

    def fetch(transfer_id: str) -> None:
        start.wait()
        got[transfer_id] = client.fetch(producer.address, transfer_id, timeout_s=60)

    threads = [threading.Thread(target=fetch, args=(transfer_id,)) for transfer_id in sent]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == sent
    client.close()


@pytest.mark.parametrize("consumer", TRANSPORTS)
def test_any_consumer_fetches_from_any_producer(producer: Producer, consumer: str) -> None:
    """The client a consumer builds dispatches on the producer's address scheme; a producer of a transport the
    consumer has no library for is fetched over TCP."""
    require(consumer)
    client = make_client(KVTransferConfig(kv_connector=consumer))
    sent = producer.publish(f"x-{consumer}", 3 * MIB + 5, seed=11)
    assert client.fetch(producer.address, f"x-{consumer}", timeout_s=60) == sent
    client.close()


def test_plain_tcp_client_fetches_from_every_producer(producer: Producer) -> None:
    sent = producer.publish("plain", 2 * MIB, seed=3)
    assert parse_address(producer.address).scheme.endswith("tcp")
    assert TcpTransferClient().fetch(producer.address, "plain", timeout_s=60) == sent
