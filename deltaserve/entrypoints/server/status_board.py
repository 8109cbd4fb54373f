"""`StatusBoard`: what `/status.json` says, computed from state the API process holds (no call to the engine).

Sources: the server's `ServerMetrics` (latency windows, finished sequences and tokens, errors by kind, the last engine
stats snapshot) and a history of samples taken every `interval_s` by the status router's background task.

The JSON (`schema: deltaserve.status/1`) is made to be merged by a router over several instances: `totals` are
cumulative counters and `now` has raw gauges (running, waiting, blocks and slots used and total), all of which add up;
the ratios next to them are recomputed from the sums; latency percentiles do not add up, so each latency also carries
a histogram over fixed bounds (`histogram_bounds`) that does; `history` columns are aligned on wall-clock `t`.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltaserve.engine.stats import EngineStats
from deltaserve.entrypoints.server.metrics import ServerMetrics
from deltaserve.entrypoints.server.rolling import HISTOGRAM_BOUNDS

SCHEMA = "deltaserve.status/1"
RATE_WINDOW_S = 10.0
"""Output tokens/s in `now` is the rate over about this many seconds of history."""


@dataclass(frozen=True, slots=True)
class _Sample:
    """One tick of the history: cumulative counters (for rates) and the values charted."""

    t: float
    """Wall-clock time (Unix seconds)."""
    generation_tokens: int
    prefix_queried: int
    prefix_hits: int
    spec_draft_tokens: int
    spec_accepted: int
    errors: int
    row: dict[str, float | None]
    """The charted values at `t` that are not rates."""


def _spec(stats: EngineStats | None, name: str) -> int | None:
    """A spec-decode counter of the engine stats, None when the engine has none (older `EngineStats`)."""
    return None if stats is None else getattr(stats, name, None)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


class StatusBoard:
    """The status page's numbers for one server; `sample()` is called every `interval_s` seconds."""

    def __init__(self, metrics: ServerMetrics, *, model_name: str, version: str, interval_s: float = 2.0,
                 history_len: int = 300, clock: Callable[[], float] = time.time) -> None:
        self.metrics = metrics
        self.model_name = model_name
        self.version = version
        self.interval_s = interval_s
        self._clock = clock
        self._history: collections.deque[_Sample] = collections.deque(maxlen=history_len)

    @property
    def stats(self) -> EngineStats | None:
        return self.metrics.engine.snapshot.stats

    def _generation_tokens(self) -> int:
        # The engine counts tokens as each step makes them (a smooth rate); the API process only when a sequence
        # ends. The engine's count is used once it has sent one.
        stats = self.stats
        if stats is not None and stats.generation_tokens:
            return stats.generation_tokens
        return self.metrics.generation_tokens_total

    def _latency(self) -> dict[str, dict[str, Any]]:
        return {"ttft": self.metrics.ttft_window.summary(), "itl": self.metrics.itl_window.summary()}

    def _gauges(self, latency: dict[str, dict[str, Any]]) -> dict[str, float | None]:
        s = self.stats
        ttft, itl = latency["ttft"], latency["itl"]
        row: dict[str, float | None] = {f"ttft_p{q}": ttft[f"p{q}"] for q in (50, 90, 99)}
        row.update({f"itl_p{q}": itl[f"p{q}"] for q in (50, 90, 99)})
        row["running"] = None if s is None else s.num_running
        row["waiting"] = None if s is None else s.num_waiting
        row["kv_usage"] = None if s is None else _ratio(s.kv_blocks_used, s.kv_blocks_total)
        row["slot_usage"] = None if s is None else _ratio(s.state_slots_used, s.state_slots_total)
        return row

    def _take(self, latency: dict[str, dict[str, Any]]) -> _Sample:
        s = self.stats
        return _Sample(t=self._clock(), generation_tokens=self._generation_tokens(),
                       prefix_queried=0 if s is None else s.prefix_queried_tokens,
                       prefix_hits=0 if s is None else s.prefix_hit_tokens,
                       spec_draft_tokens=_spec(s, "spec_num_draft_tokens") or 0,
                       spec_accepted=_spec(s, "spec_num_accepted_tokens") or 0,
                       errors=sum(self.metrics.errors_by_kind.values()), row=self._gauges(latency))

    def sample(self) -> None:
        """Append one history point (the background task calls this every `interval_s`)."""
        self._history.append(self._take(self._latency()))

    def _rates(self, prev: _Sample | None, cur: _Sample) -> dict[str, float | None]:
        if prev is None or cur.t <= prev.t:
            return {"tokens_per_s": None, "prefix_hit_rate": None, "spec_acceptance": None, "errors_per_s": None}
        dt = cur.t - prev.t
        return {"tokens_per_s": max(cur.generation_tokens - prev.generation_tokens, 0) / dt,
                "prefix_hit_rate": _ratio(cur.prefix_hits - prev.prefix_hits, cur.prefix_queried - prev.prefix_queried),
                "spec_acceptance": _ratio(cur.spec_accepted - prev.spec_accepted,
                                          cur.spec_draft_tokens - prev.spec_draft_tokens),
                "errors_per_s": max(cur.errors - prev.errors, 0) / dt}

    def history(self) -> dict[str, list[float | None]]:
        """Columns over the history, oldest first: `t`, the charted gauges and per-interval rates."""
        columns: dict[str, list[float | None]] = collections.defaultdict(list)
        prev: _Sample | None = None
        for cur in self._history:
            columns["t"].append(cur.t)
            for key, value in {**cur.row, **self._rates(prev, cur)}.items():
                columns[key].append(value)
            prev = cur
        return dict(columns)

    def _rate_base(self, now: float) -> _Sample | None:
        """The oldest history sample within `RATE_WINDOW_S` of `now` (or the newest before it)."""
        base = None
        for sample in reversed(self._history):
            base = sample
            if sample.t <= now - RATE_WINDOW_S:
                break
        return base

    def to_json(self, *, engine_alive: bool) -> dict[str, Any]:
        """The `/status.json` body (see the module docstring)."""
        m, s = self.metrics, self.stats
        latency = self._latency()
        cur = self._take(latency)
        rates = self._rates(self._rate_base(cur.t), cur)
        now: dict[str, Any] = {
            "running": None if s is None else s.num_running,
            "waiting": None if s is None else s.num_waiting,
            "kv_blocks_used": None if s is None else s.kv_blocks_used,
            "kv_blocks_total": None if s is None else s.kv_blocks_total,
            "state_slots_used": None if s is None else s.state_slots_used,
            "state_slots_total": None if s is None else s.state_slots_total,
            "kv_usage": cur.row["kv_usage"],
            "slot_usage": cur.row["slot_usage"],
            "tokens_per_s": rates["tokens_per_s"],
        }
        queried = 0 if s is None else s.prefix_queried_tokens
        hits = 0 if s is None else s.prefix_hit_tokens
        totals: dict[str, Any] = {
            "sequences_finished": sum(m.finished_by_reason.values()),
            "finished_by_reason": dict(sorted(m.finished_by_reason.items())),
            "prompt_tokens": m.prompt_tokens_total,
            "generation_tokens": m.generation_tokens_total,
            "errors": sum(m.errors_by_kind.values()),
            "errors_by_kind": dict(sorted(m.errors_by_kind.items())),
            "prefix_queried_tokens": queried,
            "prefix_hit_tokens": hits,
            "prefix_hit_rate": _ratio(hits, queried),
            "preemptions": None if s is None else s.num_preemptions,
        }
        spec = {name: _spec(s, f"spec_{name}") for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        if spec["num_draft_tokens"]:  # an engine with spec-decode counters that has proposed tokens
            totals["spec_decode"] = {**spec, "acceptance_rate": _ratio(spec["num_accepted_tokens"] or 0,
                                                                       spec["num_draft_tokens"] or 0)}
        return {
            "schema": SCHEMA,
            "model": self.model_name,
            "version": self.version,
            "time": cur.t,
            "started": m.started,
            "uptime_s": cur.t - m.started,
            "engine_alive": engine_alive,
            "engine_stats_age_s": m.engine.snapshot.age_s,
            "interval_s": self.interval_s,
            "latency_window_s": m.ttft_window.window_s,
            "histogram_bounds": list(HISTOGRAM_BOUNDS),
            "now": now,
            "totals": totals,
            "latency": latency,
            "history": self.history(),
        }
