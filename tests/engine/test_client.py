"""`AsyncEngineClient` against a real engine process on the tiny checkpoint: same outputs as `LLM.generate`,
aborts free the cache, bad requests fail alone, a dead engine fails every caller promptly, shutdown is clean."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.config import CacheConfig, EngineConfig
from deltaserve.engine import client as client_module
from deltaserve.engine.client import (
    AsyncEngineClient,
    EngineDeadError,
    EngineRequestError,
    EngineStartError,
)
from deltaserve.engine.core_proc import MAX_FAILED_STEPS, run_engine_core
from deltaserve.engine.inproc_client import InprocEngineClient
from deltaserve.engine.messages import EngineCoreOutput
from deltaserve.engine.output_processor import OutputProcessor, TextProcessor
from deltaserve.engine.protocol import EngineClient
from deltaserve.request import FinishReason
from deltaserve.sampling_params import StructuredOutput
from deltaserve.text.tokenizer import Tokenizer
from tests.helpers import prompt_ids

MAX_MODEL_LEN = 256
CACHE_MEMORY = "64MiB"
TIMEOUT_S = 60.0
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here and in the engine processes (spawned children read OMP_NUM_THREADS): on a small
    shared CPU, spinning OpenMP threads make every step many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def path(tiny_dir) -> str:
    return str(tiny_dir("base"))


@pytest.fixture(scope="module")
def config(path) -> EngineConfig:
    return EngineConfig(model=path, max_model_len=MAX_MODEL_LEN, cache=CacheConfig(cache_memory=CACHE_MEMORY))


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module, so the engine started by `engine` outlives a single test."""
    with asyncio.Runner() as runner:
        yield runner


def run(loop: asyncio.Runner, coro, timeout: float = TIMEOUT_S):
    """Run a coroutine on the module's loop; a hang fails the test instead of blocking it."""
    return loop.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def engine(loop, config):
    client = run(loop, AsyncEngineClient.start(config))
    yield client
    run(loop, client.shutdown())


@pytest.fixture(scope="module")
def llm(path) -> LLM:
    return LLM(model=path, max_model_len=MAX_MODEL_LEN, cache_memory=CACHE_MEMORY)


async def collect(client: AsyncEngineClient, request_id: str, ids: list[int],
                  params: SamplingParams) -> list[EngineCoreOutput]:
    return [delta async for delta in client.generate(request_id, ids, params)]


def tokens(deltas: list[EngineCoreOutput]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


async def stats_when_idle(client: AsyncEngineClient):
    """Stats once the engine has applied everything sent before (inputs are handled in order)."""
    return await client.get_stats()


def test_engine_info(engine):
    info = engine.info
    assert info.max_model_len == MAX_MODEL_LEN and info.vocab_size == 1024 and info.block_size == 16
    assert info.num_blocks > 0 and info.num_state_slots > 0 and isinstance(info.eos_token_ids, frozenset)
    assert engine.is_alive and engine.num_unfinished == 0


def test_concurrent_greedy_equals_llm(engine, loop, llm):
    """Five concurrent requests of different prompt and output lengths give LLM.generate's tokens, one per delta."""
    lengths, max_tokens = [3, 17, 40, 9, 70], [4, 12, 7, 16, 9]
    prompts = [prompt_ids(1024, n, seed=300 + i) for i, n in enumerate(lengths)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    expected = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]

    async def scenario():
        return await asyncio.gather(*(collect(engine, f"greedy-{i}", p, sp)
                                      for i, (p, sp) in enumerate(zip(prompts, params, strict=True))))

    results = run(loop, scenario())
    assert [tokens(deltas) for deltas in results] == expected
    for deltas, m in zip(results, max_tokens, strict=True):
        assert len(deltas) == m and all(len(d.new_token_ids) == 1 for d in deltas)
        assert [d.finish_reason for d in deltas] == [None] * (m - 1) + [FinishReason.LENGTH]
    assert engine.num_unfinished == 0


def test_seeded_sampling_and_logprobs_equal_llm(engine, loop, llm):
    """Seeded sampling (beside an unseeded request) and logprobs come through the process boundary unchanged."""
    prompts = [prompt_ids(1024, n, seed=400 + n) for n in (11, 29)]
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=42, max_tokens=10, ignore_eos=True, logprobs=3)
    other = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    ref = llm.generate(prompts[0], seeded)[0].outputs[0]

    async def scenario():
        return await asyncio.gather(collect(engine, "seeded", prompts[0], seeded),
                                    collect(engine, "unseeded", prompts[1], other))

    deltas, unseeded = run(loop, scenario())
    assert tokens(deltas) == ref.token_ids
    got = [lp for d in deltas for lp in d.logprobs]
    assert len(got) == len(ref.logprobs) == 10
    for ours, theirs in zip(got, ref.logprobs, strict=True):
        assert (ours.token_id, ours.rank) == (theirs.token_id, theirs.rank)
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)  # batched with another request here
        assert [t for t, _ in ours.top] == [t for t, _ in theirs.top] and len(ours.top) == 3
    assert len(tokens(unseeded)) == 10 and all(lp is None for d in unseeded for lp in d.logprobs)


def test_abort_and_early_close_free_the_cache(engine, loop):
    """abort(), abort(STOP), closing the iterator and cancelling its task each end a request mid-generation; after
    all of them no KV block or state slot is held."""

    async def scenario():
        prompts = [prompt_ids(1024, 40 + i, seed=500 + i) for i in range(4)]
        gens = [engine.generate(f"long-{i}", p, LONG) for i, p in enumerate(prompts)]
        for g in gens[:3]:
            await anext(g)
        busy = await engine.get_stats()
        assert busy.num_running + busy.num_waiting == 3 and busy.kv_blocks_used >= 3 * 3
        assert busy.state_slots_used == busy.num_running >= 1

        await engine.abort("long-0")
        rest = [d async for d in gens[0]]
        assert [(d.new_token_ids, d.finish_reason) for d in rest[-1:]] == [([], FinishReason.ABORT)]
        await engine.abort("long-1", FinishReason.STOP)
        assert (await anext(gens[1])).finish_reason in (None, FinishReason.STOP)
        assert [d async for d in gens[1]][-1].finish_reason is FinishReason.STOP
        await gens[2].aclose()

        async def consume():
            async for _ in gens[3]:
                pass

        task = asyncio.create_task(consume())
        while engine.num_unfinished < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert engine.num_unfinished == 0
        return await stats_when_idle(engine)

    stats = run(loop, scenario())
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used, stats.state_slots_used) == (0, 0, 0, 0)


def test_bad_requests_fail_alone(engine, loop, llm):
    """Out-of-vocabulary ids, a too long or empty prompt, a grammar that does not compile raise EngineRequestError;
    n > 1 and a reused id raise ValueError in the client; the engine keeps serving."""
    good = prompt_ids(1024, 12, seed=600)

    async def scenario():
        for rid, ids, match in [("oov", [5, 1024, 7], "outside the vocabulary"),
                                ("negative", [-1], "outside the vocabulary"),
                                ("too-long", [3] * MAX_MODEL_LEN, "max_model_len"),
                                ("empty", [], "empty")]:
            with pytest.raises(EngineRequestError, match=match):
                await collect(engine, rid, ids, GREEDY)
        bad_grammar = SamplingParams(max_tokens=4, structured=StructuredOutput(kind="regex", spec="(("))
        with pytest.raises(EngineRequestError, match="regex"):  # compiled in the engine: fails after add_request
            await collect(engine, "bad-grammar", good, bad_grammar)
        with pytest.raises(ValueError, match="n=1"):
            await collect(engine, "n2", good, SamplingParams(n=2))
        first = engine.generate("dup", good, GREEDY)
        await anext(first)
        with pytest.raises(ValueError, match="already in use"):
            await collect(engine, "dup", good, GREEDY)
        await first.aclose()
        return await collect(engine, "after-errors", good, GREEDY)

    deltas = run(loop, scenario())
    assert tokens(deltas) == llm.generate(good, GREEDY)[0].outputs[0].token_ids
    assert engine.is_alive and engine.num_unfinished == 0


def test_idle_engine_does_not_spin(engine, loop):
    """An idle engine blocks on its socket: well under 10% of a core over a second."""
    run(loop, asyncio.sleep(0.3))
    before = _cpu_seconds(engine.pid)
    run(loop, asyncio.sleep(1.0))
    assert _cpu_seconds(engine.pid) - before < 0.1


def test_stats_counters(engine, loop):
    """Cumulative counters move with the work done (prompt and generated tokens, steps, prefix lookups)."""

    async def scenario():
        before = await engine.get_stats()
        await collect(engine, "count", prompt_ids(1024, 20, seed=700), GREEDY)
        return before, await engine.get_stats()

    before, after = run(loop, scenario())
    assert after.prompt_tokens - before.prompt_tokens == 20
    assert after.generation_tokens - before.generation_tokens == GREEDY.max_tokens
    assert after.steps - before.steps >= GREEDY.max_tokens
    assert after.prefix_queried_tokens > before.prefix_queried_tokens
    assert after.kv_blocks_total == engine.info.num_blocks and after.state_slots_total == engine.info.num_state_slots


async def processed(client: EngineClient, tokenizer: Tokenizer, request_id: str, ids: list[int],
                    params: SamplingParams) -> list[dict]:
    """Each sequence of a request through the output processor, joined: ids, text, reason, stop string, logprobs."""
    seqs = [{"ids": [], "text": "", "reason": None, "stop": None, "logprobs": []} for _ in range(params.n)]
    processor = OutputProcessor(client, eos_token_ids=frozenset(tokenizer.eos_token_ids))
    async for u in processor.generate(request_id, ids, params, lambda p: TextProcessor(tokenizer, p)):
        seq = seqs[u.index]
        seq["ids"] += u.token_ids
        seq["text"] += u.delta.content
        seq["logprobs"] += u.logprobs
        if u.finish_reason is not None:
            seq["reason"], seq["stop"] = u.finish_reason, u.stop_string
    return seqs


def test_inproc_and_process_clients_give_the_same_outputs(engine, loop, config, path):
    """Through the same output processor, the in-process and the engine-process clients give the same n=2 outputs:
    greedy with logprobs, and seeded sampling ended by a stop string (child seeds differ per sequence)."""
    tokenizer = Tokenizer.from_pretrained(path)
    inproc = InprocEngineClient.from_config(config)
    prompt = prompt_ids(1024, 25, seed=900)
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, logprobs=1)
    free = run(loop, processed(inproc, tokenizer, "free", prompt, seeded))
    stop = free[0]["text"][len(free[0]["text"]) // 2:][:3]
    assert free[0]["ids"] != free[1]["ids"] and len(stop) == 3
    stopped = dataclasses.replace(seeded, stop=[stop])

    results = {}
    for name, client in (("inproc", inproc), ("process", engine)):
        results[name] = [run(loop, processed(client, tokenizer, f"{name}-{i}", prompt, params))
                         for i, params in enumerate((greedy, stopped))]
    run(loop, inproc.shutdown())
    ours, theirs = results["inproc"], results["process"]
    assert ours[1][0]["reason"] == "stop" and ours[1][0]["stop"] == stop and stop not in ours[1][0]["text"]
    for request_ours, request_theirs in zip(ours, theirs, strict=True):
        for a, b in zip(request_ours, request_theirs, strict=True):
            assert (a["ids"], a["text"], a["reason"], a["stop"]) == (b["ids"], b["text"], b["reason"], b["stop"])
            assert len(a["logprobs"]) == len(a["ids"])
            for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
                assert (x.token_id, x.rank, [t for t, _ in x.top]) == (y.token_id, y.rank, [t for t, _ in y.top])
                assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert engine.num_unfinished == 0 and inproc.num_unfinished == 0


def test_shutdown_is_clean_and_idempotent(engine, loop):
    """The engine exits with code 0, the socket directory is removed, later calls raise EngineDeadError."""
    process, socket_dir = engine._process, Path(engine._socket_dir)
    run(loop, engine.shutdown())
    run(loop, engine.shutdown())
    assert process.exitcode == 0 and not engine.is_alive and not socket_dir.exists()
    assert process not in multiprocessing.active_children()
    with pytest.raises(EngineDeadError):
        run(loop, collect(engine, "late", [1, 2], GREEDY))
    with pytest.raises(EngineDeadError):
        run(loop, engine.get_stats())


def test_missing_model_dir_raises_start_error(loop, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(EngineStartError, match="no-such-model") as info:
        run(loop, AsyncEngineClient.start(EngineConfig(model=str(missing))))
    assert "Traceback" in info.value.traceback
    assert not [p for p in multiprocessing.active_children() if p.name == "deltaserve-engine"]


def test_killed_engine_fails_callers_promptly(loop, config):
    """SIGKILL on the engine: the pending iterator, new requests and stats raise EngineDeadError within seconds."""

    async def scenario():
        client = await AsyncEngineClient.start(config)
        try:
            gen = client.generate("doomed", prompt_ids(1024, 30, seed=800), LONG)
            await anext(gen)
            os.kill(client.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="exited unexpectedly"):
                async for _ in gen:
                    pass
            assert time.monotonic() - start < 5.0
            with pytest.raises(EngineDeadError):
                await collect(client, "new", [1, 2, 3], GREEDY)
            with pytest.raises(EngineDeadError):
                await client.get_stats()
            assert not client.is_alive and client.num_unfinished == 0
        finally:
            await client.shutdown()
        return client

    client = run(loop, scenario())
    assert not Path(client._socket_dir).exists()


def _engine_with_failing_step(config: EngineConfig, *args) -> None:
    """A spawn target: the real engine process, except that its third step raises."""
    from deltaserve.engine.engine_core import EngineCore

    real_step = EngineCore.step

    def step(self):
        if self.stats.steps == 2:
            raise RuntimeError("injected step failure")
        return real_step(self)

    EngineCore.step = step
    run_engine_core(config, *args)


def test_engine_failure_is_reported(loop, config, monkeypatch):
    """An exception inside step ends the requests in it with an error and the engine goes on; MAX_FAILED_STEPS
    failing steps in a row reach the client as EngineDeadError with the message, and the process exits with 1."""
    monkeypatch.setattr(client_module, "run_engine_core", _engine_with_failing_step)

    async def scenario():
        client = await AsyncEngineClient.start(config)
        try:
            for i in range(MAX_FAILED_STEPS - 1):  # the step counter stays at 2, so each new request fails there
                with pytest.raises(EngineRequestError, match="injected step failure"):
                    await collect(client, f"victim{i}", [1, 2, 3], LONG)
                assert client.is_alive
            with pytest.raises(EngineDeadError, match="injected step failure"):
                await collect(client, "last", [1, 2, 3], LONG)
        finally:
            await client.shutdown()
        return client

    client = run(loop, scenario())
    assert client._process.exitcode == 1


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
