"""Engine telemetry for the control step, read from SGLang's own names (docs/emulator.md, "Metrics").

Two sources give the same totals: a direct scrape of every engine's `/metrics` and `/v1/loads`, or
instant PromQL sums through Prometheus. `Tracker` turns totals into the policy's reading: the hit rate is
cached over prompt tokens prefilled since the previous reading, as the simulator measures it. A source
that fails yields a stale reading: NaN hit rate, queues zero, `fresh` False — a state the controller
sees (and the log and a metric say), never an exception.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from basin_gateway.brain import EngineReading

log = logging.getLogger("basin.gateway")


@dataclass(frozen=True)
class Totals:
    """Cluster-wide sums at one instant."""

    prompt_tokens: float  # counter, prefill
    cached_tokens: float  # counter, prefill
    prefill_backlog_tokens: float
    decode_waiting_requests: float
    decode_kv_used_tokens: float
    decode_kv_capacity_tokens: float
    lent_tokens: float


class TelemetryError(Exception):
    """A source could not produce totals (engine down, garbage, Prometheus unreachable)."""


def _label(sample_labels: dict[str, str], role: str) -> bool:
    return sample_labels.get("engine_type", role) == role


# Queue gauges SGLang records as a total under `priority=""` plus one series per priority value when
# priority scheduling is on (its `_log_gauge_queue_count`): only the total counts. Its token counters carry
# each request's priority instead, a partition that sums.
QUEUE_TOTALS = {"decode_waiting_requests"}


def totals_from_metrics(text: str, loads: dict | None) -> dict[str, float]:
    """Sums over one engine endpoint's `/metrics` text and `/v1/loads` record list."""
    sums = dict.fromkeys(Totals.__dataclass_fields__, 0.0)
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, IndexError) as exc:
        raise TelemetryError(f"unparseable /metrics ({exc})") from None
    names = {
        "sglang:prompt_tokens": ("prompt_tokens", "prefill"),
        "sglang:cached_tokens": ("cached_tokens", "prefill"),
        "sglang:num_decode_prealloc_queue_reqs": ("decode_waiting_requests", "decode"),
        "sglang:num_used_tokens": ("decode_kv_used_tokens", "decode"),
        "sglang:max_total_num_tokens": ("decode_kv_capacity_tokens", "decode"),
        "sglang:basin_lent_tokens": ("lent_tokens", "decode"),
    }
    present = {family.name for family in families}
    for family in families:
        target = names.get(family.name)
        if target is None:
            continue
        field, role = target
        for sample in family.samples:
            if sample.name.endswith("_created") or not _label(sample.labels, role):
                continue
            if field in QUEUE_TOTALS and sample.labels.get("priority", ""):
                continue  # a per-priority breakdown beside the total (SGLang's priority scheduling)
            sums[field] += sample.value
    # SGLang's labelled counters appear with their first request (a fresh engine has no
    # sglang:prompt_tokens_total yet: it counts 0); an endpoint without any sglang:* series is no engine.
    if not any(name.startswith("sglang:") for name in present):
        raise TelemetryError("no sglang:* series (is this an SGLang engine with --enable-metrics?)")
    for record in (loads or {}).get("loads", []) or []:
        if isinstance(record, dict) and record.get("engine_type", "prefill") == "prefill":
            sums["prefill_backlog_tokens"] += float(record.get("num_waiting_uncached_tokens") or 0)
    return sums


class PodEngines:
    """Engine URLs from the operator's pod label selectors, read through the Kubernetes API: the Ready
    pods' IPs at the engine port. In a pod it uses the service account; elsewhere a kubeconfig."""

    def __init__(self, namespace: str, selectors: tuple[str, ...], port: int, kubeconfig: str | None) -> None:
        from kubernetes import client, config

        if kubeconfig:
            api = config.new_client_from_config(config_file=kubeconfig)
        else:
            config.load_incluster_config()
            api = client.ApiClient()
        self.core = client.CoreV1Api(api)
        self.namespace = namespace
        self.selectors = selectors
        self.port = port

    def describe(self) -> str:
        return f"pods {' + '.join(self.selectors)} in {self.namespace}"

    def _list(self) -> tuple[str, ...]:
        urls = set()
        for selector in self.selectors:
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector, _request_timeout=5)
            for pod in pods.items:
                status = pod.status
                if status is None or status.phase != "Running" or not status.pod_ip:
                    continue
                if any(c.type == "Ready" and c.status == "True" for c in status.conditions or []):
                    urls.add(f"http://{status.pod_ip}:{self.port}")
        return tuple(sorted(urls))

    async def urls(self) -> tuple[str, ...]:
        try:
            return await asyncio.to_thread(self._list)
        except Exception as exc:  # the client raises ApiException, urllib3's and OS errors
            raise TelemetryError(f"listing engine pods ({self.describe()}) failed: {exc}") from None


# The gateway's HTTP client passes answers through undecoded (auto_decompress off, for proxying), and
# SGLang's Prometheus endpoint gzips when asked: telemetry asks for plain text.
PLAIN = {"Accept-Encoding": "identity"}


class ScrapeSource:
    """Scrapes each engine URL's `/metrics` and `/v1/loads` (a static list, or found in Kubernetes)."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        engines: tuple[str, ...],
        timeout_s: float = 2.0,
        pods: PodEngines | None = None,
        refresh_s: float = 30.0,
    ) -> None:
        self.http = http
        self.engines = engines
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.pods = pods
        self.refresh_s = refresh_s
        self.listed = -math.inf

    def describe(self) -> str:
        if self.pods is not None:
            return f"scraping {self.pods.describe()}"
        return f"scraping {', '.join(self.engines)}"

    async def discover(self) -> None:
        """Re-list the engine pods when the list is older than `refresh_s` (or empty)."""
        if self.pods is None or (self.engines and time.monotonic() - self.listed < self.refresh_s):
            return
        engines = await self.pods.urls()
        self.listed = time.monotonic()
        if engines != self.engines:
            log.info("engines for telemetry: %s", ", ".join(engines) or "none")
        self.engines = engines

    async def _one(self, url: str) -> dict[str, float]:
        base = url.rstrip("/")
        try:
            async with self.http.get(f"{base}/metrics", timeout=self.timeout, headers=PLAIN) as response:
                if response.status != 200:
                    raise TelemetryError(f"{base}/metrics answered {response.status}")
                text = await response.text()
            loads = None
            async with self.http.get(f"{base}/v1/loads", timeout=self.timeout, headers=PLAIN) as response:
                if response.status == 200:
                    loads = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise TelemetryError(f"{base}: {type(exc).__name__} {exc}") from None
        return totals_from_metrics(text, loads if isinstance(loads, dict) else None)

    async def totals(self) -> Totals:
        await self.discover()
        if not self.engines:
            raise TelemetryError(f"no engine to read ({self.describe()})")
        results = await asyncio.gather(*(self._one(u) for u in self.engines))
        sums = dict.fromkeys(Totals.__dataclass_fields__, 0.0)
        for result in results:
            for key, value in result.items():
                sums[key] += value
        return Totals(**sums)


PROMQL = {
    "prompt_tokens": 'sum(sglang:prompt_tokens_total{engine_type="prefill"})',
    "cached_tokens": 'sum(sglang:cached_tokens_total{engine_type="prefill"})',
    "decode_waiting_requests": 'sum(sglang:num_decode_prealloc_queue_reqs{engine_type="decode",priority=""})',
    "decode_kv_used_tokens": 'sum(sglang:num_used_tokens{engine_type="decode"})',
    "decode_kv_capacity_tokens": 'sum(sglang:max_total_num_tokens{engine_type="decode"})',
    "lent_tokens": 'sum(sglang:basin_lent_tokens{engine_type="decode"})',
}


class PrometheusSource:
    """Instant PromQL sums through prometheus-api-client; Q_P (uncached waiting tokens) is not a metric
    SGLang exports, so it comes from the engines' `/v1/loads` when they are known, else counts as 0."""

    def __init__(self, url: str, loads: ScrapeSource | None = None) -> None:
        from prometheus_api_client import PrometheusConnect

        self.url = url
        self.client = PrometheusConnect(url=url, disable_ssl=True)
        self.loads = loads

    def describe(self) -> str:
        return f"Prometheus at {self.url}"

    def _query(self) -> dict[str, float]:
        sums: dict[str, float] = {}
        for key, query in PROMQL.items():
            try:
                result = self.client.custom_query(query)
            except Exception as exc:  # the client raises its own and requests' errors
                raise TelemetryError(f"Prometheus {self.url}: {type(exc).__name__} {exc}") from None
            if not result:
                if key == "prompt_tokens":
                    raise TelemetryError(f"Prometheus {self.url} has no {query}")
                sums[key] = 0.0
                continue
            sums[key] = float(result[0]["value"][1])
        return sums

    async def totals(self) -> Totals:
        sums = await asyncio.to_thread(self._query)
        backlog = 0.0
        if self.loads is not None:
            try:
                await self.loads.discover()
            except TelemetryError as exc:
                log.warning("%s", exc)
            for url in self.loads.engines:
                try:
                    async with self.loads.http.get(
                        f"{url.rstrip('/')}/v1/loads", timeout=self.loads.timeout
                    ) as response:
                        data = await response.json(content_type=None)
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    continue
                for record in data.get("loads", []) if isinstance(data, dict) else []:
                    if isinstance(record, dict) and record.get("engine_type", "prefill") == "prefill":
                        backlog += float(record.get("num_waiting_uncached_tokens") or 0)
        return Totals(prefill_backlog_tokens=backlog, **sums)


class Tracker:
    """Readings from a source: deltas of the token counters, the gauges as they are."""

    def __init__(self, source: ScrapeSource | PrometheusSource) -> None:
        self.source = source
        self.previous: Totals | None = None
        self.stale = True
        self.failures = 0
        self.last_error = ""

    async def read(self) -> EngineReading:
        try:
            totals = await self.source.totals()
        except TelemetryError as exc:
            self.failures += 1
            if not self.stale or self.failures == 1:
                log.warning("telemetry unavailable, the controller sees NaN hit rate: %s", exc)
            self.stale = True
            self.last_error = str(exc)
            self.previous = None  # the next good reading starts a new delta
            return EngineReading()
        if self.stale and self.failures:
            log.info("telemetry back from %s", self.source.describe())
        self.stale = False
        hit = math.nan
        if self.previous is not None:
            prompt = totals.prompt_tokens - self.previous.prompt_tokens
            cached = totals.cached_tokens - self.previous.cached_tokens
            if prompt > 0 and cached >= 0:  # a counter that went down means an engine restarted
                hit = min(cached / prompt, 1.0)
        self.previous = totals
        return EngineReading(
            hit_rate=hit,
            prefill_backlog_tokens=int(totals.prefill_backlog_tokens),
            decode_waiting_requests=int(totals.decode_waiting_requests),
            decode_kv_used_tokens=int(totals.decode_kv_used_tokens),
            decode_kv_capacity_tokens=int(totals.decode_kv_capacity_tokens),
            lent_tokens=int(totals.lent_tokens),
            fresh=True,
        )
