"""A uvicorn HTTP protocol with a bound on how long a request's headers may take to arrive.

uvicorn times out idle keep-alive connections but not a client that opens a connection and sends nothing, or sends
its headers a byte at a time: each such connection would be held forever. `with_header_timeout` makes the httptools
protocol (what uvicorn[standard] uses) answer 408 and close a connection whose headers are not complete within the
bound, counted from the connection's opening or from the first byte of each later request on it. The body's bound
is the app's (`app._read_body`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_TIMEOUT_BODY = b"request headers not received in time\n"
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                     b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY)


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """`HttpToolsProtocol` that closes a connection (after a 408) whose request headers arrive too slowly."""

    header_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:  # a later request on a kept-alive connection: its first byte is here
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # not in the middle of a pipelined response
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def with_header_timeout(timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """The protocol class to pass as uvicorn's `http=`, with this bound on header arrival."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": timeout_s})
