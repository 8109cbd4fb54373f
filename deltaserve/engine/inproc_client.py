"""`InprocEngineClient`: the `EngineClient` (protocol.py) of an `EngineCore` in this process, as `LLM` uses it.

Steps run inline on the event loop, in a driver task that lives while the core has unfinished requests: step,
route each output to its request's queue, yield once to the loop (so every consumer sees the step's outputs, and
can abort on a stop string, before the next step), repeat. Inline rather than in a worker thread because:
- the offline API has nothing else to run while a step runs, and a thread hop per step (waking the loop from
  another thread, handing over the GIL) costs more than the output processing of a small model's step;
- adds and aborts are plain calls on the core from the loop's thread, so they can only happen between two steps,
  with no lock and no pending-input queue.
The price: the loop is blocked for the length of each step. The HTTP server therefore uses `AsyncEngineClient`,
whose engine runs in its own process. Not thread-safe: call it from one event loop at a time.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from deltaserve.engine.core_proc import MAX_FAILED_STEPS, engine_info
from deltaserve.engine.messages import EngineCoreOutput
from deltaserve.engine.protocol import EngineDeadError, EngineRequestError
from deltaserve.engine.stats import EngineStats
from deltaserve.executor.base import WorkerDiedError
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.request import FinishReason
from deltaserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deltaserve.config import EngineConfig
    from deltaserve.engine.engine_core import EngineCore

__all__ = ["InprocEngineClient"]

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 10.0
"""At most this long, when the driver starts (a batch of requests was added), it waits for their grammars to
compile, so that an offline batch is scheduled the same way however fast the compile threads run."""
MAX_IDLE_STEPS = 10_000
"""Steps in a row that may produce nothing before the requests in flight are failed (a scheduler that cannot make
progress; see the watchdog log)."""


class InprocEngineClient:
    """Owns one `EngineCore` (`core`) and streams its outputs to asyncio code; see the module docstring.

    A step that raises ends every request in flight with an `EngineRequestError` chained from the step's exception
    (`core.fail_unfinished`, as the engine process does) and the client goes on; `MAX_FAILED_STEPS` failing steps in
    a row kill it (`EngineDeadError` from then on). A KeyboardInterrupt inside a step does the same for the requests
    in flight, then propagates out of the event loop. Outputs of requests that were not added through this client
    (put into `core` directly) abort those requests: they are nobody's to report.
    """

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.info = engine_info(core)
        self._streams: dict[str, _Stream] = {}
        self._driver: asyncio.Task[None] | None = None
        self._dead_reason: str | None = None
        self._shut_down = False
        self._failed_steps = 0
        self._idle_steps = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> InprocEngineClient:
        """Build the engine (loads the model and allocates the cache) in this process."""
        from deltaserve.engine.engine_core import EngineCore  # torch and the model stack

        return cls(EngineCore(config))

    # -- requests ------------------------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       eos_token_ids: frozenset[int] = frozenset(), priority: int = 0, session_id: str | None = None,
                       kv_transfer_params: dict[str, Any] | None = None, images: tuple[ImageInput, ...] = ()
                       ) -> AsyncGenerator[EngineCoreOutput, None]:
        """Add a request to the core (when iteration starts: between two steps) and yield its outputs, as
        `EngineClient.generate` says (`session_id`, a routing hint, is ignored). A request the core refuses raises
        EngineRequestError chained from the core's ValueError."""
        if params.n != 1:
            raise ValueError(f"generate takes n=1 sampling params (got n={params.n}); fan out n in the frontend")
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            self.core.add_request(request_id, prompt_token_ids, params, eos_token_ids=eos_token_ids,
                                  priority=priority, kv_transfer_params=kv_transfer_params, images=images)
        except ValueError as exc:
            raise EngineRequestError(str(exc)) from exc
        self._prompt_tokens += len(prompt_token_ids)
        queue = self._streams[request_id] = _Stream()
        loop = asyncio.get_running_loop()
        if self._driver is None or self._driver.done():  # done: cancelled before it ever ran (loop shut down)
            self._driver = loop.create_task(self._drive(), name="deltaserve-inproc-engine")
            self._driver.add_done_callback(_retrieve)
        finished = False
        try:
            while not finished:
                while not queue.items:
                    queue.waiter = loop.create_future()
                    await queue.waiter
                item = queue.items.popleft()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished and self._streams.get(request_id) is queue:
                del self._streams[request_id]
                if self._dead_reason is None:
                    self.core.abort_request(request_id)

    async def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request now and free its cache (ABORT, or STOP for a stop string). Its iterator yields a last
        output with no tokens and `finish_reason=reason`. Unknown ids are ignored."""
        queue = self._streams.pop(request_id, None)
        if queue is not None:
            queue.put(EngineCoreOutput(request_id=request_id, new_token_ids=[], logprobs=[], finish_reason=reason))
        if self._dead_reason is None:
            self.core.finish_request(request_id, reason)

    async def get_stats(self, *, reset_prefix_cache: bool = False) -> EngineStats:
        """The core's snapshot (never taken inside a step), with the prompt and generated tokens of this client."""
        self._check_alive()
        if reset_prefix_cache:
            blocks, checkpoints = self.core.reset_prefix_cache()
            logger.info("prefix cache reset: %d blocks and %d checkpoints forgotten", blocks, checkpoints)
        return dataclasses.replace(self.core.get_stats(), prompt_tokens=self._prompt_tokens,
                                   generation_tokens=self._generation_tokens)

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None

    @property
    def num_unfinished(self) -> int:
        """Requests added through this client that have not finished, failed or been aborted."""
        return len(self._streams)

    async def shutdown(self) -> None:
        """Fail the requests in flight with EngineDeadError, wait for the driver to stop, release the core.
        Idempotent."""
        if self._shut_down:
            return
        self._shut_down = True
        if self._dead_reason is None:
            self._die("the engine was shut down")
        if self._driver is not None:
            await asyncio.wait([self._driver])  # it stops at its next check of `_dead_reason`
        self.core.shutdown()  # also after the client died of failed steps: its worker processes must still go

    # -- the driver ----------------------------------------------------------------------------------------------

    async def _drive(self) -> None:
        """Step while the core has unfinished requests; yield to the loop after each step."""
        try:
            # The requests added with the one that started the driver are in: let their grammars compile first.
            self.core.wait_for_grammars(GRAMMAR_WAIT_S)
            while self._dead_reason is None and self.core.has_unfinished_requests():
                self._step()
                await asyncio.sleep(0)
        finally:
            self._driver = None

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt too: the core must not stay mid-step
            self._fail_step(exc)
            if not isinstance(exc, Exception):
                raise
            return
        self._failed_steps = 0
        self._idle_steps = 0 if outputs else self._idle_steps + 1
        for out in outputs:
            self._route(out)
        if self._idle_steps >= MAX_IDLE_STEPS:
            self._fail_step(RuntimeError(f"the engine made no progress for {MAX_IDLE_STEPS:,} steps "
                                         "(see the watchdog log)"))

    def _fail_step(self, exc: BaseException) -> None:
        """End every request in flight with an error chained from `exc`; die after too many failures in a row."""
        message = f"internal error in an engine step: {type(exc).__name__}: {exc}"
        if isinstance(exc, Exception):
            self._failed_steps += 1
            logger.error("engine step failed: ending the requests in flight with an error", exc_info=exc)
        self._idle_steps = 0
        for out in self.core.fail_unfinished(message):
            self._route(out, cause=exc if out.error == message else None)
        if self._failed_steps >= MAX_FAILED_STEPS or isinstance(exc, WorkerDiedError):  # a dead worker: no model
            self._die(f"the engine failed: {message}")

    def _route(self, out: EngineCoreOutput, cause: BaseException | None = None) -> None:
        self._generation_tokens += len(out.new_token_ids)
        queue = self._streams.get(out.request_id)
        if queue is None:
            if out.finish_reason is None:  # added to the core directly, or left behind: nobody reads it
                self.core.abort_request(out.request_id)
            return
        if out.error is not None:
            del self._streams[out.request_id]
            error = EngineRequestError(out.error)
            error.__cause__ = cause
            queue.put(error)
            return
        if out.finish_reason is not None:
            del self._streams[out.request_id]
        queue.put(out)

    def _check_alive(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def _die(self, reason: str) -> None:
        self._dead_reason = reason
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put(EngineDeadError(reason))


class _Stream:
    """One request's undelivered outputs, and the future its reader waits on while there are none (cheaper than
    an asyncio.Queue, which this would be otherwise: one item per request per step)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: collections.deque[EngineCoreOutput | BaseException] = collections.deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: EngineCoreOutput | BaseException) -> None:
        self.items.append(item)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark the driver's exception as seen (a KeyboardInterrupt it re-raised has already reached the caller)."""
    if not task.cancelled():
        task.exception()
