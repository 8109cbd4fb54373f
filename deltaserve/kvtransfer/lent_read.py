"""The consumer's side of a zero-copy read, shared by the NIXL and Mooncake clients: LEND over the control
connection, read the producer's registered buffer with the library, RELEASE; the bytes come over the connection
instead when the library's read fails before the deadline (a producer without that library answers UNSUPPORTED
and is FETCHed the same way)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from deltaserve.kvtransfer.tcp import Channel
from deltaserve.kvtransfer.wire import Op, Status

logger = logging.getLogger(__name__)


class ReadFailed(Exception):
    """The library's read failed (not timed out): the payload may still come over TCP."""


def fetch_lent(channel: Channel, transfer_id: str, read: Callable[[bytes], bytes | None]) -> bytes | None:
    """`read(descriptor)` returns the payload, None when it ran past the channel's deadline (no retry then), or
    raises ReadFailed (the bytes are then SENT over the connection)."""
    status, length = channel.ask(Op.LEND, transfer_id)
    if status is Status.UNSUPPORTED:
        return channel.fetch_plain(Op.FETCH, transfer_id)
    if status is not Status.OK:
        return None
    descriptor = channel.read_small(length)
    payload: bytes | None
    try:
        payload = read(descriptor)
    except ReadFailed as exc:
        logger.warning("kv transfer: zero-copy read of %s failed (%s): fetching over TCP", transfer_id, exc)
        payload = channel.fetch_plain(Op.SEND, transfer_id)
    if payload is not None:
        channel.tell(Op.RELEASE, transfer_id)
    return payload
