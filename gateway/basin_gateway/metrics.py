"""The gateway's Prometheus series (`/metrics`): what it decided, what it saw, how requests fared.

Gauges that mirror the policy (B, B0, flags) are read at scrape time from the live objects, so they
can never disagree with what the controller holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "basin_gateway"
WAIT_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 900, 1800, 3600)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class StateCollector(Collector):
    """Gauges computed at scrape time from a callable returning (name, help, labels, value) rows."""

    def __init__(self, rows: Callable[[], list[tuple[str, str, dict[str, str], float]]]) -> None:
        self.rows = rows

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # the rows exist once the gateway runs; registering must not compute them

    def collect(self) -> Iterator[GaugeMetricFamily]:
        families: dict[str, GaugeMetricFamily] = {}
        for name, doc, labels, value in self.rows():
            family = families.get(name)
            if family is None:
                family = families[name] = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=list(labels))
            family.add_metric(list(labels.values()), value if value is not None else math.nan)
        yield from families.values()


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests", "Calls answered, by route and status.", ["route", "status"], registry=r
        )
        self.parked_answers = Counter(
            f"{PREFIX}_parked_answers", "429 answers (parked or paused).", registry=r
        )
        self.hold_rechecks = Counter(
            f"{PREFIX}_hold_rechecks",
            "Times a held-open parked call was asked again and was still parked.",
            registry=r,
        )
        self.upstream_errors = Counter(
            f"{PREFIX}_upstream_errors", "Upstream failures, by kind.", ["kind"], registry=r
        )
        self.upstream_retries = Counter(
            f"{PREFIX}_upstream_retries",
            "Calls sent again on a new connection after the upstream closed a pooled one as they went out.",
            registry=r,
        )
        self.aborts = Counter(
            f"{PREFIX}_upstream_aborts", "Upstream requests aborted after a client left.", registry=r
        )
        self.first_call_wait = Histogram(
            f"{PREFIX}_first_call_wait_seconds",
            "Model seconds from a session's arrival to its first forwarded call.",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            f"{PREFIX}_request_duration_seconds",
            "Wall seconds per forwarded call.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}_ttft_seconds",
            "Wall seconds to the first streamed byte.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.control_steps = Counter(f"{PREFIX}_control_steps", "Control steps run.", registry=r)
        self.telemetry_failures = Counter(
            f"{PREFIX}_telemetry_failures", "Telemetry reads that failed.", registry=r
        )
        self.redis_errors = Counter(f"{PREFIX}_redis_errors", "Redis operations that failed.", registry=r)

    def add_state(self, rows: Callable[[], list[tuple[str, str, dict[str, str], float]]]) -> None:
        self.registry.register(StateCollector(rows))
