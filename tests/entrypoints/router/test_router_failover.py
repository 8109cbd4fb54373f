"""1 prefill + 2 decode instances behind the router: outputs equal a direct request; a frozen or killed prefill
instance means local prefills (counted); a decode instance frozen or killed under a stream ends it with an error event
while the other decode instance goes on serving; with none left, a 503 in the route's error shape.

The tests run in file order on one set of instances, each killing what the next no longer needs.
"""

from __future__ import annotations

import signal

import anthropic
import httpx
import openai
import pytest

from tests.entrypoints.router.helpers import API_KEY, start_instance, start_router, stop_router, wait_until
from tests.entrypoints.server_fixture import stop_server

PROMPT = "Which way to the harbour?"
MAX_TOKENS = 6
LONG = 1500
"""Tokens of the stream whose decode instance is killed: far more than it makes before the kill lands."""


@pytest.fixture(scope="module")
def cell(tiny_dir, tmp_path_factory):
    """(prefill, [decode 0, decode 1], router over all three)."""
    logs = tmp_path_factory.mktemp("router-failover")
    servers = []
    try:
        for role in ("prefill", "decode", "decode"):
            servers.append(start_instance(tiny_dir("base"), logs, role, max_model_len=2048))
        prefill, *decodes = servers
        router = start_router(logs, [prefill.url], [d.url for d in decodes])
        yield prefill, decodes, router
        stop_router(router)
    finally:
        for server in servers:
            stop_server(server)


def chat(url: str, prompt: str = PROMPT) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                         max_tokens=MAX_TOKENS, temperature=0)
    return out.choices[0].message.content or ""


def _kill(server) -> None:
    server.process.send_signal(signal.SIGKILL)
    server.process.wait()


def test_one_prefill_two_decode_equals_direct(cell):
    """Through 1P + 2D, greedy outputs equal a direct request, and both decode instances take requests."""
    _, decodes, router = cell
    prompts = [f"{PROMPT} Take {i} steps." for i in range(4)]
    expected = [chat(decodes[0].url, p) for p in prompts]
    assert [chat(router.url, p) for p in prompts] == expected
    for d in decodes:  # idle instances are taken in turn
        assert router.metric("instance_requests_total", role="decode", instance=d.url) >= 2
    assert router.metric("decode_failures_total") == 0


def _fallbacks(router) -> float:
    return (router.metric("local_prefill_fallbacks_total", reason="prefill_failed")
            + router.metric("local_prefill_fallbacks_total", reason="no_healthy_prefill_instance"))


def test_frozen_prefill_instance_falls_back_and_comes_back(cell):
    """A prefill instance that stops answering (SIGSTOP) does not hang the request: once its health check fails
    the decode instance prefills locally (counted); after SIGCONT it is back in the pool."""
    prefill, decodes, router = cell
    expected = chat(decodes[0].url)
    before = _fallbacks(router)
    prefill.process.send_signal(signal.SIGSTOP)
    try:
        assert chat(router.url) == expected
        assert _fallbacks(router) == before + 1
    finally:
        prefill.process.send_signal(signal.SIGCONT)
    wait_until(lambda: router.metric("instance_healthy", role="prefill") == 1, "the prefill instance back")


def test_prefill_instance_killed_falls_back_to_local_prefill(cell):
    """With the only prefill instance dead, requests are still served (the decode instance prefills), the same
    text, and the fallback is counted."""
    prefill, decodes, router = cell
    expected = chat(decodes[0].url)
    before = _fallbacks(router)
    _kill(prefill)
    assert chat(router.url) == expected
    assert _fallbacks(router) == before + 1
    wait_until(lambda: router.metric("instance_healthy", role="prefill") == 0, "the prefill instance marked down")
    assert chat(router.url) == expected
    assert _fallbacks(router) == before + 2


def _busy_after_first_event(router, decodes, stream):
    """The decode instance serving `stream`, once its first event arrived."""
    assert next(iter(stream)) is not None
    busy = [d for d in decodes if router.metric("in_flight", role="decode", instance=d.url) == 1]
    assert len(busy) == 1
    return busy[0]


def _openai_long_stream(router):
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=LONG, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})


def _assert_openai_stream_fails(stream) -> None:
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert "decode instance failed" in str(info.value)


def test_frozen_decode_instance_ends_its_stream_and_comes_back(cell):
    """A decode instance that stops answering (SIGSTOP) fails its health checks: the stream it serves ends with
    an error event and requests go to the other instance; once it answers again, it is back in the pool."""
    _, decodes, router = cell
    stream = _openai_long_stream(router)
    frozen = _busy_after_first_event(router, decodes, stream)
    other = next(d for d in decodes if d is not frozen)
    frozen.process.send_signal(signal.SIGSTOP)
    try:
        _assert_openai_stream_fails(stream)
        assert router.metric("decode_failures_total", instance=frozen.url, reason="unhealthy") == 1
        assert chat(router.url) == chat(other.url)
    finally:
        frozen.process.send_signal(signal.SIGCONT)
    wait_until(lambda: router.metric("instance_healthy", role="decode") == 2, "the thawed instance back in the pool")
    assert router.metric("in_flight") == 0


def test_decode_instance_killed_mid_stream(cell):
    """The client of a stream whose decode instance dies gets an error event; the next request is served by the
    other decode instance."""
    _, decodes, router = cell
    assert all(d.process.poll() is None for d in decodes)
    stream = _openai_long_stream(router)
    killed = _busy_after_first_event(router, decodes, stream)
    _kill(killed)
    _assert_openai_stream_fails(stream)
    assert router.metric("decode_failures_total", instance=killed.url) >= 1
    survivor = next(d for d in decodes if d is not killed)
    assert chat(router.url) == chat(survivor.url)
    assert router.metric("in_flight") == 0


def test_last_decode_instance_killed_mid_anthropic_stream(cell):
    """An Anthropic stream whose decode instance dies ends with Anthropic's error event; with no decode instance
    left, requests get a 503 in the route's error shape and /health is 503."""
    _, decodes, router = cell
    live = [d for d in decodes if d.process.poll() is None]
    assert len(live) == 1
    client = anthropic.Anthropic(base_url=router.url, api_key=API_KEY, max_retries=0, timeout=60)
    stream = client.messages.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=LONG,
                                    stream=True, extra_body={"temperature": 0, "ignore_eos": True})
    _kill(_busy_after_first_event(router, live, stream))
    with pytest.raises(anthropic.APIError) as info:
        for _ in stream:
            pass
    assert "decode instance failed" in str(info.value)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    chat_reply = httpx.post(f"{router.url}/v1/chat/completions", headers=headers, timeout=30,
                            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat_reply.status_code == 503
    assert chat_reply.json()["error"]["type"] == "service_unavailable"
    msg_reply = httpx.post(f"{router.url}/v1/messages", headers=headers, timeout=30,
                           json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert msg_reply.status_code == 503
    assert msg_reply.json()["type"] == "error" and msg_reply.json()["error"]["type"] == "overloaded_error"
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 503
