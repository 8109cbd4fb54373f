"""`BoundedCaller`: a call's result or exception, or a timeout; and a failed call leaves nothing of its caller alive."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from deltaserve.kvstore.bounded import BoundedCaller, CallTimeout


class _Engine:
    """Stands for what calls the store (an engine holding gigabytes of cache)."""


def _fail() -> None:
    raise ConnectionError("store gone")


def _call_from(owner: _Engine, caller: BoundedCaller) -> None:
    """A frame that holds `owner`, as the engine's frames do when they call the store."""
    assert owner is not None
    caller.call(5.0, _fail)


def test_result_exception_and_timeout() -> None:
    caller = BoundedCaller("t", workers=2)
    release = threading.Event()
    try:
        assert caller.call(5.0, lambda x: x + 1, 1) == 2
        with pytest.raises(ConnectionError):
            caller.call(5.0, _fail)
        with pytest.raises(CallTimeout):
            caller.call(0.05, release.wait)  # the worker stays blocked until the event is set
    finally:
        release.set()
        caller.shutdown()


def test_a_failed_call_does_not_keep_its_callers_frames_alive() -> None:
    """The failed call's exception carries a traceback through the caller's frames; an idle worker once kept its
    last job, and with it that traceback: an engine whose store had failed was never freed (2 GiB per test in CI)."""
    caller = BoundedCaller("t", workers=1)
    try:
        owner = _Engine()
        alive = weakref.ref(owner)
        with pytest.raises(ConnectionError):
            _call_from(owner, caller)
        del owner
        # No further call: the worker sits idle after the failed one (a later job would have replaced the old one
        # and hidden the leak). It drops the job right after handing over the exception; wait for that, bounded.
        deadline = time.monotonic() + 30
        while (gc.collect(), alive())[1] is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alive() is None
    finally:
        caller.shutdown()
