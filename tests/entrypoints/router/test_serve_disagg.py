"""`deltaserve serve-disagg` end to end: one prefill and one decode instance and the router answer a chat request;
SIGTERM or SIGINT stops the router and every process it started, and so does killing the launcher outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.entrypoints.router.helpers import API_KEY, serve_has_kv_transfer_config, wait_until
from tests.entrypoints.server_fixture import free_port


def _children(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc: parent ids)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not serve_has_kv_transfer_config(), reason="needs --kv-transfer-config")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: s.name)
def test_serve_disagg_answers_and_stops_every_process(tiny_dir, tmp_path, sig):
    """serve-disagg 1P + 1D answers a chat request through its router; SIGTERM or SIGINT ends it with status 0
    and every instance and engine process it started gone; killed outright (SIGKILL), its instances still stop
    (the parent-death signal)."""
    port = free_port()
    log = tmp_path / "serve-disagg.log"
    cmd = [sys.executable, "-m", "deltaserve.entrypoints.router.commands", "serve-disagg", "--model",
           str(tiny_dir("base")), "--prefill", "1", "--decode", "1", "--port", str(port), "--num-threads", "1",
           "--max-model-len", "512", "--api-key", API_KEY, "--served-model-name", "tiny"]
    with open(log, "wb") as out:
        launcher = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    started: set[int] = set()
    try:
        wait_until(lambda: launcher.poll() is not None or _healthy(url), "the serve-disagg router", timeout_s=300)
        assert launcher.poll() is None, log.read_text()[-4000:]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                             max_tokens=4, temperature=0)
        assert out.choices[0].message.content
        started = _children(launcher.pid)
        assert len(started) >= 4  # two instances and their engine processes
        launcher.send_signal(sig)
        status = launcher.wait(timeout=120)
        assert status == (-signal.SIGKILL if sig == signal.SIGKILL else 0), log.read_text()[-4000:]
        wait_until(lambda: not any(_alive(pid) for pid in started), "every started process to exit", timeout_s=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in started:  # a failed test leaves nothing running either
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
