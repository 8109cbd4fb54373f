"""The engine process loop (`core_proc`) in-process, around a fake engine core: input handling, batching of step
outputs, bad requests, failing steps, an orphaned engine."""

from __future__ import annotations

import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from deltaserve.engine import core_proc
from deltaserve.engine.core_proc import EngineProc, serve
from deltaserve.engine.messages import (
    AbortRequest,
    AddRequest,
    EngineCoreOutput,
    EngineOutput,
    FatalError,
    OutputBatch,
    ShutdownRequest,
    StatsReply,
    StatsRequest,
)
from deltaserve.engine.stats import EngineStats
from deltaserve.request import FinishReason
from deltaserve.sampling_params import SamplingParams

_sockets = itertools.count()


@dataclass
class FakeCore:
    """Each step gives every live request one token (its step number); requests end after params.max_tokens."""

    fail_at_step: int | None = None
    failures: int = 1
    """How many times the step at `fail_at_step` raises before it succeeds."""
    live: dict[str, list[int]] = field(default_factory=dict)
    stats: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(steps=0))
    finished: dict[str, FinishReason] = field(default_factory=dict)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def add_request(self, request_id, prompt_token_ids, params, *, eos_token_ids=frozenset(), priority=0,
                    kv_transfer_params=None, images=()) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt is empty")
        self.live[request_id] = [0, params.max_tokens]

    def abort_request(self, request_id: str) -> None:
        self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason) -> None:
        if self.live.pop(request_id, None) is not None:
            self.finished[request_id] = reason

    def step(self) -> list[EngineCoreOutput]:
        if self.stats.steps == self.fail_at_step and self.failures:
            self.failures -= 1
            raise RuntimeError("injected failure")
        self.stats.steps += 1
        outs = []
        for rid, progress in list(self.live.items()):
            progress[0] += 1
            done = progress[0] == progress[1]
            outs.append(EngineCoreOutput(request_id=rid, new_token_ids=[self.stats.steps], logprobs=[None],
                                         finish_reason=FinishReason.LENGTH if done else None))
            if done:
                del self.live[rid]
        return outs

    def fail_unfinished(self, error: str) -> list[EngineCoreOutput]:
        failed = list(self.live)
        for rid in failed:
            self.finish_request(rid, FinishReason.ERROR)
        return [EngineCoreOutput(request_id=rid, new_token_ids=[], logprobs=[], finish_reason=FinishReason.ERROR,
                                 error=error) for rid in failed]

    def get_stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.live), num_waiting=0, kv_blocks_used=0, kv_blocks_total=1,
                           state_slots_used=0, state_slots_total=1, prefix_queried_tokens=0, prefix_hit_tokens=0,
                           num_preemptions=0, steps=self.stats.steps)


@pytest.fixture
def sockets():
    """(send, engine inputs, engine outputs, receive) over inproc sockets."""
    ctx = zmq.Context()
    n = next(_sockets)
    inputs, outputs = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inputs.bind(f"inproc://in-{n}")
    outputs.bind(f"inproc://out-{n}")
    send, receive = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    send.connect(f"inproc://in-{n}")
    receive.connect(f"inproc://out-{n}")
    yield send, inputs, outputs, receive
    for s in (send, inputs, outputs, receive):
        s.close(linger=0)
    ctx.term()


def _send(sock: zmq.Socket, *msgs) -> None:
    for msg in msgs:
        sock.send(msg if isinstance(msg, bytes) else msgspec.msgpack.encode(msg))


def _received(sock: zmq.Socket) -> list:
    decoder = msgspec.msgpack.Decoder(EngineOutput)
    out = []
    while sock.poll(100):
        out.append(decoder.decode(sock.recv()))
    return out


def add(request_id: str, ids: list[int], max_tokens: int = 3) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=ids, params=SamplingParams(max_tokens=max_tokens))


def test_steps_batch_outputs_and_bad_requests_fail_alone(sockets):
    """One OutputBatch per step with every request's token; a ValueError from add_request and an invalid message
    become error outputs for that request; garbage is dropped; stats and aborts are applied; shutdown ends it."""
    send, inputs, outputs, receive = sockets
    bad_params = msgspec.msgpack.encode({"type": "add", "request_id": "bad-params", "prompt_token_ids": [1],
                                         "params": {"temperature": -1.0}})
    core = FakeCore()
    engine = threading.Thread(target=EngineProc(core, inputs, outputs, parent_pid=os.getppid()).run)
    engine.start()
    _send(send, add("a", [1, 2], 2), add("b", [3], 10**9), add("empty", []), bad_params, b"\xc1garbage",
          AbortRequest(request_id="unknown"))
    outs: dict[str, list] = {}
    decoder = msgspec.msgpack.Decoder(EngineOutput)
    # Wait for every request that must finish on its own (the rejections may come a step after "a" finishes).
    while any(r not in outs or outs[r][-1].finish_reason is None for r in ("a", "empty", "bad-params")):
        assert receive.poll(5000), "no output from the engine loop"
        batch = decoder.decode(receive.recv())
        assert len({o.request_id for o in batch.outputs}) == len(batch.outputs)
        for o in batch.outputs:
            outs.setdefault(o.request_id, []).append(o)
    _send(send, AbortRequest(request_id="b", reason=FinishReason.STOP), StatsRequest(request_no=7), ShutdownRequest())
    engine.join(60)  # a bound for a broken shutdown only: 5 s was once too short on a loaded CI machine
    assert not engine.is_alive()
    rest = _received(receive)
    for batch in rest:
        for o in batch.outputs if isinstance(batch, OutputBatch) else ():
            outs.setdefault(o.request_id, []).append(o)
    stats = [m for m in rest if isinstance(m, StatsReply)]
    assert len(stats) == 1 and stats[0].request_no == 7 and stats[0].stats.prompt_tokens == 3
    assert "prompt is empty" in outs["empty"][0].error and "temperature" in outs["bad-params"][0].error
    assert outs["empty"][0].finish_reason is FinishReason.ERROR
    assert [o.finish_reason for o in outs["a"]] == [None, FinishReason.LENGTH]
    assert all(o.error is None and len(o.new_token_ids) == 1 for o in outs["a"] + outs["b"])
    assert core.finished == {"b": FinishReason.STOP} and not core.live
    assert stats[0].stats.generation_tokens == len(outs["a"]) + len(outs["b"]) == 2 + len(outs["b"])


def _outputs_until_finished(receive: zmq.Socket, request_id: str) -> list:
    decoder, outs = msgspec.msgpack.Decoder(EngineOutput), []
    while True:
        assert receive.poll(5000), "no output from the engine loop"
        msg = decoder.decode(receive.recv())
        assert isinstance(msg, OutputBatch), msg
        outs += [o for o in msg.outputs if o.request_id == request_id]
        if outs and outs[-1].finish_reason is not None:
            return outs


def test_failing_step_ends_the_requests_in_flight_and_the_engine_goes_on(sockets):
    send, inputs, outputs, receive = sockets
    core = FakeCore(fail_at_step=1)
    engine = threading.Thread(target=serve, args=(core, inputs, outputs, os.getppid()))
    engine.start()
    _send(send, add("a", [1], 5))
    a = _outputs_until_finished(receive, "a")
    assert a[-1].finish_reason is FinishReason.ERROR and "injected failure" in a[-1].error
    assert core.finished == {"a": FinishReason.ERROR}
    _send(send, add("b", [2], 2))
    b = _outputs_until_finished(receive, "b")
    assert [o.finish_reason for o in b] == [None, FinishReason.LENGTH] and all(o.error is None for o in b)
    _send(send, ShutdownRequest())
    engine.join(5)
    assert not engine.is_alive()


def test_failing_steps_in_a_row_send_fatal_error(sockets):
    """A step that fails MAX_FAILED_STEPS times in a row (each time with a new request to run) is fatal."""
    send, inputs, outputs, receive = sockets
    result = []
    engine = threading.Thread(target=lambda: result.append(serve(FakeCore(fail_at_step=0, failures=99), inputs,
                                                                  outputs, os.getppid())))
    engine.start()
    for i in range(core_proc.MAX_FAILED_STEPS - 1):
        _send(send, add(f"r{i}", [1], 5))
        assert _outputs_until_finished(receive, f"r{i}")[-1].finish_reason is FinishReason.ERROR
    _send(send, add("last", [1], 5))
    engine.join(5)
    assert result == [False]
    msgs = _received(receive)
    assert isinstance(msgs[-1], FatalError) and msgs[-1].message == "RuntimeError: injected failure"
    assert "Traceback" in msgs[-1].traceback


def test_rejections_queued_with_a_shutdown_are_still_sent(sockets):
    send, inputs, outputs, receive = sockets
    _send(send, add("empty", []), ShutdownRequest())
    assert serve(FakeCore(), inputs, outputs, parent_pid=os.getppid())
    (batch,) = _received(receive)
    assert [o.request_id for o in batch.outputs] == ["empty"] and "prompt is empty" in batch.outputs[0].error


def test_orphaned_engine_exits(sockets, monkeypatch):
    """An idle engine whose parent is gone (reparented: getppid changed) leaves its loop at the next check, and a
    busy one after its step."""
    monkeypatch.setattr(core_proc, "PARENT_CHECK_S", 0.05)
    send, inputs, outputs, receive = sockets
    start = time.monotonic()
    assert serve(FakeCore(), inputs, outputs, parent_pid=-1)
    assert time.monotonic() - start < 1.0
    _send(send, add("a", [1], 100))
    core = FakeCore()
    assert serve(core, inputs, outputs, parent_pid=-1)
    assert core.stats.steps == 1
