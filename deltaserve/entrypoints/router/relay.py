"""Relaying an instance's response to the client: a whole body, or an SSE stream cut only at event boundaries, so
an instance that fails mid-stream leaves the client complete events followed by one error event."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from deltaserve.entrypoints.router.errors import error_event
from deltaserve.entrypoints.router.instances import Lease

T = TypeVar("T")

# Hop-by-hop headers and those the router's own server writes (uvicorn adds date and server, starlette the length).
_DROPPED_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "date", "server",
                              "proxy-connection", "te", "trailer", "upgrade"})


class InstanceDown(Exception):
    """The instance was marked unhealthy while a request waited on it."""


async def unless_down(aw: Awaitable[T], down: asyncio.Future[Any] | asyncio.Event) -> T:
    """`aw`'s result, or InstanceDown as soon as `down` is set or done (then `aw` is cancelled)."""
    waiter = asyncio.ensure_future(down.wait()) if isinstance(down, asyncio.Event) else down
    step = asyncio.ensure_future(aw)
    # Its outcome may go unread: when our caller is cancelled as the call ends (a client that leaves right after a
    # stream's last event), or when the call ends before its cancel lands.
    step.add_done_callback(_discard_outcome)
    try:
        done, _ = await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if isinstance(down, asyncio.Event):
            waiter.cancel()
        if not step.done():  # the instance went down, or our own caller was cancelled: the call goes too
            # Not awaited: inside a cancelled anyio scope (a stream whose client left) every await is cancelled
            # again. The loop holds the task until its clean-up (closing the connection) has run.
            step.cancel()
    if step in done:
        return step.result()
    raise InstanceDown


def _discard_outcome(task: asyncio.Future[Any]) -> None:
    """Mark a call's exception as seen (asyncio logs an exception never retrieved; a caller that still waits gets
    it all the same)."""
    if not task.cancelled():
        task.exception()


def relayed_headers(upstream: httpx.Response) -> dict[str, str]:
    """The instance's response headers a client should see (content type, encoding, Retry-After and the like)."""
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _DROPPED_HEADERS}


async def read_body(upstream: httpx.Response, down: asyncio.Event) -> bytes:
    """All of a response's bytes as sent (not decoded: the encoding header goes with them)."""
    chunks: list[bytes] = []

    async def read() -> None:
        async for chunk in upstream.aiter_raw():
            chunks.append(chunk)

    await unless_down(read(), down)
    return b"".join(chunks)


class RelayedStream(StreamingResponse):
    """A streamed response whose upstream response and lease end with it, however it ends (a client that leaves
    included: closing the upstream connection is what tells the instance to abort the request)."""

    def __init__(self, content: AsyncIterator[bytes], upstream: httpx.Response, lease: Lease) -> None:
        super().__init__(content, status_code=upstream.status_code, headers=relayed_headers(upstream))
        self._upstream = upstream
        self._lease = lease
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()

    async def close(self) -> None:
        """Close the upstream response and release the lease (idempotent)."""
        aclose = getattr(self._content, "aclose", None)
        if aclose is not None:
            await aclose()
        await self._upstream.aclose()
        self._lease.release()


def relay_stream(upstream: httpx.Response, lease: Lease, api: str,
                 on_failure: Callable[[str], object]) -> RelayedStream:
    """Stream `upstream`'s SSE events to the client; when the instance fails mid-stream (`on_failure(reason)` is
    called), the client gets the events that arrived whole, then a 503 error event and the end of the stream."""
    return RelayedStream(_events(upstream, lease, api, on_failure), upstream, lease)


async def _events(upstream: httpx.Response, lease: Lease, api: str,
                  on_failure: Callable[[str], object]) -> AsyncIterator[bytes]:
    chunks = upstream.aiter_raw()
    waiter = asyncio.ensure_future(lease.down.wait())  # one waiter for the whole stream, not one per chunk
    pending = b""
    try:
        while True:
            try:
                chunk = await unless_down(anext(chunks), waiter)
            except StopAsyncIteration:
                break
            except (httpx.HTTPError, InstanceDown) as exc:
                on_failure(_reason(exc))
                yield error_event(api, 503, f"the decode instance failed during the stream ({_reason(exc)}); "
                                            "retry the request", code="decode_instance_failed")
                return
            pending += chunk
            cut = pending.rfind(b"\n\n") + 2
            if cut >= 2:
                yield pending[:cut]
                pending = pending[cut:]
        if pending:
            yield pending
    finally:
        waiter.cancel()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, InstanceDown):
        return "unhealthy"
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    return type(exc).__name__
