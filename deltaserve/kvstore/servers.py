"""Local store servers on free loopback ports, for the tests and the benchmark: Debian's `redis-server`, and the
Mooncake wheel's `mooncake_master` (with its HTTP metadata server) plus a `mooncake_client` pool process that holds
the entries' memory. Each can be killed and restarted on the same ports (the outage tests)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_port(port: int, process: subprocess.Popen[bytes], deadline_s: float = 30.0) -> None:
    """Until 127.0.0.1:port accepts; RuntimeError when the process exits first or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with status {process.returncode} before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{process.args!r} did not listen on port {port} within {deadline_s} s")


def redis_binary() -> str | None:
    return shutil.which("redis-server")


def mooncake_binaries() -> tuple[str, str] | None:
    """(mooncake_master, mooncake_client) from the installed Mooncake wheel, or None."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    master, client = folder / "mooncake_master", folder / "mooncake_client"
    return (str(master), str(client)) if master.is_file() and client.is_file() else None


class _Server:
    """One server process with a fixed command line (so a restart reuses its ports)."""

    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.argv, self.port, self.log = argv, port, log
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        wait_port(self.port, self.process)

    def kill(self) -> None:
        """SIGKILL (a crash, not a shutdown) and reap."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.process = None


class LocalRedis:
    """`redis-server` on a free loopback port, no persistence."""

    def __init__(self, workdir: str | None = None) -> None:
        binary = redis_binary()
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="kvstore-redis-"))
        self.port = free_port()
        self._server = _Server([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(self.dir)], self.port, self.dir / "redis.log")
        self._server.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def kill(self) -> None:
        self._server.kill()

    def restart(self) -> None:
        self._server.kill()
        self._server.start()

    def stop(self) -> None:
        self._server.kill()


class LocalMooncake:
    """`mooncake_master` (RPC, HTTP metadata and metrics on free ports) and a `mooncake_client` pool process that
    mounts `pool_bytes` of memory for the entries."""

    def __init__(self, pool_bytes: int = 1 << 30, workdir: str | None = None) -> None:
        binaries = mooncake_binaries()
        if binaries is None:
            raise FileNotFoundError("the Mooncake store is not installed (pip install 'deltaserve[mooncake]')")
        master, client = binaries
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="kvstore-mooncake-"))
        self.rpc_port, self.metadata_port, metrics_port, client_port = (free_port() for _ in range(4))
        self._master = _Server([master, "-rpc_port", str(self.rpc_port), "-rpc_address", "127.0.0.1",
                                "-enable_http_metadata_server=true", "-http_metadata_server_host", "127.0.0.1",
                                "-http_metadata_server_port", str(self.metadata_port), "-metrics_port",
                                str(metrics_port)], self.rpc_port, self.dir / "master.log")
        self._pool = _Server([client, "-host", "127.0.0.1", "-port", str(client_port), "-global_segment_size",
                              f"{pool_bytes // (1 << 20)}MB", "-master_server_address", f"127.0.0.1:{self.rpc_port}",
                              "-metadata_server", self.metadata_url, "-protocol", "tcp"], client_port,
                             self.dir / "pool.log")
        self._master.start()
        wait_port(self.metadata_port, self._master.process)  # type: ignore[arg-type]
        try:
            self._pool.start()
        except Exception:
            self._master.kill()
            raise

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def url(self, **fields: object) -> str:
        """The store URL; `fields` add query fields (e.g. global_segment_size=0: the pool holds everything)."""
        extra = "".join(f"&{name}={value}" for name, value in fields.items())
        return f"mooncake://127.0.0.1:{self.rpc_port}?metadata={self.metadata_url}{extra}"

    def kill(self) -> None:
        """Kills the master (the pool process stays and remounts its memory when a master comes back)."""
        self._master.kill()

    def restart(self) -> None:
        self._master.kill()
        self._master.start()
        wait_port(self.metadata_port, self._master.process)  # type: ignore[arg-type]

    def stop(self) -> None:
        self._pool.kill()
        self._master.kill()
