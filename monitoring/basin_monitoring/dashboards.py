"""Basin's Grafana dashboards as code (grafana-foundation-sdk): *Basin overview*, *Engines*, *Profiling*.

`python -m basin_monitoring` writes them to `helm/basin/files/dashboards/*.json`, which the chart turns
into ConfigMaps for Grafana's dashboard sidecar; a test regenerates and compares, and evaluates every
query against a real Prometheus that scraped a surge run. Queries read only series the gateway and the
engines (SGLang, or the emulator under SGLang's names) export; the gateway's policy gauges are taken
from the leader replica.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DataSourceRef, VariableRefresh
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from basin_monitoring.promql import DECODE, PREFILL

DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
NS = 'namespace=~"$namespace"'
RATE = "$__rate_interval"
TOTAL = 'priority=""'  # SGLang's totals beside its per-priority breakdowns (matches series without it too)
PREFILL_TOTAL, DECODE_TOTAL = f"{PREFILL},{TOTAL}", f"{DECODE},{TOTAL}"


def gw(series: str, extra: str = "") -> str:
    """A gateway series in the selected namespaces."""
    selector = f"{NS},{extra}" if extra else NS
    return f"basin_gateway_{series}{{{selector}}}"


def leader(series: str) -> str:
    """The leader replica's value of a policy gauge (a follower's shows its stand-by brain)."""
    return f"max by (namespace) ({gw(series)} and {gw('leader')} == 1)"


def engine(series: str, selector: str = "") -> str:
    return f"sglang:{series}{{{NS}{',' + selector if selector else ''}}}"


def hit_rate(selector: str = PREFILL) -> str:
    return (
        f"sum by (namespace) (rate({engine('cached_tokens_total', selector)}[{RATE}]))"
        f" / sum by (namespace) (rate({engine('prompt_tokens_total', selector)}[{RATE}]))"
    )


def quantiles(
    bucket: str, by: str = "namespace", qs: tuple[float, ...] = (0.5, 0.9, 0.99)
) -> Iterator[tuple[str, str]]:
    for q in qs:
        yield (
            f"histogram_quantile({q}, sum by ({by}, le) (rate({bucket}[{RATE}])))",
            f"p{round(q * 100)} {{{{{by.split(',')[0].strip()}}}}}",
        )


def query(expr: str, legend: str = "", instant: bool = False) -> prometheus.Dataquery:
    q = prometheus.Dataquery().expr(expr).legend_format(legend or "__auto").datasource(DS)
    return q.instant().format(PromQueryFormat.TABLE) if instant else q.range()


def series(
    title: str,
    description: str,
    targets: list[tuple[str, str]],
    unit: str = "short",
    width: int = 12,
    stepped: bool = False,
) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(width)
        .height(8)
        .legend(common_b.VizLegendOptions().display_mode(common.LegendDisplayMode.LIST).show_legend(True))
    )
    if stepped:
        panel = panel.line_interpolation(common.LineInterpolation.STEP_AFTER)
    for index, (expr, legend) in enumerate(targets):
        panel = panel.with_target(query(expr, legend).ref_id(chr(ord("A") + index)))
    return panel


def single(title: str, description: str, expr: str, unit: str = "short", width: int = 4) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(width)
        .height(4)
        .with_target(query(expr, "{{namespace}}").ref_id("A"))
    )


def base(uid: str, title: str, description: str) -> dash.Dashboard:
    return (
        dash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["basin"])
        .time("now-3h", "now")
        .refresh("30s")
        .timezone("browser")
        .editable()
        .with_variable(dash.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            dash.QueryVariable("namespace")
            .label("Namespace")
            .datasource(DS)
            .query("label_values(basin_gateway_leader, namespace)")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .include_all(True)
            .all_value(".*")
            .multi(True)
        )
        .links([dash.DashboardLink("Basin").type("dashboards").tags(["basin"]).as_dropdown(True)])
    )


def overview() -> dash.Dashboard:
    d = base(
        "basin-overview",
        "Basin overview",
        "Sessions, the working set against the budget and the cache cliff, reuse, waits, sheds and the "
        "controller's state (docs/dashboards.md).",
    )
    d = d.with_row(dash.Row("Controller"))
    for title, description, expr, unit in [
        ("Leader", "Replicas leading (1 expected).", f"sum by (namespace) ({gw('leader')})", "short"),
        ("Redis up", "Replicas reaching Redis.", f"sum by (namespace) ({gw('redis_up')})", "short"),
        ("Profile κ", "κ of the profile in force.", f"max by (namespace) ({gw('profile_kappa')})", "short"),
        (
            "Profile λc",
            "Peak departures/min.",
            f"max by (namespace) ({gw('profile_lambda_c_per_min')})",
            "short",
        ),
        (
            "Profile age",
            "Since the profile in force was measured.",
            f"time() - max by (namespace) ({gw('profile_timestamp_seconds')})",
            "s",
        ),
        (
            "Telemetry stale",
            "Replicas whose last engine reading failed.",
            f"sum by (namespace) ({gw('telemetry_stale')})",
            "short",
        ),
    ]:
        d = d.with_panel(single(title, description, expr, unit))
    d = d.with_row(dash.Row("Sessions and the cache cliff"))
    d = d.with_panel(
        series(
            "Active and parked sessions",
            "Sessions admitted and not ended; sessions parked at the gateway (leader).",
            [
                (leader("sessions_active"), "active {{namespace}}"),
                (leader("sessions_parked"), "parked {{namespace}}"),
            ],
        )
    )
    d = d.with_panel(
        series(
            "Working set against B, B0 and the cliff κ·C",
            "W: Σ current contexts of active sessions. B: the admission budget (absent while not engaged). "
            "B0: its anchor. Cliff: κ·x_k·C from the profile. W approaching the cliff while the hit rate "
            "falls is the early warning.",
            [
                (leader("working_set_tokens"), "W {{namespace}}"),
                (f"{leader('budget_tokens')} < +Inf", "B {{namespace}}"),
                (leader("b0_tokens"), "B0 {{namespace}}"),
                (f"max by (namespace) ({gw('cliff_tokens')})", "cliff κ·x_k·C {{namespace}}"),
                (leader("reserved_tokens"), "Σ Ŵ reserved {{namespace}}"),
            ],
        )
    )
    d = d.with_panel(
        series(
            "Prefix hit rate",
            "Cached over prompt tokens prefilled (engines), and what the leader's last control step saw. "
            "A fall of 0.1 below the baseline while sessions rise is the trap signature. BASIN's budget "
            "follows warm returns (calls back within a minute of their previous answer): it falls once they "
            "drop 0.05 below their plateau.",
            [
                (hit_rate(), "engines {{namespace}}"),
                (leader("telemetry_hit_rate"), "control step {{namespace}}"),
                (leader("warm_hit_rate"), "warm returns {{namespace}}"),
                (leader("warm_hit_plateau"), "warm plateau {{namespace}}"),
            ],
            unit="percentunit",
        )
    )
    d = d.with_panel(
        series(
            "First-call wait",
            "Model seconds from a session's arrival to its first forwarded call (parked time included).",
            list(quantiles(gw("first_call_wait_seconds_bucket"))),
            unit="s",
        )
    )
    d = d.with_row(dash.Row("Decisions"))
    d = d.with_panel(
        series(
            "Sessions ended by outcome and reason",
            "Per minute: shed/rejected by reason, completed, ended, failed (leader's running totals).",
            [
                (
                    f"sum by (namespace, outcome, reason) (rate({gw('sessions_ended')}[{RATE}])) * 60",
                    "{{outcome}} {{reason}}",
                )
            ],
        )
    )
    d = d.with_panel(
        series(
            "Admission, ordering and lending",
            "BASIN's flags on the leader (1: engaged).",
            [
                (leader(f"{flag}_active"), f"{flag} {{{{namespace}}}}")
                for flag in ("admission", "ordering", "lending")
            ],
            stepped=True,
        )
    )
    d = d.with_panel(
        series(
            "Answers by status",
            "Calls answered per second, by route and status (429: parked, 503: shed or rejected).",
            [(f"sum by (namespace, status) (rate({gw('requests_total')}[{RATE}]))", "{{status}}")],
            unit="reqps",
        )
    )
    d = d.with_panel(
        series(
            "Engine backlog seen by the controller",
            "Q_P (uncached prefill tokens waiting) and Q_D (requests waiting for decode memory), leader.",
            [
                (leader("telemetry_prefill_backlog_tokens"), "Q_P tokens {{namespace}}"),
                (leader("telemetry_decode_waiting_requests"), "Q_D requests {{namespace}}"),
            ],
        )
    )
    return d


def engines() -> dash.Dashboard:
    d = base(
        "basin-engines",
        "Basin engines",
        "SGLang prefill and decode engines under SGLang's own metric names (the emulator exports the same).",
    )
    d = d.with_row(dash.Row("Queues"))
    d = d.with_panel(
        series(
            "Running and queued requests",
            'Per role; `priority=""` keeps the totals SGLang records beside per-priority breakdowns.',
            [
                (
                    f"sum by (engine_type) ({engine('num_running_reqs', TOTAL)})",
                    "running {{engine_type}}",
                ),
                (
                    f"sum by (engine_type) ({engine('num_queue_reqs', TOTAL)})",
                    "queued {{engine_type}}",
                ),
            ],
        )
    )
    d = d.with_panel(
        series(
            "PD queues",
            "Prefill: waiting for decode to reserve KV (bootstrap), KV being sent (inflight). Decode: "
            "waiting "
            "for a KV reservation (prealloc), reserved and awaiting prefill or transfer (transfer).",
            [
                (f"sum({engine('num_prefill_bootstrap_queue_reqs', PREFILL_TOTAL)})", "prefill bootstrap"),
                (f"sum({engine('num_prefill_inflight_queue_reqs', PREFILL_TOTAL)})", "prefill inflight"),
                (f"sum({engine('num_decode_prealloc_queue_reqs', DECODE_TOTAL)})", "decode prealloc"),
                (f"sum({engine('num_decode_transfer_queue_reqs', DECODE_TOTAL)})", "decode transfer"),
            ],
        )
    )
    d = d.with_row(dash.Row("Memory and reuse"))
    d = d.with_panel(
        series(
            "KV token usage",
            "Share of KV capacity held by requests, per role (evictable cache not counted).",
            [
                (
                    f"sum by (engine_type) ({engine('num_used_tokens')}) / sum by (engine_type) "
                    f"({engine('max_total_num_tokens')})",
                    "{{engine_type}}",
                )
            ],
            unit="percentunit",
        )
    )
    d = d.with_panel(
        series(
            "Prefix hit rate by tier",
            "Cached prompt tokens per tier (device: GPU, host: HiCache host memory) over prompt tokens.",
            [
                (
                    f"sum by (cache_source) (rate({engine('cached_tokens_total', PREFILL)}[{RATE}]))"
                    " / ignoring (cache_source) group_left "
                    f"sum(rate({engine('prompt_tokens_total', PREFILL)}[{RATE}]))",
                    "{{cache_source}}",
                )
            ],
            unit="percentunit",
        )
    )
    d = d.with_panel(
        series(
            "Host tier and lent decode memory",
            "HiCache host tier tokens in use, and decode KV lent to the prefix cache (Basin's lending).",
            [
                (f"sum({engine('hicache_host_used_tokens', PREFILL)})", "host tier used"),
                (f"sum({engine('basin_lent_tokens', DECODE)})", "lent by decode"),
            ],
        )
    )
    d = d.with_panel(
        series(
            "Retractions",
            "Decode requests retracted per second (memory ran out mid-decode), and those waiting to resume.",
            [
                (f"sum(rate({engine('num_retracted_requests_total', DECODE)}[{RATE}]))", "retracted/s"),
                (f"sum({engine('num_retracted_reqs', DECODE)})", "waiting to resume"),
            ],
        )
    )
    d = d.with_row(dash.Row("Latency"))
    d = d.with_panel(
        series(
            "Time to first token",
            "SGLang's TTFT histogram.",
            list(quantiles(engine("time_to_first_token_seconds_bucket"), "engine_type")),
            unit="s",
        )
    )
    d = d.with_panel(
        series(
            "Inter-token latency",
            "SGLang's ITL histogram (the paper's SLO: 50 ms).",
            list(quantiles(engine("inter_token_latency_seconds_bucket"), "engine_type")),
            unit="s",
        )
    )
    d = d.with_panel(
        series(
            "End-to-end request latency",
            "SGLang's e2e histogram.",
            list(quantiles(engine("e2e_request_latency_seconds_bucket"), "engine_type")),
            unit="s",
        )
    )
    d = d.with_panel(
        series(
            "KV transfer latency",
            "Prefill to decode KV transfer, SGLang's histogram.",
            list(quantiles(engine("kv_transfer_latency_ms_bucket", PREFILL), "engine_type")),
            unit="ms",
        )
    )
    d = d.with_panel(
        series(
            "Token throughput",
            "Prompt tokens prefilled and tokens generated per second.",
            [
                (f"sum(rate({engine('prompt_tokens_total', PREFILL)}[{RATE}]))", "prompt"),
                (f"sum(rate({engine('generation_tokens_total', DECODE)}[{RATE}]))", "generated"),
            ],
            width=24,
        )
    )
    return d


def profiling() -> dash.Dashboard:
    d = base(
        "basin-profiling",
        "Basin profiling",
        "The profile in force (κ, λc, its age) over time and the ramps it was fitted from.",
    )
    d = d.with_panel(
        series(
            "κ over time",
            "The cliff scale of the profile in force.",
            [(f"max by (namespace) ({gw('profile_kappa')})", "κ {{namespace}}")],
        )
    )
    d = d.with_panel(
        series(
            "λc over time",
            "Peak departure rate of the profile in force (sessions/min); shedding starts "
            "when long-run arrivals exceed it.",
            [(f"max by (namespace) ({gw('profile_lambda_c_per_min')})", "λc {{namespace}}")],
        )
    )
    d = d.with_panel(
        series(
            "Working set over cache against the cliff",
            "W/C now, and κ·x_k, where the profile puts the cliff (C: the larger of GPU cache and "
            "host tier).",
            [
                (
                    f"{leader('working_set_tokens')} / on (namespace) "
                    f"max by (namespace) ({gw('profile_cache_tokens')})",
                    "W/C {{namespace}}",
                ),
                (
                    f"max by (namespace) ({gw('cliff_tokens')}) / "
                    f"max by (namespace) ({gw('profile_cache_tokens')})",
                    "κ·x_k {{namespace}}",
                ),
            ],
        )
    )
    d = d.with_panel(
        series(
            "Profile age",
            "Since the profile in force was measured.",
            [(f"time() - max by (namespace) ({gw('profile_timestamp_seconds')})", "{{namespace}}")],
            unit="s",
        )
    )
    ramp = (
        table.Panel()
        .title("Ramp results")
        .description(
            "Each profiling ramp step: the W/C it reached, the hit rate it settled at and the "
            "sessions/min departing; κ is fitted where the hit rate falls off."
        )
        .datasource(DS)
        .span(24)
        .height(10)
        .with_target(
            query(
                f"max by (namespace, ramp, step) ({gw('profile_ramp_working_set_ratio')})", "", True
            ).ref_id("W/C")
        )
        .with_target(
            query(f"max by (namespace, ramp, step) ({gw('profile_ramp_hit_rate')})", "", True).ref_id("hit")
        )
        .with_target(
            query(
                f"max by (namespace, ramp, step) ({gw('profile_ramp_departures_per_min')})", "", True
            ).ref_id("departures")
        )
    )
    return d.with_panel(ramp)


DASHBOARDS = {"basin-overview": overview, "basin-engines": engines, "basin-profiling": profiling}


def render(name: str) -> str:
    """One dashboard as the JSON Grafana imports (stable key order, so the committed copy diffs cleanly)."""
    built = json.loads(json.dumps(DASHBOARDS[name]().build(), cls=JSONEncoder))
    for number, panel in enumerate(built.get("panels", []), start=1):
        panel["id"] = number  # stable ids: Grafana keys panel links and state by them
    return json.dumps(built, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def expressions(name: str) -> list[str]:
    """Every PromQL expression of a dashboard's panels and variables (the test evaluates each)."""
    data = json.loads(render(name))
    out = [t["expr"] for p in data.get("panels", []) for t in p.get("targets", []) if t.get("expr")]
    return out
