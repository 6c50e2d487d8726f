"""Prometheus metrics for lending and unit fetches, beside SGLang's own.

Names follow SGLang's `sglang:` prefix and its scheduler labels (model_name, engine_type, tp_rank), so the
gateway scrapes them from the same `/metrics` endpoint. They are created in the scheduler process after
SGLang has set PROMETHEUS_MULTIPROC_DIR (when metrics are on), so SGLang's HTTP server exports them;
gauges use the same multiprocess mode SGLang uses for its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

LABELS = ("model_name", "engine_type", "tp_rank")

# name -> (kind, help)
METRICS = {
    "sglang:basin_lent_tokens": ("gauge", "Decode KV tokens held by lent units."),
    "sglang:basin_lent_units": ("gauge", "Lent units held on this decode instance."),
    "sglang:basin_unit_hits_total": (
        "counter",
        "Prefill turns whose lent unit covered more than the local match.",
    ),
    "sglang:basin_unit_misses_total": (
        "counter",
        "Prefill turns with a unit that added nothing to the local match.",
    ),
    "sglang:basin_fetched_tokens_total": (
        "counter",
        "Prompt tokens written from a lent unit into prefill KV.",
    ),
    "sglang:basin_reclaimed_tokens_total": ("counter", "Lent tokens freed for decode demand."),
    "sglang:basin_unit_fallbacks_total": (
        "counter",
        "Unit fetches abandoned for recomputation (timeout, peer lost).",
    ),
    "sglang:basin_adopt_refusals_total": ("counter", "Marked prompts not adopted (cap or headroom)."),
}


@dataclass
class EngineMetrics:
    lent_tokens: Gauge
    lent_units: Gauge
    unit_hits: Counter
    unit_misses: Counter
    fetched_tokens: Counter
    reclaimed_tokens: Counter
    fallbacks: Counter
    adopt_refusals: Counter
    labels: dict[str, str]

    @classmethod
    def create(cls, labels: dict[str, str], registry: CollectorRegistry = REGISTRY) -> EngineMetrics:
        made = {}
        for name, (kind, doc) in METRICS.items():
            if kind == "gauge":
                metric = Gauge(name, doc, LABELS, registry=registry, multiprocess_mode="mostrecent")
            else:
                # prometheus_client appends `_total` to counters itself.
                metric = Counter(name.removesuffix("_total"), doc, LABELS, registry=registry)
            made[name] = metric.labels(**{k: str(labels.get(k, "")) for k in LABELS})
        return cls(
            lent_tokens=made["sglang:basin_lent_tokens"],
            lent_units=made["sglang:basin_lent_units"],
            unit_hits=made["sglang:basin_unit_hits_total"],
            unit_misses=made["sglang:basin_unit_misses_total"],
            fetched_tokens=made["sglang:basin_fetched_tokens_total"],
            reclaimed_tokens=made["sglang:basin_reclaimed_tokens_total"],
            fallbacks=made["sglang:basin_unit_fallbacks_total"],
            adopt_refusals=made["sglang:basin_adopt_refusals_total"],
            labels=dict(labels),
        )
