"""The seam between a worker and the thing that moves a request's cache bytes between processes.

A producer (prefill instance) rank `publish`es one payload per request under a transfer id; a consumer (decode
instance) rank `fetch`es it by the producer rank's `address` and the id. Transports move opaque bytes: the worker
frames each payload (`kvstore.entry`: a header with the cache layout's namespace, the transfer id, the length and a
CRC-32), so a payload cut short, altered or meant for another layout is refused on arrival whatever the transport.

Rules every transport keeps:
- `fetch` never raises on a transfer failure (peer gone, refused, timed out, id unknown or expired, short read): it
  returns None, and the consumer recomputes the prefix locally.
- `fetch` returns within about `timeout_s` even if the peer stops answering mid-transfer.
- A published payload is held until it has been fetched once, `withdraw`n, or `ttl_s` passed; the server holds at
  most `max_bytes` (past that the oldest payloads are dropped: their fetches fail, a recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

Payload = bytes | memoryview
"""What a fetch returns: the payload's bytes, as `bytes` or a read-only view of the buffer it was received into
(no copy)."""


@dataclass(frozen=True, slots=True)
class TransportStats:
    """Cumulative counters of one side of a transport (a server's or a client's)."""

    published: int = 0
    published_bytes: int = 0
    served: int = 0
    """Payloads fetched by a peer (server side)."""
    expired: int = 0
    """Payloads dropped unfetched (ttl or max_bytes)."""
    fetched: int = 0
    fetched_bytes: int = 0
    fetch_failures: int = 0
    fetch_seconds: float = 0.0
    """Wall time of the fetches (client side), successful or not."""


class TransferServer(Protocol):
    """The producer rank's side: holds payloads until a consumer fetches them."""

    @property
    def address(self) -> str:
        """How a consumer reaches this server (`scheme://...`), sent to the decode instance with the transfer."""
        ...

    def publish(self, transfer_id: str, payload: bytes) -> None:
        """Hold `payload` for one fetch of `transfer_id` (replaces an earlier payload of the same id)."""
        ...

    def withdraw(self, transfer_id: str) -> None:
        """Drop a payload nobody will fetch (unknown ids are ignored)."""
        ...

    def stats(self) -> TransportStats: ...

    def close(self) -> None:
        """Stop serving and free the held payloads."""
        ...


class TransferClient(Protocol):
    """The consumer rank's side."""

    def fetch(self, address: str, transfer_id: str, timeout_s: float) -> Payload | None:
        """The payload published under `transfer_id` at `address`, or None on any failure (see the module rules)."""
        ...

    def stats(self) -> TransportStats: ...

    def close(self) -> None: ...
