"""The emulator's `/metrics` under SGLang 0.5.23's own names, types and labels, read from SGLang's metrics
collector source (`sglang/srt/observability/metrics_collector.py`): dashboards and alerts written against
the emulator then work unchanged on a real deployment."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from basin.sim import get_deployment
from basin_emulator.engine import LiveEngine
from basin_emulator.metrics import EngineCollector

COLLECTOR = Path("sglang/srt/observability/metrics_collector.py")
KINDS = {"Gauge": "gauge", "Counter": "counter", "Histogram": "histogram", "Summary": "summary"}
# One emulator process serves every instance; its tokenizer series name the instance as its scheduler
# series do, where a real deployment tells them apart by pod.
INSTANCE_LABELS = {"tp_rank", "pp_rank", "dp_rank"}


def collector_source() -> Path:
    venv = Path(os.environ.get("SGLANG_VENV", Path.home() / ".cache/basin/sglang-venv"))
    for site in sorted(venv.glob("lib/python3*/site-packages")):
        if (site / COLLECTOR).exists():
            return site / COLLECTOR
    pytest.fail(f"SGLang's source is not installed under {venv} (`make test` builds that venv first)")


def _label_names(node: ast.expr, base: set[str]) -> set[str]:
    """`labels.keys()`, `list(labels.keys()) + ["x"]`, `[*labels.keys(), "x"]`, `{"layer"}`."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "keys":
        return set(base)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "list":
        return _label_names(node.args[0], base)
    if isinstance(node, ast.BinOp):
        return _label_names(node.left, base) | _label_names(node.right, base)
    if isinstance(node, ast.List | ast.Set | ast.Tuple):
        out: set[str] = set()
        for element in node.elts:
            if isinstance(element, ast.Starred):
                out |= _label_names(element.value, base)
            elif isinstance(element, ast.Constant):
                out.add(element.value)
        return out
    raise AssertionError(f"unrecognised labelnames: {ast.unparse(node)}")


def _labels_built_in(function: ast.FunctionDef) -> set[str]:
    """The keys a function puts in its `labels` dict: the literal's and every `labels["x"] = …`."""
    keys: set[str] = set()
    for node in ast.walk(function):
        if not isinstance(node, ast.Assign):
            continue
        named = any(isinstance(t, ast.Name) and t.id == "labels" for t in node.targets)
        if named and isinstance(node.value, ast.Dict):
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        for target in node.targets:
            if (
                isinstance(target, ast.Subscript)
                and isinstance(target.value, ast.Name)
                and target.value.id == "labels"
                and isinstance(target.slice, ast.Constant)
            ):
                keys.add(target.slice.value)
    return keys


def sglang_metrics() -> dict[str, tuple[str, set[str]]]:
    """Family name -> (type, label names) for the scheduler's and the tokenizer's collectors, with the
    labels SGLang gives them under priority scheduling and data-parallel ranks (the operator's flags)."""
    tree = ast.parse(collector_source().read_text())
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    scheduler_factory = next(
        f for f in functions.values() if "moe_ep_rank" in ast.unparse(f) and "engine_type" in ast.unparse(f)
    )
    bases = {
        "SchedulerMetricsCollector": _labels_built_in(scheduler_factory),
        "TokenizerMetricsCollector": _labels_built_in(functions["tokenizer_metric_labels"]),
    }
    out: dict[str, tuple[str, set[str]]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in bases):
        for node in ast.walk(cls):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in KINDS):
                continue
            keywords = {k.arg: k.value for k in node.keywords}
            name = keywords.get("name")
            if not isinstance(name, ast.Constant) or "labelnames" not in keywords:
                continue
            kind = KINDS[node.func.id]
            family = name.value.removesuffix("_total") if kind == "counter" else name.value
            out[family] = (kind, _label_names(keywords["labelnames"], bases[cls.name]) | {"_" + cls.name})
    return out


def emulator_metrics() -> dict[str, tuple[str, set[str]]]:
    """What the emulator exports after one plain and one streamed request ran through the model."""
    engine = LiveEngine(get_deployment("h200-1p1d"), time_scale=1.0)
    for n, streaming in enumerate((False, True)):
        engine.submit(f"r{n}", list(range(200)), 8, f"s{n}", None, False, streaming=streaming)
    engine.env.run(engine.env.now + 3600)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, "m"))
    out: dict[str, tuple[str, set[str]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        labels = {k for s in family.samples for k in s.labels} - {"le"}
        out[family.name] = (family.type, labels)
    return out


def test_every_sglang_series_of_the_emulator_has_sglangs_name_type_and_labels() -> None:
    sglang, emulator = sglang_metrics(), emulator_metrics()
    assert len(sglang) > 60  # the parse found the collectors
    ours = {name: v for name, v in emulator.items() if not name.startswith("sglang:basin_")}
    for name, (kind, labels) in sorted(ours.items()):
        assert name in sglang, f"{name}: SGLang 0.5.23 has no such metric"
        sglang_kind, sglang_labels = sglang[name]
        assert kind == sglang_kind, f"{name}: {kind} here, {sglang_kind} in SGLang"
        tokenizer = "_TokenizerMetricsCollector" in sglang_labels
        expected = sglang_labels - {"_TokenizerMetricsCollector", "_SchedulerMetricsCollector"}
        if tokenizer:
            expected |= INSTANCE_LABELS
        assert labels == expected, f"{name}: labels {sorted(labels)}, SGLang's {sorted(expected)}"


def test_the_emulator_exports_the_engine_series_dashboards_need() -> None:
    """The issue's list of what the emulator lacked, now exported (checked against SGLang above)."""
    needed = {
        "sglang:time_to_first_token_seconds",
        "sglang:e2e_request_latency_seconds",
        "sglang:inter_token_latency_seconds",
        "sglang:num_retracted_reqs",
        "sglang:num_retracted_requests",
        "sglang:num_prefill_inflight_queue_reqs",
        "sglang:kv_transfer_latency_ms",
    }
    assert needed <= set(emulator_metrics())
