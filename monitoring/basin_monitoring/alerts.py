"""Basin's Prometheus rules (`helm/basin/files/alerts/basin.yaml`): recording rules for the signals, then
one alert per failure an operator must act on, each linking to its section of docs/runbook.md (as published
on GitHub: `RUNBOOK_URL`).

The rules are data here so a test can render the same file with every window and `for:` divided by the
emulator's time scale and have a real Prometheus evaluate them during a surge run.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import yaml

from basin_monitoring.promql import DECODE, hit_rate, leader, scaled

# Where docs/runbook.md is published: each alert's runbook_url is this page and the alert's section anchor.
# The chart's `monitoring.prometheusRule.runbookBaseUrl` replaces the page (a docs mirror, an internal wiki).
RUNBOOK_URL = "https://github.com/basin-project/basin/blob/main/docs/runbook.md"


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a Markdown page's headings (lower case, punctuation dropped, spaces to
    hyphens): what each alert's `anchor` must be one of in docs/runbook.md."""
    out = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return out


# Windows (production durations); `render(scale)` divides them.
W = {
    "rate": "5m",  # the hit rate's window
    "baseline": "1h",  # the hit rate a trap is measured against ...
    "baseline_offset": "15m",  # ... ending this long ago, so a fresh fall does not drag it down
    "trend": "10m",  # how far back "falling" and "rising" look
}


@dataclass(frozen=True)
class Condition:
    """`signal op threshold`; the signal alone must return data (the test evaluates it)."""

    signal: str
    op: str
    threshold: str

    def expr(self) -> str:
        return f"({self.signal}) {self.op} {self.threshold}"


@dataclass(frozen=True)
class Alert:
    name: str
    conditions: tuple[Condition, ...]
    for_: str
    severity: str
    summary: str
    description: str
    anchor: str  # the runbook section
    labels: dict[str, str] = field(default_factory=dict)

    def expr(self) -> str:
        return "\n  and\n".join(c.expr() for c in self.conditions)


def recording(scale: float = 1) -> list[tuple[str, str]]:
    """(record, expr) pairs; the alerts and the overview dashboard read these."""
    w = {k: scaled(v, scale) for k, v in W.items()}
    return [
        # At most 1: a series that appears mid-window (the first host hit) has its rate extrapolated back
        # to the window's start, and early in a run that pushed the ratio over 1 and the baseline with it.
        ("basin:prefix_hit_rate:rate", f"clamp_max({hit_rate(w['rate'])}, 1)"),
        (
            "basin:prefix_hit_rate:baseline",
            f"avg_over_time(basin:prefix_hit_rate:rate[{w['baseline']}] offset {w['baseline_offset']})",
        ),
        (
            # TTFT as clients see it: the decode side's, which includes the wait for prefill and transfer.
            "basin:ttft_seconds:p50",
            "histogram_quantile(0.5, sum by (namespace, le) "
            f"(rate(sglang:time_to_first_token_seconds_bucket{{{DECODE}}}[{w['rate']}])))",
        ),
        ("basin:sessions_active:leader", leader("sessions_active")),
        ("basin:sessions_parked:leader", leader("sessions_parked")),
        ("basin:working_set_tokens:leader", leader("working_set_tokens")),
        ("basin:cliff_tokens:max", "max by (namespace) (basin_gateway_cliff_tokens)"),
    ]


# Thresholds an operator may tune (docs/runbook.md says what each protects).
# The early warning: W above this share of κ·x_k·C (in the live surge runs HiCache alone's hit rate
# collapsed at 0.84-1.05 of it, so the warning must start below; BASIN's own budget admits by predicted
# peaks up to m·κ·x_k·C, m = 0.9, which the hit-rate and growth conditions keep quiet while it holds) ...
CLIFF_SHARE = 0.8
CLIFF_HIT_FALL = 0.1  # ... while the hit rate fell at least this much over the trend window ...
# ... and active sessions still grow over this window: the trap's loop is feeding (a deployment already
# draining sessions is recovering, not approaching the cliff).
CLIFF_RISING = "5m"
TRAP_HIT_DROP = 0.1  # the trap: hit rate this far below its baseline (the paper's "trapped" label) ...
# ... while calls are slow: median TTFT above the bound of §7.1's degraded window. A healthy operating point
# may keep a lower hit rate (BASIN's budget admits while warm returns still hit, and returns from long tool
# runs miss at any load); the trap is reuse lost *and* the engine degraded.
TRAP_TTFT_P50_S = 5.0
FIRST_CALL_WAIT_P90_S = 300  # the paper's degraded-window bound on first-call waits (5 minutes)
PROFILE_MAX_AGE_S = 7 * 86400


def alerts(scale: float = 1) -> list[Alert]:
    w = {k: scaled(v, scale) for k, v in W.items()}

    def f(duration: str) -> str:
        return scaled(duration, scale)

    return [
        Alert(
            "BasinApproachingCacheCliff",
            (
                Condition("basin:working_set_tokens:leader", ">", f"{CLIFF_SHARE} * basin:cliff_tokens:max"),
                Condition(
                    f"basin:prefix_hit_rate:rate offset {w['trend']} - basin:prefix_hit_rate:rate",
                    ">=",
                    str(CLIFF_HIT_FALL),
                ),
                Condition(f"deriv(basin:sessions_active:leader[{f(CLIFF_RISING)}])", ">", "0"),
            ),
            f("5m"),
            "warning",
            "Working set near the cache cliff while the prefix hit rate falls",
            "The sessions' working set W is above "
            f"{CLIFF_SHARE:.0%} of the profiled cliff κ·x_k·C and the prefix hit rate fell by at least "
            f"{CLIFF_HIT_FALL} over {W['trend']} while active sessions keep growing: more sessions now push "
            "the deployment over the cliff into the cache trap.",
            "approaching-the-cache-cliff",
        ),
        Alert(
            "BasinCacheTrap",
            (
                Condition(
                    "basin:prefix_hit_rate:baseline - basin:prefix_hit_rate:rate", ">=", str(TRAP_HIT_DROP)
                ),
                Condition("basin:ttft_seconds:p50", ">", f"{TRAP_TTFT_P50_S:g}"),
                Condition(f"deriv(basin:sessions_active:leader[{w['trend']}])", ">", "0"),
            ),
            f("10m"),
            "critical",
            "Cache-trap signature: hit rate far below its baseline, calls slow, active sessions piling up",
            f"The prefix hit rate is at least {TRAP_HIT_DROP} below its baseline (the hour before the last "
            f"{W['baseline_offset']}), the median time to first token is above {TRAP_TTFT_P50_S:g} s and "
            "active sessions keep rising: recomputation slows every call, sessions live longer and more pile "
            "up; the engine will not recover by itself.",
            "cache-trap",
        ),
        Alert(
            "BasinSustainedShedding",
            (
                Condition(
                    "sum by (namespace) "
                    f'(rate(basin_gateway_sessions_ended{{outcome=~"shed|rejected"}}[{f("10m")}]))',
                    ">",
                    "0",
                ),
            ),
            f("15m"),
            "warning",
            "Basin keeps shedding or rejecting sessions",
            "Sessions have been shed or rejected for 15 minutes: long-run arrivals exceed the profiled peak "
            "departure rate λc, or parked sessions wait past --max-park-wait.",
            "sustained-shedding",
        ),
        Alert(
            "BasinLongFirstCallWaits",
            (
                Condition(
                    "histogram_quantile(0.9, sum by (namespace, le) "
                    f"(rate(basin_gateway_first_call_wait_seconds_bucket[{f('10m')}])))",
                    ">",
                    str(FIRST_CALL_WAIT_P90_S),  # model seconds: the gateway's clock, unscaled
                ),
            ),
            f("10m"),
            "warning",
            "New sessions wait long for their first call",
            f"The 90th percentile of first-call waits is above {FIRST_CALL_WAIT_P90_S} s (model seconds): "
            "new sessions are parked or queued for minutes.",
            "long-first-call-waits",
        ),
        Alert(
            "BasinProfileStale",
            (
                Condition(
                    "time() - max by (namespace) (basin_gateway_profile_timestamp_seconds)",
                    ">",
                    str(PROFILE_MAX_AGE_S),
                ),
            ),
            f("1h"),
            "warning",
            "The deployment profile is old",
            "κ and λc were measured more than 7 days ago; the engines, model or workload may have changed.",
            "stale-or-failed-profile",
        ),
        Alert(
            "BasinProfileMissingOrRefused",
            (
                Condition(
                    "max by (namespace) "
                    '(basin_gateway_profile_refused or basin_gateway_profile_info{source="none"})',
                    ">",
                    "0",
                ),
            ),
            f("30m"),
            "warning",
            "The gateway runs without a usable profile",
            "The profile file holds a profile the gateway refused (another deployment's, or malformed), or "
            "none arrived: the gateway forwards everything (HiCache alone) or keeps an outdated profile.",
            "stale-or-failed-profile",
        ),
        Alert(
            "BasinGatewayWithoutLeader",
            (Condition("max by (namespace) (basin_gateway_leader)", "<", "1"),),
            f("1m"),
            "critical",
            "No gateway replica leads",
            "No replica holds the leader lease: calls get 429 `no-leader` and nothing is admitted.",
            "gateway-without-a-leader",
        ),
        Alert(
            "BasinRedisUnreachable",
            (Condition("min by (namespace) (basin_gateway_redis_up)", "<", "1"),),
            f("2m"),
            "critical",
            "A gateway replica cannot reach Redis",
            "Replicas decide locally; the single-ledger guarantee is suspended until Redis returns.",
            "redis-unreachable",
        ),
    ]


def rules(scale: float = 1, runbook_url: str = RUNBOOK_URL) -> dict:
    """The rule file as a dict (Prometheus rule-file format, top-level `groups:`); each alert's
    `runbook_url` is `runbook_url#<its section's anchor>`."""
    return {
        "groups": [
            {
                "name": "basin.recording",
                "rules": [{"record": r, "expr": e} for r, e in recording(scale)],
            },
            {
                "name": "basin.alerts",
                "rules": [
                    {
                        "alert": a.name,
                        "expr": a.expr(),
                        "for": a.for_,
                        "labels": {"severity": a.severity, **a.labels},
                        "annotations": {
                            "summary": a.summary,
                            "description": a.description,
                            "runbook_url": f"{runbook_url}#{a.anchor}",
                        },
                    }
                    for a in alerts(scale)
                ],
            },
        ]
    }


HEADER = (
    "# Generated by `python -m basin_monitoring` from monitoring/basin_monitoring/alerts.py; do not edit.\n"
)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the alert expressions) as literal blocks, which read like PromQL."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(scale: float = 1, runbook_url: str = RUNBOOK_URL) -> str:
    return HEADER + yaml.dump(
        rules(scale, runbook_url), Dumper=_Dumper, sort_keys=False, width=1000, allow_unicode=True
    )
