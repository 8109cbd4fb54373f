"""The engine process: an `EngineCore` behind two ZMQ sockets, started by `AsyncEngineClient`.

`run_engine_core` builds the engine, sends `Ready` (or `StartupError`), then loops: when the engine has no work it
blocks on the input socket (waking every `PARENT_CHECK_S` to exit if its parent died); when it has work it takes
whatever inputs arrived without waiting, runs one step and sends the step's outputs as one `OutputBatch`. A bad
request becomes an error output for that request; a step that raises ends the requests in flight with an error and
the loop goes on; an unexpected exception elsewhere (or `MAX_FAILED_STEPS` failing steps in a row) is logged and sent
as `FatalError`, and the process exits.

A `Heartbeat` thread sends a `Heartbeat` every `HEARTBEAT_INTERVAL_S` on a socket of its own: the API process's
/health sees a stopped or frozen process (every thread stops) but not a long step (torch ops release the GIL, and
Python switches threads every few milliseconds even when they do not).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import zmq

from deltaserve.config import EngineConfig, ModelConfig
from deltaserve.engine.messages import (
    HEARTBEAT_INTERVAL_S,
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    EngineInfo,
    EngineInput,
    FatalError,
    Heartbeat,
    OutputBatch,
    Ready,
    ShutdownRequest,
    StartupError,
    StatsReply,
    StatsRequest,
)
from deltaserve.executor.base import WorkerDiedError
from deltaserve.request import FinishReason

if TYPE_CHECKING:
    from deltaserve.engine.dp_lockstep import Lockstep
    from deltaserve.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0
"""How often an idle engine wakes to check that its parent process still exists."""
MAX_FAILED_STEPS = 3
"""Steps in a row that may raise before the engine gives up (each one ends the requests it held)."""

_ENCODER = msgspec.msgpack.Encoder()


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, parent_pid: int,
                    log_level: int = logging.INFO) -> None:
    """Entry point of the engine process (a `multiprocessing` spawn target). Exits with 1 after a failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.setsockopt(zmq.RCVHWM, 0)
    inputs.bind(input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)  # connect side: queued from the start, so a send never blocks
    outputs.connect(output_address)
    failed = True
    try:
        try:
            ModelConfig.from_pretrained(config.model)  # a bad checkpoint fails before torch is imported
            from deltaserve.engine.dp_lockstep import Lockstep
            from deltaserve.engine.engine_core import EngineCore  # torch and the model stack: errors reported too

            core = EngineCore(config)
            replicas = config.parallel.expert_replicas
            try:
                lockstep = None if replicas is None else Lockstep(replicas)
            except Exception:
                core.shutdown()
                raise
        except Exception as e:
            logger.exception("engine start-up failed")
            outputs.send(_ENCODER.encode(StartupError(message=_one_line(e), traceback=traceback.format_exc())))
            return
        outputs.send(_ENCODER.encode(Ready(info=engine_info(core))))
        beat = HeartbeatThread(ctx, output_address, lambda: core.stats.steps)
        try:
            failed = not serve(core, inputs, outputs, parent_pid, lockstep)
        finally:
            beat.stop()
            core.shutdown()
    finally:
        inputs.close(linger=0)
        outputs.close(linger=2000)  # deliver the last message (a StartupError or FatalError) before exiting
        ctx.term()
        if failed:
            sys.exit(1)


class HeartbeatThread:
    """Sends a `Heartbeat` every `HEARTBEAT_INTERVAL_S` until stopped, on its own PUSH socket (ZMQ sockets are not
    thread-safe) connected to the client's output address."""

    def __init__(self, ctx: zmq.Context, address: str, steps: Callable[[], int]) -> None:
        self._socket = ctx.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.connect(address)
        self._steps = steps
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deltaserve-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()  # not shared with the loop's thread
        try:
            while not self._stop.wait(HEARTBEAT_INTERVAL_S):
                self._socket.send(encoder.encode(Heartbeat(step=self._steps())), zmq.NOBLOCK)
        finally:
            self._socket.close(linger=0)  # before ctx.term(), which waits for every socket to close

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def serve(core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int,
          lockstep: Lockstep | None = None) -> bool:
    """Run the engine loop; on an unexpected exception log it, send `FatalError` and return False."""
    try:
        EngineProc(core, inputs, outputs, parent_pid, lockstep).run()
        return True
    except Exception as e:
        logger.exception("engine loop failed")
        outputs.send(_ENCODER.encode(FatalError(message=_one_line(e), traceback=traceback.format_exc())))
        return False


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def engine_info(core: EngineCore) -> EngineInfo:
    return EngineInfo(
        max_model_len=core.max_model_len, vocab_size=core.model_config.vocab_size,
        eos_token_ids=frozenset(core.model_config.eos_token_ids), num_blocks=core.cache.blocks.num_blocks,
        num_state_slots=core.cache.slots.num_slots, block_size=core.config.cache.block_size,
    )


class EngineProc:
    """The busy loop around one `EngineCore`: inputs, step, outputs. With a `Lockstep` (experts over data-parallel
    replicas) the replicas agree before each step and all step when any has work (`dp_lockstep.py`)."""

    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, parent_pid: int,
                 lockstep: Lockstep | None = None) -> None:
        self.core, self.inputs, self.outputs, self.parent_pid = core, inputs, outputs, parent_pid
        self.lockstep = lockstep
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.rejected: list[EngineCoreOutput] = []
        self.failed_steps = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def run(self) -> None:
        """Loop until a `ShutdownRequest` or the parent process is gone."""
        while True:
            if not self.await_work():
                logger.warning("parent process %d is gone: engine exiting", self.parent_pid)
                return
            running = self.handle_inputs()
            batch = self.rejected  # sent even on shutdown: the client may still wait for these answers
            self.rejected = []
            step = running and self.core.has_unfinished_requests()
            if self.lockstep is not None:  # a replica without work steps too: its workers join the exchanges
                busy, stopping = self.lockstep.agree(step, not running)
                if stopping and running:
                    logger.info("another data-parallel replica is shutting down: so is this one (its experts)")
                    running = False
                step = busy and running
            if step:
                outs = self.step()
                self.generation_tokens += sum(len(out.new_token_ids) for out in outs)
                batch += outs
            if batch:
                self.outputs.send(_ENCODER.encode(OutputBatch(outputs=batch, step=self.core.stats.steps)))
            if not running:
                logger.info("engine shutting down")
                return
            if os.getppid() != self.parent_pid:  # orphaned while busy
                logger.warning("parent process %d is gone: engine exiting", self.parent_pid)
                return

    def step(self) -> list[EngineCoreOutput]:
        """One engine step. A step that raises ends the requests in flight with an error and the engine goes on;
        MAX_FAILED_STEPS failures in a row (a broken device, not one bad request) or a dead worker re-raise, which is
        fatal."""
        try:
            outputs = self.core.step()
        except WorkerDiedError:  # the model is gone with its worker: nothing left to serve with
            raise
        except Exception as e:
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise
            logger.exception("engine step failed: ending the requests in flight with an error")
            return self.core.fail_unfinished(f"internal error in an engine step: {_one_line(e)}")
        self.failed_steps = 0
        return outputs

    def await_work(self) -> bool:
        """Return at once with work here (or, in lockstep, on any replica); else wait for an input (in lockstep at
        most `Lockstep.idle_wait_s`). False if the parent process died meanwhile."""
        if self.core.has_unfinished_requests():
            return True
        if self.lockstep is None:
            return self.wait_for_input()
        if not self.lockstep.busy_anywhere:
            self.inputs.poll(timeout=int(self.lockstep.idle_wait_s * 1000))
        return os.getppid() == self.parent_pid

    def wait_for_input(self) -> bool:
        """Block until an input arrives; False if the parent process died meanwhile."""
        while not self.inputs.poll(timeout=int(PARENT_CHECK_S * 1000)):
            if os.getppid() != self.parent_pid:
                return False
        return True

    def handle_inputs(self) -> bool:
        """Apply every input that has arrived, without waiting; False on a shutdown request."""
        while int(self.inputs.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # cheaper than a recv raising zmq.Again
            raw: bytes = self.inputs.recv(zmq.NOBLOCK)
            try:
                msg = self.decoder.decode(raw)
            except msgspec.DecodeError as e:  # ValidationError too (e.g. invalid SamplingParams)
                self.reject_undecodable(raw, e)
                continue
            if isinstance(msg, ShutdownRequest):
                return False
            self.handle(msg)
        return True

    def handle(self, msg: AddRequest | AbortRequest | StatsRequest) -> None:
        if isinstance(msg, AddRequest):
            self.add(msg)
        elif isinstance(msg, AbortRequest):
            if msg.reason is FinishReason.ABORT:
                self.core.abort_request(msg.request_id)
            else:
                self.core.finish_request(msg.request_id, msg.reason)
        elif isinstance(msg, StatsRequest):
            if msg.reset_prefix_cache:
                blocks, checkpoints = self.core.reset_prefix_cache()
                logger.info("prefix cache reset: %d blocks and %d checkpoints forgotten", blocks, checkpoints)
            stats = dataclasses.replace(self.core.get_stats(), prompt_tokens=self.prompt_tokens,
                                        generation_tokens=self.generation_tokens)
            self.outputs.send(_ENCODER.encode(StatsReply(request_no=msg.request_no, stats=stats)))

    def add(self, msg: AddRequest) -> None:
        try:
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params,
                                  eos_token_ids=msg.eos_token_ids, priority=msg.priority,
                                  kv_transfer_params=msg.kv_transfer_params, images=tuple(msg.images))
        except ValueError as e:
            self.reject(msg.request_id, str(e))
        except Exception as e:  # a bug for this request only: report it and keep serving the others
            logger.exception("adding request %r failed", msg.request_id)
            self.reject(msg.request_id, f"internal error while adding the request: {type(e).__name__}: {e}")
        else:
            self.prompt_tokens += len(msg.prompt_token_ids)

    def reject(self, request_id: str, error: str) -> None:
        self.rejected.append(EngineCoreOutput(request_id=request_id, new_token_ids=[], logprobs=[],
                                           finish_reason=FinishReason.ERROR, error=error))

    def reject_undecodable(self, raw: bytes, error: Exception) -> None:
        """A message that does not fit the protocol: answer its request id if one can be read, else log it."""
        try:
            request_id = msgspec.msgpack.decode(raw).get("request_id")
        except Exception:
            request_id = None
        if isinstance(request_id, str):
            self.reject(request_id, f"invalid request: {error}")
        else:
            logger.error("dropped an undecodable engine input: %s", error)
