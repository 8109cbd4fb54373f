"""When `bench serve` sends each request: vLLM's gamma arrival process (burstiness, an infinite rate, ramp-up)."""

from __future__ import annotations

import numpy as np


def request_rates(n: int, rate: float, ramp_up: tuple[str, float, float] | None = None) -> np.ndarray:
    """The arrival rate at each request: `rate`, or vLLM's ramp-up from start to end over the request index
    (linear, or exponential: start * (end / start) ** progress)."""
    if ramp_up is None:
        return np.full(n, rate)
    strategy, start, end = ramp_up
    progress = np.arange(n) / max(n - 1, 1)
    return start + (end - start) * progress if strategy == "linear" else start * (end / start) ** progress


def arrival_delays(n: int, rate: float, burstiness: float, seed: int,
                   ramp_up: tuple[str, float, float] | None = None) -> list[float]:
    """vLLM's send times (s after the start): gamma gaps (shape = burstiness, mean 1 / the request's rate),
    cumulated; without ramp-up rescaled so that the last request departs at exactly n / rate. All zeros for an
    infinite rate."""
    rates = request_rates(n, rate, ramp_up)
    if np.isinf(rates).all():
        return [0.0] * n
    if burstiness == float("inf"):
        gaps = 1.0 / rates
    else:
        gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rates * burstiness))
    cum = np.cumsum(gaps)
    if ramp_up is None and cum[-1] > 0:
        cum = cum * (n / rate) / cum[-1]
    return cum.tolist()
