"""The plugin's Prometheus series: SGLang-style names and labels, moved by real lending activity."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from basin_engine_ext.lending import DecodeLender
from basin_engine_ext.metrics import METRICS, EngineMetrics
from basin_engine_ext.units import UnitStore

pytestmark = pytest.mark.engine

LABELS = {"model_name": "qwen", "engine_type": "decode", "tp_rank": "0"}


def sample(registry: CollectorRegistry, name: str) -> float:
    value = registry.get_sample_value(name, LABELS)
    assert value is not None, name
    return value


def test_every_series_is_exported_with_sglang_labels() -> None:
    registry = CollectorRegistry()
    EngineMetrics.create(LABELS, registry)
    text = generate_latest(registry).decode()
    for name in METRICS:
        assert f'{name}{{engine_type="decode",model_name="qwen",tp_rank="0"}}' in text


def test_lending_moves_the_series(decode_kv) -> None:
    registry = CollectorRegistry()
    metrics = EngineMetrics.create(LABELS, registry)
    store: UnitStore = UnitStore(capacity=decode_kv.allocator.size)
    lender = DecodeLender(decode_kv.allocator, store, metrics)
    for name in ("a", "b"):
        slots = decode_kv.allocator.alloc(16)
        lender.adopt(name, 1, list(range(16)), slots)
    assert sample(registry, "sglang:basin_lent_tokens") == 32
    assert sample(registry, "sglang:basin_lent_units") == 2
    assert lender.plan_fetch("a", list(range(20)), local_match=4) is not None
    assert lender.plan_fetch("b", list(range(16)), local_match=16) is None
    assert sample(registry, "sglang:basin_unit_hits_total") == 1
    assert sample(registry, "sglang:basin_unit_misses_total") == 1
    lender.reclaim(10)
    assert sample(registry, "sglang:basin_reclaimed_tokens_total") == 16
    assert sample(registry, "sglang:basin_lent_tokens") == 16
    big = decode_kv.allocator.alloc(200)
    assert big is not None
    lender.adopt("c", 1, list(range(16)), decode_kv.allocator.alloc(16))  # no headroom left
    assert sample(registry, "sglang:basin_adopt_refusals_total") == 1
