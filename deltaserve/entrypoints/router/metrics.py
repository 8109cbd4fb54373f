"""The router's own Prometheus metrics (`deltaserve:router_*`), in a registry of its own."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deltaserve.entrypoints.router.instances import Pools


class _InstanceCollector(Collector):
    """Per-instance gauges read from the pools at scrape time (nothing to keep in step)."""

    def __init__(self, pools: Pools) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily("deltaserve:router_in_flight", "Router requests in flight per instance",
                                      labels=["role", "instance"])
        healthy = GaugeMetricFamily("deltaserve:router_instance_healthy",
                                    "1 while the instance passes its health checks", labels=["role", "instance"])
        for _, inst in self._pools.all():
            in_flight.add_metric([inst.role, inst.url], inst.in_flight)
            healthy.add_metric([inst.role, inst.url], int(inst.healthy))
        yield in_flight
        yield healthy


class RouterMetrics:
    """Counters of requests, prefill failures, fallbacks to a local prefill and decode failures."""

    def __init__(self, pools: Pools) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("deltaserve:router_requests", "Requests received, by route", ["route"],
                                registry=self.registry)
        self.instance_requests = Counter("deltaserve:router_instance_requests",
                                         "Requests sent to each instance (retries on another instance included)",
                                         ["role", "instance"], registry=self.registry)
        self.prefill_failures = Counter(
            "deltaserve:router_prefill_failures",
            "Prefill attempts that failed on an instance (connect, timeout, 5xx, bad answer), by instance and reason",
            ["instance", "reason"], registry=self.registry)
        self.fallbacks = Counter(
            "deltaserve:router_local_prefill_fallbacks",
            "Requests sent to a decode instance without kv_transfer_params (it prefills locally), by reason",
            ["reason"], registry=self.registry)
        self.decode_failures = Counter(
            "deltaserve:router_decode_failures",
            "Decode attempts that failed on an instance (connect, 503, died, timeout), by instance and reason",
            ["instance", "reason"], registry=self.registry)
        self.registry.register(_InstanceCollector(pools))

    def render(self) -> bytes:
        """The Prometheus text exposition."""
        return generate_latest(self.registry)
