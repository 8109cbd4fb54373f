"""Prometheus metrics of the API process (`GET /metrics`), with vLLM's metric names under a `deltaserve:` prefix.

Request latencies are observed here, where the tokens reach the client; engine gauges and counters (queue
lengths, pool usage, prefix-cache tokens, preemptions) come from the last engine stats snapshot the API process
holds (`EngineStatsSnapshot`): a scrape waits a moment for a fresh one and otherwise serves the last, so it never
waits for a long engine step (`deltaserve:engine_stats_age_seconds` says how old it is). Every HTTP answer of 400 or
more, unhandled 500s included, is also counted by kind in `deltaserve:request_errors`. With data parallelism the
engine metrics are the replicas' sums and `deltaserve:dp_replica_*` describe each replica. Each server owns its
registry, so several apps can live in one process (tests).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from deltaserve.engine.stats import EngineStats
from deltaserve.entrypoints.server.rolling import RollingWindow

logger = logging.getLogger(__name__)

ERROR_KINDS = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
               408: "request_timeout", 413: "request_too_large", 422: "invalid_request", 429: "rate_limited",
               499: "client_disconnected", 500: "internal", 503: "unavailable", 504: "timeout"}
"""The `kind` label of `deltaserve:request_errors` by HTTP status (others: `http_<status>`)."""

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


class EngineStatsSnapshot:
    """The last `EngineStats` the API process got from the engine, and when (`time.monotonic()`).

    `refresh` asks the engine for a fresh snapshot but waits at most `wait_s`: the engine answers only between two
    steps, so during a long step the caller gets the last snapshot instead of waiting. At most one question is in
    flight; callers that come meanwhile share it, so a frozen engine does not collect a pile of them.
    """

    def __init__(self) -> None:
        self.stats: EngineStats | None = None
        self.updated_at: float | None = None
        self._pending: asyncio.Future[EngineStats] | None = None

    def set(self, stats: EngineStats) -> None:
        self.stats, self.updated_at = stats, time.monotonic()

    @property
    def age_s(self) -> float | None:
        """Seconds since the snapshot was taken (None before the first)."""
        return None if self.updated_at is None else time.monotonic() - self.updated_at

    async def refresh(self, fetch: Callable[[], Awaitable[EngineStats]], wait_s: float) -> EngineStats | None:
        """Start (or join) a `fetch` of fresh stats, wait for it at most `wait_s` seconds, return the latest
        snapshot (None while the engine never answered). Errors of `fetch` (a dead engine) are logged, not raised."""
        if self._pending is None:
            self._pending = asyncio.ensure_future(fetch())
            self._pending.add_done_callback(self._fetched)
        try:
            await asyncio.wait_for(asyncio.shield(self._pending), wait_s)
        except Exception:  # noqa: BLE001 - timeout (a long step) or a dead engine: the last snapshot will do
            pass
        return self.stats

    def _fetched(self, future: asyncio.Future[EngineStats]) -> None:
        self._pending = None
        if future.cancelled():
            return
        if future.exception() is not None:
            logger.debug("engine stats unavailable: %s", future.exception())
            return
        self.set(future.result())


class _EngineStatsCollector:
    """Exposes the last engine stats snapshot as gauges and counters."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.snapshot = EngineStatsSnapshot()

    @property
    def stats(self) -> Any:
        return self.snapshot.stats

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
        yield counter("host_cache_hits", "Prompt tokens of prefix hits that needed the host tier (L2).",
                      s.host_hit_tokens)
        yield counter("host_cache_demoted_bytes", "Bytes copied from device caches to the host tier, per rank.",
                      s.host_demoted_bytes)
        yield counter("host_cache_promoted_bytes", "Bytes copied from the host tier back to the device, per rank.",
                      s.host_promoted_bytes)
        yield counter("host_cache_copy_seconds", "Time spent copying to and from the host tier.", s.host_copy_seconds)
        yield counter("shared_cache_fetches", "Entries fetched from the shared store (L3) into the host tier.",
                      s.shared_fetched)
        yield counter("shared_cache_fetch_failures",
                      "Shared-store fetches that failed (missing, corrupt, store down): the request recomputes.",
                      s.shared_fetch_failures)
        yield from _shared_store_counters(s, labels)
        yield counter("num_preemptions", "Requests preempted by the scheduler.", s.num_preemptions)
        yield gauge("engine_stats_age_seconds", "Age of the engine stats snapshot these engine metrics come from.",
                    self.snapshot.age_s or 0.0)
        yield from _spec_decode_counters(s, labels)
        yield from _kv_transfer_counters(s, labels)
        yield counter("encoder_cache_queries", "Image lookups in the encoder cache (one per image per step that "
                      "computes some of its placeholder tokens).", s.encoder_cache_hits + s.images_encoded)
        yield counter("encoder_cache_hits", "Image lookups the encoder cache answered (the vision tower not run).",
                      s.encoder_cache_hits)
        yield counter("images_encoded", "Images the vision tower ran on.", s.images_encoded)
        yield counter("encoder_seconds", "Time in the vision tower and projector.", s.encoder_seconds)


class ReplicaCollector:
    """Per data-parallel replica: alive, requests in flight, requests routed (`DPEngineClient.replica_status`)."""

    def __init__(self, model_name: str, replicas: Callable[[], Sequence[dict[str, Any]]]) -> None:
        self.model_name = model_name
        self.replicas = replicas

    def collect(self):  # noqa: ANN201 - prometheus collector protocol
        labels = ["model_name", "replica"]
        alive = GaugeMetricFamily("deltaserve:dp_replica_alive", "1 while the replica's engine process runs.",
                                  labels=labels)
        in_flight = GaugeMetricFamily("deltaserve:dp_replica_requests_in_flight",
                                      "Requests the router sent to the replica that have not ended.", labels=labels)
        routed = CounterMetricFamily("deltaserve:dp_replica_requests_routed", "Requests the router sent to the "
                                     "replica.", labels=labels)
        for r in self.replicas():
            key = [self.model_name, str(r["replica"])]
            alive.add_metric(key, 1.0 if r["alive"] else 0.0)
            in_flight.add_metric(key, r["in_flight"])
            routed.add_metric(key, r["routed"])
        yield from (alive, in_flight, routed)


def _spec_decode_counters(s: Any, labels: list[str]):  # noqa: ANN202 - yields metric families
    """vLLM's spec-decode counters. Always exposed (vLLM registers them only with speculative decoding on), so a
    dashboard reads 0 rather than no data."""
    for name, doc, value in (
        ("spec_decode_num_drafts", "Request-steps that verified proposed tokens.", s.spec_num_drafts),
        ("spec_decode_num_draft_tokens", "Proposed tokens verified.", s.spec_num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Proposed tokens accepted.", s.spec_num_accepted_tokens),
        ("spec_decode_adaptive_steps", "Steps adaptive verification decided.", s.spec_adaptive_steps),
        ("spec_decode_adaptive_offered_positions", "Draft positions offered to adaptive verification.",
         s.spec_adaptive_offered_positions),
        ("spec_decode_adaptive_verified_positions", "Draft positions adaptive verification kept.",
         s.spec_adaptive_verified_positions),
        ("spec_decode_adaptive_draft_off_steps", "Steps after which adaptive verification turned drafting off.",
         s.spec_adaptive_draft_off_steps),
    ):
        c = CounterMetricFamily(f"deltaserve:{name}", doc, labels=["model_name"])
        c.add_metric(labels, value)
        yield c
    per_pos = CounterMetricFamily("deltaserve:spec_decode_num_accepted_tokens_per_pos",
                                  "Accepted proposed tokens by position in the draft.",
                                  labels=["model_name", "position"])
    for position, value in enumerate(s.spec_accepted_per_pos):
        per_pos.add_metric([*labels, str(position)], value)
    yield per_pos


def _shared_store_counters(s: Any, labels: list[str]):  # noqa: ANN202 - yields metric families
    """The shared store (L3) as rank 0 sees it: calls that reached it, hits, bytes and time each way, failures."""
    for name, doc, value in (
        ("shared_cache_gets", "Shared-store gets that reached the store (rank 0).", s.shared_gets),
        ("shared_cache_get_hits", "Shared-store gets that returned a whole, checked entry.", s.shared_get_hits),
        ("shared_cache_get_bytes", "Payload bytes read from the shared store.", s.shared_get_bytes),
        ("shared_cache_get_seconds", "Time in shared-store gets (mean latency: over shared_cache_gets).",
         s.shared_get_seconds),
        ("shared_cache_puts", "Entries written to the shared store (write-through).", s.shared_puts),
        ("shared_cache_put_bytes", "Payload bytes written to the shared store.", s.shared_put_bytes),
        ("shared_cache_put_seconds", "Time in shared-store puts.", s.shared_put_seconds),
        ("shared_cache_errors", "Shared-store calls that failed or timed out (requests recompute).", s.shared_errors),
        ("shared_cache_corrupt_entries", "Shared-store entries refused as truncated, altered or foreign.",
         s.shared_corrupt),
    ):
        c = CounterMetricFamily(f"deltaserve:{name}", doc, labels=["model_name"])
        c.add_metric(labels, value)
        yield c


def _kv_transfer_counters(s: Any, labels: list[str]):  # noqa: ANN202 - yields metric families
    """Prefill/decode disaggregation: requests and bytes moved (KV blocks and KDA state apart, all ranks), the time
    spent, failed fetches and requests computed locally despite kv_transfer_params."""
    requests = CounterMetricFamily("deltaserve:kv_transfer_requests", "Request caches published (sent) or fetched "
                                   "whole (received).", labels=["model_name", "direction"])
    requests.add_metric([*labels, "sent"], s.kv_transfer_sent)
    requests.add_metric([*labels, "received"], s.kv_transfer_received)
    yield requests
    moved = CounterMetricFamily("deltaserve:kv_transfer_bytes", "Bytes of request caches moved, by direction and "
                                "kind (kv: MLA KV blocks; state: KDA recurrent state and conv window).",
                                labels=["model_name", "direction", "kind"])
    for direction, kind, value in (("sent", "kv", s.kv_transfer_sent_kv_bytes),
                                   ("sent", "state", s.kv_transfer_sent_state_bytes),
                                   ("received", "kv", s.kv_transfer_received_kv_bytes),
                                   ("received", "state", s.kv_transfer_received_state_bytes)):
        moved.add_metric([*labels, direction, kind], value)
    yield moved
    for name, doc, value in (
        ("kv_transfer_seconds", "Time spent packing and publishing, or fetching and checking, request caches.",
         s.kv_transfer_seconds),
        ("kv_transfer_failures", "Fetches that failed (peer gone, timeout, payload cut short or corrupt): "
         "recomputed locally.", s.kv_transfer_failures),
        ("kv_transfer_fallbacks", "Requests with kv_transfer_params computed locally without a fetch (local cache "
         "hit, no host-tier room, or a transfer for another prompt or layout).", s.kv_transfer_fallbacks),
    ):
        c = CounterMetricFamily(f"deltaserve:{name}", doc, labels=["model_name"])
        c.add_metric(labels, value)
        yield c


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
        self.errors = Counter("deltaserve:request_errors", "HTTP answers with a status of 400 or more (unhandled "
                              "exceptions: kind=internal) by kind.", ["model_name", "kind"], registry=self.registry)
        self.engine = _EngineStatsCollector(model_name)
        self.registry.register(self.engine)
        self.started = time.time()
        """When the server started (Unix time), for the uptime."""
        self.ttft_window = RollingWindow()
        """Recent TTFT samples (the status page's percentiles)."""
        self.itl_window = RollingWindow()
        self.finished_by_reason: dict[str, int] = {}
        self.errors_by_kind: dict[str, int] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    async def refresh_engine_stats(self, fetch: Callable[[], Awaitable[EngineStats]], wait_s: float = 0.5) -> None:
        """Update the engine snapshot if the engine answers within `wait_s` (see `EngineStatsSnapshot`)."""
        await self.engine.snapshot.refresh(fetch, wait_s)

    def observe_http(self, route: str, status: int) -> None:
        self.requests.labels(self._model, route, str(status)).inc()
        if status >= 400:
            self.observe_error(status)

    def observe_error(self, status: int) -> None:
        """Count an error of HTTP status `status` by kind: an answer's, or one a stream reported (or a client
        disconnect it saw, 499) after its 200 went out."""
        kind = ERROR_KINDS.get(status, f"http_{status}")
        self.errors.labels(self._model, kind).inc()
        self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + 1

    def observe_finished(self, reason: str, *, prompt_tokens: int, generated: int, ttft: float | None,
                         e2e: float) -> None:
        self.finished.labels(self._model, reason).inc()
        self.prompt_tokens.labels(self._model).inc(prompt_tokens)
        self.generation_tokens.labels(self._model).inc(generated)
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        self.prompt_tokens_total += prompt_tokens
        self.generation_tokens_total += generated
        if ttft is not None:
            self.ttft.labels(self._model).observe(ttft)
            self.ttft_window.add(ttft)
        self.e2e.labels(self._model).observe(e2e)

    def observe_itl(self, seconds: float) -> None:
        self.itl.labels(self._model).observe(seconds)
        self.itl_window.add(seconds)
