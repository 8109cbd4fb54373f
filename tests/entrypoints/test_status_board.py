"""`RollingWindow` and `StatusBoard` on a controlled clock: percentiles and expiry of the latency window, rates and
ratios of the history, spec-decode counters read when the engine stats have them, the mergeable histogram."""

from __future__ import annotations

import types

import pytest

from deltaserve.engine.stats import EngineStats
from deltaserve.entrypoints.server.metrics import ServerMetrics
from deltaserve.entrypoints.server.rolling import HISTOGRAM_BOUNDS, RollingWindow, percentile
from deltaserve.entrypoints.server.status_board import SCHEMA, StatusBoard


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def engine_stats(**kw: int) -> EngineStats:
    base = dict(num_running=0, num_waiting=0, kv_blocks_used=0, kv_blocks_total=100, state_slots_used=0,
                state_slots_total=8, prefix_queried_tokens=0, prefix_hit_tokens=0, num_preemptions=0, steps=0)
    return EngineStats(**{**base, **kw})


def test_percentile_matches_numpy_linear_rule():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4 + 0.6 * 6)
    assert percentile([7.0], 99) == 7.0


def test_rolling_window_forgets_old_samples_and_buckets_the_rest():
    clock = Clock()
    window = RollingWindow(10.0, clock=clock)
    window.add(5.0)
    clock.t += 6
    for v in (0.001, 0.002, 0.003):
        window.add(v)
    summary = window.summary()
    assert summary["count"] == 4 and summary["p99"] == pytest.approx(5.0 - 0.03 * (5.0 - 0.003))
    clock.t += 5  # the 5 s sample is now 11 s old
    summary = window.summary()
    assert summary["count"] == 3 and summary["p50"] == pytest.approx(0.002)
    counts = summary["histogram"]
    assert len(counts) == len(HISTOGRAM_BOUNDS) + 1 and sum(counts) == 3
    for v in (0.001, 0.002, 0.003):  # each sample lies in the bucket whose upper bound is the first >= it
        i = next(i for i, bound in enumerate(HISTOGRAM_BOUNDS) if v <= bound)
        assert counts[i] >= 1 and (i == 0 or HISTOGRAM_BOUNDS[i - 1] < v)
    clock.t += 100
    assert window.summary()["p50"] is None


def test_status_board_counts_rates_and_ratios():
    clock = Clock()
    metrics = ServerMetrics("m")
    board = StatusBoard(metrics, model_name="m", version="9", clock=clock)
    assert board.to_json(engine_alive=True)["now"]["running"] is None  # no engine snapshot yet
    metrics.engine.snapshot.set(engine_stats(generation_tokens=100, prefix_queried_tokens=50, prefix_hit_tokens=10))
    board.sample()
    clock.t += 2
    metrics.observe_finished("length", prompt_tokens=7, generated=30, ttft=0.25, e2e=1.0)
    metrics.observe_finished("stop", prompt_tokens=0, generated=4, ttft=0.5, e2e=1.0)
    metrics.observe_itl(0.01)
    metrics.observe_http("/v1/chat/completions", 400)
    metrics.observe_http("/v1/chat/completions", 500)
    metrics.observe_http("/v1/chat/completions", 200)
    metrics.engine.snapshot.set(engine_stats(num_running=3, num_waiting=1, kv_blocks_used=25, state_slots_used=2,
                                             generation_tokens=160, prefix_queried_tokens=150, prefix_hit_tokens=85))
    board.sample()
    status = board.to_json(engine_alive=True)
    assert status["schema"] == SCHEMA and status["model"] == "m" and status["engine_alive"] is True
    assert status["now"] == {"running": 3, "waiting": 1, "kv_blocks_used": 25, "kv_blocks_total": 100,
                             "state_slots_used": 2, "state_slots_total": 8, "kv_usage": 0.25, "slot_usage": 0.25,
                             "tokens_per_s": 30.0}  # 60 engine tokens over the 2 s since the first sample
    totals = status["totals"]
    assert totals["sequences_finished"] == 2 and totals["finished_by_reason"] == {"length": 1, "stop": 1}
    assert totals["generation_tokens"] == 34 and totals["prompt_tokens"] == 7
    assert totals["errors"] == 2 and totals["errors_by_kind"] == {"bad_request": 1, "internal": 1}
    assert totals["prefix_hit_rate"] == pytest.approx(85 / 150)
    assert "spec_decode" not in totals  # this engine reports no proposed tokens
    assert status["latency"]["ttft"]["count"] == 2 and status["latency"]["ttft"]["p50"] == pytest.approx(0.375)
    history = status["history"]
    assert history["t"] == [1000.0, 1002.0] and history["running"] == [0, 3]
    assert history["tokens_per_s"] == [None, 30.0]
    assert history["prefix_hit_rate"] == [None, pytest.approx(75 / 100)]  # of the interval, not since start
    assert history["errors_per_s"] == [None, 1.0]
    assert history["spec_acceptance"] == [None, None]


def test_status_board_reads_spec_decode_counters_when_present():
    clock = Clock()
    metrics = ServerMetrics("m")
    board = StatusBoard(metrics, model_name="m", version="9", clock=clock)
    fields = {f: getattr(engine_stats(), f) for f in EngineStats.__dataclass_fields__}

    def with_spec(drafts: int, draft_tokens: int, accepted: int) -> types.SimpleNamespace:
        # Stands in for the engine's stats record once it carries spec-decode counters (read with getattr).
        return types.SimpleNamespace(**{**fields, "spec_num_drafts": drafts, "spec_num_draft_tokens": draft_tokens,
                                        "spec_num_accepted_tokens": accepted})

    metrics.engine.snapshot.set(with_spec(0, 0, 0))  # type: ignore[arg-type]
    board.sample()
    clock.t += 2
    metrics.engine.snapshot.set(with_spec(10, 40, 30))  # type: ignore[arg-type]
    board.sample()
    status = board.to_json(engine_alive=True)
    assert status["totals"]["spec_decode"] == {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 30,
                                               "acceptance_rate": 0.75}
    assert status["history"]["spec_acceptance"] == [None, 0.75]
