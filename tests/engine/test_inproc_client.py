"""`InprocEngineClient` on the tiny checkpoint: aborts and early closes free the request, the core's refusals and a
failed step come back as chained EngineRequestErrors, requests put into the core directly are aborted, stats count
tokens, shutdown fails the requests in flight."""

from __future__ import annotations

import asyncio

import pytest

from deltaserve import SamplingParams
from deltaserve.config import CacheConfig, EngineConfig
from deltaserve.engine.core_proc import MAX_FAILED_STEPS
from deltaserve.engine.engine_core import EngineCore
from deltaserve.engine.inproc_client import InprocEngineClient
from deltaserve.engine.messages import EngineCoreOutput
from deltaserve.engine.protocol import EngineClient, EngineDeadError, EngineRequestError
from deltaserve.request import FinishReason
from tests.helpers import prompt_ids

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def core(tiny_dir) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_dir("base")), max_model_len=256,
                                   cache=CacheConfig(cache_memory="64MiB")))


@pytest.fixture
def client(core) -> InprocEngineClient:
    assert not core.has_unfinished_requests()
    return InprocEngineClient(core)


async def collect(client: EngineClient, request_id: str, ids: list[int],
                  params: SamplingParams) -> list[EngineCoreOutput]:
    return [out async for out in client.generate(request_id, ids, params)]


def assert_nothing_held(core: EngineCore) -> None:
    assert not core.has_unfinished_requests()
    usage = core.cache.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_free_slots == usage.num_slots


def test_abort_close_and_cancel_mid_stream_free_the_request(client, core):
    """abort(), abort(STOP), aclose() and cancelling the reading task each end a running request at once: its
    stream ends with the reason (no tokens), the core holds nothing afterwards."""

    async def scenario() -> None:
        gens = [client.generate(f"long-{i}", prompt_ids(1024, 30 + i, seed=i), LONG) for i in range(4)]
        for g in gens[:3]:
            await anext(g)
        assert core.has_unfinished_requests() and client.num_unfinished == 3
        await client.abort("long-0")
        rest = [o async for o in gens[0]]  # outputs of steps run since, then the abort's
        assert (rest[-1].new_token_ids, rest[-1].finish_reason) == ([], FinishReason.ABORT)
        assert all(o.finish_reason is None for o in rest[:-1])
        await client.abort("long-1", FinishReason.STOP)
        assert [o async for o in gens[1]][-1].finish_reason is FinishReason.STOP
        await gens[2].aclose()
        got_one = asyncio.Event()

        async def read() -> None:
            async for _ in gens[3]:
                got_one.set()

        task = asyncio.create_task(read())
        await got_one.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert client.num_unfinished == 0

    asyncio.run(scenario())
    assert_nothing_held(core)


def test_outputs_follow_the_engine(client, core):
    """One output per step with one token each, the last with LENGTH; stats count this client's tokens."""

    async def scenario():
        outs = await collect(client, "a", prompt_ids(1024, 20, seed=7), GREEDY)
        return outs, await client.get_stats()

    outs, stats = asyncio.run(scenario())
    assert [len(o.new_token_ids) for o in outs] == [1] * 6
    assert [o.finish_reason for o in outs] == [None] * 5 + [FinishReason.LENGTH]
    assert (stats.prompt_tokens, stats.generation_tokens) == (20, 6)
    assert_nothing_held(core)


def test_refusals_raise_before_anything_is_queued(client, core):
    """The core's ValueError comes back as EngineRequestError chained from it; n != 1 and a reused id are
    ValueErrors of the client."""

    async def scenario() -> None:
        with pytest.raises(EngineRequestError, match="outside the vocabulary") as info:
            await collect(client, "oov", [5, 1024], GREEDY)
        assert isinstance(info.value.__cause__, ValueError)
        with pytest.raises(ValueError, match="n=1"):
            await collect(client, "n2", [5], SamplingParams(n=2))
        first = client.generate("dup", [5, 6], GREEDY)
        await anext(first)
        with pytest.raises(ValueError, match="already in use"):
            await collect(client, "dup", [5], GREEDY)
        await first.aclose()

    asyncio.run(scenario())
    assert_nothing_held(core)


def test_requests_put_into_the_core_directly_are_aborted(client, core):
    """A request nobody reads (added to the core, not through the client) is aborted when its output shows up."""
    core.add_request("orphan", prompt_ids(1024, 9, seed=3), LONG)

    async def scenario():
        return await collect(client, "mine", prompt_ids(1024, 9, seed=4), GREEDY)

    assert len(asyncio.run(scenario())) == GREEDY.max_tokens
    assert_nothing_held(core)


def test_failed_steps_end_the_requests_in_flight(client, core, monkeypatch):
    """A step that raises ends every request in flight with an EngineRequestError chained from the step's error
    (the core is cleaned up by fail_unfinished) and the client goes on; MAX_FAILED_STEPS in a row kill it."""
    real_step = core.step
    failures = iter(range(1))

    def step():
        if next(failures, None) is not None:
            raise RuntimeError("injected")
        return real_step()

    monkeypatch.setattr(core, "step", step)

    async def scenario() -> None:
        with pytest.raises(EngineRequestError, match="injected") as info:
            await asyncio.gather(collect(client, "x", [5, 6], GREEDY), collect(client, "y", [7, 8], GREEDY))
        assert isinstance(info.value.__cause__, RuntimeError)
        assert client.num_unfinished == 0 and client.is_alive
        assert len(await collect(client, "after", [5, 6], GREEDY)) == GREEDY.max_tokens

    asyncio.run(scenario())
    assert_nothing_held(core)

    def broken_step():
        raise RuntimeError("broken")

    monkeypatch.setattr(core, "step", broken_step)

    async def dying() -> None:
        for i in range(MAX_FAILED_STEPS):
            with pytest.raises(EngineRequestError, match="broken"):
                await collect(client, f"d{i}", [5, 6], GREEDY)
        assert not client.is_alive
        with pytest.raises(EngineDeadError, match="broken"):
            await collect(client, "late", [5, 6], GREEDY)

    asyncio.run(dying())
    assert_nothing_held(core)


def test_shutdown_fails_requests_in_flight_and_releases_the_core(client, core, monkeypatch):
    """Shutdown: a stream in flight raises EngineDeadError, new requests too, and the core's shutdown is called
    once however often the client is shut down."""
    calls = []
    monkeypatch.setattr(core, "shutdown", lambda: calls.append(1))  # the module's core serves the other tests

    async def scenario() -> None:
        gen = client.generate("inflight", [5, 6, 7], LONG)
        await anext(gen)
        await client.shutdown()
        await client.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await anext(gen)
        with pytest.raises(EngineDeadError):
            await collect(client, "late", [5], GREEDY)

    asyncio.run(scenario())
    assert calls == [1] and not client.is_alive and client.num_unfinished == 0
    core.abort_request("inflight")  # a shut-down client leaves the core as it was
    assert_nothing_held(core)
