"""Blocking calls with a deadline: a backend call runs on a daemon worker thread and the caller waits at most the
timeout. A call that overruns keeps its worker (C++ code cannot be interrupted) until it returns by itself; the
caller has gone on, and the store is skipped for its back-off, so stuck calls do not pile up."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

T = TypeVar("T")


class CallTimeout(Exception):
    """A call ran past its timeout (it may still complete later, unobserved)."""


class BoundedCaller:
    """A few daemon worker threads (daemon: a call stuck in C++ does not hold up the interpreter's exit)."""

    def __init__(self, name: str, workers: int = 4) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def call(self, timeout_s: float, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a worker: its result or exception, or CallTimeout after `timeout_s` (a call still queued
        then is dropped, never run)."""
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        try:
            return future.result(timeout=timeout_s)
        except FutureTimeout:
            future.cancel()
            raise CallTimeout(f"no answer within {timeout_s:g} s") from None

    def shutdown(self) -> None:
        """Lets idle workers exit (a stuck one exits when its call returns)."""
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(*job)
            # An idle worker must not keep its last job: a failed call's future holds the exception, whose traceback
            # holds the caller's frames and through them whatever called the store (an engine and its caches).
            del job

    @staticmethod
    def _run(future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to the caller, if it still waits
            future.set_exception(exc)
