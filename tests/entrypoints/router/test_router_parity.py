"""Greedy outputs through the router (1 prefill + 1 decode instance) equal a unified instance's, streamed and not,
on the OpenAI chat and completions routes and Anthropic messages; the routes a decode instance answers alone."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tests.entrypoints.router.helpers import (
    API_KEY,
    metric_sum,
    serve_has_kv_transfer_config,
    start_instance,
    start_router,
    stop_router,
    wait_until,
)
from tests.entrypoints.server_fixture import free_port, stop_server

PROMPTS = ["Tell me about the sea.", "A" * 40 + " and then some more words to pass a block boundary maybe"]
MAX_TOKENS = 8
GREEDY = {"temperature": 0}  # this SDK version takes no temperature argument


@pytest.fixture(scope="module")
def cell(tiny_dir, tmp_path_factory):
    """(unified instance, router over one prefill and one decode instance, the prefill and decode instances)."""
    logs = tmp_path_factory.mktemp("router-parity")
    servers = []
    try:
        for role in (None, "prefill", "decode"):
            servers.append(start_instance(tiny_dir("base"), logs, role, max_model_len=2048))
        unified, prefill, decode = servers
        router = start_router(logs, [prefill.url], [decode.url])
        yield unified, router, prefill, decode
        stop_router(router)
    finally:
        for server in servers:
            stop_server(server)


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _anthropic(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0, timeout=60)


def chat_text(url: str, prompt: str, stream: bool) -> str:
    client = _openai(url)
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        return out.choices[0].message.content or ""
    chunks = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def completion_text(url: str, prompt: str, stream: bool) -> str:
    client = _openai(url)
    if not stream:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
                                         ).choices[0].text
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def message_text(url: str, prompt: str, stream: bool) -> str:
    client = _anthropic(url)
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        out = client.messages.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, extra_body=GREEDY)
        return "".join(block.text for block in out.content if block.type == "text")
    with client.messages.stream(model="tiny", messages=messages, max_tokens=MAX_TOKENS, extra_body=GREEDY) as events:
        return "".join(events.text_stream)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("call", [chat_text, completion_text, message_text], ids=["chat", "completions", "messages"])
def test_router_output_equals_unified(cell, call, stream):
    """Greedy text through prefill + decode is the unified instance's text, streamed or not."""
    unified, router, *_ = cell
    fallbacks = router.metric("local_prefill_fallbacks_total")
    for prompt in PROMPTS:
        expected = call(unified.url, prompt, stream)
        assert expected
        assert call(router.url, prompt, stream) == expected
    if serve_has_kv_transfer_config():  # decoded from the prefill instance's cache, not a local prefill
        assert router.metric("local_prefill_fallbacks_total") == fallbacks


def test_router_counts_requests(cell):
    """Each request is counted on its route, no lease outlives its request, and with instances that have a KV
    connector every request is decoded from a transfer (no fallback to a local prefill)."""
    _, router, *_ = cell
    before = router.metric("requests_total", route="/v1/chat/completions")
    fallbacks = router.metric("local_prefill_fallbacks_total")
    for stream in (False, True):
        chat_text(router.url, PROMPTS[0], stream=stream)
    assert router.metric("requests_total", route="/v1/chat/completions") == before + 2
    assert router.metric("in_flight") == 0
    assert router.metric("prefill_failures_total") == 0
    if serve_has_kv_transfer_config():
        assert router.metric("local_prefill_fallbacks_total") == fallbacks
    else:  # today's instances answer without kv_transfer_params
        assert router.metric("local_prefill_fallbacks_total", reason="no_kv_transfer_params") == fallbacks + 2


def test_concurrent_requests_all_complete(cell):
    """16 requests at once, streamed and not, through the router: each gets the unified text, and no lease is
    left on either instance."""
    unified, router, *_ = cell
    prompts = [f"Item {i}: say something" for i in range(8)]
    expected = {p: chat_text(unified.url, p, stream=False) for p in prompts}
    jobs = [(p, stream) for p in prompts for stream in (False, True)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: chat_text(router.url, *job), jobs))
    assert got == [expected[p] for p, _ in jobs]
    assert router.metric("in_flight") == 0


def _raw_post(url: str, path: str, body: dict) -> socket.socket:
    """A request on a socket of its own, so the test decides when the client leaves."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_client_that_leaves_aborts_the_decode(cell, stream):
    """A client that disconnects mid-generation ends the request on the decode instance too (it stops running
    without finishing its 1,500 tokens) and releases its lease in the router."""
    _, router, _, decode = cell

    def running() -> float:
        return metric_sum(decode.url, "deltaserve:num_requests_running")

    def finished() -> float:
        return metric_sum(decode.url, "deltaserve:request_success_total")

    before = finished()
    sock = _raw_post(router.url, "/v1/chat/completions",
                     {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 1500,
                      "ignore_eos": True, "temperature": 0, "stream": stream})
    if stream:  # generating once its first event is here
        received = b""
        while b"data:" not in received:
            received += sock.recv(65536)
    else:
        wait_until(lambda: running() == 1, "the decode instance running the request")
    sock.close()
    wait_until(lambda: router.metric("in_flight") == 0, "the router to release the lease")
    wait_until(lambda: running() == 0, "the decode instance to stop the request")
    assert finished() == before  # stopped, not run to its end


def test_decode_only_routes_relay_the_instance(cell):
    """/v1/models, /tokenize, /detokenize and count_tokens answer as the instance does (same bodies)."""
    unified, router, *_ = cell
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for method, path, body in [("GET", "/v1/models", None),
                               ("POST", "/tokenize", {"model": "tiny", "prompt": "hello there"}),
                               ("POST", "/detokenize", {"model": "tiny", "tokens": [5, 6, 7]}),
                               ("POST", "/v1/messages/count_tokens",
                                {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})]:
        direct = httpx.request(method, f"{unified.url}{path}", json=body, headers=headers, timeout=30)
        routed = httpx.request(method, f"{router.url}{path}", json=body, headers=headers, timeout=30)
        assert routed.status_code == direct.status_code == 200, routed.text
        got, want = routed.json(), direct.json()
        if path == "/v1/models":  # the checkpoint path and creation time are the instance's own
            got, want = [m["id"] for m in got["data"]], [m["id"] for m in want["data"]]
        assert got == want


def test_client_errors_are_relayed(cell):
    """A bad request is the decode instance's 4xx, body and all; a wrong API key its 401."""
    unified, router, *_ = cell
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    direct = httpx.post(f"{unified.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    routed = httpx.post(f"{router.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert direct.status_code == routed.status_code == 400
    assert routed.json() == direct.json()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{router.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=router.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    not_json = httpx.post(f"{router.url}/v1/completions", content=b"{nope", headers=headers, timeout=30)
    assert not_json.status_code == 400 and "error" in not_json.json()


@pytest.fixture(scope="module")
def failing_prefill():
    """An instance whose /health answers 200 and whose generation routes answer 500."""

    async def ok(request: Request) -> Response:
        return Response(status_code=200)

    async def broken(request: Request) -> Response:
        return JSONResponse({"error": {"message": "broken on purpose", "type": "internal_server_error"}}, 500)

    app = Starlette(routes=[Route("/health", ok), Route("/v1/chat/completions", broken, methods=["POST"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "the failing instance")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join()


def test_failing_prefill_instance_is_skipped_for_another(cell, failing_prefill, tmp_path):
    """A prefill instance that answers 500 is counted as failed and the next prefill instance takes the request:
    the same text, and no local prefill."""
    unified, _, prefill, decode = cell
    router = start_router(tmp_path, [failing_prefill, prefill.url], [decode.url])
    try:
        for prompt in PROMPTS:  # idle instances are taken in turn: the failing one comes first at least once
            assert chat_text(router.url, prompt, stream=False) == chat_text(unified.url, prompt, stream=False)
        assert router.metric("prefill_failures_total", instance=failing_prefill, reason="status_500") >= 1
        assert router.metric("local_prefill_fallbacks_total", reason="prefill_failed") == 0
        assert router.metric("instance_healthy", role="prefill") == 2  # a 500 is the request's failure, not down
    finally:
        stop_router(router)
