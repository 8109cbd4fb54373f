"""`Lifecycle`: admission, deadlines and draining of the HTTP server's requests.

- Draining (SIGTERM, `drain`): `AdmissionGate`, an ASGI middleware, answers every new request 503 with Retry-After
  once draining has begun, and counts the requests in flight; `drain` waits for them to finish (at most
  `shutdown_timeout_s`), then aborts those left, which end like a request past its deadline.
- Deadlines (`--request-timeout-s`): `run` (a JSON response) and `guard_stream` (an event stream) end a request at
  its deadline or when a drain aborts it (`run` also when the client disconnects). Ending it cancels the work, which
  closes its generators: that aborts its sequences in the engine and frees their cache.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from deltaserve.entrypoints.server.errors import ApiError

logger = logging.getLogger(__name__)

T = TypeVar("T")

ABORT_GRACE_S = 10.0
"""After a drain aborts the requests still running, how long they get to send their error before the server
stops anyway."""
RETRY_AFTER_S = 5
"""The Retry-After of the 503 a draining server answers (a supervisor restarts it, or a balancer moves on)."""


class DeadlineError(ApiError):
    """A request still running at its server-side deadline (504; `timeout_error`, as Anthropic names it)."""

    def openai_body(self) -> dict[str, Any]:
        body = super().openai_body()
        body["error"]["type"] = "timeout_error"
        return body

    def anthropic_body(self) -> dict[str, Any]:
        body = super().anthropic_body()
        body["error"]["type"] = "timeout_error"
        return body


class Lifecycle:
    """Requests in flight, their deadlines and the server's drain. Use from one event loop."""

    def __init__(self, *, request_timeout_s: float | None = None, shutdown_timeout_s: float = 30.0) -> None:
        self.request_timeout_s = request_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.draining = False
        """Set when a drain has begun: new requests get 503."""
        self.in_flight = 0
        """HTTP requests (streams included) that have started and not finished."""
        self._idle = asyncio.Event()
        self._idle.set()
        self._aborted: asyncio.Future[None] | None = None
        """Done when a drain aborts the requests still running (made on first use, in the running loop)."""

    # -- admission -----------------------------------------------------------------------------------------------

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self, stop: Callable[[], None]) -> None:
        """Refuse new requests, wait for those in flight (abort them after `shutdown_timeout_s`), then `stop()`."""
        self.draining = True
        logger.info("draining: %d requests in flight, %g s to finish", self.in_flight, self.shutdown_timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), self.shutdown_timeout_s)
        except TimeoutError:
            logger.warning("aborting %d requests still running after %g s", self.in_flight, self.shutdown_timeout_s)
            self._abort_future().set_result(None)
            try:
                await asyncio.wait_for(self._idle.wait(), ABORT_GRACE_S)
            except TimeoutError:
                logger.warning("%d requests did not end after their abort", self.in_flight)
        stop()

    # -- deadlines -----------------------------------------------------------------------------------------------

    def deadline(self) -> float | None:
        """The event-loop time at which a request arriving now is aborted (None: never)."""
        if self.request_timeout_s is None:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout_s

    async def run(self, work: Awaitable[T], deadline: float | None, disconnected: Awaitable[Any]) -> T | None:
        """The result of `work`; None when `disconnected` finishes first; DeadlineError at the deadline, 503 when a
        drain aborts it (`work` is cancelled in all three cases)."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(disconnected)
        try:
            why = await self._race(task, deadline, watcher)
            if why is None:
                return task.result()
            await _cancel(task)
            if why == "disconnect":
                return None
            raise self._error(why)
        finally:
            watcher.cancel()
            task.cancel()

    async def guard_stream(self, events: AsyncIterator[str], deadline: float | None,
                           error_event: Callable[[ApiError], str]) -> AsyncIterator[str]:
        """`events`, ended by `error_event(err)` at the deadline or when a drain aborts it (`events` is closed
        first, which aborts its sequences).

        No task or future per event (a stream sends one per token): a timer and a callback on the drain's abort
        interrupt the wait for the next event by cancelling this task, only while it waits inside `events` (not
        while the consumer sends what it yielded), and take the cancellation back once `events` has ended.
        """
        interrupt = _Interrupt(asyncio.current_task())
        loop = asyncio.get_running_loop()
        timer = None if deadline is None else loop.call_at(deadline, interrupt.fire, "timeout")
        aborted = self._abort_future()

        def on_abort(_: asyncio.Future[None]) -> None:
            interrupt.fire("shutdown")

        aborted.add_done_callback(on_abort)
        try:
            while interrupt.why is None:
                interrupt.inside = True
                try:
                    item = await events.__anext__()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not interrupt.take_back():
                        raise
                    break
                finally:
                    interrupt.inside = False
                yield item
            await _aclose(events)
            assert interrupt.why is not None
            yield error_event(self._error(interrupt.why))
        finally:
            if timer is not None:
                timer.cancel()
            aborted.remove_done_callback(on_abort)
            await _aclose(events)

    async def _race(self, work: asyncio.Future[Any], deadline: float | None, *others: asyncio.Future[Any]
                    ) -> str | None:
        """None when `work` is done first; else "shutdown" (a drain's abort), "disconnect" (one of `others`) or
        "timeout" (the deadline)."""
        aborted = self._abort_future()
        timeout = None if deadline is None else max(0.0, deadline - asyncio.get_running_loop().time())
        done, _ = await asyncio.wait({work, aborted, *others}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if work in done:
            return None
        if aborted in done:
            return "shutdown"
        return "disconnect" if done else "timeout"

    def _abort_future(self) -> asyncio.Future[None]:
        if self._aborted is None:
            self._aborted = asyncio.get_running_loop().create_future()
        return self._aborted

    def _error(self, why: str) -> ApiError:
        if why == "shutdown":
            return ApiError(503, "the server is shutting down and aborted the request", code="shutting_down",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
        return DeadlineError(504, f"the request did not finish within the server's limit of "
                                  f"{self.request_timeout_s:g} s (--request-timeout-s)", code="request_timeout")


class _Interrupt:
    """Why a guarded stream must end, and the cancellation of its task that made it stop waiting."""

    def __init__(self, task: asyncio.Task[Any] | None) -> None:
        assert task is not None, "guard_stream runs in a task"
        self.task = task
        self.why: str | None = None
        self.inside = False
        """The task waits inside the guarded iterator (where a cancellation only ends that iterator)."""
        self.cancelled = False

    def fire(self, why: str) -> None:
        if self.why is not None:
            return
        self.why = why
        if self.inside:  # otherwise the stream sees `why` when the consumer comes back for the next event
            self.cancelled = True
            self.task.cancel()

    def take_back(self) -> bool:
        """After a CancelledError: True when it was ours alone (now withdrawn), False when to re-raise it."""
        if not self.cancelled:
            return False
        self.cancelled = False
        return self.task.uncancel() == 0


async def _aclose(events: AsyncIterator[str]) -> None:
    aclose = getattr(events, "aclose", None)
    if aclose is not None:
        await aclose()


async def _cancel(future: asyncio.Future[Any]) -> None:
    """Cancel and wait until it has ended (its `finally` blocks have run)."""
    future.cancel()
    try:
        await future
    except BaseException:  # noqa: BLE001 - CancelledError or whatever the work raised while ending
        pass


class AdmissionGate:
    """ASGI middleware: 503 with Retry-After to every request once the server drains; counts those in flight."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, render: Callable[[str, ApiError], Response]) -> None:
        self.app = app
        self.lifecycle = lifecycle
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.draining:
            err = ApiError(503, "the server is shutting down", code="shutting_down",
                           headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
            await self.render(scope["path"], err)(scope, receive, send)
            return
        self.lifecycle.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.leave()
