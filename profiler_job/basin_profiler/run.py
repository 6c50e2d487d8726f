"""One live profiling run, shared by `basin profile --target` and the Job (`python -m basin_profiler`):
preflight, plan (printed before any load), ramps with a progress bar and Ctrl-C, then the outputs.

Exit status: 0 with a profile; 1 when profiling failed (the reason on stderr, in the ConfigMap's status
key and in an Event; no profile written); 2 for bad input; 130 after Ctrl-C (also recorded as a failure).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from basin.profile_schema import ProfileDocument
from basin.workload import Session
from basin_profiler import configmap
from basin_profiler.ramp import (
    LiveRun,
    ProfileFailure,
    RampProgress,
    RampSettings,
    deployment_from,
    plan,
    preflight,
)

EXIT_FAILED = 1
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class Shape:
    """What the caller knows of the deployment; the rest comes from the target's `/get_server_info`."""

    preset: str | None = None
    gpu: str | None = None
    prefill: int | None = None
    decode: int | None = None
    host_ratio: float | None = None


@dataclass(frozen=True)
class Outputs:
    out: Path | None = None
    plot: Path | None = None
    destination: configmap.Destination | None = None


def execute(
    target: str,
    shape: Shape,
    pool_factory: Callable[[int], Sequence[Session]],
    settings_for: Callable[..., RampSettings],
    time_scale: float | None,
    outputs: Outputs,
    quiet: bool = False,
    echo: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
    fingerprint: str = "",
    wait_s: float = 0.0,
) -> int:
    """Run the whole profile; returns the exit status. `settings_for(deployment=..., time_scale=...)`
    builds the ramp settings once the deployment's shape is known; `fingerprint` goes with a failure;
    `wait_s` is how long a target that does not answer yet is waited for."""
    try:
        info = asyncio.run(preflight(target, wait_s, echo))
        deployment = deployment_from(
            info, shape.preset, shape.gpu, shape.prefill, shape.decode, shape.host_ratio
        )
        scale = time_scale if time_scale is not None else float(info.get("time_scale") or 1.0)
        settings = settings_for(deployment=deployment, time_scale=scale)
        the_plan = plan(settings)
    except ProfileFailure as failure:
        return _fail(str(failure), fingerprint, outputs, echo)
    how = (
        f"{settings.step_minutes:g} model min"
        if settings.step_minutes is not None
        else f"{the_plan.min_step_min:.0f}-{the_plan.timeout_step_min:.0f} model min (until settled)"
    )
    duration = (
        f"about {the_plan.max_wall_minutes:.0f}"
        if settings.step_minutes is not None
        else f"{the_plan.min_wall_minutes:.0f}-{the_plan.max_wall_minutes:.0f}"
    )
    echo(
        f"profiling {target} as {deployment.prefill_instances}P{deployment.decode_instances}D"
        f" {deployment.gpu.name} (host tier {deployment.host_tier:g}x): {the_plan.ramps} ramps x"
        f" {settings.steps} steps of {how} at x{scale:g}, {the_plan.rates[0]:.2f}-{the_plan.rates[-1]:.2f}"
        f" sessions/min (fluid peak {the_plan.peak_per_min:.2f}); {duration} wall minutes"
        f" (budget {settings.budget_minutes:g})"
    )
    if the_plan.note:
        echo(f"note: {the_plan.note}")
    try:
        profile = _run(settings, the_plan, quiet)
    except ProfileFailure as failure:
        code = EXIT_INTERRUPTED if str(failure).startswith("interrupted") else EXIT_FAILED
        return _fail(str(failure), fingerprint, outputs, echo, code)
    unsettled = [
        f"ramp {r + 1} step {i + 1}"
        for r, ramp in enumerate(profile.ramps)
        for i, step in enumerate(ramp)
        if step.settled is False
    ]
    if unsettled and settings.step_minutes is not None:
        echo(
            f"warning: {len(unsettled)} steps had not settled by their sampled half"
            f" ({', '.join(unsettled[:4])}{', ...' if len(unsettled) > 4 else ''}):"
            " fixed steps measure a population still moving, as"
            " `basin profile --simulate` does with the same steps; --settle waits for it"
        )
    return _write(profile, outputs, echo)


def _run(settings: RampSettings, the_plan, quiet: bool) -> ProfileDocument:  # type: ignore[no-untyped-def]
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    total = the_plan.ramps * settings.steps
    with Progress(
        TextColumn("profiling"),
        BarColumn(),
        TextColumn("ramp {task.fields[ramp]} step {task.fields[step]} · {task.fields[status]}"),
        TimeElapsedColumn(),
        disable=quiet,
        transient=True,
    ) as progress:
        task = progress.add_task("profile", total=total, ramp=1, step=1, status="")

        def report(state: RampProgress) -> None:
            progress.update(
                task,
                completed=state.ramp * settings.steps + state.step,
                ramp=f"{state.ramp + 1}/{the_plan.ramps}",
                step=f"{state.step + 1}/{settings.steps}",
                status=f"{state.answered:,} calls, {state.errors} errors",
            )

        live = LiveRun(settings, the_plan, report)

        async def go() -> ProfileDocument:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, live.stop, f"interrupted ({signal.Signals(sig).name})")
            try:
                return await live.run()
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

        return asyncio.run(go())


def _write(profile: ProfileDocument, outputs: Outputs, echo: Callable[[str], None]) -> int:
    text = profile.to_json()
    if outputs.out is not None:
        outputs.out.write_text(text + "\n")
    if outputs.plot is not None:
        from basin_profiler.plot import plot_profile

        plot_profile(profile, outputs.plot)
    if outputs.destination is not None:
        what = configmap.write_profile(outputs.destination, text, profile.fingerprint)
        echo(f"{what} ConfigMap {outputs.destination.namespace}/{outputs.destination.name}")
    echo(
        f"{profile.deployment}: κ = {profile.kappa:.2f} (lower quartile of"
        f" {', '.join(f'{k:.2f}' for k in profile.kappas)}), λc = {profile.lambda_c_per_min:.2f} sessions/min"
    )
    for index, ramp in enumerate(profile.ramps, start=1):
        steps = "  ".join(
            f"{_fmt(s.working_set_over_cache)}:{_fmt(s.hit_rate)}" + ("" if s.settled is not False else "*")
            for s in ramp
        )
        echo(f"  ramp {index} (W/C:hit, * not settled)  {steps}")
    return 0


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _fail(
    reason: str, fingerprint: str, outputs: Outputs, echo: Callable[[str], None], code: int = EXIT_FAILED
) -> int:
    echo(f"profile failed: {reason}")
    if outputs.destination is not None:
        for problem in configmap.write_failure(outputs.destination, reason, fingerprint):
            echo(f"error: {problem}")
    return code
