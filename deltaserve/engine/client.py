"""`AsyncEngineClient`: the `EngineClient` (protocol.py) of an `EngineCore` that runs in its own process.

The engine process (`core_proc.run_engine_core`) is started with the "spawn" method and joined by two ZMQ PUSH/PULL
channels over `ipc://` sockets in a private temporary directory (protocol: `messages.py`). The API process never
imports torch or the model: a slow HTTP handler cannot stall the step loop, and a step cannot stall the server.

In this process, a reader callback on the output socket routes each request's outputs to that request's
`asyncio.Queue` (ids that are unknown or already finished/aborted are dropped), and a callback on the process
sentinel fails every waiter with `EngineDeadError` as soon as the engine process exits. Sends never block: both
PUSH sockets are the connecting side with no high-water mark.

Liveness: the engine process sends a `Heartbeat` every `HEARTBEAT_INTERVAL_S` from a thread of its own, and
`heartbeat_age` says how long ago the last one arrived (a stopped or frozen engine process keeps existing, so
`is_alive` alone cannot see it). `wait_exited` returns once the process has exited; `restart` then starts a new
one with the same config behind the same client object.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import weakref
from collections.abc import AsyncGenerator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from deltaserve.config import EngineConfig
from deltaserve.engine.core_proc import run_engine_core
from deltaserve.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    EngineInfo,
    EngineOutput,
    FatalError,
    Heartbeat,
    OutputBatch,
    Ready,
    ShutdownRequest,
    StartupError,
    StatsReply,
    StatsRequest,
)
from deltaserve.engine.protocol import EngineDeadError, EngineRequestError
from deltaserve.engine.stats import EngineStats
from deltaserve.multimodal.inputs import ImageInput
from deltaserve.request import FinishReason
from deltaserve.sampling_params import SamplingParams

__all__ = [
    "AsyncEngineClient",
    "EngineDeadError",
    "EngineInfo",
    "EngineRequestError",
    "EngineStartError",
    "EngineStats",
]

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
"""How long `shutdown` waits for the engine to exit by itself before terminating it."""


class EngineStartError(RuntimeError):
    """The engine process failed to start (its error, one line; the full traceback is in `.traceback`)."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback


@dataclass(frozen=True, slots=True)
class _Channel:
    """A started engine process and the ZMQ sockets to it."""

    process: multiprocessing.process.BaseProcess
    ctx: zmq.Context
    input: zmq.Socket
    output: zmq.Socket
    socket_dir: str
    info: EngineInfo


class AsyncEngineClient:
    """One engine process and the routing of its outputs (an `EngineClient`). Create with
    `await AsyncEngineClient.start(config)`; all methods must be called from the event loop that started it."""

    def __init__(self, *, config: EngineConfig, channel: _Channel, startup_timeout_s: float = 600,
                 env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self._startup_timeout_s = startup_timeout_s
        self._env = dict(env or {})
        self._loop = asyncio.get_running_loop()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(EngineOutput)
        self._queues: dict[str, asyncio.Queue[EngineCoreOutput | Exception]] = {}
        self._stats_waiters: dict[int, asyncio.Future[EngineStats]] = {}
        self._stats_numbers = itertools.count()
        self._closing = False
        self._closed = asyncio.Event()
        """Set when `shutdown` has finished."""
        self._attached = False
        self._attach(channel)

    def _attach(self, channel: _Channel) -> None:
        """Take over a started engine process (at start and on `restart`)."""
        self.info = channel.info
        self._process = channel.process
        self._ctx, self._input, self._output = channel.ctx, channel.input, channel.output
        self._socket_dir = channel.socket_dir
        self._fatal: FatalError | None = None
        self._dead_reason: str | None = None
        """Set once the engine process has exited: why."""
        self._exited = asyncio.Event()
        """Set when the engine process has exited (and every waiter has been failed)."""
        self._last_heartbeat = self._loop.time()
        """Event-loop time of the last `Heartbeat` (or of `Ready`)."""
        self._output_fd: int = channel.output.fileno()
        self._finalizer = weakref.finalize(self, _kill_and_clean, channel.process, channel.socket_dir)
        self._attached = True
        self._loop.add_reader(self._output_fd, self._on_readable)
        self._loop.add_reader(channel.process.sentinel, self._on_exit)
        self._on_readable()  # messages that arrived before the reader was registered (the FD is edge-triggered)

    def _detach(self) -> None:
        """Close the sockets and reap the process (killed if it still runs). Idempotent."""
        if not self._attached:
            return
        self._attached = False
        self._loop.remove_reader(self._output_fd)
        self._input.close()
        self._output.close()
        self._ctx.term()
        self._finalizer()  # kills the process if it still runs, joins it, removes the socket directory

    # -- start ---------------------------------------------------------------------------------------------------

    @classmethod
    async def start(cls, config: EngineConfig, *, startup_timeout_s: float = 600,
                    env: Mapping[str, str] | None = None) -> AsyncEngineClient:
        """Spawn the engine process (with `env` added to its environment: a data-parallel replica's GPUs) and wait
        until it has loaded the model.

        Raises EngineStartError with the engine's error when it fails, dies or is not ready within the timeout.
        """
        return cls(config=config, channel=await _spawn(config, startup_timeout_s, env or {}),
                   startup_timeout_s=startup_timeout_s, env=env)

    async def restart(self) -> None:
        """Start a new engine process (same config) after the previous one exited; its requests have already
        failed with EngineDeadError. Raises EngineStartError like `start`, EngineDeadError after `shutdown`."""
        if self._closing:
            raise EngineDeadError("the engine is shutting down")
        if self._dead_reason is None:
            raise RuntimeError("the engine process is still running")
        self._detach()
        channel = await _spawn(self.config, self._startup_timeout_s, self._env)
        if self._closing:  # shut down while the new engine started: it is not wanted
            _close_channel(channel)
            raise EngineDeadError("the engine is shutting down")
        self._attach(channel)

    async def wait_exited(self) -> str:
        """Wait until the current engine process has exited (its waiters failed); why it exited."""
        await self._exited.wait()
        return self._dead_reason or "the engine process exited"

    def heartbeat_age(self) -> float:
        """Seconds since the engine process last sent a `Heartbeat` (read after draining what has arrived, so a
        busy event loop here does not make the engine look late)."""
        if self._attached:
            self._on_readable()
        return self._loop.time() - self._last_heartbeat

    # -- requests ------------------------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       eos_token_ids: frozenset[int] = frozenset(), priority: int = 0, session_id: str | None = None,
                       kv_transfer_params: dict[str, Any] | None = None, images: tuple[ImageInput, ...] = ()
                       ) -> AsyncGenerator[EngineCoreOutput, None]:
        """Add a request (when iteration starts) and yield one output per engine step that produced tokens for it,
        until the one with `finish_reason` set. `session_id` (a routing hint) is ignored: there is one engine.

        Closing the iterator early (aclose, cancellation, garbage collection) aborts the request in the engine.
        Raises EngineRequestError if the engine rejects the request, EngineDeadError if the engine is gone, and
        ValueError for n != 1 or a request id that is still in use.
        """
        if params.n != 1:
            raise ValueError(f"generate takes n=1 sampling params (got n={params.n}); fan out n in the frontend")
        self._check_alive()
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        try:
            message = self._encoder.encode(AddRequest(
                request_id=request_id, prompt_token_ids=prompt_token_ids, params=params,
                eos_token_ids=eos_token_ids, priority=priority, kv_transfer_params=kv_transfer_params,
                images=list(images)))
        except (OverflowError, UnicodeEncodeError, TypeError) as exc:  # a value the wire cannot carry
            raise EngineRequestError(f"the request cannot be sent to the engine: {exc}") from exc
        queue: asyncio.Queue[EngineCoreOutput | Exception] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            self._input.send(message, zmq.NOBLOCK)
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished and self._queues.get(request_id) is queue:
                del self._queues[request_id]
                if self._dead_reason is None and not self._closing:
                    self._send(AbortRequest(request_id=request_id, reason=FinishReason.ABORT))

    async def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        """End a request now and free its cache (ABORT: the client went away; STOP: the frontend found a stop
        string). Its iterator yields a last output with no tokens and `finish_reason=reason`. Unknown ids are
        ignored."""
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(EngineCoreOutput(request_id=request_id, new_token_ids=[], logprobs=[],
                                              finish_reason=reason))
        if self._dead_reason is None and not self._closing:
            self._send(AbortRequest(request_id=request_id, reason=reason))

    async def get_stats(self, *, reset_prefix_cache: bool = False) -> EngineStats:
        """A fresh snapshot from the engine process (answered between two steps); optionally first forget every
        cached prefix (KV blocks and state checkpoints), as `vllm`'s /reset_prefix_cache does."""
        self._check_alive()
        number = next(self._stats_numbers)
        waiter = self._loop.create_future()
        self._stats_waiters[number] = waiter
        try:
            self._send(StatsRequest(request_no=number, reset_prefix_cache=reset_prefix_cache))
            return await waiter
        finally:
            self._stats_waiters.pop(number, None)

    @property
    def is_alive(self) -> bool:
        return self._dead_reason is None and not self._closing and self._process.is_alive()

    @property
    def num_unfinished(self) -> int:
        """Requests added through this client that have not finished, failed or been aborted."""
        return len(self._queues)

    @property
    def pid(self) -> int | None:
        """The engine process id."""
        return self._process.pid

    # -- shutdown ------------------------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Ask the engine to exit, wait for it (terminate it if it does not), close the sockets. Idempotent;
        requests still in flight fail with EngineDeadError."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            if self._dead_reason is None:
                self._send(ShutdownRequest())
            for stop in (None, self._process.terminate, self._process.kill):
                if stop is not None:
                    logger.warning("engine process %d did not exit: %s", self._process.pid, stop.__name__)
                    stop()
                try:
                    await asyncio.wait_for(self._exited.wait(), SHUTDOWN_TIMEOUT_S)
                    break
                except TimeoutError:
                    continue
        finally:
            self._detach()
            self._closed.set()

    # -- internals -----------------------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if self._closing:
            raise EngineDeadError("the engine is shutting down")

    def _send(self, msg: msgspec.Struct) -> None:
        self._input.send(self._encoder.encode(msg), zmq.NOBLOCK)

    def _on_readable(self) -> None:
        """Drain the output socket (called by the event loop when its FD signals)."""
        while True:
            try:
                raw = self._output.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._dispatch(self._decoder.decode(raw))
            except Exception:  # keep draining: an unread message would never signal the FD again
                logger.exception("could not handle an engine output")

    def _dispatch(self, msg: EngineOutput) -> None:
        if isinstance(msg, OutputBatch):
            for out in msg.outputs:
                self._route(out)
        elif isinstance(msg, StatsReply):
            waiter = self._stats_waiters.pop(msg.request_no, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg.stats)
        elif isinstance(msg, Heartbeat):
            self._last_heartbeat = self._loop.time()
        elif isinstance(msg, FatalError):
            self._fatal = msg
            logger.error("engine process failed: %s\n%s", msg.message, msg.traceback)

    def _route(self, out: EngineCoreOutput) -> None:
        queue = self._queues.get(out.request_id)
        if queue is None:
            return
        if out.error is not None:
            del self._queues[out.request_id]
            queue.put_nowait(EngineRequestError(out.error))
            return
        if out.finish_reason is not None:
            del self._queues[out.request_id]
        queue.put_nowait(out)

    def _on_exit(self) -> None:
        """The engine process exited: deliver what it sent last, then fail every waiter."""
        self._loop.remove_reader(self._process.sentinel)
        if not self._output.closed:
            if not self._closing:
                self._output.poll(100)  # a FatalError sent just before exiting may still be on its way
            self._on_readable()
        self._process.join(1)
        if self._closing:
            reason = "the engine was shut down"
        elif self._fatal is not None:
            reason = f"the engine process failed: {self._fatal.message}"
        else:
            reason = f"the engine process exited unexpectedly (exit code {self._process.exitcode})"
        if not self._closing:
            logger.error("%s", reason)
        self._dead_reason = reason
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait(EngineDeadError(reason))
        waiters, self._stats_waiters = self._stats_waiters, {}
        for waiter in waiters.values():
            if not waiter.done():
                waiter.set_exception(EngineDeadError(reason))
        self._exited.set()


async def _spawn(config: EngineConfig, startup_timeout_s: float, env: Mapping[str, str]) -> _Channel:
    """Spawn an engine process with `env` added to its environment and wait for its `Ready` (EngineStartError on
    failure, death or timeout)."""
    socket_dir = tempfile.mkdtemp(prefix="deltaserve-")
    input_address, output_address = f"ipc://{socket_dir}/input", f"ipc://{socket_dir}/output"
    ctx = zmq.Context()
    ctx.setsockopt(zmq.LINGER, 0)
    output_socket = ctx.socket(zmq.PULL)
    output_socket.setsockopt(zmq.RCVHWM, 0)
    output_socket.bind(output_address)
    input_socket = ctx.socket(zmq.PUSH)
    input_socket.setsockopt(zmq.SNDHWM, 0)  # connect side: queued from the start, so a send never blocks
    input_socket.setsockopt(zmq.RECONNECT_IVL, 10)  # the engine binds a moment after we connect
    input_socket.connect(input_address)
    log_level = logging.getLogger("deltaserve").getEffectiveLevel()
    process = multiprocessing.get_context("spawn").Process(
        target=run_engine_core, args=(config, input_address, output_address, os.getpid(), log_level),
        name="deltaserve-engine", daemon=True,
    )
    try:
        with _environment(env):  # a spawned child starts with this process's environment as it is now
            process.start()
        info = await _wait_ready(output_socket, process, startup_timeout_s)
    except BaseException:
        input_socket.close()
        output_socket.close()
        ctx.term()
        _kill_and_clean(process, socket_dir)
        raise
    logger.info("engine process %d ready: %s", process.pid, info)
    return _Channel(process, ctx, input_socket, output_socket, socket_dir, info)


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """`env` set in this process's environment for the block (no await inside: nothing else runs meanwhile)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _close_channel(channel: _Channel) -> None:
    channel.input.close()
    channel.output.close()
    channel.ctx.term()
    _kill_and_clean(channel.process, channel.socket_dir)


async def _wait_ready(output_socket: zmq.Socket, process: multiprocessing.process.BaseProcess,
                      timeout_s: float) -> EngineInfo:
    """The engine's Ready message; EngineStartError on its StartupError, its death or the timeout."""
    decoder = msgspec.msgpack.Decoder(EngineOutput)
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        alive = process.is_alive()
        if output_socket.poll(0 if alive else 100):  # a dead engine's last message may still be on its way
            msg = decoder.decode(output_socket.recv())
            if isinstance(msg, Ready):
                return msg.info
            if isinstance(msg, StartupError):
                raise EngineStartError(f"engine start-up failed: {msg.message}", msg.traceback)
            continue
        if not alive:
            raise EngineStartError(f"the engine process exited during start-up (exit code {process.exitcode}); "
                                   "see its log above")
        if asyncio.get_running_loop().time() > deadline:
            raise EngineStartError(f"the engine was not ready within {timeout_s:g} s")
        await asyncio.sleep(0.02)


def _kill_and_clean(process: multiprocessing.process.BaseProcess, socket_dir: str) -> None:
    """Stop the process if it still runs and remove the socket directory (also at interpreter exit)."""
    if process.is_alive():
        process.kill()
    if process.pid is not None:
        process.join(5)
    shutil.rmtree(socket_dir, ignore_errors=True)
