"""Which dashboard and rule expressions return no data from a Prometheus that scraped Basin: the check the
monitoring service test and the end-to-end run (`make e2e`) share.

A dashboard expression must return data. A rule expression may be empty only where a labelled counter has
had no event yet (no session shed, say); every metric it names must still be one the targets export, so a
misspelled name fails."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from basin_monitoring import alerts, dashboards

METRIC = re.compile(r"\b(basin_gateway_\w+|sglang:\w+|basin:[\w:]+)")


def dashboard_expressions(rate_interval: str, namespace: str = ".*") -> list[tuple[str, str]]:
    """(dashboard, expression) for every panel query, Grafana's variables filled in."""
    return [
        (name, expr.replace("$__rate_interval", rate_interval).replace("$namespace", namespace))
        for name in dashboards.DASHBOARDS
        for expr in dashboards.expressions(name)
    ]


def rule_expressions(scale: float) -> list[str]:
    """Each recording rule, and each alert condition's signal and (when not a number) its threshold."""
    exprs = [expr for _, expr in alerts.recording(scale)]
    for alert in alerts.alerts(scale):
        for condition in alert.conditions:
            exprs.append(condition.signal)
            if not _is_number(condition.threshold):
                exprs.append(condition.threshold)
    return exprs


def exported_families(metrics_pages: Iterable[str]) -> frozenset[str]:
    """The metric families named by the HELP lines of /metrics pages."""
    return frozenset(
        line.split()[2] for page in metrics_pages for line in page.splitlines() if line.startswith("# HELP ")
    )


def empty_dashboard_queries(
    has_data: Callable[[str], bool], rate_interval: str, namespace: str = ".*"
) -> list[tuple[str, str]]:
    return [(name, e) for name, e in dashboard_expressions(rate_interval, namespace) if not has_data(e)]


def unknown_rule_metrics(
    has_data: Callable[[str], bool], scale: float, families: frozenset[str]
) -> dict[str, set[str]]:
    """Rule expressions without data that name a metric no target exports, with those names."""
    recorded = {name for name, _ in alerts.recording(scale)}
    unknown = {}
    for expr in rule_expressions(scale):
        if has_data(expr):
            continue
        names = {n for n in METRIC.findall(expr) if not _exported(n, families)} - recorded
        if names:
            unknown[expr] = names
    return unknown


def _exported(name: str, families: frozenset[str]) -> bool:
    """A sample name's family is exported (histograms and counters add suffixes to their family's name)."""
    base = re.sub(r"_(bucket|sum|count|total|created)$", "", name)
    return name in families or base in families or f"{base}_total" in families


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
