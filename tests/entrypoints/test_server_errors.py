"""Every client error gets the right status and error body, and the server keeps serving; disconnects free memory."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.entrypoints.server_fixture import API_KEY, start_server, stop_server

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def _post(server, path, body=None, *, raw: bytes | None = None, headers=None):
    hdrs = server.headers() if headers is None else headers
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers={"Content-Type": "application/json", **hdrs},
                      timeout=60)


def _openai_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _still_serving(server):
    ok = _post(server, CHAT, {"model": "tiny", "messages": USER, "max_tokens": 2})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("body, status, param", [
    ({"model": "tiny", "messages": "not a list"}, 422, "messages"),
    ({"model": "tiny"}, 422, "messages"),
    ({"model": "nope", "messages": USER}, 404, "model"),
    ({"model": "tiny", "messages": USER, "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "messages": USER, "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "messages": USER, "n": 99}, 400, "n"),
    ({"model": "tiny", "messages": USER, "max_tokens": 100_000}, 400, "max_tokens"),
    ({"model": "tiny", "messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "messages": USER, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages"),
    ({"model": "tiny", "messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     400, "response_format"),
    ({"model": "tiny", "messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ({"model": "tiny", "messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
])
def test_chat_errors(server, body, status, param):
    _openai_error(_post(server, CHAT, body), status, param)
    _still_serving(server)


def test_malformed_json_and_non_object(server):
    err = _openai_error(_post(server, CHAT, raw=b'{"model": "tiny", "messages": ['), 400)
    assert "JSON" in err["message"]
    _openai_error(_post(server, CHAT, raw=b"[1, 2]"), 400)
    _still_serving(server)


def test_completion_errors(server):
    _openai_error(_post(server, "/v1/completions", {"model": "tiny", "prompt": [10**9]}), 400, "prompt")
    _openai_error(_post(server, "/v1/completions", {"model": "tiny", "prompt": "x " * 5000}), 400, "prompt")
    _openai_error(_post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "logprobs": 99}), 400,
                  "logprobs")
    _still_serving(server)


def test_auth_and_body_size(server):
    _openai_error(_post(server, CHAT, {"model": "tiny", "messages": USER}, headers={}), 401)
    _openai_error(_post(server, CHAT, {"model": "tiny", "messages": USER},
                        headers={"Authorization": "Bearer wrong"}), 401)
    resp = _post(server, "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": USER}, headers={})
    assert resp.status_code == 401 and resp.json()["type"] == "error"
    assert resp.json()["error"]["type"] == "authentication_error"
    ok = _post(server, "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": USER},
               headers={"x-api-key": API_KEY})
    assert ok.status_code == 200, ok.text
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 400_000}]}
    _openai_error(_post(server, CHAT, big), 413)
    _still_serving(server)


@pytest.mark.parametrize("body, status", [
    ({"model": "tiny", "messages": USER}, 422),  # max_tokens is required
    ({"model": "other", "max_tokens": 2, "messages": USER}, 404),
    ({"model": "tiny", "max_tokens": 2, "messages": USER, "temperature": 3}, 400),
    ({"model": "tiny", "max_tokens": 2, "messages": USER, "tools": [{"name": "f", "input_schema": {}}],
      "tool_choice": {"type": "tool", "name": "g"}}, 400),
    ({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400),
])
def test_anthropic_errors(server, body, status):
    resp = _post(server, "/v1/messages", body)
    assert resp.status_code == status, resp.text
    payload = resp.json()
    assert payload["type"] == "error" and payload["error"]["message"] and payload["error"]["type"]
    _still_serving(server)


def _wait_idle(server, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (server.metric("num_requests_running") == 0 and server.metric("kv_cache_usage_perc") == 0
                and server.metric("state_slot_usage_perc") == 0):
            return
        time.sleep(0.2)
    raise AssertionError("requests still hold cache memory after the clients disconnected")


def _errors(server, kind: str) -> float:
    """deltaserve:request_errors_total of `kind` (0 before the first)."""
    prefix = f'deltaserve:request_errors_total{{kind="{kind}",'
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


def test_disconnected_stream_frees_memory(server):
    """A client that leaves mid-stream: its request is aborted and its cache freed, and the stream is counted
    as a client_disconnected error (a 200 went out, but the request did not complete)."""
    body = {"model": "tiny", "messages": USER, "max_tokens": 600, "stream": True, "ignore_eos": True}
    disconnected = _errors(server, "client_disconnected")
    with httpx.stream("POST", f"{server.url}{CHAT}", json=body, headers=server.headers(), timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert server.metric("num_requests_running") == 1
    _wait_idle(server)  # closing the stream aborted the request
    deadline = time.monotonic() + 30
    while _errors(server, "client_disconnected") != disconnected + 1:
        assert time.monotonic() < deadline, "the disconnected stream was not counted once"
        time.sleep(0.1)


def test_disconnected_non_stream_request_is_aborted(server):
    body = {"model": "tiny", "messages": USER, "max_tokens": 600, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post_timeout = httpx.post(f"{server.url}{CHAT}", json=body, headers=server.headers(), timeout=1.5)
        del _post_timeout
    _wait_idle(server)


def test_metrics_exposed(server):
    _still_serving(server)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("http_requests_total", "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket", "num_requests_running",
                 "num_requests_waiting", "kv_cache_usage_perc", "state_slot_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total"):
        assert f"deltaserve:{name}" in text, name
    assert server.metric("prefix_cache_queries_total") > 0


def test_queue_full_returns_503_with_retry_after(tiny_dir, tmp_path):
    small = start_server(tiny_dir("base"), tmp_path, "--max-num-seqs", "1", "--max-queued-requests", "0",
                         "--max-model-len", "768")
    try:
        body = {"model": "tiny", "messages": USER, "max_tokens": 500, "ignore_eos": True}
        first = threading.Thread(target=_post, args=(small, CHAT, body), daemon=True)
        first.start()
        deadline = time.monotonic() + 30
        while small.metric("num_requests_running") + small.metric("num_requests_waiting") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        resp = _post(small, CHAT, {"model": "tiny", "messages": USER, "max_tokens": 2})
        _openai_error(resp, 503)
        assert resp.headers["retry-after"] == "1"
        first.join(timeout=120)
        _still_serving(small)
    finally:
        stop_server(small)


def test_reset_prefix_cache_endpoint(server):
    body = {"model": "tiny", "prompt": list(range(40, 140)), "max_tokens": 2, "temperature": 0}
    assert _post(server, "/v1/completions", body).status_code == 200
    warm = _post(server, "/v1/completions", body).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert _post(server, "/reset_prefix_cache", {}, headers={}).status_code == 401
    assert _post(server, "/reset_prefix_cache", {}).status_code == 200
    cold = _post(server, "/v1/completions", body).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"]
