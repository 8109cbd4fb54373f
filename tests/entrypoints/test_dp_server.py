"""Data parallelism through a real `deltaserve serve --data-parallel-size 2`, with the official `openai` SDK.

- many concurrent greedy requests are all served, by both replicas, with the outputs of a DP=1 server;
- a session's follow-ups (by `user`, by the `X-Session-ID` header, or by prompt prefix alone) land on the replica
  that served it: their prompt's previous turn comes from the prefix cache, which the other replica never saw;
- one replica's engine process killed (SIGKILL): its requests in flight fail cleanly (an error event in a stream,
  a 503 otherwise), later requests are served by the survivor and the server stays up.

Every wait is a poll with a deadline; which replica holds what is read from `/status.json`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.entrypoints.server_fixture import API_KEY, LiveServer, start_server, stop_server

DEADLINE_S = 120.0
BLOCK = 16  # the engine's default block size
ARGS = ("--max-model-len", "2048", "--num-threads", "1")


def wait_for(what: str, check: Callable[[], object], timeout_s: float = DEADLINE_S) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def replicas(server: LiveServer) -> list[dict]:
    return httpx.get(f"{server.url}/status.json", timeout=10).json()["data_parallel"]["replicas"]


def routed(server: LiveServer) -> list[int]:
    return [r["routed"] for r in replicas(server)]


def sdk(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=DEADLINE_S)


@pytest.fixture(scope="module")
def dp2(tiny_dir, tmp_path_factory):
    server = start_server(tiny_dir("base"), tmp_path_factory.mktemp("dp2"), *ARGS, "--data-parallel-size", "2")
    yield server
    stop_server(server)


PROMPTS = [f"Request {i}: the scheduler {'admits' if i % 2 else 'preempts'} a sequence of {i * 7} tokens and"
           for i in range(24)]


def greedy_texts(server: LiveServer) -> list[str]:
    client = sdk(server)

    def one(prompt: str) -> str:
        resp = client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert resp.choices[0].finish_reason == "length"
        return resp.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def test_concurrent_requests_are_all_served_by_both_replicas_with_the_outputs_of_dp1(dp2, tiny_dir,
                                                                                      tmp_path_factory):
    before = routed(dp2)
    texts = greedy_texts(dp2)
    after = routed(dp2)
    assert sum(after) - sum(before) == len(PROMPTS)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)  # both replicas served
    metrics = httpx.get(f"{dp2.url}/metrics", timeout=10).text
    for i, n in enumerate(after):
        assert f'deltaserve:dp_replica_requests_routed_total{{model_name="tiny",replica="{i}"}} {float(n)}' in metrics
        assert f'deltaserve:dp_replica_alive{{model_name="tiny",replica="{i}"}} 1.0' in metrics
    dp1 = start_server(tiny_dir("base"), tmp_path_factory.mktemp("dp1"), *ARGS)
    try:
        assert texts == greedy_texts(dp1)
    finally:
        stop_server(dp1)


def _follow_ups(server: LiveServer, ask: Callable[[list[dict], int], openai.types.chat.ChatCompletion],
                topic: str) -> None:
    """Three turns of one conversation: every follow-up lands on the first turn's replica (its routed count is
    the only one that moves) and has at least the previous prompt's full blocks from the prefix cache."""
    messages = [{"role": "user", "content": f"Tell me about {topic}. " * 12}]
    start = routed(server)
    resp = ask(messages, 0)
    first = [a - b for a, b in zip(routed(server), start, strict=True)]
    assert sorted(first) == [0, 1]
    owner = first.index(1)
    for turn in (1, 2):
        previous_prompt = resp.usage.prompt_tokens
        messages += [{"role": "assistant", "content": resp.choices[0].message.content or ""},
                     {"role": "user", "content": f"And then? ({turn})"}]
        resp = ask(messages, turn)
        now = routed(server)
        assert now[owner] - start[owner] == turn + 1 and now[1 - owner] == start[1 - owner]
        cached = resp.usage.prompt_tokens_details.cached_tokens
        assert cached > 0 and cached >= previous_prompt // BLOCK * BLOCK, (cached, previous_prompt)


def test_a_session_by_user_field_stays_on_its_replica(dp2):
    client = sdk(dp2)
    _follow_ups(dp2, lambda msgs, _: client.chat.completions.create(
        model=dp2.model, messages=msgs, max_tokens=8, temperature=0, user="session-user"), "linear attention")


def test_a_session_by_header_stays_on_its_replica(dp2):
    client = sdk(dp2)
    _follow_ups(dp2, lambda msgs, _: client.chat.completions.create(
        model=dp2.model, messages=msgs, max_tokens=8, temperature=0,
        extra_headers={"X-Session-ID": "session-header"}), "state slots")


def test_a_session_without_an_id_stays_on_its_replica_by_prefix(dp2):
    client = sdk(dp2)
    _follow_ups(dp2, lambda msgs, _: client.chat.completions.create(
        model=dp2.model, messages=msgs, max_tokens=8, temperature=0), "prefix caching")


def test_an_anthropic_session_by_metadata_user_id_stays_on_its_replica(dp2):
    body = {"model": dp2.model, "max_tokens": 8, "metadata": {"user_id": "session-anthropic"},
            "messages": [{"role": "user", "content": "Explain block tables. " * 12}]}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    start = routed(dp2)
    first = httpx.post(f"{dp2.url}/v1/messages", json=body, headers=headers, timeout=DEADLINE_S).json()
    owner = [a - b for a, b in zip(routed(dp2), start, strict=True)].index(1)
    body["messages"] += [{"role": "assistant", "content": first["content"][0]["text"] if first["content"] else "."},
                         {"role": "user", "content": "More."}]
    second = httpx.post(f"{dp2.url}/v1/messages", json=body, headers=headers, timeout=DEADLINE_S).json()
    now = routed(dp2)
    assert now[owner] - start[owner] == 2 and now[1 - owner] == start[1 - owner]
    assert second["usage"]["cache_read_input_tokens"] >= first["usage"]["input_tokens"] // BLOCK * BLOCK > 0


LONG_TOKENS = 600
"""Long enough that every request is still running when the victim is killed (they are all seen in flight first)."""


def test_a_killed_replica_fails_its_requests_cleanly_and_the_survivor_serves(tiny_dir, tmp_path_factory):
    server = start_server(tiny_dir("base"), tmp_path_factory.mktemp("dp-kill"), *ARGS, "--data-parallel-size", "2")
    try:
        client = sdk(server)
        long = dict(model=server.model, max_tokens=LONG_TOKENS, temperature=0, extra_body={"ignore_eos": True})
        # Two streams and two plain requests, one of each per replica (least loaded), all in flight.
        streams = [client.completions.create(prompt=f"Stream {i} begins", stream=True, user=f"session-{i}", **long)
                   for i in range(2)]
        firsts = [next(iter(s)) for s in streams]
        assert all(f.choices[0].text is not None for f in firsts)
        pool = ThreadPoolExecutor(2)
        plain = [pool.submit(client.completions.create, prompt=f"Plain {i} begins", **long) for i in range(2)]
        wait_for("two requests in flight on each replica",
                 lambda: [r["in_flight"] for r in replicas(server)] == [2, 2])
        victim = replicas(server)[0]
        os.kill(victim["pid"], signal.SIGKILL)

        stream_errors = 0
        for s in streams:
            try:
                chunks = list(s)
            except openai.APIError as exc:
                stream_errors += 1
                assert "replica" in str(exc) or "engine" in str(exc)
            else:
                assert sum(len(c.choices[0].text) for c in chunks if c.choices) > 0
        assert stream_errors == 1
        plain_errors = []
        for future in plain:
            try:
                resp = future.result(timeout=DEADLINE_S)
            except openai.APIStatusError as exc:
                plain_errors.append(exc)
            else:
                assert resp.usage.completion_tokens == LONG_TOKENS
        pool.shutdown()
        assert len(plain_errors) == 1 and plain_errors[0].status_code == 503
        assert plain_errors[0].body["code"] == "engine_dead"

        wait_for("the dead replica reported", lambda: not replicas(server)[0]["alive"])
        before = routed(server)
        for i in range(4):  # new requests, the dead replica's session among them, go to the survivor
            resp = client.completions.create(model=server.model, prompt=f"After the crash {i}", max_tokens=4,
                                             temperature=0, user=f"session-{i % 2}")
            assert resp.choices[0].finish_reason in ("length", "stop")
        after = routed(server)
        assert after[0] == before[0] and after[1] - before[1] == 4
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert 'deltaserve:dp_replica_alive{model_name="tiny",replica="0"} 0.0' in httpx.get(
            f"{server.url}/metrics", timeout=10).text
        assert server.process.poll() is None  # the server stays up
    finally:
        stop_server(server)


def test_the_server_exits_with_status_1_once_every_replica_is_dead(tiny_dir, tmp_path_factory):
    server = start_server(tiny_dir("base"), tmp_path_factory.mktemp("dp-all-dead"), *ARGS, "--data-parallel-size",
                          "2")
    try:
        first, second = replicas(server)
        os.kill(first["pid"], signal.SIGKILL)
        wait_for("the first replica reported dead", lambda: not replicas(server)[0]["alive"])
        assert server.process.poll() is None  # one replica left: still serving
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        os.kill(second["pid"], signal.SIGKILL)
        assert server.process.wait(timeout=DEADLINE_S) == 1
    finally:
        stop_server(server)


@pytest.mark.slow  # CI time (as the one-engine --restart-engine test)
def test_restart_engine_restarts_a_dead_replica(tiny_dir, tmp_path_factory):
    server = start_server(tiny_dir("base"), tmp_path_factory.mktemp("dp-restart"), *ARGS, "--data-parallel-size",
                          "2", "--restart-engine")
    try:
        old = replicas(server)[1]["pid"]
        os.kill(old, signal.SIGKILL)
        wait_for("a new engine process for replica 1",
                 lambda: (r := replicas(server)[1])["alive"] and r["pid"] != old)
        client = sdk(server)
        before = routed(server)
        for i in range(2):  # both replicas serve again (least loaded, ties rotate)
            resp = client.completions.create(model=server.model, prompt=f"Restarted {i}", max_tokens=4,
                                             temperature=0)
            assert resp.usage.completion_tokens >= 1
        assert [a - b for a, b in zip(routed(server), before, strict=True)] == [1, 1]
        assert server.process.poll() is None
    finally:
        stop_server(server)
