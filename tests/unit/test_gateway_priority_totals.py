"""Q_D from an SGLang engine running with priority scheduling (as the operator starts it): SGLang records
its queue gauges as a total under `priority=""` plus one series per priority, so summing every series
would count each waiting request twice."""

from __future__ import annotations

from basin_gateway.telemetry import PROMQL, totals_from_metrics

LABELS = 'engine_type="decode",model_name="m",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
TEXT = f"""# TYPE sglang:num_decode_prealloc_queue_reqs gauge
sglang:num_decode_prealloc_queue_reqs{{{LABELS},priority=""}} 5.0
sglang:num_decode_prealloc_queue_reqs{{{LABELS},priority="0"}} 2.0
sglang:num_decode_prealloc_queue_reqs{{{LABELS},priority="7"}} 3.0
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{{engine_type="prefill",model_name="m",priority="0",is_streaming="false"}} 100.0
sglang:prompt_tokens_total{{engine_type="prefill",model_name="m",priority="7",is_streaming="false"}} 50.0
"""


def test_queue_totals_count_once_and_token_counters_sum_over_priorities() -> None:
    sums = totals_from_metrics(TEXT, None)
    assert sums["decode_waiting_requests"] == 5
    assert sums["prompt_tokens"] == 150  # each request counted under its own priority: a partition


def test_the_promql_reads_the_total_too() -> None:
    assert 'priority=""' in PROMQL["decode_waiting_requests"]
