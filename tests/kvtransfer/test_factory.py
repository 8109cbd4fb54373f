"""Building transports from `KVTransferConfig`, addresses, and a missing library: an error naming kv_connector
for the configured transport, a TCP fetch for a producer of another transport."""

from __future__ import annotations

import socket
import sys

import pytest

from deltaserve.config.kv_transfer import KVTransferConfig
from deltaserve.kvtransfer.address import Address, is_local_host, parse_address
from deltaserve.kvtransfer.factory import make_client, make_server
from tests.kvtransfer.conftest import TRANSPORTS, require


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_make_server_and_client_from_config(transport: str) -> None:
    require(transport)
    config = KVTransferConfig(kv_connector=transport, kv_buffer_size=2e6, transfer_ttl_s=30.0)
    server = make_server(config, rank=1)
    client = make_client(config)
    try:
        assert parse_address(server.address).host == "127.0.0.1"
        assert server.held.max_bytes == 2_000_000 and server.held.ttl_s == 30.0  # type: ignore[attr-defined]
        server.publish("id", b"payload")
        assert client.fetch(server.address, "id", 10.0) == b"payload"
        assert server.stats().served == 1 and client.stats().fetched == 1
    finally:
        server.close()
        client.close()


def _free_port_pair() -> int:
    """A port p with p + 1 free as well, a moment ago."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
                return int(port)
            except OSError:
                continue
    pytest.skip("no two adjacent free ports")


def test_rank_listens_on_kv_port_plus_rank_or_a_free_port_when_taken() -> None:
    base = _free_port_pair()
    config = KVTransferConfig(kv_connector="tcp", kv_port=base)
    server = make_server(config, rank=1)
    try:
        assert parse_address(server.address).port == base + 1
        taken = make_server(config, rank=1)  # base + 1 is ours now: the next one gets a free port
        assert parse_address(taken.address).port not in (0, base + 1)
        taken.close()
    finally:
        server.close()


def test_configured_transport_missing_is_an_error_naming_kv_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "nixl._api", None)  # import nixl._api now raises ImportError
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    for name in ("nixl", "mooncake"):
        config = KVTransferConfig(kv_connector=name)
        with pytest.raises(ImportError, match=f"kv_connector '{name}'"):
            make_server(config, rank=0)
        with pytest.raises(ImportError, match=f"kv_connector '{name}'"):
            make_client(config)


def test_producer_of_a_transport_missing_here_is_fetched_over_tcp(monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer without NIXL still fetches a nixl+tcp producer's payload (every server answers plain fetches):
    here a TCP server's port under a nixl+tcp address."""
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    server = make_server(KVTransferConfig(kv_connector="tcp"), rank=0)
    client = make_client(KVTransferConfig(kv_connector="shm"))
    try:
        server.publish("id", b"via tcp")
        address = str(Address("nixl+tcp", "127.0.0.1", parse_address(server.address).port))
        assert client.fetch(address, "id", 10.0) == b"via tcp"
    finally:
        server.close()
        client.close()


def test_addresses() -> None:
    assert parse_address("shm+tcp://127.0.0.1:5000") == Address("shm+tcp", "127.0.0.1", 5000)
    assert str(parse_address("tcp://[::1]:7")) == "tcp://[::1]:7"
    for bad in ("127.0.0.1:5000", "udp://h:1", "tcp://h", "tcp://:5", "tcp://h:port"):
        with pytest.raises(ValueError, match="transfer address"):
            parse_address(bad)
    assert is_local_host("127.0.0.1") and is_local_host("localhost")
    assert not is_local_host("192.0.2.1")  # TEST-NET-1: never an address of this machine
    assert not is_local_host("no-such-host.invalid")
