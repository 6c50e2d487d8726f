"""The PromQL both the dashboards and the alert rules read, in one place.

Every signal is aggregated `by (namespace)`: one BasinDeployment's engines and gateway replicas live in
one namespace, and the recording rules' series then match each other label for label. The gateway's
policy gauges are read from the replica whose `leader` is 1 (a follower's show its idle stand-by brain).
Windows are production durations; `scaled` divides them for the time-scaled test runs.
"""

from __future__ import annotations

import re

PREFILL = 'engine_type="prefill"'
DECODE = 'engine_type="decode"'


def leader(series: str) -> str:
    """The leader replica's value of a gateway gauge, per namespace."""
    return f"max by (namespace) (basin_gateway_{series} and basin_gateway_leader == 1)"


def hit_rate(window: str, selector: str = PREFILL) -> str:
    """Prefix hit rate over prompt tokens prefilled in the window, as the gateway's telemetry computes it."""
    return (
        f"sum by (namespace) (rate(sglang:cached_tokens_total{{{selector}}}[{window}]))"
        f" / sum by (namespace) (rate(sglang:prompt_tokens_total{{{selector}}}[{window}]))"
    )


_DURATION = re.compile(r"^(\d+)([smhd])$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(duration: str) -> int:
    match = _DURATION.match(duration)
    if match is None:
        raise ValueError(f"not a simple Prometheus duration: {duration!r}")
    return int(match.group(1)) * _SECONDS[match.group(2)]


def scaled(duration: str, scale: float) -> str:
    """`duration` divided by `scale` (at least 2 s, so a rate still sees two 1 s scrapes)."""
    if scale == 1:
        return duration
    return f"{max(2, round(seconds(duration) / scale))}s"
