"""A router process in front of live `deltaserve serve` instances, and reading its /metrics (the instances come
from tests/entrypoints/server_fixture.py)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.server_fixture import API_KEY, LiveServer, free_port, start_server

SERVE_ARGS = ("--num-threads", "1")


@functools.cache
def serve_has_kv_transfer_config() -> bool:
    """Whether `deltaserve serve` takes --kv-transfer-config yet (the engine side of issue 19)."""
    out = subprocess.run([sys.executable, "-m", "deltaserve.entrypoints.cli", "serve", "--help"],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    return "--kv-transfer-config" in out.stdout


def start_instance(model_dir: Path, log_dir: Path, role: str | None, max_model_len: int = 512) -> LiveServer:
    """A `deltaserve serve` instance: role 'prefill' / 'decode' gets its kv_role when the engine has the option
    (then transfers really happen; before, every request is prefilled on its decode instance), None is unified."""
    extra: list[str] = [*SERVE_ARGS, "--max-model-len", str(max_model_len)]
    if role is not None and serve_has_kv_transfer_config():
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        extra += ["--kv-transfer-config", json.dumps({"kv_role": kv_role})]
    return start_server(model_dir, log_dir, *extra)


@dataclass(frozen=True)
class LiveRouter:
    url: str
    process: subprocess.Popen
    log: Path

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `deltaserve:router_{name}` whose labels include `labels` (0 when none)."""
        return metric_sum(self.url, f"deltaserve:router_{name}", **labels)


def metric_sum(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of metric `name` on `url`/metrics whose labels include `labels` (0 when none)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def start_router(log_dir: Path, prefill: list[str], decode: list[str], *extra: str,
                 timeout_s: float = 60) -> LiveRouter:
    """`deltaserve router` as a process (through commands.main), once it answers /metrics."""
    port = free_port()
    log = log_dir / f"router-{port}.log"
    cmd = [sys.executable, "-m", "deltaserve.entrypoints.router.commands", "router", "--port", str(port),
           "--health-interval-s", "0.5", *extra]
    cmd += [arg for url in prefill for arg in ("--prefill", url)]
    cmd += [arg for url in decode for arg in ("--decode", url)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    router = LiveRouter(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{router.url}/metrics", timeout=1).status_code == 200:
                return router
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"router not up after {timeout_s} s:\n{log.read_text()[-4000:]}")


def stop_router(router: LiveRouter) -> None:
    router.process.terminate()
    try:
        router.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        router.process.kill()
        router.process.wait()


def wait_until(condition, what: str, timeout_s: float = 30) -> None:
    """Poll `condition()` until true (a state another process reaches: an instance seen down, a request begun)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


__all__ = ["API_KEY", "LiveRouter", "start_instance", "start_router", "stop_router", "wait_until"]
