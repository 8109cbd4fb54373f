"""Prometheus metrics of the API process (`GET /metrics`), with vLLM's metric names under a `deltaserve:` prefix.

Request latencies are observed here, where the tokens reach the client; engine gauges and counters (queue
lengths, pool usage, prefix-cache tokens, preemptions) come from the engine's latest stats snapshot, read at
scrape time. Each server owns its registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


class _EngineStatsCollector:
    """Exposes the last engine stats snapshot (set before each scrape) as gauges and counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: Any = None

    def collect(self):  # noqa: ANN201 - prometheus collector protocol
        s = self.stats
        if s is None:
            return
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"deltaserve:{name}", doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"deltaserve:{name}", doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Requests holding cache memory in the engine.", s.num_running)
        yield gauge("num_requests_waiting", "Requests queued in the engine.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Share of MLA KV blocks held by requests (0-1).",
                    s.kv_blocks_used / max(s.kv_blocks_total, 1))
        yield gauge("state_slot_usage_perc", "Share of KDA state slots held by requests (0-1).",
                    s.state_slots_used / max(s.state_slots_total, 1))
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_queried_tokens)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_hit_tokens)
        yield counter("num_preemptions", "Requests preempted by the scheduler.", s.num_preemptions)


class ServerMetrics:
    """The metrics one server exposes; `registry` is what /metrics renders."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self._model = model_name
        self.requests = Counter("deltaserve:http_requests", "HTTP requests by route and status code.",
                                ["model_name", "route", "status"], registry=self.registry)
        self.finished = Counter("deltaserve:request_success", "Finished output sequences by finish reason.",
                                ["model_name", "finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("deltaserve:prompt_tokens", "Prompt tokens of accepted requests.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("deltaserve:generation_tokens", "Generated tokens.", labels,
                                         registry=self.registry)
        self.ttft = Histogram("deltaserve:time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("deltaserve:inter_token_latency_seconds", "Time between consecutive token deliveries.",
                             labels, buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("deltaserve:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.engine = _EngineStatsCollector(model_name)
        self.registry.register(self.engine)

    def observe_http(self, route: str, status: int) -> None:
        self.requests.labels(self._model, route, str(status)).inc()

    def observe_finished(self, reason: str, *, prompt_tokens: int, generated: int, ttft: float | None,
                         e2e: float) -> None:
        self.finished.labels(self._model, reason).inc()
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)
        self.generation_tokens.labels(self._model).inc(generated)
        if ttft is not None:
            self.ttft.labels(self._model).observe(ttft)
        self.e2e.labels(self._model).observe(e2e)

    def observe_itl(self, seconds: float) -> None:
        self.itl.labels(self._model).observe(seconds)
