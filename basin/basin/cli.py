"""The `basin` command: the one place that knows every component.

Components are imported inside their subcommands, so `basin workload` needs neither kopf nor aiohttp.
User errors (BasinError) print one line and exit with status 2; they never show a traceback.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from basin import __version__
from basin.errors import BasinError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from rich.progress import Progress, ProgressColumn

    from basin.evaluate.trapmap import Outcome
    from basin.workload import WorkloadSpec

EXIT_USER_ERROR = 2

_WORKLOAD_HELP = (
    "terminal-bench or swe-pro (synthetic, shaped like the paper's traces), or the path"
    " of a session file (JSONL) or a Mooncake trace."
)


workload_scale_options = [
    click.option(
        "--tool-time-scale", type=float, default=1.0, show_default=True, help="Multiply every tool gap."
    ),
    click.option(
        "--output-scale",
        type=float,
        default=1.0,
        show_default=True,
        help="Multiply output lengths (later prompts grow by the extra tokens, unless --keep-prompts).",
    ),
    click.option(
        "--resend-outputs/--keep-prompts",
        default=True,
        show_default=True,
        help="With --output-scale: later prompts resend the extra output tokens (an agent's history), or"
        " keep their recorded lengths (reasoning a chat template strips; a replay of recorded prompts).",
    ),
]


def workload_options(default: str | None = None):  # type: ignore[no-untyped-def]
    """The options every command that reads a workload shares (`--workload` required without default);
    the command gets `workload` and `seed`, and the rest with them as `workload_spec`."""
    # click treats an explicit default=None as a default, so pass either `required` or `default`.
    chosen = {"required": True} if default is None else {"default": default, "show_default": True}
    options = [
        click.option("--workload", "workload", metavar="NAME|FILE", help=_WORKLOAD_HELP, **chosen),
        click.option(
            "--seed",
            type=int,
            default=0,
            show_default=True,
            help="Seed of the synthetic workload and of the run.",
        ),
        click.option(
            "--sessions",
            type=int,
            default=None,
            help="Generate this many sessions (synthetic) or read only the first ones (file).",
        ),
        *workload_scale_options,
    ]

    def decorate(command):  # type: ignore[no-untyped-def]
        @functools.wraps(command)
        def with_spec(  # type: ignore[no-untyped-def]
            *args, workload, seed, sessions, tool_time_scale, output_scale, resend_outputs, **kwargs
        ):
            from basin.workload import WorkloadSpec as Spec  # the one above is for annotations only

            spec = Spec(workload, seed, tool_time_scale, output_scale, sessions, resend_outputs)
            return command(*args, workload=workload, seed=seed, workload_spec=spec, **kwargs)

        return _options(options)(with_spec)

    return decorate


def _options(options: list):  # type: ignore[no-untyped-def,type-arg]
    def decorate(command):  # type: ignore[no-untyped-def]
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


def deployment_options(default: str):  # type: ignore[no-untyped-def]
    """The options that pick and shape a deployment preset (simulate, emulate)."""
    return _options(
        [
            click.option(
                "--deployment",
                default=default,
                show_default=True,
                metavar="PRESET",
                help=(
                    "h100-1p1d, h200-1p1d, h200-1p2d, h200-1p3d or h200-2p6d, or another shape"
                    " <gpu>-<P>p<D>d of h100 or h200 (host tier 2x unless --host-tier)."
                ),
            ),
            click.option(
                "--host-tier",
                type=float,
                default=None,
                help="Host tier as a multiple of the GPU prefix cache (0: GPU-only). Default: the preset's.",
            ),
            click.option(
                "--allocation-policy",
                "allocation",
                default=None,
                metavar="early|prefill_complete",
                help="When decode reserves KV: before prefill (SGLang's default) or at prefill completion.",
            ),
            click.option(
                "--router",
                default=None,
                metavar="cache_aware|affinity|least_loaded",
                help="Prefill routing across prefill instances.",
            ),
            click.option(
                "--transfer",
                type=click.Choice(["fixed", "proportional"]),
                default=None,
                help=(
                    "How the prefill-to-decode KV transfer is priced: the paper's fixed 10 ms (default)"
                    " or proportional to the prompt."
                ),
            ),
            click.option(
                "--state-slots",
                "state_slots",
                type=click.IntRange(min=1),
                default=None,
                metavar="N",
                help=(
                    "Recurrent-state snapshots each prefill instance keeps (a hybrid model's linear-attention"
                    " state): a cached prefix is reusable only up to a kept snapshot, the least recently used"
                    " going first. Default: no limit."
                ),
            ),
            click.option(
                "--waiting-prefix-refresh",
                "waiting_prefix_refresh",
                is_flag=True,
                default=None,
                help=(
                    "Keep the cached prefixes of the first 128 requests waiting for prefill recently used"
                    " (SGLang 0.5.23 refreshes them every 32 scheduling passes by default). Default: off,"
                    " as calibrated."
                ),
            ),
        ]
    )


def schedule_options():  # type: ignore[no-untyped-def]
    """The arrival schedule's options (simulate, replay); `_schedule` builds it from them."""
    return _options(
        [
            click.option(
                "--base-rate",
                type=float,
                default=None,
                help="Session arrivals per minute (required unless arrivals come from a trace).",
            ),
            click.option(
                "--surge-factor",
                type=float,
                default=1.0,
                show_default=True,
                help="Arrival-rate multiplier during the surge (2.0 = +100 %).",
            ),
            click.option("--surge-start-min", type=float, default=15.0, show_default=True),
            click.option("--surge-minutes", type=float, default=0.0, show_default=True, help="0: no surge."),
            click.option(
                "--post-surge-rate", type=float, default=None, help="Arrivals per minute after the surge."
            ),
            click.option(
                "--duration-min", type=float, default=120.0, show_default=True, help="Minutes to run."
            ),
        ]
    )


def warm_sessions_option():  # type: ignore[no-untyped-def]
    """Where a run starts (simulate, replay): with the steady population already running, so a surge
    early in the run meets the load it would meet in production, and both start from the same one."""
    return click.option(
        "--warm-sessions",
        type=int,
        default=None,
        help="Sessions running at time 0, joined mid-trajectory (a replay first sends each one's"
        " previous prompt for one token, so the server caches it). Default: rate x unloaded lifetime.",
    )


def _warm_sessions(value: int | None) -> int | None:
    if value is not None and value < 0:
        raise BasinError(f"--warm-sessions must not be negative, got {value}")
    return value


def endpoint_options(help_prefix: str = ""):  # type: ignore[no-untyped-def]
    """How a live run talks to its endpoint (replay, profile --target): time scale, wire format, model."""
    return _options(
        [
            click.option(
                "--time-scale",
                type=float,
                default=None,
                help=f"{help_prefix}Model seconds per wall second. "
                "Default: the server's own (an emulator reports it), else 1.",
            ),
            click.option(
                "--api",
                type=click.Choice(["openai", "sglang"]),
                default="openai",
                show_default=True,
                help=f"{help_prefix}openai: POST /v1/chat/completions; sglang: POST /generate with input_ids",
            ),
            click.option(
                "--model",
                default="default",
                show_default=True,
                help=f"{help_prefix}Model name sent with OpenAI requests.",
            ),
        ]
    )


def _schedule(
    base_rate: float | None,
    surge_factor: float,
    surge_start_min: float,
    surge_minutes: float,
    post_surge_rate: float | None,
    duration_min: float,
):  # type: ignore[no-untyped-def]
    from basin.workload import RateSchedule

    if base_rate is None:
        raise BasinError("Missing option '--base-rate'.")
    return RateSchedule(
        base_rate=base_rate,
        duration_min=duration_min,
        surge_factor=surge_factor,
        surge_start_min=surge_start_min,
        surge_minutes=surge_minutes,
        post_surge_rate=post_surge_rate,
    )


def _warn(message: str) -> None:
    """A warning on stderr: the run goes on, but its figures may not mean what they seem to."""
    click.echo(f"warning: {message}", err=True)


def _console():  # type: ignore[no-untyped-def]
    """Rich console; wide when piped, so tables in logs and CI keep one line per row."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _progress(*columns: str | ProgressColumn, transient: bool = False, disable: bool = False) -> Progress:
    """Rich progress bar on stderr, so that stdout carries only the command's results (piped, a
    transient bar left an empty first line there)."""
    from rich.console import Console
    from rich.progress import Progress

    return Progress(*columns, console=Console(stderr=True), transient=transient, disable=disable)


def _writable(out: str) -> Path:
    """Check, before any long work, that an output file can be created where the user asked."""
    path = Path(out)
    if not path.parent.is_dir():
        raise BasinError(f"cannot write {path}: the folder {path.parent} does not exist")
    return path


def _write_json(payload: dict, json_out: str | None) -> None:
    """`--json`: `-` prints one line to stdout (and nothing else is printed), a path gets the file."""
    if json_out == "-":
        click.echo(json.dumps(payload))
    elif json_out:
        Path(json_out).write_text(json.dumps(payload, indent=1))


def _report_run(
    payload: dict,
    summary,  # type: ignore[no-untyped-def]
    records,
    json_out: str | None,
    plot_out: str | None,
    plot_title: str,
    **table: object,
) -> None:
    """A simulated or replayed run's outputs: the JSON, the time-series figure, the summary table."""
    _write_json(payload, json_out)
    if plot_out:
        from basin.evaluate.plot import plot_run

        plot_run(summary, records, plot_out, title=plot_title)
    if json_out != "-":
        _print_summary(payload, **table)  # type: ignore[arg-type]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="basin")
def cli() -> None:
    """Basin keeps SGLang prefill-decode deployments serving LLM agents out of the cache trap."""


@cli.group()
def workload() -> None:
    """Agent workloads: statistics and the session file."""


@workload.command("stats")
@workload_options()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def workload_stats(
    workload: str,
    seed: int,
    workload_spec: WorkloadSpec,
    as_json: bool,
) -> None:
    """Print a workload's statistics beside the paper's published values."""
    from basin.workload import PUBLISHED, compute_stats

    loaded = workload_spec.load()
    stats = compute_stats(loaded).to_dict()
    names = {s.workload for s in loaded}
    source = names.pop() if len(names) == 1 else ""
    # Targets hold for the unscaled trajectories only.
    published = PUBLISHED.get(source, {}) if not workload_spec.scaled else {}
    if as_json:
        click.echo(json.dumps({"workload": workload, "seed": seed, **stats, "published": published}))
        return

    from rich.table import Table

    table = Table(title=f"{workload} (seed {seed})" if workload in PUBLISHED else workload)
    for column in ("statistic", "value", "paper", "ratio"):
        table.add_column(column, justify="left" if column == "statistic" else "right")
    for key, value in stats.items():
        target = published.get(key)
        shown = _format_number(value)
        paper = "" if target is None else _format_number(target)
        ratio = "" if target is None else f"{value / target:.3f}"
        table.add_row(key, shown, paper, ratio)
    _console().print(table)


def _format_number(value: float) -> str:
    if isinstance(value, int):
        return f"{value:,d}"
    if abs(value) < 10:
        return f"{value:.3f}"
    return f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"


shared_prefix_option = click.option(
    "--shared-prefix",
    "shared_prefix",
    type=click.IntRange(min=0),
    default=None,
    metavar="TOKENS",
    help="Open every session's first prompt with the same TOKENS tokens (the agent's system prompt and tool"
    " schema), shared across sessions in the prefix cache; a shorter first prompt is all shared. Default:"
    " the workload's own (terminal-bench 8192, swe-pro none; 0 removes it).",
)


@workload.command("export")
@workload_options()
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, writable=True, allow_dash=True),
    default="-",
    show_default=True,
    help="Session file to write (JSONL); - for stdout.",
)
@shared_prefix_option
def workload_export(
    workload: str,
    seed: int,
    workload_spec: WorkloadSpec,
    out: str,
    shared_prefix: int | None,
) -> None:
    """Write a workload as a session file (one JSON session per line, see docs/session-file.md)."""
    from basin.workload import write_sessions

    loaded = workload_spec.load(shared_prefix)
    if out == "-":
        write_sessions(loaded, sys.stdout)
        return
    path = _writable(out)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        count = write_sessions(loaded, handle)
    tmp.replace(path)  # never leave a half-written session file behind
    click.echo(f"wrote {count} sessions to {path}", err=True)


def _float_list(text: str, option: str) -> tuple[float, ...]:
    """`2.5,3.3` → (2.5, 3.3); anything else is a user error naming the option."""
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise BasinError(f"{option} takes a comma list of numbers, got {text!r}") from None
    if not values:
        raise BasinError(f"{option} takes a comma list of numbers, got {text!r}")
    return tuple(dict.fromkeys(values))


@cli.command("simulate")
@deployment_options(default="h100-1p1d")
@click.option(
    "--policy",
    default="hicache",
    show_default=True,
    help="Session policy: hicache (SGLang alone), continuum, thunderagent, concur, crossflow, composition, "
    "basin, or basin-arrival (the prototype).",
)
@click.option(
    "--prediction",
    default="predictor",
    show_default=True,
    metavar="predictor|oracle|noisy:SIGMA",
    help="BASIN's peak-context estimates: cross-fitted predictor, true peaks, or noisy true peaks.",
)
@click.option("--kappa", type=float, default=None, help="BASIN's profiled cliff scale κ (default 1.0).")
@click.option(
    "--lambda-c",
    type=float,
    default=None,
    help="BASIN's profiled peak departure rate, sessions/min (default: the fluid model's peak).",
)
@workload_options(default="terminal-bench")
@schedule_options()
@click.option(
    "--arrivals",
    type=click.Choice(["poisson", "trace"]),
    default="poisson",
    show_default=True,
    help="poisson: draw sessions at --base-rate (and the surge); trace: replay each session of a"
    " Mooncake trace once, at the trace's own timestamps.",
)
@warm_sessions_option()
@click.option(
    "--terminate-surge-sessions",
    is_flag=True,
    help="End every session that arrived during the surge when it ends (paper §3.3).",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    default=None,
    help="Write the full result as JSON (- for stdout).",
)
@click.option(
    "--plot",
    "plot_out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write a time-series figure (PNG).",
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def simulate(
    deployment: str,
    host_tier: float | None,
    allocation: str | None,
    router: str | None,
    transfer: str | None,
    state_slots: int | None,
    waiting_prefix_refresh: bool | None,
    policy: str,
    workload: str,
    seed: int,
    workload_spec: WorkloadSpec,
    base_rate: float | None,
    surge_factor: float,
    surge_start_min: float,
    surge_minutes: float,
    post_surge_rate: float | None,
    duration_min: float,
    arrivals: str,
    warm_sessions: int | None,
    terminate_surge_sessions: bool,
    json_out: str | None,
    plot_out: str | None,
    quiet: bool,
    prediction: str,
    kappa: float | None,
    lambda_c: float | None,
) -> None:
    """Simulate agent sessions on a PD deployment and report goodput, latency and the run's state."""
    from basin.policy import POLICIES
    from basin.sim import Simulation, SimulationConfig, get_deployment
    from basin.sim.policies import build_policy

    preset = get_deployment(
        deployment,
        host_tier=host_tier,
        allocation=allocation,
        router=router,
        transfer=transfer,
        state_slots=state_slots,
        waiting_prefix_refresh=waiting_prefix_refresh,
    )
    if policy not in POLICIES:
        raise BasinError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if arrivals == "trace":
        if base_rate is not None or surge_minutes > 0 or post_surge_rate is not None:
            raise BasinError(
                "--arrivals trace takes its times from the trace: drop --base-rate and the surge"
            )
        base_rate = 0.0
    schedule = _schedule(
        base_rate, surge_factor, surge_start_min, surge_minutes, post_surge_rate, duration_min
    )
    warm_sessions = _warm_sessions(warm_sessions)
    for path in (json_out, plot_out):
        if path and path != "-":
            _writable(path)
    pool = workload_spec.load()
    agent_policy = build_policy(policy, preset, pool, seed, prediction, kappa, lambda_c)
    config = SimulationConfig(
        preset,
        schedule,
        seed=seed,
        warm_sessions=warm_sessions,
        terminate_surge_sessions=terminate_surge_sessions,
        arrivals=arrivals,
    )
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    with _progress(
        TextColumn("simulating"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} min"),
        TimeElapsedColumn(),
        disable=quiet,
        transient=True,
    ) as progress:
        task = progress.add_task("simulate", total=duration_min)
        sim = Simulation(
            config, agent_policy, pool, progress=lambda t: progress.update(task, completed=t / 60)
        )
        result = sim.run()
    summary = result.summary
    payload = {
        "deployment": preset.name,
        "host_tier": preset.host_tier,
        "allocation": preset.allocation,
        "router": preset.router,
        "transfer": preset.transfer,
        "state_slots": preset.gpu.recurrent_state_slots,
        "waiting_prefix_refresh": preset.waiting_prefix_refresh,
        "policy": policy,
        "workload": workload,
        "seed": seed,
        "base_rate": base_rate,
        "arrivals": arrivals,
        "surge_factor": surge_factor,
        "surge_start_min": surge_start_min,
        "surge_minutes": surge_minutes,
        "duration_min": duration_min,
        "warm_sessions": result.warm_sessions,
        **summary.to_dict(),
        "events": result.events,
        "wall_seconds": result.wall_seconds,
    }
    title = f"{preset.name}, {policy}, {base_rate:g}/min, surge x{surge_factor:g}"
    _report_run(payload, summary, result.records, json_out, plot_out, title)


@cli.command("emulate")
@deployment_options(default="h200-1p3d")
@click.option(
    "--lending",
    is_flag=True,
    help="Keep prompts of requests marked custom_params.basin_lend in idle decode memory (BASIN's lending).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=30000, show_default=True, help="Port (0: any free port).")
@click.option(
    "--time-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Model seconds per wall second (10: the deployment runs ten times faster than real time).",
)
@click.option("--model-name", default="basin-emulated", show_default=True, help="The served model name.")
@click.option(
    "--context-length", type=int, default=262_144, show_default=True, help="Longest prompt plus output."
)
def emulate(
    deployment: str,
    host_tier: float | None,
    allocation: str | None,
    router: str | None,
    transfer: str | None,
    state_slots: int | None,
    waiting_prefix_refresh: bool | None,
    lending: bool,
    host: str,
    port: int,
    time_scale: float,
    model_name: str,
    context_length: int,
) -> None:
    """Serve SGLang's HTTP API and metrics from the calibrated engine model (no GPU, no model)."""
    import asyncio
    import logging

    from basin.sim import get_deployment

    try:
        from basin_emulator.server import EmulatorSettings, serve
    except ImportError as error:
        raise BasinError(f"the emulator needs: pip install 'basin[emulator]' ({error})") from None
    preset = get_deployment(
        deployment,
        host_tier=host_tier,
        allocation=allocation,
        router=router,
        transfer=transfer,
        state_slots=state_slots,
        waiting_prefix_refresh=waiting_prefix_refresh,
    )
    if time_scale <= 0:
        raise BasinError(f"--time-scale must be positive, got {time_scale}")
    if context_length < 1:
        raise BasinError(f"--context-length must be positive, got {context_length}")
    if not 0 <= port < 65536:
        raise BasinError(f"--port must be between 0 and 65535, got {port}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = EmulatorSettings(preset, time_scale, lending, model_name, context_length)

    def ready(bound: int) -> None:
        logging.getLogger("basin.emulator").info(
            "EMULATOR (no GPU, no model): SGLang-compatible %s (%dP%dD, host tier %gx, %s allocation%s) "
            "at http://%s:%d, time x%g",
            preset.name,
            preset.prefill_instances,
            preset.decode_instances,
            preset.host_tier,
            preset.allocation,
            ", lending" if lending else "",
            host,
            bound,
            time_scale,
        )

    try:
        asyncio.run(serve(settings, host, port, ready))
    except KeyboardInterrupt:
        logging.getLogger("basin.emulator").info("stopped")


@cli.command("replay")
@click.option(
    "--target", required=True, metavar="URL", help="Base URL of the endpoint, e.g. http://127.0.0.1:30000."
)
@workload_options(default="terminal-bench")
@schedule_options()
@warm_sessions_option()
@endpoint_options()
@click.option(
    "--max-concurrency", type=int, default=512, show_default=True, help="Requests in flight at most."
)
@click.option(
    "--max-errors",
    type=int,
    default=50,
    show_default=True,
    help="Stop the run after this many connection errors and failed requests.",
)
@click.option(
    "--reference-gpu",
    type=click.Choice(["h100", "h200"]),
    default=None,
    help="GPU whose unloaded session times define slowdown. Default: the emulator's, else h200.",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    default=None,
    help="Write the full result as JSON (- for stdout).",
)
@click.option(
    "--plot", "plot_out", type=click.Path(dir_okay=False), default=None, help="Write a figure (PNG)."
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def replay(
    target: str,
    workload: str,
    seed: int,
    workload_spec: WorkloadSpec,
    base_rate: float,
    surge_factor: float,
    surge_start_min: float,
    surge_minutes: float,
    post_surge_rate: float | None,
    duration_min: float,
    warm_sessions: int | None,
    time_scale: float | None,
    api: str,
    model: str,
    max_concurrency: int,
    max_errors: int,
    reference_gpu: str | None,
    json_out: str | None,
    plot_out: str | None,
    quiet: bool,
) -> None:
    """Replay agent sessions against an OpenAI-compatible or SGLang endpoint and summarize the run.

    Exits 1 when requests failed (the summary still prints), 130 when interrupted with Ctrl-C.
    """
    import asyncio
    import signal
    from urllib.parse import urlparse

    from basin.sim.deployments import GPUS
    from basin.sim.simulator import estimate_warm_sessions

    try:
        from basin_profiler.replay import CLIENT_LAG_SHARE, Replay, ReplayConfig, server_info
    except ImportError as error:
        raise BasinError(f"replay needs: pip install 'basin[profiler]' ({error})") from None
    parsed = urlparse(target)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise BasinError(f"--target must be an http(s) URL, got {target!r}")
    if time_scale is not None and time_scale <= 0:
        raise BasinError(f"--time-scale must be positive, got {time_scale}")
    if max_concurrency < 1 or max_errors < 1:
        raise BasinError("--max-concurrency and --max-errors must be at least 1")
    warm_sessions = _warm_sessions(warm_sessions)
    schedule = _schedule(
        base_rate, surge_factor, surge_start_min, surge_minutes, post_surge_rate, duration_min
    )
    for path in (json_out, plot_out):
        if path and path != "-":
            _writable(path)
    pool = workload_spec.load()
    server = asyncio.run(server_info(target))
    gpu = reference_gpu or (server.gpu if server.gpu in GPUS else "h200")
    if time_scale is None:
        time_scale = server.time_scale or 1.0
    elif server.time_scale is not None and server.time_scale != time_scale:
        _warn(
            f"--time-scale {time_scale:g} differs from the server's {server.time_scale:g}: tool gaps and "
            "every figure run at a different clock than the engine's (leave --time-scale out to take the "
            "server's)"
        )
    config = ReplayConfig(
        target=target,
        schedule=schedule,
        reference_gpu=GPUS[gpu],
        api=api,
        seed=seed,
        time_scale=time_scale,
        max_concurrency=max_concurrency,
        max_errors=max_errors,
        model=model,
        cache_tokens=server.cache_tokens,
        warm_sessions=(
            estimate_warm_sessions(GPUS[gpu], pool, base_rate) if warm_sessions is None else warm_sessions
        ),
    )
    from rich.progress import BarColumn, TextColumn, TimeElapsedColumn

    with _progress(
        TextColumn("replaying"),
        BarColumn(),
        TextColumn("{task.completed:.1f}/{task.total:.0f} min · {task.fields[status]}"),
        TimeElapsedColumn(),
        disable=quiet,
        transient=True,
    ) as progress:
        task = progress.add_task("replay", total=duration_min, status="")

        def report(model_s: float, counts) -> None:  # type: ignore[no-untyped-def]
            status = f"{counts.answered:,} calls answered, {counts.errors} errors"
            progress.update(task, completed=min(model_s / 60, duration_min), status=status)

        runner = Replay(config, pool, progress=report)

        async def run():  # type: ignore[no-untyped-def]
            loop = asyncio.get_running_loop()
            loop.add_signal_handler(signal.SIGINT, runner.stop, "interrupted (Ctrl-C)")
            try:
                return await runner.run()
            finally:
                loop.remove_signal_handler(signal.SIGINT)

        result = asyncio.run(run())
    counts = result.counts
    payload = {
        "target": target,
        "api": api,
        "workload": workload,
        "seed": seed,
        "base_rate": base_rate,
        "surge_factor": surge_factor,
        "surge_start_min": surge_start_min,
        "surge_minutes": surge_minutes,
        "duration_min": duration_min,
        "time_scale": time_scale,
        "reference_gpu": gpu,
        "warm_sessions": config.warm_sessions,
        **result.summary.to_dict(),
        "requests": counts.requests,
        "answered": counts.answered,
        "parked_answers": counts.parked_answers,
        "cut_off": counts.cut_off,
        "connection_errors": counts.connection_errors,
        "failed_requests": counts.failed_requests,
        "first_errors": counts.first_errors,
        "stopped_early": counts.stopped_early or None,
        "model_seconds": result.model_seconds,
        "wall_seconds": result.wall_seconds,
        **result.client.to_dict(),
    }
    _report_run(
        payload,
        result.summary,
        result.records,
        json_out,
        plot_out,
        f"replay of {workload} against {target}",
        title=f"replay · {target} · {workload} · {base_rate:g} sessions/min · seed {seed}",
        extra=[
            ("requests / answered", f"{counts.requests:,} / {counts.answered:,}"),
            ("parked answers (429)", str(counts.parked_answers)),
            ("errors (connection / failed)", f"{counts.connection_errors} / {counts.failed_requests}"),
            ("wall seconds", f"{result.wall_seconds:.1f}"),
            (
                "client loop lag mean / p90 (s)",
                f"{result.client.lag_mean_model_s:.3f} / {result.client.lag_p90_model_s:.3f}",
            ),
            ("client CPU (cores)", f"{result.client.cpu_fraction:.2f}"),
        ],
    )
    median_ttft = result.median_ttft_s
    server_lag = asyncio.run(server_info(target)).loop_lag_mean_s
    if server_lag is not None and server_lag * time_scale >= CLIENT_LAG_SHARE * median_ttft:
        _warn(
            f"the emulator measured itself: its event loop ran {server_lag * time_scale:.2f} s late on "
            f"average (model time) against a median TTFT of {median_ttft:.2f} s; lower its --time-scale"
            + (" or use --api sglang (no word tokenizing)" if api == "openai" else "")
        )
    if result.client.dominates(median_ttft):
        hint = " (--api sglang sends token ids and skips word tokenizing)" if api == "openai" else ""
        _warn(
            f"the client measured itself: its event loop ran {result.client.lag_mean_model_s:.2f} s late on "
            f"average (model time, CPU {result.client.cpu_fraction:.2f} cores) against a median TTFT of "
            f"{median_ttft:.2f} s; lower --time-scale or the load, or run the client on another machine{hint}"
        )
    for message in counts.first_errors:
        click.echo(f"error: {message}", err=True)
    if counts.stopped_early:
        click.echo(f"stopped early: {counts.stopped_early}", err=True)
    if counts.stopped_early.startswith("interrupted"):
        sys.exit(130)
    if counts.errors:
        sys.exit(1)


@cli.command("analyze")
@click.option(
    "--deployment", default="h200-1p3d", show_default=True, metavar="PRESET", help="Deployment preset."
)
@click.option(
    "--host-tier",
    type=float,
    default=None,
    help="Host tier as a multiple of the GPU prefix cache (0: GPU-only). Default: the preset's.",
)
@workload_options(default="terminal-bench")
@click.option(
    "--base-rate",
    type=float,
    default=None,
    help="Base arrivals, sessions per minute (required without --grid).",
)
@click.option("--kappa", type=float, default=1.0, show_default=True, help="Cliff scale κ of the hit curve.")
@click.option(
    "--grid",
    is_flag=True,
    help="Classify the paper's 36-deployment grid with the model and the simulator (minutes).",
)
@click.option(
    "--backlog",
    type=float,
    default=0.0,
    show_default=True,
    help="Sessions in a backlog to drain at the base rate (Eq. 4).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--plot",
    "plot_out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write D(N) against arrivals with the equilibria marked (PNG).",
)
def analyze_command(
    deployment: str,
    host_tier: float | None,
    workload: str,
    seed: int,
    workload_spec: WorkloadSpec,
    base_rate: float | None,
    kappa: float,
    grid: bool,
    backlog: float,
    as_json: bool,
    plot_out: str | None,
) -> None:
    """The fluid model (paper §5): departure curve, equilibria, vulnerable rates and first limit."""
    from basin.fluid import FluidModel, FluidParameters, analyze, plot_departures
    from basin.sim import get_deployment

    if grid:
        _analyze_grid(seed, as_json)
        return
    if base_rate is None:
        raise BasinError("--base-rate is required (or use --grid)")

    preset = get_deployment(deployment, host_tier=host_tier)
    if plot_out:
        _writable(plot_out)
    pool = workload_spec.load()
    model = FluidModel(FluidParameters.from_workload(preset, pool, kappa))
    result = analyze(model, base_rate, backlog)
    if plot_out:
        plot_departures(
            model,
            result,
            plot_out,
            title=f"{preset.name}, host tier {preset.host_tier:g}x: first limit {result.first_limit}",
        )
    if as_json:
        click.echo(
            json.dumps(
                {
                    "deployment": preset.name,
                    "host_tier": preset.host_tier,
                    "workload": workload,
                    **result.to_dict(),
                }
            )
        )
        return
    low, high = result.vulnerable_range_per_min

    def population(value: float | None) -> str:
        return "none" if value is None else f"{value:.0f} sessions"

    click.echo(f"{preset.name}, host tier {preset.host_tier:g}x, {workload}, base rate {base_rate:g}/min")
    click.echo(
        f"  first limit             {result.first_limit} (peak without decode / decode bound ="
        f" {result.cache_first_ratio:.2f})"
    )
    click.echo(f"  departure peak          {result.d_peak_per_min:.2f}/min at N* = {result.n_peak:.0f}")
    click.echo(f"  low-reuse departures    {result.d_low_per_min:.2f}/min")
    click.echo(f"  vulnerable base rates   {low:.2f} to {high:.2f} sessions/min")
    click.echo(f"  stable equilibrium      {population(result.n_stable)}")
    click.echo(f"  unstable equilibrium    {population(result.n_unstable)}")
    click.echo(f"  state at this rate      {result.state}")
    click.echo(
        f"  Eq. 2 (cliff N_c {result.cliff_population:.0f} vs decode fill N_d"
        f" {result.decode_fill_population:.0f}): {'cache' if result.eq2_cache_first else 'decode'} first"
    )
    if backlog:
        drain = (
            "never (base rate at or above the peak)"
            if result.drain_minutes is None
            else f"{result.drain_minutes:.1f} min"
        )
        click.echo(f"  drain {backlog:g} sessions      {drain}")


@cli.command("plan")
@click.option("--gpus", type=int, required=True, help="GPUs to split into prefill and decode (at least 2).")
@click.option(
    "--gpu",
    type=click.Choice(["h100", "h200"]),
    default=None,
    help="GPU  [default: the profile's, else h200]",
)
@workload_options(default="terminal-bench")
@click.option("--base-rate", type=float, required=True, help="Base arrivals, sessions per minute.")
@click.option(
    "--surge",
    "surge_text",
    default="5:20",
    show_default=True,
    metavar="F:MINUTES",
    help="The surge to plan for: arrivals times F during MINUTES.",
)
@click.option(
    "--host-tiers",
    default="0,2,10",
    show_default=True,
    metavar="X,Y,…",
    help="Host tiers to compare, as multiples of the GPU prefix cache (0: GPU-only).",
)
@click.option(
    "--kappa",
    type=float,
    default=None,
    help="Cliff scale κ of the hit curve  [default: the profile's, else 1]",
)
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="A live profile (profile.json, as `basin profile` or the profiling Job writes it): κ, capacities"
    " and prefill rate from it instead of the presets.",
)
@click.option(
    "--verify",
    "verify_top",
    type=int,
    default=0,
    show_default=True,
    metavar="K",
    help="Simulate the K best candidates under the surge to confirm the model's verdict (minutes).",
)
@click.option(
    "--policy",
    type=click.Choice(["hicache", "basin"]),
    default="hicache",
    show_default=True,
    help="The policy the verification runs use (hicache: no control, what the verdict assumes).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--plot",
    "plot_out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the largest recoverable surge by split and host tier (PNG).",
)
def plan_command(
    gpus: int,
    gpu: str,
    workload: str,
    seed: int,
    workload_spec: WorkloadSpec,
    base_rate: float,
    surge_text: str,
    host_tiers: str,
    kappa: float | None,
    profile_path: str | None,
    verify_top: int,
    policy: str,
    as_json: bool,
    plot_out: str | None,
) -> None:
    """What-if capacity planning: every prefill:decode split of N GPUs and host tier, ranked by the
    largest surge it recovers from without control at the base rate (the fluid model, paper §5)."""
    import os
    from dataclasses import replace

    from basin.plan import Basis, Surge, plan, plot_plan, recommendation, verify

    surge = Surge.parse(surge_text)
    tiers = list(_float_list(host_tiers, "--host-tiers"))
    if verify_top < 0:
        raise BasinError(f"--verify must not be negative, got {verify_top}")
    if plot_out:
        _writable(plot_out)
    doc = None
    if profile_path is not None:
        from basin.profile_schema import parse_profile

        if kappa is not None:
            raise BasinError("--kappa and --profile both set κ: drop --kappa to use the profile's")
        doc = parse_profile(Path(profile_path).read_bytes(), profile_path)
        source = click.get_current_context().get_parameter_source("workload")
        if source is click.core.ParameterSource.DEFAULT:
            workload = doc.workload  # κ and the prefill rate were measured with this workload
        elif workload != doc.workload:
            raise BasinError(
                f"{profile_path} was measured with workload {doc.workload!r}, not {workload!r}: κ and the"
                f" prefill rate depend on it (pass --workload {doc.workload} or profile this workload)"
            )
        gpu = gpu or doc.gpu or "h200"
    gpu = gpu or "h200"
    spec = replace(workload_spec, spec=workload)  # --workload may come from the profile
    pool = spec.load()
    basis = (
        Basis.presets(gpu, 1.0 if kappa is None else kappa)
        if doc is None
        else Basis.from_profile(doc, gpu, pool, profile_path or "profile.json")
    )
    kappa = basis.kappa
    candidates = plan(gpus, basis.gpu, pool, base_rate, surge, tiers, kappa)
    checks = []
    if verify_top:
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

        chosen = candidates[:verify_top]
        with _progress(
            TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            disable=as_json, transient=True,
        ) as progress:  # fmt: skip
            task = progress.add_task("verify", total=len(chosen))
            checks = verify(
                chosen, basis.gpu, spec, base_rate, surge, policy, kappa,
                processes=min(len(chosen), os.cpu_count() or 1),
                progress=lambda done: progress.update(task, completed=done),
            )  # fmt: skip
    advice = recommendation(candidates, surge)
    title = f"{gpus}x {gpu.upper()}, {workload}, {base_rate:g} sessions/min, surge x{surge.factor:g}"
    if plot_out:
        plot_plan(candidates, surge, plot_out, f"{title} for {surge.minutes:g} min")
    if as_json:
        payload = {
            "gpus": gpus,
            "gpu": gpu,
            "workload": workload,
            "base_rate": base_rate,
            "surge_factor": surge.factor,
            "surge_minutes": surge.minutes,
            **basis.to_dict(),
            "candidates": [c.to_dict() for c in candidates],
            "verification": [v.to_dict() for v in checks],
            "recommendation": advice,
        }
        click.echo(json.dumps(payload))
        return
    from rich.table import Table

    table = Table(title=f"plan · {title} for {surge.minutes:g} min")
    for column in ("split", "host tier", "first limit", "D(N*) /min", "vulnerable /min", "N_s / N_u"):
        table.add_column(column, justify="right" if "/" in column else "left")
    table.add_column(f"x{surge.factor:g} for {surge.minutes:g} min")
    table.add_column("largest recoverable", justify="right")
    for c in candidates:
        low, high = c.vulnerable_range_per_min
        populations = f"{_count(c.n_stable)} / {_count(c.n_unstable)}"
        outcome = f"recovers in {c.drain_minutes:.0f} min" if c.recovers else "does not recover"
        largest = f"x{c.max_recoverable_factor:.2f}" if c.max_recoverable_factor < 50 else "≥ x50"
        table.add_row(
            f"{c.prefill}P{c.decode}D", f"{c.host_tier:g}x", c.first_limit, f"{c.departure_peak_per_min:.1f}",
            f"{low:.1f}–{high:.1f}", populations, outcome, largest,
        )  # fmt: skip
    console = _console()
    console.print(table)
    console.print(basis.describe())
    console.print(f"recommendation: {advice}")
    for v in checks:
        verdict = "agrees" if v.agrees else "DISAGREES"
        console.print(
            f"  simulated {v.name} with {v.host_tier:g}x host tier under {v.policy}: {v.label},"
            f" {v.goodput_sessions_per_h:.0f} sessions/h — {verdict} with the model"
        )


def _count(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def _analyze_grid(seed: int, as_json: bool) -> None:
    from rich.table import Table

    from basin.grid import HOST_TIERS, PRESETS, TOOL_SCALES, agreement, run_grid

    total = len(PRESETS) * len(HOST_TIERS) * len(TOOL_SCALES)
    with _progress(transient=True, disable=as_json) as progress:
        task = progress.add_task("model vs simulator", total=total)
        points = run_grid(seed, progress=lambda done: progress.update(task, completed=done))
    summary = agreement(points)
    if as_json:
        click.echo(json.dumps({"points": [p.to_dict() for p in points], **summary}))
        return
    table = Table(title="First limit: fluid model vs simulator (Terminal-Bench-like, H200)")
    for column in ("deployment", "host tier", "tool time", "model", "ratio", "simulator", "degraded at /min"):
        table.add_column(column, justify="left" if column == "deployment" else "right")
    for p in points:
        table.add_row(
            p.deployment,
            f"{p.host_tier:g}x",
            f"{p.tool_scale:g}x",
            p.model_first_limit,
            f"{p.model_ratio:.2f}",
            p.simulated_first_limit,
            "" if p.degraded_at_per_min is None else f"{p.degraded_at_per_min:.1f}",
        )
    _console().print(table)
    click.echo(
        f"simulator cache-first: {summary['simulated_cache_first']}, flagged by the model:"
        f" {summary['flagged_of_simulated_cache_first']}; prefill-first (reuse intact):"
        f" {summary['simulated_prefill_first']}; agreement {summary['agreement']:.0%}"
    )


@cli.command("evaluate")
@click.argument(
    "suite",
    type=click.Choice(
        ["headline", "main", "surge-sweep", "steady", "post-surge", "late", "ablation", "sensitivity"]
    ),
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the workload and the runs.")
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    default=None,
    help="Write the rows as JSON (- for stdout).",
)
@click.option(
    "--plot",
    "plot_out",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write goodput relative to BASIN as a bar chart (PNG).",
)
def evaluate_command(suite: str, seed: int, json_out: str | None, plot_out: str | None) -> None:
    """Run an evaluation suite: headline (the demo), main (paper §7.3: seven systems, six scenarios),
    surge-sweep, steady, post-surge, late, ablation (§7.8), or sensitivity (§7.9: one controller parameter
    set lower or higher at a time), on one seed. `basin report` runs suites over several seeds beside the
    paper's figures."""
    from rich.table import Table

    from basin.evaluate.suites import (
        SUITES,
        headline,
        plot_suite,
        plot_timeseries,
        run_suite,
        sensitivity_spread,
    )

    for path in (json_out, plot_out):
        if path and path != "-":
            _writable(path)
    scenarios, systems = SUITES[suite]
    with _progress(transient=True, disable=json_out == "-") as progress:
        task = progress.add_task(suite, total=len(scenarios) * len(systems))
        summaries: dict = {}
        rows = run_suite(
            suite, seed, progress=lambda done: progress.update(task, completed=done), summaries=summaries
        )
    heads = headline(rows)
    payload = {"suite": suite, "seed": seed, "rows": [r.to_dict() for r in rows], "headline": heads}
    _write_json(payload, json_out)
    if json_out == "-":
        return
    if plot_out and len(scenarios) == 1:
        plot_timeseries(summaries, scenarios[0], plot_out)  # one scenario: its time series
    elif plot_out:
        plot_suite(rows, plot_out, f"{suite} (seed {seed})")
    table = Table(title=f"{suite} · seed {seed}")  # wide: piped output would wrap every cell
    for column in (
        "scenario",
        "system",
        "goodput/h",
        "vs BASIN",
        "completed",
        "shed",
        "slowdown",
        "p90 wait s",
        "state",
    ):
        table.add_column(column, justify="left" if column in ("scenario", "system", "state") else "right")
    for r in rows:
        table.add_row(
            r.scenario,
            r.system,
            f"{r.goodput_sessions_per_h:.0f}",
            f"{r.relative_to_basin:.2f}",
            f"{r.completed_fraction:.2f}",
            f"{r.shed_fraction:.3f}",
            _format_number(r.median_slowdown),
            _format_number(r.p90_first_call_wait_s),
            r.label,
        )
    _console().print(table)
    for head in heads:
        if not head["strongest_baseline"]:
            continue  # the sensitivity suite runs BASIN's variants only
        hicache = head["vs_hicache"]
        versus = "HiCache alone completed none" if math.isnan(hicache) else f"{hicache:.2f}x HiCache alone"
        click.echo(
            f"{head['scenario']}: BASIN {head['vs_strongest']:.2f}x the strongest baseline"
            f" ({head['strongest_baseline']}), {versus}"
        )
    if spread := sensitivity_spread(rows):
        click.echo(spread.text())


@cli.command("report")
@click.option("--seeds", default="0-4", show_default=True, help="Seeds: A-B, N, or a comma list of them.")
@click.option(
    "--suites",
    default="all",
    show_default=True,
    help="all, or a comma list of headline, main, surge-sweep, steady, post-surge, late, ablation,"
    " sensitivity.",
)
@click.option(
    "--scenario",
    "only_scenarios",
    multiple=True,
    metavar="NAME",
    help="Only this scenario, named as the report names it (repeat for more).",
)
@click.option(
    "--system",
    "only_systems",
    multiple=True,
    metavar="NAME",
    help="Only this system, named as the report names it (repeat for more).",
)
@click.option(
    "--jobs",
    type=click.IntRange(min=1),
    default=None,
    help="Worker processes, one scenario and seed each [default: the CPU count].",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, allow_dash=True),
    default="docs/evaluation.md",
    show_default=True,
    help="Write the Markdown report here (- for stdout).",
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    default=None,
    help="Write every per-seed row as JSON (- for stdout).",
)
@click.option(
    "--from-json",
    "from_json",
    type=click.Path(dir_okay=False, exists=True),
    default=None,
    help="Re-render the report from a --json file instead of running.",
)
@shared_prefix_option
def report_command(
    seeds: str,
    suites: str,
    only_scenarios: tuple[str, ...],
    only_systems: tuple[str, ...],
    jobs: int | None,
    out: str,
    json_out: str | None,
    from_json: str | None,
    shared_prefix: int | None,
) -> None:
    """Every evaluation suite over several seeds: goodput mean [min–max], run states and BASIN's margin
    over the strongest baseline, beside the paper's figure for each cell (docs/evaluation.md)."""
    import os

    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from basin.evaluate import report

    for path in (out, json_out):
        if path and path != "-":
            _writable(path)
    given = {
        "--shared-prefix": shared_prefix is not None,
        "--scenario": only_scenarios,
        "--system": only_systems,
    }
    partial = [flag for flag, value in given.items() if value]  # the options that limit or vary the runs
    if from_json:
        if partial:
            raise BasinError(
                "--shared-prefix, --scenario and --system apply to runs;"
                " --from-json re-renders the file's own"
            )
        try:
            data = report.check_payload(json.loads(Path(from_json).read_text()))
        except json.JSONDecodeError as error:
            raise BasinError(f"--from-json: {from_json} is not JSON ({error})") from None
    else:
        out_source = click.get_current_context().get_parameter_source("out")
        if partial and out_source is click.core.ParameterSource.DEFAULT:
            raise BasinError(
                f"a report under {' and '.join(partial)} is not the project's; name its --out (the default is"
                " docs/evaluation.md)"
            )
        seed_list, suite_list = report.parse_seeds(seeds), report.parse_suites(suites)
        jobs = jobs or os.cpu_count() or 1
        total = report.run_count(suite_list, seed_list, only_scenarios, only_systems)
        measured_on = report.commit()
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with _progress(*columns, disable=json_out == "-" or out == "-") as progress:
            task = progress.add_task(f"{len(seed_list)} seeds × {', '.join(suite_list)}: runs", total=total)
            rows = report.run_report(
                suite_list,
                seed_list,
                jobs,
                lambda n: progress.advance(task, n),
                shared_prefix,
                only_scenarios,
                only_systems,
            )
        data = report.payload(
            rows, suite_list, seed_list, measured_on, shared_prefix, only_scenarios, only_systems
        )
    _write_json(data, json_out)
    text = report.render(data)
    if out == "-":
        click.echo(text, nl=False)
    else:
        report.write(out, text)
        if json_out != "-":
            click.echo(f"wrote {out}")


@cli.command("trap-map")
@deployment_options(default="h100-1p1d")
@click.option(
    "--workload", default="terminal-bench", show_default=True, metavar="NAME|FILE", help=_WORKLOAD_HELP
)
@click.option(
    "--tool-time-scale", type=float, default=1.0, show_default=True, help="Multiply every tool gap."
)
@shared_prefix_option
@click.option(
    "--base-rates", default="3.3", show_default=True, help="Base arrival rates, sessions/min (comma list)."
)
@click.option(
    "--surges",
    default="1,1.33,2",
    show_default=True,
    help="Surge factors (comma list; 1 is the no-surge control, 2 is +100 %).",
)
@click.option(
    "--surge-start-min", type=float, default=15.0, show_default=True, help="Minute the surges start."
)
@click.option("--surge-minutes", type=float, default=10.0, show_default=True, help="Length of every surge.")
@click.option(
    "--duration-min", type=float, default=120.0, show_default=True, help="Simulated minutes per run."
)
@click.option("--seeds", default="0-11", show_default=True, help="Seeds: A-B, N, or a comma list of them.")
@click.option(
    "--offered",
    is_flag=True,
    help="Also run every cell's arrivals on an engine that never runs out of cache or KV memory and report"
    " the peak working set (over the cache) and active sessions they bring: each seed's demand, apart"
    " from how the engine copes (twice the runs).",
)
@click.option(
    "--jobs", type=click.IntRange(min=1), default=None, help="Worker processes [default: the CPU count]."
)
@click.option(
    "--json",
    "json_out",
    type=click.Path(dir_okay=False, allow_dash=True),
    default=None,
    help="Write every run's outcome as JSON (- for stdout).",
)
@click.option(
    "--plot", "plot_out", type=click.Path(dir_okay=False), default=None, help="Write the map (PNG)."
)
@click.option("--quiet", is_flag=True, help="No progress bar.")
def trap_map(
    deployment: str,
    host_tier: float | None,
    allocation: str | None,
    router: str | None,
    transfer: str | None,
    state_slots: int | None,
    waiting_prefix_refresh: bool | None,
    workload: str,
    tool_time_scale: float,
    shared_prefix: int | None,
    base_rates: str,
    surges: str,
    surge_start_min: float,
    surge_minutes: float,
    duration_min: float,
    seeds: str,
    offered: bool,
    jobs: int | None,
    json_out: str | None,
    plot_out: str | None,
    quiet: bool,
) -> None:
    """How often a surge traps HiCache alone, by base rate and surge size over seeds (paper §4, Fig. 7)."""
    import os

    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from basin.evaluate import trapmap
    from basin.evaluate.report import parse_seeds
    from basin.workload import load_workload

    for path in (json_out, plot_out):
        if path and path != "-":
            _writable(path)
    # A bad workload, or a shared prefix it cannot take, fails here, not in a worker.
    load_workload(workload, 0, tool_time_scale, shared_prefix=shared_prefix)
    spec = trapmap.MapSpec(
        deployment=deployment,
        base_rates=_float_list(base_rates, "--base-rates"),
        surge_factors=_float_list(surges, "--surges"),
        seeds=tuple(parse_seeds(seeds)),
        host_tier=host_tier,
        allocation=allocation,
        router=router,
        transfer=transfer,
        state_slots=state_slots,
        waiting_prefix_refresh=waiting_prefix_refresh,
        workload=workload,
        tool_time_scale=tool_time_scale,
        shared_prefix=shared_prefix,
        surge_start_min=surge_start_min,
        surge_minutes=surge_minutes,
        duration_min=duration_min,
        offered=offered,
    )
    spec.validate()
    spec.deployment_model()  # an unknown deployment or option fails here, not in a worker
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with _progress(*columns, disable=quiet or json_out == "-") as progress:
        task = progress.add_task(f"trap map of {deployment}: runs", total=len(spec.runs))
        outcomes = trapmap.run_map(spec, jobs or os.cpu_count() or 1, lambda: progress.advance(task))
    _write_json(trapmap.payload(spec, outcomes), json_out)
    if plot_out:
        trapmap.plot_map(spec, outcomes, plot_out)
    if json_out == "-":
        return
    table = Table(
        title=f"{deployment} · HiCache alone · {len(spec.seeds)} seeds · {surge_minutes:g}-minute surges"
    )
    for column in (
        "base /min",
        "surge",
        "trapped",
        "95 % CI",
        "trapped seeds",
        "other states",
        "hit before",
        "trapped: late hit",
        "trapped: late TTFT (s)",
        "L_late > 10 s",
        "goodput /h",
        *(("offered peak W/C", "offered peak sessions") if offered else ()),
    ):
        table.add_column(column, justify="left" if "seeds" in column or "states" in column else "right")
    for cell in trapmap.cells(outcomes):
        others = {k: v for k, v in cell.labels.items() if k != "trapped"}
        demand = (
            (
                "{:.2f} [{:.2f}–{:.2f}]".format(*cell.spread("offered_peak_working_set")),
                "{:.0f} [{:.0f}–{:.0f}]".format(*cell.spread("offered_peak_sessions")),
            )
            if offered
            else ()
        )
        table.add_row(
            f"{cell.base_rate:g}",
            trapmap.surge_name(cell.surge_factor),
            f"{len(cell.trapped)}/{len(cell.outcomes)}",
            "{:.0%}–{:.0%}".format(*cell.trapped_share_interval),
            ",".join(str(o.seed) for o in cell.trapped) or "-",
            ", ".join(f"{k} {v}" for k, v in sorted(others.items())) or "-",
            f"{cell.median('hit_rate_pre'):.2f}",
            _format_optional(cell.median("hit_rate_late", trapped_only=True), "{:.2f}"),
            _format_optional(cell.median("median_ttft_late_s", trapped_only=True), "{:.0f}"),
            f"{len(cell.persistently_slow)}/{len(cell.outcomes)}",
            f"{cell.median('goodput_sessions_per_h'):.0f}",
            *demand,
        )
    _console().print(table)
    if offered:
        _print_trap_thresholds(outcomes)
    if plot_out:
        click.echo(f"figure: {plot_out}")


def _print_trap_thresholds(outcomes: Sequence[Outcome]) -> None:
    """Under an offered-demand map: the offered peak that best tells trapped runs from the rest."""
    from basin.evaluate import trapmap

    lines = []
    for name, field, pattern in (
        ("peak W/C", "offered_peak_working_set", "{:.2f}"),
        ("peak sessions", "offered_peak_sessions", "{:.1f}"),
    ):
        cut = trapmap.trap_threshold(outcomes, field)
        if cut is not None:
            lines.append(
                f"  {name} {pattern.format(cut.value)}: above it {cut.trapped_above} of {cut.trapped}"
                f" trapped runs and {cut.others_above} of {cut.others} others"
            )
    if lines:
        click.echo("The offered demand that best tells trapped runs from the rest (Youden's J):")
        click.echo("\n".join(lines))


def _format_optional(value: float, pattern: str) -> str:
    return "-" if math.isnan(value) else pattern.format(value)


@cli.command("profile")
@click.option("--simulate", is_flag=True, help="Ramp load in the simulator.")
@click.option(
    "--target",
    default=None,
    metavar="URL",
    help="Ramp live load against this endpoint (gateway with controls off, router, or emulator).",
)
@click.option(
    "--deployment", default="h200-1p3d", show_default=True, metavar="PRESET", help="Deployment preset."
)
@click.option(
    "--host-tier", type=float, default=None, help="Host tier multiple (0: GPU-only). Default: preset's."
)
@click.option(
    "--workload", default="terminal-bench", show_default=True, metavar="NAME|FILE", help=_WORKLOAD_HELP
)
@click.option(
    "--ramps", type=int, default=4, show_default=True, help="Repeated ramps (κ: their lower quartile)."
)
@click.option("--steps", type=int, default=8, show_default=True, help="Load steps per ramp.")
@click.option(
    "--step-minutes",
    type=float,
    default=None,
    help="Minutes per step. Default: simulated, three mean unloaded session lifetimes (at least 12), so"
    " the population settles at each rate; live, 12 (or --settle).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the first ramp.")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as one JSON object.")
@_options(workload_scale_options)
@shared_prefix_option
@click.option(
    "--allow-no-cliff",
    is_flag=True,
    help="Simulated: a ramp that never falls off its reuse plateau (decode limits first) counts κ = 1"
    " instead of failing, as the evaluation suites count it; λc is then decode's departure peak.",
)
@click.option("--settle", is_flag=True, help="Live: end each step when the active population settles.")
@click.option(
    "--settle-tolerance",
    type=float,
    default=0.10,
    show_default=True,
    help="Live --settle: largest relative change of the active population between two half lifetimes.",
)
@click.option(
    "--top-rate",
    type=float,
    default=2.0,
    show_default=True,
    help="Live: the last step's rate as a multiple of the fluid model's peak departure rate.",
)
@click.option(
    "--budget-minutes",
    type=float,
    default=240.0,
    show_default=True,
    help="Live: wall-clock bound; ramps are dropped to fit it, and a run past it fails.",
)
@endpoint_options(help_prefix="Live: ")
@click.option("--gpu", type=click.Choice(["h100", "h200"]), default=None, help="Live: GPU kind measured.")
@click.option("--prefill-replicas", type=int, default=None, help="Live: prefill replicas measured.")
@click.option("--decode-replicas", type=int, default=None, help="Live: decode replicas measured.")
@click.option("--fingerprint", default="", help="Live: the operator's deployment fingerprint to write back.")
@click.option(
    "--out", "out", type=click.Path(dir_okay=False), default=None, help="Live: write profile.json here."
)
@click.option(
    "--configmap",
    default=None,
    metavar="NS/NAME",
    help="Live: write the profile (or the failure reason) into this ConfigMap.",
)
@click.option("--kubeconfig", default=None, metavar="FILE", help="Live: kubeconfig for --configmap.")
@click.option(
    "--plot", "plot_out", type=click.Path(dir_okay=False), default=None, help="Live: write the figure (PNG)."
)
@click.option("--quiet", is_flag=True, help="Live: no progress bar.")
@click.pass_context
def profile_command(
    ctx: click.Context,
    simulate: bool,
    target: str | None,
    deployment: str,
    host_tier: float | None,
    workload: str,
    ramps: int,
    steps: int,
    step_minutes: float | None,
    seed: int,
    as_json: bool,
    tool_time_scale: float,
    output_scale: float,
    resend_outputs: bool,
    shared_prefix: int | None,
    allow_no_cliff: bool,
    settle: bool,
    settle_tolerance: float,
    top_rate: float,
    budget_minutes: float,
    time_scale: float | None,
    api: str,
    model: str,
    gpu: str | None,
    prefill_replicas: int | None,
    decode_replicas: int | None,
    fingerprint: str,
    out: str | None,
    configmap: str | None,
    kubeconfig: str | None,
    plot_out: str | None,
    quiet: bool,
) -> None:
    """Fit the cliff scale κ and the peak departure rate λc with stepped load ramps, in the simulator
    (--simulate) or live against an endpoint (--target; exits 1 with the reason when profiling fails)."""
    if simulate == (target is not None):
        raise BasinError("give either --simulate or --target URL")
    if target is not None:
        source = ctx.get_parameter_source
        simulated_only = {
            "tool_time_scale",
            "output_scale",
            "resend_outputs",
            "shared_prefix",
            "allow_no_cliff",
        }
        named = ("deployment", "host_tier", "step_minutes", *simulated_only)
        explicit = {n for n in named if source(n).name != "DEFAULT"}
        if settle and "step_minutes" in explicit:
            raise BasinError("--settle and --step-minutes exclude each other")
        if given := sorted(explicit & simulated_only):
            flags = {p.name: "/".join(p.opts + p.secondary_opts) for p in ctx.command.params}
            names = ", ".join(flags[n] for n in given)
            raise BasinError(f"{names}: --simulate only (a live ramp replays --workload as it is)")
        fixed = None if settle else (step_minutes or 12.0)  # a None default (issue 15) means 12 live
        sys.exit(
            _profile_live(
                target, deployment if "deployment" in explicit else None, host_tier, workload, ramps,
                steps, fixed, seed, settle_tolerance, top_rate, budget_minutes,
                time_scale, api, model, gpu, prefill_replicas, decode_replicas, fingerprint, out, configmap,
                kubeconfig, plot_out, quiet,
            )
        )  # fmt: skip

    from basin.profile import profile_simulated

    with _progress(transient=True, disable=as_json) as progress:
        task = progress.add_task("ramping", total=ramps)
        result = profile_simulated(
            deployment,
            ramps,
            steps,
            step_minutes,
            host_tier,
            workload,
            seed,
            progress=lambda done: progress.update(task, completed=done),
            tool_time_scale=tool_time_scale,
            require_cliff=not allow_no_cliff,
            shared_prefix=shared_prefix,
            output_scale=output_scale,
            resend_outputs=resend_outputs,
        )
    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    click.echo(
        f"{result.deployment}: κ = {result.kappa:.2f} (lower quartile of "
        f"{', '.join(f'{k:.2f}' for k in result.kappas)}), λc = {result.lambda_c_per_min:.2f} sessions/min"
    )
    click.echo(
        f"  capacities: prefill GPU {result.prefill_gpu_tokens:,} tokens, host {result.host_tokens:,},"
        f" decode KV {result.decode_kv_tokens:,}"
    )
    for index, ramp in enumerate(result.ramps, start=1):
        steps_text = "  ".join(f"{s.working_set_over_cache:.2f}:{s.hit_rate:.2f}" for s in ramp)
        click.echo(f"  ramp {index} (W/C:hit)  {steps_text}")


def _profile_live(
    target: str, preset: str | None, host_tier: float | None, workload: str, ramps: int, steps: int,
    step_minutes: float | None, seed: int, settle_tolerance: float, top_rate: float, budget_minutes: float,
    time_scale: float | None, api: str, model: str, gpu: str | None, prefill: int | None, decode: int | None,
    fingerprint: str, out: str | None, configmap: str | None, kubeconfig: str | None, plot_out: str | None,
    quiet: bool,
) -> int:  # fmt: skip
    """`basin profile --target`: checks every input before any load, then `basin_profiler.run.execute`."""
    from functools import partial
    from urllib.parse import urlparse

    from basin.workload import load_workload

    try:
        from basin_profiler import configmap as cm
        from basin_profiler.ramp import RampSettings
        from basin_profiler.run import Outputs, Shape, execute
    except ImportError as error:
        raise BasinError(f"live profiling needs: pip install 'basin[profiler]' ({error})") from None
    parsed = urlparse(target)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise BasinError(f"--target must be an http(s) URL, got {target!r}")
    if time_scale is not None and time_scale <= 0:
        raise BasinError(f"--time-scale must be positive, got {time_scale}")
    for count, name in ((prefill, "--prefill-replicas"), (decode, "--decode-replicas")):
        if count is not None and count < 1:
            raise BasinError(f"{name} must be at least 1, got {count}")
    outputs = Outputs(
        out=_writable(out) if out else None,
        plot=_writable(plot_out) if plot_out else None,
        destination=cm.Destination.parse(configmap, kubeconfig=kubeconfig) if configmap else None,
    )
    load_workload(workload, seed=seed)  # a bad workload is an error before any load

    def pool(s: int):  # type: ignore[no-untyped-def]
        return load_workload(workload, seed=s)

    settings_for = partial(
        RampSettings, target=target, pool_factory=pool, workload=workload, ramps=ramps, steps=steps,
        step_minutes=step_minutes, top_rate=top_rate, settle_tolerance=settle_tolerance,
        budget_minutes=budget_minutes, seed=seed, api=api, model=model, fingerprint=fingerprint,
    )  # fmt: skip
    shape = Shape(preset, gpu, prefill, decode, host_tier)
    return execute(
        target, shape, pool, settings_for, time_scale, outputs, quiet,
        lambda line: click.echo(line, err=True), fingerprint,
    )  # fmt: skip


@cli.group()
def predictor() -> None:
    """The peak-context predictor: train a model for the gateway, or measure it cross-fitted."""


@predictor.command("train")
@workload_options()
@click.option(
    "--out", "out", type=click.Path(dir_okay=False), required=True, help="Model file to write (JSON)."
)
@click.option("--alpha", type=float, default=1.0, show_default=True, help="Ridge penalty on text features.")
def predictor_train(
    workload: str,
    seed: int,
    workload_spec: WorkloadSpec,
    out: str,
    alpha: float,
) -> None:
    """Train on every session of a workload and save the model."""
    from basin.predictor import fit

    path = _writable(out)
    model = fit(workload_spec.load(), alpha)
    model.save(path)
    kind = "task text and lengths" if model.uses_text else "lengths only (no task texts)"
    click.echo(f"trained on {model.trained_sessions} sessions ({kind}); wrote {path}", err=True)


@predictor.command("evaluate")
@workload_options()
@click.option(
    "--folds",
    type=int,
    default=None,
    help="Cross-fitting folds. Default: leave-one-out up to 300 sessions, else 10.",
)
@click.option("--alpha", type=float, default=1.0, show_default=True, help="Ridge penalty on text features.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def predictor_evaluate(
    workload: str,
    seed: int,
    workload_spec: WorkloadSpec,
    folds: int | None,
    alpha: float,
    as_json: bool,
) -> None:
    """Cross-fitted rank correlation and log-error spread of the predictor on a workload."""
    from basin.predictor import evaluate

    result = evaluate(workload_spec.load(), folds, seed, alpha).to_dict()
    if as_json:
        click.echo(json.dumps({"workload": workload, **result}))
        return
    features = "task text + lengths" if result["uses_text"] else "lengths only"
    click.echo(f"{workload}: {result['sessions']} sessions, {result['folds']} folds, {features}")
    click.echo(
        f"  Spearman rank correlation  {result['spearman']:.3f}   (paper: 0.64 Terminal-Bench,"
        " 0.56 SWE-bench Pro)"
    )
    click.echo(f"  log-error std. deviation   {result['log_error_sd']:.3f}   (paper: 0.54, 0.34)")
    click.echo(f"  median |log error|         {result['median_abs_log_error']:.3f}")


def _late_window_label(late_s: float, duration_s: float) -> str:
    """What the late figures cover, in words: the final 30 minutes, or the whole of a shorter run."""
    return "whole run" if late_s >= duration_s else f"last {late_s / 60:g} min"


def _print_summary(payload: dict, title: str | None = None, extra: list[tuple[str, object]] = ()) -> None:  # type: ignore[assignment]
    from rich.table import Table

    table = Table(
        title=title
        or f"{payload['deployment']} · {payload['policy']} · {payload['workload']} · "
        f"{payload['base_rate']:g} sessions/min · seed {payload['seed']}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    late = _late_window_label(payload["late_window_s"], payload["duration_min"] * 60)
    rows = [
        ("state", f"{payload['label']} ({payload['label_reason']})"),
        ("goodput (sessions/h)", payload["goodput_sessions_per_h"]),
        ("completed fraction", payload["completed_fraction"]),
        ("shed fraction", payload["shed_fraction"]),
        ("hit rate before trigger", payload["hit_rate_pre"]),
        (f"hit rate, {late}", payload["hit_rate_late"]),
        (f"median TTFT, {late} (s)", payload["median_ttft_late_s"]),
        ("L_late (s)", payload["l_late_s"]),
        ("median slowdown", payload["median_slowdown"]),
        ("median first-call wait (s)", payload["median_first_call_wait_s"]),
    ]
    if "events" in payload:
        rows.append(("events / wall seconds", f"{payload['events']:,} / {payload['wall_seconds']:.1f}"))
    rows.extend(extra)
    for name, value in rows:
        shown = (
            "n/a" if value is None else (_format_number(value) if isinstance(value, float) else str(value))
        )
        table.add_row(name, shown)
    _console().print(table)


@cli.group("gateway")
def gateway_group() -> None:
    """The session gateway in front of an SGLang router (needs the `gateway` extra)."""


@gateway_group.command("run")
@click.option(
    "--upstream",
    default=None,
    metavar="URL",
    help="The SGLang router (or engine, or emulator). Env: BASIN_ROUTER_URL. Default: http://127.0.0.1:30000.",
)
@click.option(
    "--prefill",
    nargs=2,
    multiple=True,
    metavar="URL BOOTSTRAP_PORT",
    help="Address this prefill engine directly, not through the router (repeatable; with --decode; as"
    " sglang-router's --prefill). Env: BASIN_PREFILL_ENGINES ('URL PORT,URL PORT').",
)
@click.option(
    "--decode",
    multiple=True,
    metavar="URL",
    help="Address this decode engine directly (repeatable; with --prefill). Env: BASIN_DECODE_ENGINES.",
)
@click.option(
    "--direct",
    is_flag=True,
    default=None,
    help="Address the Ready engine pods found by BASIN_PREFILL_SELECTOR/BASIN_DECODE_SELECTOR directly"
    " (prefill bootstrap on BASIN_BOOTSTRAP_PORT, default 8998). Env: BASIN_DIRECT_ENGINES=1.",
)
@click.option("--host", default=None, help="Address to listen on. Env: BASIN_GATEWAY_HOST. Default: 0.0.0.0.")
@click.option(
    "--port", type=int, default=None, help="Port (0: any free one). Env: BASIN_GATEWAY_PORT. Default: 8080."
)
@click.option(
    "--metrics-port", type=int, default=None, help="Also serve on this port (for /metrics and health)."
)
@click.option(
    "--redis",
    "redis_url",
    default=None,
    metavar="URL",
    help="Shared state for several replicas. Env: BASIN_REDIS_URL. Default: in memory, one replica.",
)
@click.option(
    "--deployment-name",
    "deployment",
    default=None,
    help="Namespace of the Redis keys. Env: BASIN_DEPLOYMENT. Default: local.",
)
@click.option(
    "--profile",
    "profile_path",
    default=None,
    metavar="FILE",
    help="The profiler's profile.json. Env: BASIN_PROFILE_PATH.",
)
@click.option(
    "--deployment",
    "preset",
    default=None,
    metavar="PRESET",
    help="Without --profile: use the profile `basin simulate` assumes for this preset (local runs).",
)
@click.option(
    "--predictor",
    "predictor_path",
    default=None,
    metavar="FILE",
    help="A trained peak predictor. Env: BASIN_PREDICTOR_PATH. Default: the packaged one.",
)
@click.option(
    "--policy",
    default=None,
    metavar="NAME",
    help="basin, basin-arrival, passthrough (HiCache alone), thunderagent or concur. Env: BASIN_POLICY."
    " Default: basin.",
)
@click.option(
    "--prometheus",
    "prometheus_url",
    default=None,
    metavar="URL",
    help="Read engine telemetry through Prometheus. Env: BASIN_PROMETHEUS_URL.",
)
@click.option(
    "--engines",
    default=None,
    metavar="URL,URL...",
    help="Engine endpoints to scrape for telemetry. Env: BASIN_ENGINES. Default: the upstream.",
)
@click.option(
    "--time-scale",
    type=float,
    default=None,
    help="Model seconds per wall second (match the emulator's). Env: BASIN_TIME_SCALE. Default: 1.",
)
@click.option(
    "--admin-token", default=None, help="Token for session deletion and bypass. Env: BASIN_ADMIN_TOKEN."
)
@click.option(
    "--idle-timeout",
    "idle_timeout_s",
    type=float,
    default=None,
    help="Model seconds without a call before a session ends. Default: 900.",
)
@click.option(
    "--max-park-wait",
    "max_park_wait_s",
    type=float,
    default=None,
    help="Model seconds a session may stay parked before the gateway sheds it. Default: 3600.",
)
@click.option("--max-parked", type=int, default=None, help="Parked sessions at most. Default: 10000.")
@click.option(
    "--hold-parked",
    "hold_parked_s",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Hold a parked first call open up to this many wall seconds, forwarding it once admitted, before"
    " answering 429. Env: BASIN_GATEWAY_HOLD_PARKED_S. Default: 0 (429 at once).",
)
@click.option(
    "--max-held",
    type=int,
    default=None,
    help="Parked calls held open at once; past it they are answered 429 at once. Env: BASIN_GATEWAY_MAX_HELD."
    " Default: 1000.",
)
@click.option("--max-body-bytes", type=int, default=None, help="Largest request body. Default: 32 MiB.")
@click.option(
    "--max-header-bytes", type=int, default=None, help="Largest request header block. Default: 32 KiB."
)
@click.option(
    "--body-timeout",
    "body_timeout_s",
    type=float,
    default=None,
    help="Wall seconds to receive a request body. Default: 30.",
)
@click.option(
    "--lease-ttl",
    "lease_ttl_s",
    type=float,
    default=None,
    help="Wall seconds of the Redis leader lease. Default: 5.",
)
def gateway_run(**flags: object) -> None:
    """Serve the session gateway: admission, ordering, lending and shedding by the chosen policy."""
    import asyncio
    import logging

    try:
        from basin_gateway.server import serve
        from basin_gateway.settings import from_environment
        from basin_gateway.upstream import Upstreams, parse_decode, parse_prefill
    except ImportError as error:
        raise BasinError(f"the gateway needs: pip install 'basin[gateway]' ({error})") from None
    flags["prefill"] = tuple(parse_prefill(url, port) for url, port in flags["prefill"])  # type: ignore[attr-defined]
    flags["decode"] = tuple(parse_decode(url) for url in flags["decode"])  # type: ignore[attr-defined]
    settings = from_environment(**flags)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("basin.gateway")

    def ready(bound: int) -> None:
        log.info(
            "gateway (%s) serving at http://%s:%d, calls go %s, time x%g",
            settings.policy,
            settings.host,
            bound,
            Upstreams.of(settings).describe(),
            settings.time_scale,
        )

    asyncio.run(serve(settings, ready))


@cli.command("up")
@click.option(
    "--deployment", default="h200-1p3d", show_default=True, metavar="PRESET", help="Emulated deployment."
)
@click.option(
    "--time-scale", type=float, default=20.0, show_default=True, help="Model seconds per wall second."
)
@click.option(
    "--policy", default="basin", show_default=True, help="The gateway's policy (passthrough to compare)."
)
@click.option(
    "--no-redis", is_flag=True, help="Keep the gateway's state in memory even if redis-server exists."
)
@click.option("--duration-min", type=float, default=30.0, show_default=True, help="Model minutes to replay.")
def up(deployment: str, time_scale: float, policy: str, no_redis: bool, duration_min: float) -> None:
    """The local stack: the emulator, the gateway (Redis when installed) and a short x5 surge through it."""
    try:
        from basin_gateway.local import Stack, run_stack, surge_replay
    except ImportError as error:
        raise BasinError(
            f"the local stack needs: pip install 'basin[gateway,emulator,profiler]' ({error})"
        ) from None
    if duration_min < 16:
        raise BasinError("--duration-min must be at least 16 (the surge runs from minute 3 to 15)")
    replay = surge_replay(duration_min)
    code = run_stack(Stack(deployment, time_scale, policy, not no_redis, replay), _console())
    if code:
        sys.exit(code)


@cli.group("operator")
def operator_group() -> None:
    """The Kubernetes operator for BasinDeployment resources (needs the `operator` extra)."""


@operator_group.command("run")
@click.option(
    "--kubeconfig", default=None, metavar="FILE", help="Kubeconfig; default: in-cluster, then $KUBECONFIG."
)
@click.option(
    "--namespace",
    "namespaces",
    multiple=True,
    metavar="NS",
    help="Watch this namespace (repeatable); default: every namespace.",
)
@click.option(
    "--resync-seconds",
    type=float,
    default=10.0,
    show_default=True,
    help="Interval of the reconcile timer (drift, child readiness, profiling Jobs).",
)
@click.option("--log-json", is_flag=True, help="Structured JSON log lines.")
@click.option("--verbose", is_flag=True, help="Debug logging.")
@click.option(
    "--liveness",
    default=None,
    metavar="URL",
    help="Serve a liveness probe, e.g. http://0.0.0.0:8080/healthz.",
)
def operator_run(
    kubeconfig: str | None,
    namespaces: tuple[str, ...],
    resync_seconds: float,
    log_json: bool,
    verbose: bool,
    liveness: str | None,
) -> None:
    """Run the operator: BasinDeployments become engines, router, gateway, Redis and profiling Jobs."""
    try:
        from basin_operator.run import run_operator
    except ImportError as exc:
        raise BasinError(
            f"the operator needs the `operator` extra (pip install 'basin[operator]'): {exc}"
        ) from None
    run_operator(kubeconfig, namespaces, resync_seconds, log_json, verbose, liveness)


@operator_group.command("crd")
@click.option("--out", default="-", show_default=True, metavar="FILE|-", help="Where to write the CRD YAML.")
def operator_crd(out: str) -> None:
    """Print the BasinDeployment CRD generated from the spec models (crds/basindeployment.yaml)."""
    try:
        from basin_operator.crd import render_crd
    except ImportError as exc:
        raise BasinError(
            f"the operator needs the `operator` extra (pip install 'basin[operator]'): {exc}"
        ) from None
    text = render_crd()
    if out == "-":
        click.echo(text, nl=False)
    else:
        _writable(out).write_text(text)


@operator_group.command("docs")
@click.option(
    "--out", default="-", show_default=True, metavar="FILE|-", help="Where to write the Markdown reference."
)
def operator_docs(out: str) -> None:
    """Print the BasinDeployment reference generated from the spec models (docs/reference/)."""
    try:
        from basin_operator.reference import render_reference
    except ImportError as exc:
        raise BasinError(
            f"the operator needs the `operator` extra (pip install 'basin[operator]'): {exc}"
        ) from None
    text = render_reference()
    if out == "-":
        click.echo(text, nl=False)
    else:
        _writable(out).write_text(text)


def main() -> None:
    try:
        code = cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except BasinError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except OSError as exc:
        click.echo(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), err=True)
        sys.exit(EXIT_USER_ERROR)
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
