"""The consumer's side of a zero-copy read, shared by the NIXL and Mooncake clients: LEND over the control
connection, read the producer's registered buffer with the library, RELEASE; the bytes come over the connection
instead when the library's read fails before the deadline, or when the producer holds the payload without a
zero-copy path (UNSUPPORTED)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from deltaserve.kvtransfer.tcp import Channel
from deltaserve.kvtransfer.transport import Payload
from deltaserve.kvtransfer.wire import Op, Status

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
