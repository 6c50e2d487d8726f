"""`GET /metrics`: the engine model's state under SGLang's metric names and labels.

Each engine instance is one label set, `engine_type` prefill or decode and `dp_rank` its index, beside
SGLang's `model_name`, `tp_rank` and `pp_rank`; summing over `dp_rank` gives a role's total, as it does
across the pods of a real deployment. Metrics of the Basin engine extension carry a `basin_` prefix.
Values are computed at scrape time from `LiveEngine.snapshot`, the same records `/v1/loads` serves.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from basin_emulator.engine import InstanceCounters, LiveEngine

LABELS = ["model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank"]

GAUGES = {
    "num_running_reqs": "Requests running (prefill: in a chunked prefill; decode: in the batch).",
    "num_queue_reqs": "Requests waiting in the scheduler's queues.",
    "num_used_tokens": "KV tokens held by requests (not counting evictable cache).",
    "max_total_num_tokens": "KV capacity in tokens.",
    "kv_available_tokens": "KV tokens free or evictable.",
    "token_usage": "Share of KV capacity held by requests.",
    "cache_hit_rate": "Prefix hit rate of recent prefills.",
}
PREFILL_GAUGES = {
    "num_prefill_bootstrap_queue_reqs": "Requests waiting for decode to reserve KV (bootstrap queue).",
    "hicache_host_used_tokens": "Host tier tokens in use.",
    "hicache_host_total_tokens": "Host tier capacity in tokens.",
}
DECODE_GAUGES = {
    "num_decode_prealloc_queue_reqs": "Requests waiting for a decode KV reservation.",
    "num_decode_transfer_queue_reqs": "Requests holding a decode reservation, awaiting prefill or transfer.",
    "basin_lent_tokens": "Decode KV tokens lent as units to the prefix cache.",
    "basin_lent_units": "Lent units held.",
}
_SNAPSHOT_FIELD = {"basin_lent_tokens": "lent_tokens", "basin_lent_units": "lent_units"}


class EngineCollector(Collector):
    def __init__(self, engine: LiveEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        records = self.engine.snapshot()
        labels = {
            id(r): [self.model_name, str(r["engine_type"]), "0", "0", str(r["dp_rank"])] for r in records
        }
        for name, documentation in {**GAUGES, **PREFILL_GAUGES, **DECODE_GAUGES}.items():
            family = GaugeMetricFamily(f"sglang:{name}", documentation, labels=LABELS)
            field = _SNAPSHOT_FIELD.get(name, name)
            for record in records:
                if field in record:
                    family.add_metric(labels[id(record)], float(record[field]))
            yield family
        yield from self._counters()

    def _labels(self, engine_type: str, index: int) -> list[str]:
        return [self.model_name, engine_type, "0", "0", str(index)]

    def _counters(self) -> Iterator[Metric]:
        engine = self.engine
        instances: list[tuple[list[str], InstanceCounters]] = [
            (self._labels("prefill", i), c) for i, c in enumerate(engine.prefill_counters)
        ] + [(self._labels("decode", i), c) for i, c in enumerate(engine.decode_counters)]
        prompt = CounterMetricFamily("sglang:prompt_tokens", "Prompt tokens prefilled.", labels=LABELS)
        generation = CounterMetricFamily("sglang:generation_tokens", "Tokens generated.", labels=LABELS)
        requests = CounterMetricFamily("sglang:num_requests", "Requests processed.", labels=LABELS)
        aborted = CounterMetricFamily("sglang:num_aborted_requests", "Requests aborted.", labels=LABELS)
        cached = CounterMetricFamily(
            "sglang:cached_tokens", "Cached prompt tokens by source.", labels=[*LABELS, "cache_source"]
        )
        effective = CounterMetricFamily(
            "sglang:prefill_effective_tokens",
            "Prompt tokens by how prefill obtained them: computed (input) or hit in a cache tier.",
            labels=[*LABELS, "mode"],
        )
        fetched = CounterMetricFamily(
            "sglang:basin_unit_fetched_tokens", "Prompt tokens fetched from lent units.", labels=LABELS
        )
        for labels, c in instances:
            requests.add_metric(labels, c.requests)
            aborted.add_metric(labels, c.aborted)
            if labels[1] == "decode":
                generation.add_metric(labels, c.generation_tokens)
                continue
            prompt.add_metric(labels, c.prompt_tokens)
            fetched.add_metric(labels, c.fetched_tokens)
            cached.add_metric([*labels, "device"], c.cached_device_tokens)
            cached.add_metric([*labels, "host"], c.cached_host_tokens)
            effective.add_metric([*labels, "input"], c.computed_tokens)
            effective.add_metric([*labels, "device_hit"], c.cached_device_tokens)
            effective.add_metric([*labels, "host_hit"], c.cached_host_tokens)
            effective.add_metric([*labels, "storage_hit"], 0)
        yield from (prompt, generation, requests, aborted, cached, effective, fetched)
