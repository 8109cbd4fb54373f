"""Builds a rank's transfer server and client from `KVTransferConfig`; the client dispatches on each address's
scheme, so a consumer fetches from producers of any transport (over TCP when it lacks the producer's library)."""

from __future__ import annotations

import importlib
import logging
import threading

from deltaserve.config.kv_transfer import KVTransferConfig
from deltaserve.kvtransfer.address import parse_address
from deltaserve.kvtransfer.counters import Counters
from deltaserve.kvtransfer.tcp import TcpTransferClient
from deltaserve.kvtransfer.transport import Payload, TransferClient, TransferServer, TransportStats

logger = logging.getLogger(__name__)

# transport -> (module, server class, client class, address scheme); imported when used (NIXL imports torch)
TRANSPORTS: dict[str, tuple[str, str, str, str]] = {
    "tcp": ("deltaserve.kvtransfer.tcp", "TcpTransferServer", "TcpTransferClient", "tcp"),
    "shm": ("deltaserve.kvtransfer.shm", "ShmTransferServer", "ShmTransferClient", "shm+tcp"),
    "nixl": ("deltaserve.kvtransfer.nixl_transport", "NixlTransferServer", "NixlTransferClient", "nixl+tcp"),
    "mooncake": ("deltaserve.kvtransfer.mooncake_transport", "MooncakeTransferServer", "MooncakeTransferClient",
                 "mooncake+tcp"),
}
_TRANSPORT_OF_SCHEME = {scheme: name for name, (_, _, _, scheme) in TRANSPORTS.items()}


def make_server(config: KVTransferConfig, rank: int) -> TransferServer:
    """Rank `rank`'s server on `kv_ip`, port `kv_port + rank` (a free port when kv_port is 0, or when that port is
    taken: the address travels with each transfer, so any port works), holding at most `kv_buffer_size` bytes for
    `transfer_ttl_s`. ImportError naming kv_connector when the transport's library is missing."""
    module, server_class, _, _ = TRANSPORTS[config.transport]
    cls = getattr(importlib.import_module(module), server_class)
    kwargs = {"max_bytes": int(config.kv_buffer_size), "ttl_s": float(config.transfer_ttl_s)}
    port = config.kv_port + rank if config.kv_port else 0
    try:
        server: TransferServer = cls(config.kv_ip, port, **kwargs)
    except OSError as exc:
        if not port:
            raise
        logger.warning("kv transfer: port %d on %s is not available (%s): listening on a free port", port,
                       config.kv_ip, exc)
        server = cls(config.kv_ip, 0, **kwargs)
    return server


def make_client(config: KVTransferConfig) -> TransferClient:
    """A client for producers of every transport, with the configured transport's client built now (so a missing
    library is an ImportError at start-up, naming kv_connector)."""
    return SchemeClient(config)


class SchemeClient:
    """Fetches from each address with the client of its scheme, built on first use; a scheme whose library is
    missing here is fetched over TCP (every producer also answers plain fetches), logged once."""

    def __init__(self, config: KVTransferConfig) -> None:
        self._config = config
        self._lock = threading.Lock()
        self._clients: dict[str, TransferClient] = {}
        self._client_for(TRANSPORTS[config.transport][3], strict=True)

    def fetch(self, address: str, transfer_id: str, timeout_s: float) -> Payload | None:
        try:
            scheme = parse_address(address).scheme
        except ValueError:
            scheme = "tcp"  # the TCP client counts the failure and returns None
        return self._client_for(scheme).fetch(address, transfer_id, timeout_s)

    def stats(self) -> TransportStats:
        """The sum over the clients of every scheme used."""
        with self._lock:
            clients = list({id(client): client for client in self._clients.values()}.values())  # TCP may be shared
        total = Counters()
        for client in clients:
            stats = client.stats()
            total.add(fetched=stats.fetched, fetched_bytes=stats.fetched_bytes, fetch_failures=stats.fetch_failures,
                      fetch_seconds=stats.fetch_seconds)
        return total.snapshot()

    def close(self) -> None:
        with self._lock:
            clients = list({id(client): client for client in self._clients.values()}.values())
        for client in clients:
            client.close()

    def _client_for(self, scheme: str, strict: bool = False) -> TransferClient:
        with self._lock:
            client = self._clients.get(scheme)
            if client is not None:
                return client
            module, _, client_class, _ = TRANSPORTS[_TRANSPORT_OF_SCHEME.get(scheme, "tcp")]
            try:
                cls = getattr(importlib.import_module(module), client_class)
                client = cls(self._config.kv_ip) if scheme == "mooncake+tcp" else cls()
            except (ImportError, RuntimeError) as exc:
                if strict:
                    raise
                logger.warning("kv transfer: no %s client here (%s): fetching those producers over TCP", scheme, exc)
                client = self._clients.get("tcp") or TcpTransferClient()
                self._clients.setdefault("tcp", client)
            self._clients[scheme] = client
            return client
