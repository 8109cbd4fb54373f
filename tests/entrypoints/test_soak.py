"""Soak: a live server under mixed OpenAI-SDK traffic with client aborts, disconnects and preemption, then idle.

The traffic (several client threads, each with its own seeded random choices) mixes chat and completions, streamed
and not, `n` > 1, logprobs, stop strings, JSON-schema output, a burst that must preempt (`n` sequences that cannot
all fit the small KV cache), streams closed after a random number of chunks and non-streamed requests whose client
gives up after a random timeout (the SDK closes the connection). Every request that is not given up is checked.

Afterwards the server must be back where it was after warm-up:
- cache: /status.json shows 0 running and 0 waiting requests, 0 KV blocks and 0 state slots held (blocks kept only
  for the prefix cache count as free);
- memory: the resident set (VmRSS) of the API process and of the engine process each within `RSS_MARGIN` of its
  idle value measured after a warm-up that ran every kind of request at full concurrency;
- the server log has no error line (`error_lines`): no `ERROR` or `CRITICAL` record and no `Traceback`. Aborts
  and disconnects are normal client behaviour and log nothing at that level, so no exception is allowed.
Preemptions must have happened: the traffic starts with one burst alone on the idle server, which cannot finish
without preempting (checked on its own), and bursts recur in the mix.

`test_soak` (slow) runs for `DELTASERVE_SOAK_S` seconds (default 300, at most 1800) on a plain server, then for
`DELTASERVE_SOAK_SPEC_S` (default a quarter of it) on a server with n-gram speculative decoding; it prints the
numbers. `test_soak_small` is the CI-sized variant: a fixed number of requests, no clock in what it asserts.
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import openai
import pytest

from tests.entrypoints.server_fixture import API_KEY, LiveServer, start_server, stop_server

SOAK_MAX_S = 1800.0
"""The bound on a soak phase, whatever the environment asks."""
RSS_MARGIN = 0.10
"""Allowed growth of a process's resident set over its idle value after warm-up (a share of that value)."""
RSS_MARGIN_MIB = 24.0
"""... or this many MiB, whichever is larger (allocator noise on a process of a few hundred MiB)."""
SETTLE_TIMEOUT_S = 120.0
"""Safety bound on waiting for the server to become idle (the wait ends as soon as it is)."""
NUM_BLOCKS, BLOCK_SIZE = 24, 16
"""A 384-token KV cache: a few concurrent requests of up to ~150 tokens each already preempt one another."""
SERVER_ARGS = ("--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE), "--max-num-seqs", "6",
               "--max-n", "4", "--max-model-len", "512", "--checkpoint-memory", "16MiB")
"""`--checkpoint-memory` small so that the engine's resident set is mostly what serving allocates (by default a
quarter of the cache budget is prefix-cache checkpoints, hundreds of MiB touched at start-up)."""
SPEC_ARGS = ("--speculative-config",
             '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}')
"""Short n-grams: the random prompts and a random model's output rarely repeat vLLM's default 5-gram."""
ERROR_LINE = re.compile(r"\b(ERROR|CRITICAL)\b|Traceback")

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
WORDS = ("state", "cache", "block", "token", "linear", "attention", "the", "a", "request", "server", "prefill")


def _soak_seconds(name: str, default: float) -> float:
    return min(float(os.environ.get(name, default)), SOAK_MAX_S)


# -- the traffic --------------------------------------------------------------------------------------------------

@dataclass
class Tally:
    """What the clients did (shared by the client threads)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    kinds: Counter[str] = field(default_factory=Counter)
    """Requests answered and checked, by scenario."""
    streams_closed: int = 0
    """Streams the client closed before their end."""
    gave_up: int = 0
    """Non-streamed requests whose client timed out and closed the connection."""
    failures: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> None:
        with self.lock:
            if outcome == "closed":
                self.streams_closed += 1
            elif outcome == "gave_up":
                self.gave_up += 1
            else:
                self.kinds[outcome] += 1

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    @property
    def answered(self) -> int:
        return sum(self.kinds.values())


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))


def _chat(rng: random.Random) -> Any:
    return [{"role": "user", "content": _prompt(rng)}]


def completion(client: openai.OpenAI, rng: random.Random) -> str:
    """Non-streamed completion, n 1-3, logprobs, sometimes a stop string."""
    n, stop = rng.randint(1, 3), rng.choice([None, ["e"], ["the", "ca"]])
    resp = client.completions.create(model="tiny", prompt=_prompt(rng), max_tokens=rng.randint(4, 64), n=n,
                                     logprobs=2, stop=stop, temperature=rng.choice([0, 0.8]), seed=rng.randint(0, 99))
    assert sorted(c.index for c in resp.choices) == list(range(n))
    for c in resp.choices:
        assert c.finish_reason in ("stop", "length"), c
        assert not stop or not any(s in c.text for s in stop), (stop, c.text)
        assert c.logprobs is not None and all(len(top) <= 2 for top in c.logprobs.top_logprobs or [])
    return "completion"


def completion_stream(client: openai.OpenAI, rng: random.Random) -> str:
    """Streamed completion with a stop string; sometimes closed after a few chunks."""
    stop, close_after = rng.choice([["e"], ["ken"], None]), rng.choice([None, None, rng.randint(1, 12)])
    stream = client.completions.create(model="tiny", prompt=_prompt(rng), max_tokens=rng.randint(8, 96), stop=stop,
                                       stream=True, logprobs=1, extra_body={"ignore_eos": True})
    text, finish = "", None
    for i, chunk in enumerate(stream):
        if close_after is not None and i + 1 >= close_after:
            stream.close()
            return "closed"
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert finish in ("stop", "length") and not (stop and stop[0] in text), (finish, stop, text)
    return "completion_stream"


def chat(client: openai.OpenAI, rng: random.Random) -> str:
    """Non-streamed chat with logprobs; sometimes a client timeout gives up on it (the connection is closed)."""
    timeout = rng.choice([None, None, rng.uniform(0.05, 1.5)])
    try:
        resp = client.with_options(timeout=timeout or 300).chat.completions.create(
            model="tiny", messages=_chat(rng), max_tokens=rng.randint(4, 48), n=rng.randint(1, 2), logprobs=True,
            top_logprobs=3, temperature=0.7, seed=rng.randint(0, 99))
    except openai.APITimeoutError:
        assert timeout is not None
        return "gave_up"
    for c in resp.choices:
        assert c.finish_reason in ("stop", "length") and c.logprobs is not None, c
        assert all(len(e.top_logprobs) == 3 for e in c.logprobs.content or [])
    return "chat"


def chat_stream(client: openai.OpenAI, rng: random.Random) -> str:
    """Streamed chat, n 1-2, usage; sometimes closed after a few chunks."""
    n, close_after = rng.randint(1, 2), rng.choice([None, rng.randint(1, 20)])
    stream = client.chat.completions.create(model="tiny", messages=_chat(rng), max_tokens=rng.randint(8, 96), n=n,
                                            stream=True, stream_options={"include_usage": True}, temperature=1.0)
    finish: dict[int, str] = {}
    usage = None
    for i, chunk in enumerate(stream):
        if close_after is not None and i + 1 >= close_after:
            stream.close()
            return "closed"
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(finish) == list(range(n)) and usage is not None, (finish, usage)
    return "chat_stream"


def structured(client: openai.OpenAI, rng: random.Random) -> str:
    """JSON-schema chat, streamed or not: a finished answer satisfies the schema."""
    kwargs: dict[str, Any] = dict(
        model="tiny", messages=_chat(rng), max_tokens=80, temperature=0.8, seed=rng.randint(0, 99),
        response_format={"type": "json_schema", "json_schema": {"name": "plan", "schema": SCHEMA}})
    if rng.random() < 0.5:
        text, finish = "", None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content or "", choice.finish_reason
    if finish == "stop":
        jsonschema.validate(json.loads(text), SCHEMA)
    return "structured"


def burst(client: openai.OpenAI, rng: random.Random) -> str:
    """n=4 sequences of ~125 tokens each: together more than the cache holds, so the scheduler must preempt."""
    resp = client.completions.create(model="tiny", prompt=_prompt(rng), max_tokens=100, n=4, temperature=1.0,
                                     seed=rng.randint(0, 99), extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in resp.choices] == ["length"] * 4
    assert resp.usage is not None and resp.usage.completion_tokens == 400
    return "burst"


SCENARIOS: tuple[Callable[[openai.OpenAI, random.Random], str], ...] = (
    completion, completion_stream, chat, chat_stream, structured, burst)
WEIGHTS = (3, 3, 3, 3, 2, 1)


def drive(server: LiveServer, *, workers: int, seed: int, more: Callable[[int], bool],
          plan: Callable[[random.Random, int], Callable[[openai.OpenAI, random.Random], str]]) -> Tally:
    """Run `workers` client threads; thread k runs request i while `more(i)`, the scenario `plan(rng, i)`."""
    tally = Tally()

    def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
        i = 0
        while more(i):
            scenario = plan(rng, i)
            try:
                tally.count(scenario(client, rng))
            except Exception as exc:  # noqa: BLE001 - every failure is reported at the end
                tally.fail(f"{scenario.__name__}: {type(exc).__name__}: {exc}")
            i += 1
        client.close()

    threads = [threading.Thread(target=worker, args=(k,), name=f"soak-{k}") for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tally


def weighted(rng: random.Random, _: int) -> Callable[[openai.OpenAI, random.Random], str]:
    return rng.choices(SCENARIOS, WEIGHTS)[0]


# -- the server's state -------------------------------------------------------------------------------------------

def status(server: LiveServer) -> dict:
    return httpx.get(f"{server.url}/status.json", timeout=30).json()


def wait_idle(server: LiveServer) -> dict:
    """Poll /status.json until an engine stats snapshot taken after this call shows no request running or waiting
    and no block or slot held; that status."""
    since = time.time()
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        s = status(server)
        now = s["now"]
        fresh = s["engine_stats_age_s"] is not None and s["time"] - s["engine_stats_age_s"] >= since
        if fresh and (now["running"], now["waiting"], now["kv_blocks_used"], now["state_slots_used"]) == (0, 0, 0, 0):
            return s
        assert time.monotonic() < deadline, f"not idle after {SETTLE_TIMEOUT_S} s: {now}"
        time.sleep(0.2)


def engine_pid(api_pid: int) -> int:
    """The engine process: the API process's child started by multiprocessing's spawn (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == api_pid and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            found.append(int(entry.name))
    assert len(found) == 1, f"engine process of {api_pid}: {found}"
    return found[0]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def rss_limit(idle: float) -> float:
    return idle + max(idle * RSS_MARGIN, RSS_MARGIN_MIB)


def settled_rss(pids: dict[str, int], idle: dict[str, float]) -> dict[str, float]:
    """Each process's RSS once it is within its limit (glibc returns freed arenas lazily: the wait ends as soon as
    both are), or its last value after `SETTLE_TIMEOUT_S`."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        now = {name: rss_mib(pid) for name, pid in pids.items()}
        if all(now[n] <= rss_limit(idle[n]) for n in pids) or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def error_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if ERROR_LINE.search(line)]


def warm_up(server: LiveServer, workers: int) -> None:
    """Every scenario, on every worker at once, twice: lazy imports, thread pools, grammar compiles and the largest
    batch shapes happen here, before the idle memory is measured."""
    tally = drive(server, workers=workers, seed=7, more=lambda i: i < 2 * len(SCENARIOS),
                  plan=lambda rng, i: SCENARIOS[i % len(SCENARIOS)])
    assert not tally.failures, tally.failures


@dataclass(frozen=True)
class SoakResult:
    tally: Tally
    rss_idle: dict[str, float]
    rss_after: dict[str, float]
    before: dict
    after: dict
    seconds: float

    def report(self, label: str) -> str:
        t, a, b = self.tally, self.after["totals"], self.before["totals"]
        finished = {k: v - b["finished_by_reason"].get(k, 0) for k, v in a["finished_by_reason"].items()}
        errors = {k: v - b["errors_by_kind"].get(k, 0) for k, v in a["errors_by_kind"].items()}
        rss = ", ".join(f"{n} {self.rss_idle[n]:.1f} -> {self.rss_after[n]:.1f} MiB" for n in self.rss_idle)
        return (f"[soak {label}] {self.seconds:.0f} s: {t.answered} answered {dict(t.kinds)}, {t.streams_closed} "
                f"streams closed early, {t.gave_up} client timeouts; server (soak only): "
                f"{a['sequences_finished'] - b['sequences_finished']} sequences finished {finished}, preemptions "
                f"{a['preemptions'] - b['preemptions']}, errors {errors}; "
                f"RSS idle -> after: {rss}; spec {a.get('spec_decode')}")


def soak(server: LiveServer, *, workers: int, seconds: float | None = None, requests: int | None = None
         ) -> SoakResult:
    """Warm up, measure idle, run the traffic (for `seconds`, or `requests` per client), wait for idle, measure
    again; assert the soak's properties."""
    pids = {"api": server.process.pid, "engine": engine_pid(server.process.pid)}
    warm_up(server, workers)
    before = wait_idle(server)
    rss_idle = {name: rss_mib(pid) for name, pid in pids.items()}
    start = time.monotonic()
    # One burst alone first: its 4 sequences join an empty cache together and cannot all finish in it.
    alone = drive(server, workers=1, seed=2, more=lambda i: i < 1, plan=lambda rng, i: burst)
    assert not alone.failures and wait_idle(server)["totals"]["preemptions"] > before["totals"]["preemptions"]
    end = start + (seconds or 0.0)
    tally = drive(server, workers=workers, seed=1, plan=weighted,
                  more=(lambda i: i < requests) if requests is not None else lambda _: time.monotonic() < end)
    elapsed = time.monotonic() - start
    after = wait_idle(server)
    rss_after = settled_rss(pids, rss_idle)
    result = SoakResult(tally, rss_idle, rss_after, before, after, elapsed)
    print(result.report(server.url))
    assert not tally.failures, tally.failures[:20]
    for name in pids:
        assert rss_after[name] <= rss_limit(rss_idle[name]), result.report(server.url)
    assert server.process.poll() is None
    assert error_lines(server.log) == []
    return result


# -- the tests ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_soak(tiny_dir, tmp_path, spec):
    """Minutes of mixed traffic with aborts and preemption: cache, memory and log back to idle."""
    seconds = _soak_seconds("DELTASERVE_SOAK_SPEC_S", _soak_seconds("DELTASERVE_SOAK_S", 300) / 4) if spec \
        else _soak_seconds("DELTASERVE_SOAK_S", 300)
    server = start_server(tiny_dir("base"), tmp_path, *SERVER_ARGS, *(SPEC_ARGS if spec else ()))
    try:
        result = soak(server, workers=6, seconds=seconds)
        if spec:
            drafts = [r["totals"].get("spec_decode", {}).get("num_draft_tokens", 0) for r in (result.before,
                                                                                           result.after)]
            assert drafts[1] > drafts[0], drafts
    finally:
        stop_server(server)


@pytest.mark.slow  # CI time; the engine-level leak and preemption tests stay in CI
def test_soak_small(tiny_dir, tmp_path):
    """The soak's properties over a fixed 40 requests from 4 clients (every scenario, burst included)."""
    server = start_server(tiny_dir("base"), tmp_path, *SERVER_ARGS)
    try:
        soak(server, workers=4, requests=10)
    finally:
        stop_server(server)
