"""/metrics comes from state the API process holds: with the engine process stopped (SIGSTOP: as for a step that
never ends) a scrape still answers at once with the last snapshot, whose age grows; unhandled exceptions are counted
as 500s in the request metrics and as errors of kind `internal`."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from starlette.testclient import TestClient

from deltaserve.chat import get_chat_format
from deltaserve.config import CacheConfig, EngineConfig, ServerConfig
from deltaserve.engine.inproc_client import InprocEngineClient
from deltaserve.entrypoints.server.app import build_app
from deltaserve.entrypoints.server.frontend import Frontend
from deltaserve.entrypoints.server.metrics import ServerMetrics
from deltaserve.structured.factory import make_backend
from deltaserve.text.tokenizer import Tokenizer
from tests.entrypoints.server_fixture import start_server, stop_server

USER = [{"role": "user", "content": "hello"}]


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def engine_pid(server_pid: int) -> int:
    """The engine process: the server's child started by multiprocessing's spawn (not its resource tracker)."""
    for pid in _children(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return pid
    raise AssertionError(f"no engine process among the children of {server_pid}")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(f"deltaserve:{name}{{") or line.startswith(f"deltaserve:{name} "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _scrape(url: str) -> tuple[str, float]:
    start = time.monotonic()
    resp = httpx.get(f"{url}/metrics", timeout=30)
    assert resp.status_code == 200
    return resp.text, time.monotonic() - start


@pytest.mark.slow  # CI time
def test_metrics_answer_from_the_last_snapshot_while_the_engine_is_stopped(tiny_dir, tmp_path):
    live = start_server(tiny_dir("base"), tmp_path, "--max-model-len", "512")
    try:
        body = {"model": "tiny", "messages": USER, "max_tokens": 3}
        assert httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=live.headers(),
                          timeout=120).status_code == 200
        text, _ = _scrape(live.url)
        blocks_total = metric(text, "kv_cache_usage_perc")  # present: the engine answered
        assert blocks_total == 0.0 and metric(text, "num_requests_running") == 0
        engine = engine_pid(live.process.pid)
        os.kill(engine, signal.SIGSTOP)
        try:
            first, took_first = _scrape(live.url)
            second, took_second = _scrape(live.url)
            status = httpx.get(f"{live.url}/status.json", timeout=30).json()
        finally:
            os.kill(engine, signal.SIGCONT)
        # The scrape waits at most 0.5 s for a fresh snapshot (it used to wait 5 s, and a Prometheus scrape
        # times out after 10 s by default); 3 s leaves room for a loaded machine.
        assert took_first < 3.0 and took_second < 3.0, (took_first, took_second)
        assert metric(first, "num_requests_running") == 0 and metric(first, "kv_cache_usage_perc") == 0.0
        assert metric(second, "engine_stats_age_seconds") > metric(first, "engine_stats_age_seconds") > 0
        assert status["now"]["running"] == 0 and status["engine_stats_age_s"] > 0
        stale = metric(second, "engine_stats_age_seconds")
        deadline = time.monotonic() + 60  # resumed: the next scrapes get fresh snapshots again
        while metric(_scrape(live.url)[0], "engine_stats_age_seconds") >= stale:
            assert time.monotonic() < deadline, "the snapshot never got fresh after SIGCONT"
        assert httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=live.headers(),
                          timeout=120).status_code == 200
    finally:
        stop_server(live)


@pytest.fixture(scope="module")
def inproc_frontend(tiny_dir):
    model = str(tiny_dir("base"))
    config = EngineConfig(model=model, max_model_len=256, cache=CacheConfig(cache_memory="64MiB"))
    tokenizer = Tokenizer.from_pretrained(model)
    client = InprocEngineClient.from_config(config)
    yield Frontend(client, tokenizer, get_chat_format(model, tokenizer, None), ServerConfig(),
                   ServerMetrics("tiny"), "tiny", max_num_seqs=config.scheduler.max_num_seqs,
                   structured_backend=make_backend(config.structured_output_backend, tokenizer))
    asyncio.run(client.shutdown())


def test_unhandled_exceptions_are_counted_as_500s(inproc_frontend):
    app = build_app(inproc_frontend)

    @app.post("/v1/broken")
    async def broken() -> None:  # a route with a bug: the app's handler answers, the metrics count it
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        for _ in range(2):
            resp = client.post("/v1/broken", json={})
            assert resp.status_code == 500
            assert resp.json()["error"]["message"] == "internal server error: RuntimeError"
        assert client.post("/v1/chat/completions", json={"messages": "not a list"}).status_code == 422
        text = client.get("/metrics").text
        assert 'deltaserve:http_requests_total{model_name="tiny",route="/v1/broken",status="500"} 2.0' in text
        assert 'deltaserve:request_errors_total{kind="internal",model_name="tiny"} 2.0' in text
        assert 'deltaserve:request_errors_total{kind="invalid_request",model_name="tiny"} 1.0' in text
        status = client.get("/status.json").json()
        assert status["totals"]["errors_by_kind"] == {"internal": 2, "invalid_request": 1}
        assert status["now"]["running"] == 0  # the in-process engine's stats reached the snapshot


def test_shared_store_counters_are_exposed():
    """The engine's shared-store (L3) counters reach /metrics under vLLM-style names, with the values given."""
    from prometheus_client import generate_latest

    from deltaserve.engine.stats import EngineStats, shared_store_stats
    from deltaserve.kvstore.store import KVStoreStats

    store = KVStoreStats(get_calls=5, hits=3, hit_bytes=3000, get_latency_s_sum=0.25, puts=7, put_bytes=7000,
                         put_latency_s_sum=0.5, errors=1, corrupt=2)
    metrics = ServerMetrics("m")
    metrics.engine.snapshot.set(EngineStats(num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=1,
                                            state_slots_used=0, state_slots_total=1, prefix_queried_tokens=0,
                                            prefix_hit_tokens=0, num_preemptions=0, steps=1,
                                            **shared_store_stats(store)))
    text = generate_latest(metrics.registry).decode()
    for name, value in (("gets", 5), ("get_hits", 3), ("get_bytes", 3000), ("get_seconds", 0.25), ("puts", 7),
                        ("put_bytes", 7000), ("put_seconds", 0.5), ("errors", 1), ("corrupt_entries", 2)):
        assert f'deltaserve:shared_cache_{name}_total{{model_name="m"}} {float(value)}' in text, name


def _stream_events(client: TestClient, path: str, body: dict) -> list[str]:
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200  # the failure comes after the headers
        return [line for line in resp.iter_lines() if line]


def _failing_after_first_update(frontend: Frontend, exc: Exception, monkeypatch) -> None:
    """The engine's updates for the next requests end with `exc` after the first one (an engine that fails a
    request, or a bug, mid-stream)."""
    original = frontend.output.generate

    async def generate(*args, **kwargs):
        updates = original(*args, **kwargs)
        try:
            yield await updates.__anext__()
            raise exc
        finally:
            await updates.aclose()

    monkeypatch.setattr(frontend.output, "generate", generate)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_errors_after_a_stream_started_are_counted_once(inproc_frontend, monkeypatch, route):
    """A stream's failure after its 200 (counted in http_requests as a 200) is counted in request_errors once, by
    its kind: the engine failing the request mid-stream (400), a bug (500), the request's deadline (504)."""
    from deltaserve.engine.protocol import EngineRequestError
    from deltaserve.entrypoints.server.lifecycle import Lifecycle

    body = {"model": "tiny", "max_tokens": 8, **({"prompt": "hello"} if route == "/v1/completions" else
                                                 {"messages": USER})}
    errors = inproc_frontend.metrics.errors_by_kind
    for exc, kind, said in [(EngineRequestError("the engine failed it"), "bad_request", "the engine failed it"),
                            (RuntimeError("a bug"), "internal", "internal error: RuntimeError")]:
        before = dict(errors)
        with monkeypatch.context() as patch, TestClient(build_app(inproc_frontend)) as client:
            _failing_after_first_update(inproc_frontend, exc, patch)
            events = _stream_events(client, route, body)
        assert any(said in e for e in events) and "error" in events[-1 if route == "/v1/messages" else -2]
        assert errors == {**before, kind: before.get(kind, 0) + 1}
    before = dict(errors)
    late = build_app(inproc_frontend, Lifecycle(request_timeout_s=1e-9))  # past its deadline at the first wait
    with TestClient(late) as client:
        events = _stream_events(client, route, body)
    assert any("timeout_error" in e for e in events), events
    assert errors == {**before, "timeout": before.get("timeout", 0) + 1}
    text = TestClient(late).get("/metrics").text
    assert f'deltaserve:request_errors_total{{kind="timeout",model_name="tiny"}} {errors["timeout"]:.1f}' in text
