"""`GET /metrics`: the engine model's state under SGLang's metric names, types and labels.

SGLang 0.5.23 labels its scheduler's series `model_name`, `engine_type`, `tp_rank`, `pp_rank`,
`moe_ep_rank`, `dp_rank` (and `priority`, "" for totals, under `--enable-priority-scheduling`, which the
operator sets), and its tokenizer's series `model_name`, `engine_type`, `priority` (plus `is_streaming` on
some). Each emulated engine instance is one label set, `engine_type` prefill or decode and `dp_rank` its
index; the tokenizer's series carry `tp_rank`, `pp_rank` and `dp_rank` too, since one emulator process
serves every instance where a real deployment tells them apart by pod. Summing over `dp_rank` gives a
role's total, as summing over pods does. Metrics of the Basin engine extension carry a `basin_` prefix.
`tests/unit/test_emulator_sglang_names.py` checks names, types and labels against SGLang's collector.
Values are computed at scrape time from `LiveEngine.snapshot` (the records `/v1/loads` serves), the
per-instance counters and the latency histograms (model seconds).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from basin_emulator.engine import Histogram, InstanceCounters, LiveEngine

SCHEDULER_LABELS = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "priority", "dp_rank"]
TOKENIZER_LABELS = ["model_name", "engine_type", "priority", "tp_rank", "pp_rank", "dp_rank"]
STREAMING_LABELS = [*TOKENIZER_LABELS, "is_streaming"]

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
    "num_prefill_inflight_queue_reqs": "Requests prefilled whose KV is being transferred to decode.",
    "hicache_host_used_tokens": "Host tier tokens in use.",
    "hicache_host_total_tokens": "Host tier capacity in tokens.",
}
DECODE_GAUGES = {
    "num_decode_prealloc_queue_reqs": "Requests waiting for a decode KV reservation.",
    "num_decode_transfer_queue_reqs": "Requests holding a decode reservation, awaiting prefill or transfer.",
    "num_retracted_reqs": "Requests retracted from the decode batch, waiting to resume.",
    "basin_lent_tokens": "Decode KV tokens lent as units to the prefix cache.",
    "basin_lent_units": "Lent units held.",
}
_SNAPSHOT_FIELD = {"basin_lent_tokens": "lent_tokens", "basin_lent_units": "lent_units"}


class EngineCollector(Collector):
    def __init__(self, engine: LiveEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _scheduler(self, engine_type: str, index: int | str) -> list[str]:
        return [self.model_name, engine_type, "0", "0", "0", "", str(index)]

    def _tokenizer(self, engine_type: str, index: int | str) -> list[str]:
        return [self.model_name, engine_type, "", "0", "0", str(index)]

    def collect(self) -> Iterator[Metric]:
        records = self.engine.snapshot()
        for name, documentation in {**GAUGES, **PREFILL_GAUGES, **DECODE_GAUGES}.items():
            family = GaugeMetricFamily(f"sglang:{name}", documentation, labels=SCHEDULER_LABELS)
            field = _SNAPSHOT_FIELD.get(name, name)
            for record in records:
                if field in record:
                    labels = self._scheduler(str(record["engine_type"]), str(record["dp_rank"]))
                    family.add_metric(labels, float(record[field]))
            yield family
        yield from self._counters()
        yield from self._histograms()

    def _counters(self) -> Iterator[Metric]:
        engine = self.engine
        instances: list[tuple[str, int, InstanceCounters]] = [
            ("prefill", i, c) for i, c in enumerate(engine.prefill_counters)
        ] + [("decode", i, c) for i, c in enumerate(engine.decode_counters)]
        prompt = CounterMetricFamily(
            "sglang:prompt_tokens", "Prompt tokens prefilled.", labels=STREAMING_LABELS
        )
        generation = CounterMetricFamily(
            "sglang:generation_tokens", "Tokens generated.", labels=STREAMING_LABELS
        )
        requests = CounterMetricFamily("sglang:num_requests", "Requests processed.", labels=STREAMING_LABELS)
        aborted = CounterMetricFamily(
            "sglang:num_aborted_requests", "Requests aborted.", labels=TOKENIZER_LABELS
        )
        cached = CounterMetricFamily(
            "sglang:cached_tokens",
            "Cached prompt tokens by source.",
            labels=[*TOKENIZER_LABELS, "cache_source"],
        )
        effective = CounterMetricFamily(
            "sglang:prefill_effective_tokens",
            "Prompt tokens by how prefill obtained them: computed (input) or hit in a cache tier.",
            labels=[*SCHEDULER_LABELS, "mode"],
        )
        retracted = CounterMetricFamily(
            "sglang:num_retracted_requests",
            "Requests retracted from the decode batch.",
            labels=SCHEDULER_LABELS,
        )
        fetched = CounterMetricFamily(
            "sglang:basin_unit_fetched_tokens",
            "Prompt tokens fetched from lent units.",
            labels=SCHEDULER_LABELS,
        )
        for engine_type, index, c in instances:
            tokenizer, scheduler = self._tokenizer(engine_type, index), self._scheduler(engine_type, index)
            aborted.add_metric(tokenizer, c.aborted)
            for stream, count in c.requests_by_stream.items():
                requests.add_metric([*tokenizer, stream], count)
            if engine_type == "decode":
                for stream, count in c.generation_by_stream.items():
                    generation.add_metric([*tokenizer, stream], count)
                retracted.add_metric(scheduler, c.retractions)
                continue
            for stream, count in c.prompt_by_stream.items():
                prompt.add_metric([*tokenizer, stream], count)
            fetched.add_metric(scheduler, c.fetched_tokens)
            cached.add_metric([*tokenizer, "device"], c.cached_device_tokens)
            cached.add_metric([*tokenizer, "host"], c.cached_host_tokens)
            effective.add_metric([*scheduler, "input"], c.computed_tokens)
            effective.add_metric([*scheduler, "device_hit"], c.cached_device_tokens)
            effective.add_metric([*scheduler, "host_hit"], c.cached_host_tokens)
            effective.add_metric([*scheduler, "storage_hit"], 0)
        yield from (prompt, generation, requests, aborted, cached, effective, retracted, fetched)

    def _histograms(self) -> Iterator[Metric]:
        """Latencies in model seconds (the KV transfer in model milliseconds), on SGLang's buckets."""
        engine = self.engine
        specs: list[tuple[str, str, Histogram, list[str], bool]] = [
            ("time_to_first_token_seconds", "Time to first token.", engine.ttft, STREAMING_LABELS, False),
            ("inter_token_latency_seconds", "Inter-token latency.", engine.itl, TOKENIZER_LABELS, False),
            ("e2e_request_latency_seconds", "End-to-end latency.", engine.e2e, STREAMING_LABELS, False),
            ("kv_transfer_latency_ms", "KV cache transfer latency in ms.", engine.kv_transfer_ms,
             SCHEDULER_LABELS, True),
        ]  # fmt: skip
        for name, documentation, histogram, labels, scheduler in specs:
            family = HistogramMetricFamily(f"sglang:{name}", documentation, labels=labels)
            for key in sorted(histogram.series):
                engine_type, index, *rest = key
                base = (
                    self._scheduler(engine_type, index) if scheduler else self._tokenizer(engine_type, index)
                )
                buckets, total = histogram.cumulative(key)
                family.add_metric([*base, *rest], buckets, total)
            yield family
