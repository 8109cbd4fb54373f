"""`RollingWindow`: the latency samples of the last `window_s` seconds, for the percentiles of the status page.

Prometheus histograms (metrics.py) are cumulative since start-up; the status page wants "TTFT p99 over the last
minute". Samples are kept exactly (bounded by `max_samples`, oldest dropped first) so one instance's percentiles are
exact; `histogram` buckets the same samples on fixed log-spaced bounds, which a router can add up across instances to
compute merged percentiles (percentiles themselves do not merge).
"""

from __future__ import annotations

import bisect
import collections
import math
import time
from collections.abc import Callable

HISTOGRAM_BOUNDS: tuple[float, ...] = tuple(round(0.0001 * 2 ** (i / 4), 7) for i in range(80))
"""Upper bounds (seconds) of the mergeable histogram: 0.1 ms to ~100 s, four buckets per doubling (a merged
percentile is off by at most 19%); samples above the last bound fall in a final +Inf bucket."""


def percentile(sorted_values: list[float], q: float) -> float:
    """The q-th percentile (0-100) of sorted values by linear interpolation between closest ranks (numpy's
    default); the list must not be empty."""
    rank = (len(sorted_values) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)


class RollingWindow:
    """Timestamped samples of one latency, those older than `window_s` forgotten."""

    def __init__(self, window_s: float = 60.0, *, max_samples: int = 20_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._samples: collections.deque[tuple[float, float]] = collections.deque(maxlen=max_samples)

    def add(self, value: float) -> None:
        self._samples.append((self._clock(), value))

    def values(self) -> list[float]:
        """The samples of the window, oldest first."""
        horizon = self._clock() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        return [v for _, v in self._samples]

    def summary(self) -> dict[str, object]:
        """count, p50 / p90 / p99 (seconds; None when the window is empty) and the mergeable histogram."""
        values = sorted(self.values())
        counts = [0] * (len(HISTOGRAM_BOUNDS) + 1)
        for v in values:
            counts[bisect.bisect_left(HISTOGRAM_BOUNDS, v)] += 1
        out: dict[str, object] = {"count": len(values)}
        for q in (50, 90, 99):
            out[f"p{q}"] = percentile(values, q) if values else None
        out["histogram"] = counts
        return out
