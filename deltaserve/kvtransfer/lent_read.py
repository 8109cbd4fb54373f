"""The consumer's side of a zero-copy read, shared by the NIXL and Mooncake clients: LEND over the control
connection, read the producer's registered buffer with the library, RELEASE; the bytes come over the connection
instead when the library's read fails before the deadline, or when the producer holds the payload without a
zero-copy path (UNSUPPORTED)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from deltaserve.kvtransfer.address import is_local_host, parse_address
from deltaserve.kvtransfer.counters import Counters, counted_fetch
from deltaserve.kvtransfer.tcp import Channel
from deltaserve.kvtransfer.transport import Payload
from deltaserve.kvtransfer.wire import Deadline, Op, Status

logger = logging.getLogger(__name__)


class ReadFailed(Exception):
    """The library's read failed (not timed out): the payload may still come over TCP."""


def fetch_lent(channel: Channel, transfer_id: str, read: Callable[[bytes], Payload | None]) -> Payload | None:
    """`read(descriptor)` returns the payload, None when it ran past the channel's deadline (no retry then), or
    raises ReadFailed (the bytes are then SENT over the connection)."""
    status, length = channel.ask(Op.LEND, transfer_id)
    payload: Payload | None
    if status is Status.UNSUPPORTED:  # lent, but held without a zero-copy path (empty, or not registered)
        payload = channel.fetch_plain(Op.SEND, transfer_id)
    elif status is not Status.OK:
        return None
    else:
        descriptor = channel.read_small(length)
        try:
            payload = read(descriptor)
        except ReadFailed as exc:
            logger.warning("kv transfer: zero-copy read of %s failed (%s): fetching over TCP", transfer_id, exc)
            payload = channel.fetch_plain(Op.SEND, transfer_id)
    if payload is not None:
        channel.tell(Op.RELEASE, transfer_id)
    return payload


def fetch_from(counters: Counters, address: str, transfer_id: str, timeout_s: float, scheme: str,
               read: Callable[[bytes, Deadline], Payload | None], *, local_only: bool = False) -> Payload | None:
    """A client's whole fetch, counted: a plain FETCH unless the producer at `address` speaks `scheme` (and, with
    `local_only`, runs on this host), else LEND, `read(descriptor, deadline)` and RELEASE (`fetch_lent`)."""

    def fetch() -> Payload | None:
        target = parse_address(address)
        with Channel(target, Deadline(timeout_s)) as channel:
            if target.scheme != scheme or (local_only and not is_local_host(target.host)):
                return channel.fetch_plain(Op.FETCH, transfer_id)
            return fetch_lent(channel, transfer_id, lambda descriptor: read(descriptor, channel.deadline))

    return counted_fetch(counters, f"{transfer_id} from {address}", fetch)
