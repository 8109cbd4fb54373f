"""`MultiprocExecutor`: one worker process per rank, joined to the engine core by a pipe each.

Every call is pickled once and broadcast to all ranks (the scheduler output, each step); every rank answers, rank 0
with the result (the sampled tokens), the others with an acknowledgement, so that a failure on any rank is seen.
While waiting the executor also watches each worker's process sentinel: a worker that dies raises
`WorkerDiedError` with its exit status instead of hanging. A worker exits when its pipe closes (the engine is gone).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

from deltaserve.config import EngineConfig
from deltaserve.executor.base import BroadcastExecutor, WorkerDiedError, WorkerInfo
from deltaserve.utils.ports import free_port

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
"""How long `shutdown` waits for a worker to exit by itself before killing it."""


class WorkerError(RuntimeError):
    """A worker raised while running a call (the worker lives on); `.traceback` has the worker's traceback."""

    def __init__(self, message: str, traceback: str = "") -> None:
        super().__init__(message)
        self.traceback = traceback


class MultiprocExecutor(BroadcastExecutor):
    """`world_size` worker processes (spawned), each loading the model; the engine core talks to them by pipe."""

    def __init__(self, config: EngineConfig) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.world_size = config.parallel.world_size
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._closed = False
        self._broken: str | None = None
        """Why the workers can no longer be used (a worker died); `shutdown` still stops the others."""
        log_level = logging.getLogger("deltaserve").getEffectiveLevel()
        init_method = f"tcp://127.0.0.1:{free_port()}" if self.world_size > 1 else None
        with _allow_children():
            for rank in range(self.world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=run_worker, args=(config, rank, child, log_level, init_method),
                                   name=f"deltaserve-worker-{rank}", daemon=True)
                proc.start()
                child.close()  # only the worker holds its end: its exit closes the pipe
                self._procs.append(proc)
                self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _kill, list(self._procs))
        try:
            self._infos: list[WorkerInfo] = self._gather()
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d worker process(es) ready: pids %s", self.world_size, [p.pid for p in self._procs])

    # -- the Executor protocol -----------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Ask every worker to exit, wait for it, kill it if it does not. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(("shutdown", ())))
        for proc in self._procs:
            proc.join(SHUTDOWN_TIMEOUT_S)
        for conn in self._conns:
            conn.close()
        self._finalizer()

    @property
    def pids(self) -> list[int | None]:
        """The worker process ids, by rank."""
        return [p.pid for p in self._procs]

    # -- internals -----------------------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any) -> Any:
        """Broadcast one call; rank 0's result once every rank has answered."""
        if self._closed or self._broken is not None:
            raise WorkerDiedError(self._broken or "the workers were shut down")
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError as e:  # the worker closed its end: it is gone
                raise self._died(rank) from e
        return self._gather()[0]

    def _gather(self) -> list[Any]:
        """One answer per rank, in rank order. Every rank's answer is read before a failing rank's WorkerError is
        raised, so the next call's answers are not mistaken for this one's; WorkerDiedError at once."""
        results, error = [], None
        for rank in range(self.world_size):
            status, value, trace = self._receive(rank)
            if status == "error" and error is None:
                error = WorkerError(f"worker {rank}: {value}", trace)
            results.append(value)
        if error is not None:
            raise error
        return results

    def _receive(self, rank: int) -> tuple[str, Any, str]:
        conn, proc = self._conns[rank], self._procs[rank]
        while True:
            ready = multiprocessing.connection.wait([conn, proc.sentinel])
            if conn in ready:
                try:
                    return pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):  # closed, or reset by the worker's death: report its exit status
                    raise self._died(rank) from None
            if proc.sentinel in ready and not conn.poll():
                raise self._died(rank)

    def _died(self, rank: int) -> WorkerDiedError:
        proc = self._procs[rank]
        proc.join(5)
        self._broken = f"worker process {rank} (pid {proc.pid}) died with exit status {proc.exitcode}"
        return WorkerDiedError(self._broken)


def run_worker(config: EngineConfig, rank: int, conn: multiprocessing.connection.Connection, log_level: int,
               distributed_init_method: str | None = None) -> None:
    """Entry point of a worker process: build the `Worker`, answer calls until shutdown or until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the engine decides
    if not logging.getLogger().handlers:
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: %(message)s")
    try:
        from deltaserve.executor.worker import Worker  # torch and the model stack: import errors are reported too

        worker = Worker(config, rank, distributed_init_method)
        _reply(conn, "ok", worker.describe())
    except Exception as e:
        logger.exception("worker %d start-up failed", rank)
        _reply(conn, "error", f"{type(e).__name__}: {e}", traceback.format_exc())
        return
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except EOFError:  # the engine is gone
            return
        if method == "shutdown":
            worker.close()
            return
        try:
            result = getattr(worker, method)(*args)
        except Exception as e:  # the step failed on this rank; the engine decides what that ends
            logger.exception("worker %d: %s failed", rank, method)
            _reply(conn, "error", f"{type(e).__name__}: {e}", traceback.format_exc())
            continue
        _reply(conn, "ok", result if rank == 0 else None)


def _reply(conn: multiprocessing.connection.Connection, status: str, value: Any, trace: str = "") -> None:
    conn.send_bytes(pickle.dumps((status, value, trace), protocol=pickle.HIGHEST_PROTOCOL))


@contextlib.contextmanager
def _allow_children() -> Iterator[None]:
    """Let a daemonic process (the server's engine process is one) start worker processes: multiprocessing refuses
    because a daemon's children would outlive it, but ours exit when their pipe to the engine closes."""
    config = multiprocessing.current_process()._config  # type: ignore[attr-defined]
    daemon = config.pop("daemon", None)
    try:
        yield
    finally:
        if daemon is not None:
            config["daemon"] = daemon


def _kill(procs: list[multiprocessing.process.BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        if proc.pid is not None:
            proc.join(5)
