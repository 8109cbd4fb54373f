"""A live `deltaserve serve` process on localhost for the end-to-end tests (one per test session and settings)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

API_KEY = "test-key"


@dataclass(frozen=True)
class LiveServer:
    url: str
    model: str
    model_dir: Path
    process: subprocess.Popen
    log: Path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def metric(self, name: str) -> float:
        """The value of one unlabelled-by-us metric line `deltaserve:{name}{...} value` from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(f"deltaserve:{name}{{") or line.startswith(f"deltaserve:{name} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"metric deltaserve:{name} not found in:\n{text}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, log_dir: Path, *extra: str, timeout_s: float = 180) -> LiveServer:
    port = free_port()
    log = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "deltaserve.entrypoints.cli", "serve", "--model", str(model_dir), "--port", str(port),
           "--api-key", API_KEY, "--served-model-name", "tiny", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return LiveServer(url, "tiny", model_dir, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not healthy after {timeout_s} s:\n{log.read_text()[-4000:]}")


def stop_server(server: LiveServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
