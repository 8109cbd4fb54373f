"""The multiprocess executor with one worker process: outputs identical to the in-process executor, and a worker
that dies is a fatal engine error with its exit status (never a hang), through the engine and through the server."""

from __future__ import annotations

import os
import re
import signal

import httpx
import openai
import pytest

from deltaserve import LLM
from deltaserve.config import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.executor import WorkerDiedError
from deltaserve.executor.block_sync import BlockTableSender
from deltaserve.executor.multiproc import MultiprocExecutor
from deltaserve.sampling_params import SamplingParams
from tests.entrypoints.server_fixture import API_KEY, start_server, stop_server
from tests.helpers import prompt_ids


def config(path: str, backend: str) -> EngineConfig:
    return EngineConfig(model=path, parallel=ParallelConfig(distributed_executor_backend=backend),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32))


def generate(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    for rid, (prompt, params) in requests.items():
        core.add_request(rid, prompt, params)
    out: dict[str, list] = {rid: [] for rid in requests}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.request_id].append((o.new_token_ids, o.logprobs, o.finish_reason))
    return out


@pytest.fixture(scope="module")
def path(tiny_dir):
    return str(tiny_dir("base"))


@pytest.mark.parametrize("variant", ["base", pytest.param("odd-sizes", marks=pytest.mark.slow), "k3"])  # CI time
def test_one_worker_process_equals_in_process(tiny_dir, variant):
    path = str(tiny_dir(variant))
    reqs = {
        "greedy": (prompt_ids(600, 40, seed=1), SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)),
        "seeded": (prompt_ids(600, 9, seed=2), SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=12)),
        "short": (prompt_ids(600, 3, seed=3), SamplingParams(temperature=0.0, max_tokens=5)),
    }
    uni = EngineCore(config(path, "uni"))
    mp = EngineCore(config(path, "mp"))
    try:
        assert isinstance(mp.executor, MultiprocExecutor)
        assert generate(mp, reqs) == generate(uni, reqs)
    finally:
        mp.shutdown()
    assert all(not os.path.exists(f"/proc/{pid}") or _is_zombie(pid) for pid in mp.executor.pids)


class CountingSender(BlockTableSender):
    """The executor's block-table sender, counting the tails it sends after the first (deltas) and whole lists."""

    deltas = wholes = 0

    def encode(self, out):
        step = super().encode(out)
        for tail in step.tails.values():
            if tail.start:
                self.deltas += 1
            else:
                self.wholes += 1
        return step


def test_block_table_deltas_under_preemption_rollback_and_prefix_hits(path):
    """A cache of 6 blocks and 3 state slots (preemptions), n-gram speculation (rolled-back blocks) and prefix
    hits: the worker process rebuilds each step's block tables from deltas, and the outputs equal in-process ones."""
    repeat = prompt_ids(1024, 6, seed=40) * 4  # n-gram proposals find matches
    reqs = {f"r{i}": (repeat[: 12 + 3 * i] + prompt_ids(1024, i, seed=41 + i),
                      SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=20, ignore_eos=True))
            for i in range(5)}
    reqs["hit"] = (repeat[:24], SamplingParams(temperature=0.0, max_tokens=10))

    def cfg(backend: str) -> EngineConfig:
        return EngineConfig(model=path, parallel=ParallelConfig(distributed_executor_backend=backend),
                            cache=CacheConfig(num_blocks=6, num_state_slots=3),
                            scheduler=SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4),
                            speculative_config=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                                 prompt_lookup_min=1, prompt_lookup_max=3))

    uni = EngineCore(cfg("uni"))
    mp = EngineCore(cfg("mp"))
    try:
        sender = mp.executor._block_sender = CountingSender()  # type: ignore[attr-defined]
        assert generate(mp, reqs) == generate(uni, reqs)
        stats = mp.get_stats()
        assert stats.num_preemptions > 0 and stats.spec_num_draft_tokens > 0 and stats.prefix_hit_tokens > 0
        assert sender.deltas > sender.wholes > 0
    finally:
        mp.shutdown()


def test_killed_worker_is_a_fatal_error_with_its_exit_status(path):
    core = EngineCore(config(path, "mp"))
    try:
        core.add_request("r", prompt_ids(1024, 20, seed=4), SamplingParams(temperature=0.0, max_tokens=50))
        core.step()
        (pid,) = core.executor.pids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=rf"pid {pid}\) died with exit status -9"):
            while core.has_unfinished_requests():
                core.step()
    finally:
        core.shutdown()


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow  # CI time: the data-parallel server's death tests cover the exit
def test_server_with_a_worker_process_serves_and_exits_on_its_death(tiny_dir, tmp_path):
    server = start_server(tiny_dir("base"), tmp_path, "--distributed-executor-backend", "mp")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)
        llm = LLM(model=str(tiny_dir("base")))
        for i, settings in enumerate([dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, seed=11)]):
            prompt = prompt_ids(1024, 12, seed=20 + i)
            done = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, **settings)
            alone = llm.generate([prompt], SamplingParams(max_tokens=8, **settings))[0].outputs[0]
            assert done.choices[0].text == alone.text and done.usage.completion_tokens == len(alone.token_ids)
        (pid,) = map(int, re.findall(r"worker process\(es\) ready: pids \[(\d+)\]", server.log.read_text()))
        stream = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=2000, temperature=0.0,
                                           stream=True)
        first = next(iter(stream))  # the request is running in the worker now
        assert first.choices
        os.kill(pid, signal.SIGKILL)
        with pytest.raises((openai.APIError, httpx.HTTPError)):
            for _ in stream:  # the stream ends with an error, not a hang and not a normal finish
                pass
        # A dead engine (its worker died) fails the requests in flight, then the server exits 1 for its supervisor
        # (vLLM's behaviour; --restart-engine would start a new engine instead).
        assert server.process.wait(timeout=120) == 1
    finally:
        stop_server(server)


def test_llm_on_a_worker_process_equals_in_process(path):
    """Through `LLM`: greedy, seeded (n=2) and logprobs outputs identical with `distributed_executor_backend="mp"`."""
    prompts = [prompt_ids(1024, n, seed=30 + n) for n in (4, 23, 57)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, logprobs=1),
              SamplingParams(temperature=0.8, top_k=40, seed=3, n=2, max_tokens=10),
              SamplingParams(temperature=0.0, max_tokens=6, stop=["a"])]
    alone = LLM(model=path).generate(prompts, params)
    mp = LLM(model=path, distributed_executor_backend="mp")
    try:
        together = mp.generate(prompts, params)
    finally:
        mp.engine.shutdown()
    assert [[(o.token_ids, o.text, o.logprobs) for o in r.outputs] for r in together] == \
        [[(o.token_ids, o.text, o.logprobs) for o in r.outputs] for r in alone]


def test_llm_raises_a_dead_worker_and_stays_dead(path):
    """`LLM` on a worker process whose worker is killed after the first step: generate raises the executor's
    WorkerDiedError (exit status -9), and every later call says the engine is dead instead of hanging."""
    from deltaserve.engine.protocol import EngineDeadError

    llm = LLM(model=path, distributed_executor_backend="mp")
    (pid,) = llm.engine.executor.pids
    llm.engine.step_observer = lambda out, seconds: os.kill(pid, signal.SIGKILL)  # after the step that ran
    try:
        with pytest.raises(WorkerDiedError, match="exit status -9"):
            llm.generate([prompt_ids(1024, 8, seed=5)], SamplingParams(temperature=0.0, max_tokens=20))
        with pytest.raises(EngineDeadError):
            llm.generate([prompt_ids(1024, 8, seed=6)], SamplingParams(temperature=0.0, max_tokens=5))
    finally:
        llm.engine.shutdown()


def test_a_client_that_died_of_failed_steps_still_stops_its_worker_on_shutdown(path, monkeypatch):
    import asyncio

    from deltaserve.engine.inproc_client import InprocEngineClient
    from deltaserve.engine.protocol import EngineDeadError, EngineRequestError

    core = EngineCore(config(path, "mp"))
    monkeypatch.setattr(core.executor, "execute_model", lambda out: (_ for _ in ()).throw(RuntimeError("boom")))
    client = InprocEngineClient(core)

    async def scenario() -> None:
        for i in range(3):  # MAX_FAILED_STEPS failing steps kill the client
            with pytest.raises((EngineRequestError, EngineDeadError)):
                async for _ in client.generate(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=2)):
                    pass
        assert not client.is_alive
        await client.shutdown()

    asyncio.run(scenario())
    proc = core.executor._procs[0]
    proc.join(10)
    assert not proc.is_alive()
