"""Disaggregation through real processes: a router over one prefill and two decode instances gives the greedy
outputs of a unified instance (OpenAI chat and completions, Anthropic messages; streamed and not; prompts on and off
block boundaries, and a repeated one that the prefill side's prefix cache serves), every request's cache really moved
(the instances' own kv_transfer counters), and 32 concurrent requests all complete with nothing held afterwards on
either side. The same on the Kimi K3 tiny checkpoint through 1 prefill + 1 decode."""

from __future__ import annotations

import concurrent.futures

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.router.helpers import API_KEY, start_instance, start_router, stop_router, wait_until
from tests.entrypoints.server_fixture import LiveServer, stop_server

MAX_TOKENS = 8


def metric(server: LiveServer, name: str, **labels: str) -> float:
    """The sum of the samples of `deltaserve:{name}` whose labels include `labels`."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in (f"deltaserve:{name}", f"deltaserve:{name}_total") and labels.items() <= s.labels.items())


def received(decodes: list[LiveServer]) -> float:
    return sum(metric(d, "kv_transfer_requests", direction="received") for d in decodes)


def chat(url: str, prompt: str, stream: bool = False) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].message.content or ""
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def completion(url: str, prompt: str) -> list[int]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    return out.choices[0].logprobs.tokens


def message(url: str, prompt: str, stream: bool = False) -> str:
    client = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=120)
    kw = dict(model="tiny", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt}],
              extra_body={"temperature": 0})  # this SDK version takes no temperature argument
    if not stream:
        return "".join(b.text for b in client.messages.create(**kw).content if b.type == "text")
    with client.messages.stream(**kw) as s:
        return "".join(s.text_stream)


def prompts(tag: str = "") -> list[str]:
    words = "the sea was calm and the ship sailed on past the old lighthouse while gulls cried".split()
    return [tag + " ".join(words[: 3 + 5 * i]) for i in range(4)]  # short to past a block boundary


def idle(server: LiveServer) -> bool:
    return (metric(server, "num_requests_running") == 0 and metric(server, "kv_cache_usage_perc") == 0
            and metric(server, "state_slot_usage_perc") == 0)


@pytest.fixture(scope="module")
def cell(tiny_dir, tmp_path_factory):
    """(unified instance, prefill instance, [decode instances], router) on the base tiny checkpoint."""
    logs = tmp_path_factory.mktemp("disagg-router")
    servers: list[LiveServer] = []
    try:
        for role in (None, "prefill", "decode", "decode"):
            servers.append(start_instance(tiny_dir("base"), logs, role))
        router = start_router(logs, [servers[1].url], [servers[2].url, servers[3].url])
        yield servers[0], servers[1], servers[2:], router
        stop_router(router)
    finally:
        for server in servers:
            stop_server(server)


@pytest.mark.parametrize("stream", [pytest.param(False, marks=pytest.mark.slow), True])  # CI time
def test_router_outputs_equal_unified_and_caches_move(cell, stream):
    unified, prefill, decodes, router = cell
    before, sent = received(decodes), metric(prefill, "kv_transfer_requests", direction="sent")
    fallbacks = sum(metric(d, "kv_transfer_fallbacks") for d in decodes)
    tag = "streamed: " if stream else ""  # prompts of their own: the decode side would hit the other case's cache
    n = 0
    for prompt in [*prompts(tag), prompts(tag)[-1]]:  # the repeat: the prefill side's prefix cache serves it
        assert chat(router.url, prompt, stream) == chat(unified.url, prompt, stream)
        assert message(router.url, prompt, stream) == message(unified.url, prompt, stream)
        n += 2
    if not stream:
        for prompt in prompts("completion: "):
            assert completion(router.url, prompt) == completion(unified.url, prompt)
            n += 1
    # Every request's cache moved from the prefill instance to one of the decode instances (a repeat may hit the
    # decode side's own cache instead: then it is computed there, counted as a fallback, not received). The
    # counters come from engine stats snapshots, refreshed as /metrics is scraped: poll until they catch up.
    wait_until(lambda: metric(prefill, "kv_transfer_requests", direction="sent") - sent == n, "prefill counters")
    wait_until(lambda: received(decodes) - before + sum(metric(d, "kv_transfer_fallbacks") for d in decodes)
               - fallbacks == n, "decode counters")
    assert received(decodes) - before >= n - 2
    assert sum(metric(d, "kv_transfer_failures") for d in decodes) == 0
    assert all(metric(d, "kv_transfer_bytes", direction="received", kind="state") > 0 for d in decodes)


def test_32_concurrent_requests_complete_and_leave_nothing_held(cell):
    unified, prefill, decodes, router = cell
    texts = [f"request {i}: " + " ".join(prompts()[i % 4].split()[::-1]) for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda t: chat(router.url, t), texts))
    assert all(isinstance(g, str) for g in got)
    for i in (0, 13, 31):
        assert got[i] == chat(unified.url, texts[i])
    for server in (prefill, *decodes):
        wait_until(lambda s=server: idle(s), f"{server.url} to hold no blocks or slots")


@pytest.mark.slow  # CI time: K3 disaggregation stays in CI at the engine level
def test_k3_through_one_prefill_and_one_decode(tiny_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("disagg-router-k3")
    servers: list[LiveServer] = []
    try:
        for role in (None, "prefill", "decode"):
            servers.append(start_instance(tiny_dir("k3"), logs, role))
        router = start_router(logs, [servers[1].url], [servers[2].url])
        try:
            for prompt in prompts()[1:3]:
                for stream in (False, True):
                    assert chat(router.url, prompt, stream) == chat(servers[0].url, prompt, stream)
            # The streamed repeat of each prompt hits the decode side's own cache: a fallback, not a fetch.
            wait_until(lambda: received(servers[2:]) == 2 and metric(servers[2], "kv_transfer_fallbacks") == 2,
                       "decode counters")
        finally:
            stop_router(router)
    finally:
        for server in servers:
            stop_server(server)
