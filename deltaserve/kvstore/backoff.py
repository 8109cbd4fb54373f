"""When to try a failing store again: skip it for a back-off after a failure, then let one call probe it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


class Backoff:
    """The store's availability. Logs once per outage (a warning when it starts, an info line when it ends); the
    failed probes in between log at debug level only. Thread-safe."""

    def __init__(self, name: str, backoff_s: float, max_backoff_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._name = name
        self._base = backoff_s
        self._max = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._delay = backoff_s
        self._retry_at = 0.0
        self.outages = 0

    @property
    def available(self) -> bool:
        return self._down_since is None

    def allow(self) -> bool:
        """Whether a call may go to the store now: always while it is up; during an outage, one caller (the probe)
        once the back-off has run out, the others are skipped until that probe's result or the next back-off."""
        with self._lock:
            if self._down_since is None:
                return True
            now = self._clock()
            if now < self._retry_at:
                return False
            self._retry_at = now + self._delay  # the probe's own slot: concurrent callers keep skipping
            return True

    def failed(self, cause: str) -> None:
        """A call to the store failed (an error or a timeout): start or extend the outage."""
        with self._lock:
            now = self._clock()
            if self._down_since is None:
                self._down_since = now
                self._delay = self._base
                self.outages += 1
                logger.warning("shared KV store %s unavailable (%s): skipped for %.3g s, then retried; requests "
                               "recompute meanwhile", self._name, cause, self._delay)
            else:
                self._delay = min(self._delay * 2, self._max)
                logger.debug("shared KV store %s still unavailable (%s): next try in %.3g s", self._name, cause,
                             self._delay)
            self._retry_at = now + self._delay

    def succeeded(self) -> None:
        """A call reached the store and it answered: end the outage, if any."""
        if self._down_since is None:  # the common case, without the lock
            return
        with self._lock:
            if self._down_since is not None:
                logger.info("shared KV store %s available again after %.1f s", self._name,
                            self._clock() - self._down_since)
                self._down_since = None
                self._delay = self._base
