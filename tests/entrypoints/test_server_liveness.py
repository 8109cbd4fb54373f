"""Liveness of a real `deltaserve serve`: /health sees a stopped engine, request deadlines free the cache, a dead
engine ends the server (or is restarted), SIGTERM drains, slow headers and bodies are dropped, the 401 says which
header to send.

Every wait is a poll with a generous deadline; the engine is frozen with SIGSTOP where a request must still be
running when the test looks, so that no assertion depends on how fast the machine is.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from deltaserve.engine.core_proc import HeartbeatThread
from deltaserve.engine.messages import HEARTBEAT_INTERVAL_S, EngineOutput, Heartbeat
from tests.entrypoints.server_fixture import LiveServer, start_server, stop_server

DEADLINE_S = 120.0


def wait_for(what: str, check: Callable[[], object], timeout_s: float = DEADLINE_S) -> object:
    """Poll `check` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def engine_pid(server: LiveServer) -> int | None:
    """The engine process: the server's child started by multiprocessing's spawn (not its resource tracker)."""
    children = Path(f"/proc/{server.process.pid}/task/{server.process.pid}/children")
    for pid in children.read_text().split() if children.exists() else ():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            return int(pid)
    return None


def health(server: LiveServer) -> int:
    try:
        return httpx.get(f"{server.url}/health", timeout=10).status_code
    except httpx.HTTPError:
        return -1


def completion_body(server: LiveServer, **extra: object) -> dict[str, object]:
    return {"model": server.model, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, **extra}


@contextlib.contextmanager
def stream(server: LiveServer, path: str = "/v1/completions", **extra: object) -> Iterator[Iterator[str]]:
    """The `data:`/`event:` lines of a streaming request, opened (its status checked) before the body yields."""
    body = completion_body(server, stream=True, **extra)
    if path == "/v1/chat/completions":
        body.pop("prompt")
        body["messages"] = [{"role": "user", "content": "hi"}]
    with httpx.Client(timeout=httpx.Timeout(DEADLINE_S)) as client:
        with client.stream("POST", f"{server.url}{path}", headers=server.headers(), json=body) as response:
            assert response.status_code == 200, response.read()
            yield (line for line in response.iter_lines() if line)


def data_events(lines: Iterator[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """The process frozen (SIGSTOP) for the block, always resumed after it."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def idle_cache(server: LiveServer) -> bool:
    try:
        return server.metric("num_requests_running") == 0 and server.metric("kv_cache_usage_perc") == 0
    except (KeyError, httpx.HTTPError):
        return False


@pytest.fixture(scope="module")
def live(tiny_dir, tmp_path_factory):
    server = start_server(tiny_dir("base"), tmp_path_factory.mktemp("liveness"), "--max-model-len", "2048",
                          "--health-timeout-s", "2", "--request-timeout-s", "5", "--header-timeout-s", "1",
                          "--body-timeout-s", "1")
    yield server
    stop_server(server)


def test_health_is_503_while_the_engine_process_is_stopped(live):
    pid = wait_for("the engine process", lambda: engine_pid(live))
    assert health(live) == 200
    with stopped(pid):
        wait_for("/health 503 while the engine is stopped", lambda: health(live) == 503)
        body = httpx.get(f"{live.url}/health", timeout=10).json()
        assert "heartbeat" in body["reason"]
    wait_for("/health 200 after SIGCONT", lambda: health(live) == 200)


def test_stream_past_its_deadline_ends_with_an_error_event_and_frees_its_cache(live):
    pid = wait_for("the engine process", lambda: engine_pid(live))
    with stream(live) as lines:
        first = next(lines)
        assert first.startswith("data: {")
        with stopped(pid):  # the request cannot finish before its deadline
            rest = data_events(lines)
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    assert "--request-timeout-s" in error["message"]
    assert all("error" not in json.loads(e) for e in rest[:-2])
    wait_for("the aborted request's cache to be freed", lambda: idle_cache(live))


def test_request_past_its_deadline_gets_504_and_frees_its_cache(live):
    pid = wait_for("the engine process", lambda: engine_pid(live))
    with stopped(pid):
        r = httpx.post(f"{live.url}/v1/messages", headers=live.headers(), timeout=DEADLINE_S,
                       json={"model": live.model, "max_tokens": 1500, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "timeout_error"
    wait_for("the aborted request's cache to be freed", lambda: idle_cache(live))
    ok = httpx.post(f"{live.url}/v1/completions", headers=live.headers(), timeout=DEADLINE_S,
                    json=completion_body(live, max_tokens=4))
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_the_heartbeat_thread_beats_while_the_loop_thread_holds_the_gil(tmp_path):
    """A long step is not a missed heartbeat: the beat thread runs while the main thread never releases the GIL by
    itself (Python switches threads every few milliseconds)."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/beats"
    pull.bind(address)
    beats_at: list[float] = []
    beat = HeartbeatThread(ctx, address, lambda: beats_at.append(time.monotonic()) or 7)
    try:
        end = time.monotonic() + 4 * HEARTBEAT_INTERVAL_S
        while time.monotonic() < end:  # pure Python: like a step that holds the GIL
            pass
        assert any(t < end for t in beats_at)
        assert pull.poll(DEADLINE_S * 1000)
        assert msgspec.msgpack.Decoder(EngineOutput).decode(pull.recv()) == Heartbeat(step=7)
    finally:
        beat.stop()
        pull.close(linger=0)
        ctx.term()


def _raw_exchange(server: LiveServer, data: bytes) -> bytes:
    """Send `data` on a fresh connection, then read until the server closes it."""
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def test_slow_headers_and_bodies_are_dropped_with_408(live):
    assert _raw_exchange(live, b"").startswith(b"HTTP/1.1 408")  # connected, never sent anything
    assert _raw_exchange(live, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n").startswith(b"HTTP/1.1 408")
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    reply = _raw_exchange(live, head + b'{"model": ')
    assert reply.startswith(b"HTTP/1.1 408")
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert health(live) == 200  # and the server goes on


def test_401_says_what_the_key_guards_and_which_header_to_send(live):
    r = httpx.post(f"{live.url}/v1/messages", json={}, timeout=30)
    assert r.status_code == 401
    message = r.json()["error"]["message"]
    assert "x-api-key" in message and "Authorization: Bearer" in message and "/v1/" in message
    r = httpx.post(f"{live.url}/v1/messages", headers={"x-api-key": "test-key"}, timeout=30,
                   json={"model": live.model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    out = subprocess.run([sys.executable, "-m", "deltaserve.entrypoints.cli", "serve", "--help"], check=True,
                         capture_output=True, text=True).stdout
    assert "x-api-key" in out and "/health" in out


@pytest.mark.slow
def test_a_killed_engine_fails_the_stream_and_the_server_exits_with_status_1(tiny_dir, tmp_path):
    server = start_server(tiny_dir("base"), tmp_path, "--max-model-len", "2048")
    try:
        pid = wait_for("the engine process", lambda: engine_pid(server))
        with stream(server, "/v1/chat/completions") as lines:
            next(lines)
            os.kill(pid, signal.SIGKILL)
            rest = data_events(lines)
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "engine_dead"
        assert server.process.wait(timeout=DEADLINE_S) == 1
    finally:
        stop_server(server)


@pytest.mark.slow
def test_restart_engine_starts_a_new_engine_process(tiny_dir, tmp_path):
    server = start_server(tiny_dir("base"), tmp_path, "--max-model-len", "2048", "--restart-engine")
    try:
        pid = wait_for("the engine process", lambda: engine_pid(server))
        with stream(server) as lines:
            next(lines)
            os.kill(pid, signal.SIGKILL)
            rest = data_events(lines)
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "engine_dead"
        new_pid = wait_for("a new engine process", lambda: (p := engine_pid(server)) not in (None, pid) and p)
        wait_for("/health 200 with the new engine", lambda: health(server) == 200)
        r = httpx.post(f"{server.url}/v1/completions", headers=server.headers(), timeout=DEADLINE_S,
                       json=completion_body(server, max_tokens=4))
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert server.process.poll() is None and engine_pid(server) == new_pid
    finally:
        stop_server(server)


@pytest.mark.slow
def test_sigterm_refuses_new_requests_lets_the_stream_finish_and_exits_0(tiny_dir, tmp_path):
    server = start_server(tiny_dir("base"), tmp_path, "--max-model-len", "2048", "--shutdown-timeout-s", "300")
    pid = wait_for("the engine process", lambda: engine_pid(server))
    try:
        with stream(server, max_tokens=200) as lines:
            next(lines)
            with stopped(pid):  # the stream is still running while the test looks
                server.process.send_signal(signal.SIGTERM)
                wait_for("503 while draining", lambda: httpx.get(f"{server.url}/v1/models", headers=server.headers(),
                                                                 timeout=10).status_code == 503)
                refused = httpx.post(f"{server.url}/v1/completions", headers=server.headers(), timeout=10,
                                     json=completion_body(server, max_tokens=4))
                assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
                assert refused.json()["error"]["code"] == "shutting_down"
            rest = data_events(lines)
        assert rest[-1] == "[DONE]"
        events = [json.loads(e) for e in rest[:-1]]
        assert all("error" not in e for e in events) and events[-1]["choices"][0]["finish_reason"] == "length"
        assert server.process.wait(timeout=DEADLINE_S) == 0
    finally:
        stop_server(server)


@pytest.mark.slow
def test_sigterm_aborts_what_outlives_the_shutdown_timeout_and_exits_0(tiny_dir, tmp_path):
    server = start_server(tiny_dir("base"), tmp_path, "--max-model-len", "2048", "--shutdown-timeout-s", "1")
    pid = wait_for("the engine process", lambda: engine_pid(server))
    try:
        with stream(server) as lines:
            next(lines)
            with stopped(pid):
                server.process.send_signal(signal.SIGTERM)
                rest = data_events(lines)
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "shutting_down"
        assert server.process.wait(timeout=DEADLINE_S) == 0
    finally:
        stop_server(server)
