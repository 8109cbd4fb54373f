"""The Ray executor: outputs identical to the in-process executor (TP=1, on a local Ray instance it starts) and to the
multiprocess one (TP=2, joining a running cluster); a failed call is a WorkerError and the actors live on; a killed
actor is a WorkerDiedError naming its rank (never a hang); an unreachable cluster address, ranks the cluster cannot
place and a missing Ray are one-line errors.

One Ray cluster serves the module (`ray start --head --block` in a subprocess, stopped by its pid); only the TP=1
test starts (and stops) a Ray instance of its own, to cover that path."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import pytest

from deltaserve.config import EngineConfig, ParallelConfig, SchedulerConfig
from deltaserve.engine.engine_core import EngineCore
from deltaserve.executor import WorkerDiedError
from deltaserve.executor.multiproc import MultiprocExecutor, WorkerError, free_port
from deltaserve.sampling_params import SamplingParams
from deltaserve.scheduler.output import SchedulerOutput
from tests.executor.test_multiproc import generate
from tests.helpers import prompt_ids

ray = pytest.importorskip("ray")

from deltaserve.executor import ray_executor  # noqa: E402  (needs ray)
from deltaserve.executor.ray_executor import RayExecutor, check_reachable  # noqa: E402

REQUESTS = {
    "greedy": (prompt_ids(600, 40, seed=1), SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)),
    "seeded": (prompt_ids(600, 9, seed=2), SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=12)),
    "short": (prompt_ids(600, 3, seed=3), SamplingParams(temperature=0.0, max_tokens=5)),
}


def config(path: str, backend: str, tp: int = 1, ray_address: str | None = None) -> EngineConfig:
    return EngineConfig(model=path, num_threads=1,
                        parallel=ParallelConfig(distributed_executor_backend=backend, tensor_parallel_size=tp,
                                                ray_address=ray_address),
                        scheduler=SchedulerConfig(max_num_batched_tokens=32))


@pytest.fixture(scope="module", autouse=True)
def _ray_environment() -> Iterator[None]:
    """No token authentication (Ray 2.60 turns it on for a new local instance, writing ~/.ray/auth_token and
    setting RAY_AUTH_MODE in this process) and no RAY_ADDRESS from outside: every test says where it connects."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.delenv("RAY_ADDRESS", raising=False)
        yield


@pytest.fixture(scope="module")
def cluster(_ray_environment) -> Iterator[str]:
    """'HOST:PORT' of a one-node Ray cluster (`ray start --head --block`, 4 logical CPUs), stopped at the end."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="ds-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    proc = subprocess.Popen(
        [ray_cli if os.path.exists(ray_cli) else "ray", "start", "--head", "--block", f"--port={port}",
         "--num-cpus=4", "--num-gpus=0", "--include-dashboard=false", "--disable-usage-stats",
         f"--temp-dir={temp_dir}", f"--object-store-memory={100 * 2**20}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    assert proc.stdout is not None
    log = []
    for line in proc.stdout:  # until the cluster says it runs (or the process ends: EOF)
        log.append(line)
        if "Ray runtime started" in line:
            break
    else:
        proc.wait()
        pytest.fail("ray start --head failed:\n" + "".join(log))
    threading.Thread(target=lambda: [log.append(line) for line in proc.stdout], daemon=True).start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes on SIGTERM
        proc.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow  # CI time: the Ray cluster test covers the executor
def test_tp1_on_a_local_ray_instance_equals_in_process(tiny_dir):
    """No address: the executor starts a local Ray instance, and stops it at shutdown (it started it)."""
    path = str(tiny_dir("base"))
    assert not ray.is_initialized()
    uni = EngineCore(config(path, "uni"))
    core = EngineCore(config(path, "ray"))
    try:
        assert isinstance(core.executor, RayExecutor) and ray.is_initialized()
        assert generate(core, REQUESTS) == generate(uni, REQUESTS)
    finally:
        core.shutdown()
    assert not ray.is_initialized()


def test_tp2_on_a_ray_cluster_equals_mp(tiny_dir, cluster, monkeypatch):
    """TP=2 joining the cluster named by $RAY_ADDRESS: outputs identical to the mp executor's TP=2, one actor per
    rank, each in its own process; the executor disconnects at shutdown and leaves the cluster running."""
    path = str(tiny_dir("base"))
    monkeypatch.setenv("RAY_ADDRESS", cluster)
    mp = EngineCore(config(path, "mp", tp=2))
    try:
        assert isinstance(mp.executor, MultiprocExecutor)
        expected = generate(mp, REQUESTS)
    finally:
        mp.shutdown()
    core = EngineCore(config(path, "ray", tp=2))
    try:
        assert isinstance(core.executor, RayExecutor)
        assert len(set(core.executor.pids)) == 2 and os.getpid() not in core.executor.pids
        assert generate(core, REQUESTS) == expected
    finally:
        core.shutdown()
    assert not ray.is_initialized()
    check_reachable(cluster)  # still up


def test_failed_call_then_killed_actor(tiny_dir, cluster, monkeypatch):
    """A worker's exception is a WorkerError with its traceback, and the next step runs (its call through the object
    store, as a large one goes); a SIGKILLed actor (rank 1 of 2) is a WorkerDiedError naming it, raised instead of
    waiting on the rank still alive, and stays one."""
    core = EngineCore(config(str(tiny_dir("base")), "ray", tp=2, ray_address=cluster))
    executor = core.executor
    assert isinstance(executor, RayExecutor)
    try:
        with pytest.raises(WorkerError, match=r"worker 0: AttributeError: .*no_such_method") as failed:
            executor._call("no_such_method")
        assert "Traceback" in failed.value.traceback and "no_such_method" in failed.value.traceback
        core.add_request("r", prompt_ids(600, 20, seed=4), SamplingParams(temperature=0.0, max_tokens=50))
        monkeypatch.setattr(ray_executor, "INLINE_CALL_BYTES", 0)
        assert core.step()[0].new_token_ids  # the actors lived on
        monkeypatch.undo()
        pid = executor.pids[1]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match=rf"worker 1 \(pid {pid} on .*\) died"):
            while core.has_unfinished_requests():
                core.step()
        with pytest.raises(WorkerDiedError, match="worker 1"):
            executor.execute_model(SchedulerOutput(chunks=[]))
    finally:
        core.shutdown()
    assert not ray.is_initialized()


@pytest.mark.slow  # CI time: waits out Ray's connection timeout
def test_unreachable_ray_address_is_a_one_line_error(tiny_dir):
    """Nothing listening, or a listener that never answers: a ConnectionError naming the address, in one line,
    before Ray is started or retried; a malformed address is a ValueError. `deltaserve serve`: one line, status 2."""
    path = str(tiny_dir("base"))
    closed = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=f"cannot reach the Ray cluster at {closed}: ") as refused:
        EngineCore(config(path, "ray", ray_address=closed))
    assert "\n" not in str(refused.value)
    assert not ray.is_initialized()
    with socket.socket() as silent:  # the kernel completes the handshake; nobody ever reads or writes
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(ConnectionError, match=f"cannot reach the Ray cluster at {address}: timed out"):
            check_reachable(address, timeout_s=0.5)
    with pytest.raises(ValueError, match="ray_address='nowhere'"):
        check_reachable("nowhere")
    for dp in ("1", "2"):  # one engine, and data-parallel replicas behind the router
        done = subprocess.run([sys.executable, "-m", "deltaserve.entrypoints.cli", "serve", "--model", path, "--port",
                               str(free_port()), "--distributed-executor-backend", "ray", "--ray-address", closed,
                               "--data-parallel-size", dp], capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, dp
        assert re.fullmatch(rf"deltaserve serve: error: .*cannot reach the Ray cluster at {closed}: [^\n]*",
                            done.stderr.strip().splitlines()[-1]), dp
        assert "site-packages/ray" not in done.stderr  # the engine logs its own start-up traceback, none of Ray's


def test_ranks_beyond_the_cluster_are_a_one_line_error(tiny_dir, cluster):
    """CUDA ranks on a cluster without GPUs: a RuntimeError saying what is missing, at once (no wait for a placement
    that cannot happen), and the executor disconnects from the cluster it joined."""
    cfg = EngineConfig(model=str(tiny_dir("base")), device="cuda",
                       parallel=ParallelConfig(distributed_executor_backend="ray", ray_address=cluster))
    with pytest.raises(RuntimeError, match=r"^1 rank\(s\) need 1 GPU\(s\), but the Ray cluster has 0 ") as refused:
        EngineCore(cfg)
    assert "\n" not in str(refused.value)
    assert not ray.is_initialized()


def test_without_ray_installed_the_backend_is_a_one_line_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ValueError, match=r"needs Ray, which is not installed: pip install 'deltaserve\[ray\]'"):
        ray_executor.import_ray()
