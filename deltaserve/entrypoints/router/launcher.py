"""`deltaserve serve-disagg`: prefill and decode instances as `deltaserve serve` processes on free loopback ports,
and the router in this process; everything stops together on SIGINT / SIGTERM.

Each instance is the leader of a process group of its own (its engine process joins it), so stopping an instance
stops all of it, and with a Linux parent-death signal an instance also stops if this process is killed outright.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import httpx

from deltaserve.entrypoints.router.app import run_router
from deltaserve.entrypoints.router.config import RouterConfig, RouterTimeouts

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.25
"""How often start-up looks at the instances (their /health, whether they exited)."""
_PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DisaggPlan:
    """What `serve-disagg` starts."""

    model: str | None
    """Checkpoint of every instance (None: `deltaserve serve`'s default model)."""
    num_prefill: int
    num_decode: int
    host: str = "127.0.0.1"
    """Where the router listens (the instances listen on loopback)."""
    port: int = 8000
    kv_transfer_config: dict[str, Any] = field(default_factory=dict)
    """The instances' `--kv-transfer-config`, less `kv_role`, which is set per instance."""
    serve_args: tuple[str, ...] = ()
    """Further `deltaserve serve` options, given unchanged to every instance."""
    startup_timeout_s: float = 600.0
    shutdown_grace_s: float = 40.0
    """How long a stopping instance gets (it drains its requests first) before it is killed."""
    timeouts: RouterTimeouts = field(default_factory=RouterTimeouts)
    """The router's."""

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError("serve-disagg: --prefill must be >= 0 and --decode >= 1")
        if "kv_role" in self.kv_transfer_config:
            raise ValueError("serve-disagg: kv_role is set per instance; leave it out of --kv-transfer-config")
        for arg in self.serve_args:
            if arg.split("=", 1)[0] in ("--port", "--host", "--kv-transfer-config", "--model"):
                raise ValueError(f"serve-disagg: {arg.split('=', 1)[0]} is set by serve-disagg for each instance")


@dataclass(frozen=True, slots=True)
class Child:
    """One started instance."""

    name: str
    """'prefill-0', 'decode-1', ...: how logs and errors name it."""
    url: str
    process: subprocess.Popen[bytes]


class ChildExited(ChildProcessError):
    """An instance exited while the launcher waited for it (an OSError: the command line prints it as one line)."""


class _Interrupted(Exception):
    """SIGINT or SIGTERM arrived: stop everything."""


def serve_disagg(plan: DisaggPlan, log_level: str = "info") -> int:
    """Start the instances, wait for their /health, serve the router until SIGINT / SIGTERM, then stop them all.
    Returns 0 on a signal; raises ChildExited or TimeoutError (after stopping the others) when start-up fails."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per /health poll otherwise
    children: list[Child] = []
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for role, count in (("prefill", plan.num_prefill), ("decode", plan.num_decode)):
            children += [start_instance(plan, role, i) for i in range(count)]
        wait_ready(children, plan.startup_timeout_s)
        stopping = threading.Event()
        _watch(children, stopping)
        config = RouterConfig(prefill_urls=tuple(c.url for c in children if c.name.startswith("prefill")),
                              decode_urls=tuple(c.url for c in children if c.name.startswith("decode")),
                              host=plan.host, port=plan.port, timeouts=plan.timeouts)
        logger.info("serve-disagg: %d prefill and %d decode instances ready; router on http://%s:%d",
                    plan.num_prefill, plan.num_decode, plan.host, plan.port)
        try:
            run_router(config, log_level)  # returns after uvicorn saw SIGINT / SIGTERM (which it raises again)
        finally:
            stopping.set()
        return 0
    except _Interrupted:
        logger.info("serve-disagg: stopping")
        return 0
    finally:
        # A second signal while stopping must not cut the clean-up short: ignored until the children are gone.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        stop_instances(children, plan.shutdown_grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_interrupted(sig: int, frame: FrameType | None) -> None:
    raise _Interrupted(signal.Signals(sig).name)


def instance_command(plan: DisaggPlan, role: str, port: int) -> list[str]:
    """The `deltaserve serve` command line of one instance."""
    kv = {**plan.kv_transfer_config, "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"}
    model = ["--model", plan.model] if plan.model is not None else []
    return [sys.executable, "-m", "deltaserve.entrypoints.cli", "serve", *model, "--host", "127.0.0.1",
            "--port", str(port), "--kv-transfer-config", json.dumps(kv), *plan.serve_args]


def start_instance(plan: DisaggPlan, role: str, index: int) -> Child:
    """Start one instance on a free loopback port, in a process group of its own."""
    port = _free_port()
    cmd = instance_command(plan, role, port)
    name = f"{role}-{index}"
    process = subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent)
    logger.info("serve-disagg: started %s (pid %d) on port %d: %s", name, process.pid, port, " ".join(cmd))
    return Child(name=name, url=f"http://127.0.0.1:{port}", process=process)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies, even by SIGKILL (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(children: list[Child], timeout_s: float) -> None:
    """Until every child's /health answers 200. ChildExited names a child that exits first; TimeoutError the
    children still starting after `timeout_s`."""
    start = time.monotonic()
    waiting = list(children)
    last_progress = start
    with httpx.Client(trust_env=False) as client:
        while waiting:
            for child in list(waiting):
                status = child.process.poll()
                if status is not None:
                    raise ChildExited(f"serve-disagg: {child.name} ({child.url}) exited during start-up with status "
                                      f"{status}")
                if _healthy(client, child.url):
                    logger.info("serve-disagg: %s ready after %.1f s", child.name, time.monotonic() - start)
                    waiting.remove(child)
            now = time.monotonic()
            if waiting and now - start > timeout_s:
                raise TimeoutError(f"serve-disagg: {', '.join(c.name for c in waiting)} not healthy after "
                                   f"{timeout_s:g} s")
            if waiting and now - last_progress >= _PROGRESS_EVERY_S:
                logger.info("serve-disagg: waiting for %s (%.0f s)", ", ".join(c.name for c in waiting), now - start)
                last_progress = now
            if waiting:
                time.sleep(_POLL_S)


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _watch(children: list[Child], stopping: threading.Event) -> None:
    """Log an instance that exits while the router serves (the router's health checks then skip it)."""

    def wait(child: Child) -> None:
        status = child.process.wait()
        if not stopping.is_set():
            logger.error("serve-disagg: %s exited with status %s; the router skips it", child.name, status)

    for child in children:
        threading.Thread(target=wait, args=(child,), name=f"watch-{child.name}", daemon=True).start()


def stop_instances(children: list[Child], grace_s: float) -> None:
    """SIGTERM to every instance (each drains and stops its engine), SIGKILL to the process group of any still
    running after `grace_s`, and to whatever its process group still holds once it exited."""
    for child in children:
        if child.process.poll() is None:
            child.process.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("serve-disagg: %s did not stop within %g s: killed", child.name, grace_s)
        _kill_group(child)
        child.process.wait()


def _kill_group(child: Child) -> None:
    try:
        os.killpg(child.process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is empty: nothing left behind
        pass
