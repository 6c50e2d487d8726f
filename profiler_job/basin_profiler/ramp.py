"""Live profiling ramps: stepped agent load against a deployment, then the shared κ and λc fit.

The ramp mirrors `basin.profile.profile_simulated`: the simulator's warm start (the steady population at
the first rate, joined mid-trajectory with its last prompt cached; same seed, same draws), rates from
0.2·top to top times the fluid model's peak departure rate (top = 2: 0.4x to 2x, so the ramp crosses the
cliff where there is one), one seed per ramp (seed, seed+1, ...), each ramp fitted by
`basin.profile.fit_kappa`, then `combine` (κ: lower quartile over ramps; λc: median over ramps of the peak
departure rate). The load is `basin_profiler.replay`'s client, so a ramp sees what the replay sees: working
set (every active session's context, tool-idle ones too), prefix hits from the server's `cached_tokens`,
and departures (sessions completed).

Two kinds of step:
- fixed (`step_minutes`): each step lasts that many model minutes and is sampled over its second half,
  as the simulator's ramp, so a live profile and `basin profile --simulate` with the same settings
  compare. Whether each step settled is recorded (a warning, not a failure).
- settle-detected (`step_minutes=None`): a step lasts at least one mean unloaded session lifetime, then
  ends as soon as the mean active population over the last half lifetime is within `settle_tolerance`
  of the half lifetime before it (sampled over that last half lifetime). A step whose hit rate has
  fallen past the cliff ends without settling (an overloaded population grows without bound: that is
  the regime being measured), and the ramp ends after two such steps. A step still on the plateau that
  has not settled after `SETTLE_TIMEOUT_LIFETIMES` lifetimes fails the profile.

Failures raise `ProfileFailure` with one line of reason; no profile is built from them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

import basin.profile
from basin.errors import BasinError
from basin.evaluate import RunRecords
from basin.hitcurve import HIT_FLOOR
from basin.profile import PLATEAU_DROP, RampSample, combine, fit_kappa
from basin.profile_schema import ProfileDocument, RampStep, versions
from basin.sim.deployments import Deployment
from basin.sim.simulator import estimate_warm_sessions
from basin.workload import Session, poisson_arrivals
from basin.workload.arrivals import StepSchedule
from basin_profiler.replay import Replay, ReplayConfig

# A fixed step is sampled over the same final share as `basin.profile.simulate_ramp` samples it: its second
# half, or the share basin.profile names where it names one (the baselines branch samples the final third).
SAMPLED_SHARE = float(getattr(basin.profile, "SAMPLED_SHARE", 0.5))
SETTLE_TOLERANCE = 0.10  # relative change of the mean active population between two half lifetimes
SETTLE_MIN_LIFETIMES = 1.0  # a new rate's population builds up over about one session lifetime
SETTLE_WINDOW_LIFETIMES = 0.5
SETTLE_TIMEOUT_LIFETIMES = 4.0
PAST_CLIFF_STEPS = 2  # settle mode: a ramp ends after this many steps past the cliff
MAX_ERROR_SHARE = 0.05  # more failed requests than this share of all fails the ramp
DEFAULT_BUDGET_MINUTES = 240.0  # a production maintenance window, wall minutes
PREFLIGHT_RETRY_S = 5.0  # wall seconds between two probes of a target that is not answering yet


class ProfileFailure(BasinError):
    """The profile could not be measured; the message is the one-line reason written for the operator."""


@dataclass(frozen=True)
class RampSettings:
    target: str
    deployment: Deployment  # the shape measured (rates and capacities come from its calibration)
    pool_factory: Callable[[int], Sequence[Session]]  # seed -> sessions
    workload: str = "terminal-bench"
    ramps: int = 4
    steps: int = 8
    step_minutes: float | None = 12.0  # None: settle-detected steps
    top_rate: float = 2.0  # the last step's rate as a multiple of the fluid model's peak departure rate
    settle_tolerance: float = SETTLE_TOLERANCE
    budget_minutes: float = DEFAULT_BUDGET_MINUTES  # wall minutes
    seed: int = 0
    time_scale: float = 1.0
    api: str = "openai"
    model: str = "default"
    max_errors: int = 50
    fingerprint: str = ""
    deployment_name: str = ""
    headers: Mapping[str, str] = field(default_factory=dict)  # sent with every call (ReplayConfig.headers)

    def __post_init__(self) -> None:
        if self.ramps < 1 or self.steps < 3:
            raise BasinError("need at least 1 ramp of at least 3 steps")
        if self.step_minutes is not None and self.step_minutes <= 0:
            raise BasinError(f"--step-minutes must be positive, got {self.step_minutes}")
        if self.top_rate <= 0 or self.budget_minutes <= 0 or self.time_scale <= 0:
            raise BasinError("--top-rate, --budget-minutes and --time-scale must be positive")
        if not 0 <= self.settle_tolerance < 1:
            raise BasinError(f"--settle-tolerance must be in [0, 1), got {self.settle_tolerance}")


@dataclass(frozen=True)
class RampPlan:
    """What a profile will do, known before any load is sent."""

    rates: list[float]  # sessions per minute, one per step
    peak_per_min: float  # the fluid model's peak departure rate
    lifetime_min: float  # mean unloaded session lifetime (model minutes)
    ramps: int  # after fitting the budget
    min_wall_minutes: float
    max_wall_minutes: float
    note: str = ""  # why ramps were dropped, if they were

    @property
    def min_step_min(self) -> float:
        return SETTLE_MIN_LIFETIMES * self.lifetime_min

    @property
    def window_min(self) -> float:
        return SETTLE_WINDOW_LIFETIMES * self.lifetime_min

    @property
    def timeout_step_min(self) -> float:
        return SETTLE_TIMEOUT_LIFETIMES * self.lifetime_min


def plan(settings: RampSettings) -> RampPlan:
    """Rates from the fluid model, and how long the ramps take in wall minutes; ramps are dropped (at
    least one kept) to fit the budget, and a budget too small for one ramp is an error before any load."""
    from basin.fluid import FluidModel, FluidParameters, analyze
    from basin.sim.costs import unloaded_session_seconds

    pool = settings.pool_factory(settings.seed)
    peak = analyze(FluidModel(FluidParameters.from_workload(settings.deployment, pool)), 0.0).d_peak_per_min
    rates = [float(r) for r in np.linspace(0.2 * settings.top_rate * peak, settings.top_rate * peak,
                                           settings.steps)]  # fmt: skip
    lifetime = float(np.mean([unloaded_session_seconds(settings.deployment.gpu, s) for s in pool])) / 60
    if settings.step_minutes is not None:
        low = high = settings.step_minutes
    else:
        low, high = SETTLE_MIN_LIFETIMES * lifetime, SETTLE_TIMEOUT_LIFETIMES * lifetime
    per_ramp_low = settings.steps * low / settings.time_scale
    per_ramp_high = settings.steps * high / settings.time_scale
    if per_ramp_low > settings.budget_minutes:
        raise BasinError(
            f"one ramp takes at least {per_ramp_low:.0f} wall minutes ({settings.steps} steps of"
            f" {low:.1f} model minutes at x{settings.time_scale:g}), over the budget of"
            f" {settings.budget_minutes:g} min: raise --budget-minutes or use fewer or shorter steps"
        )
    ramps = min(settings.ramps, max(1, int(settings.budget_minutes // per_ramp_high)))
    note = ""
    if ramps < settings.ramps:
        note = (
            f"{settings.ramps} ramps would take up to {settings.ramps * per_ramp_high:.0f} min; running"
            f" {ramps} to fit the budget of {settings.budget_minutes:g} min"
        )
    return RampPlan(rates, peak, lifetime, ramps, ramps * per_ramp_low, ramps * per_ramp_high, note)


# ---------------------------------------------------------------------------------------------- samples
def window_sample(records: RunRecords, start_s: float, end_s: float) -> tuple[float, float, float, float]:
    """(working set / cache, hit rate, departures per minute, mean active sessions) over [start, end),
    computed as `basin.profile.simulate_ramp` computes them from the simulator's records."""
    states = [s for s in records.samples if start_s <= s.t < end_s]
    cached = prompt = 0
    for call in records.calls:
        if call.prefill_start_s is not None and start_s <= call.prefill_start_s < end_s:
            cached += call.cached_tokens
            prompt += call.prompt_tokens
    done = sum(1 for s in records.sessions if s.done_s is not None and start_s <= s.done_s < end_s)
    working_set = float(np.mean([s.working_set_tokens for s in states])) if states else math.nan
    active = float(np.mean([s.active_sessions for s in states])) if states else math.nan
    cache = records.cache_tokens or 1
    hit = cached / prompt if prompt else math.nan
    return working_set / cache, hit, done / ((end_s - start_s) / 60), active


def settled(
    records: RunRecords, end_s: float, window_s: float, tolerance: float
) -> tuple[bool, float, float]:
    """Whether the mean active population over [end - w, end) is within `tolerance` of the one over
    [end - 2w, end - w); returns (settled, earlier mean, later mean)."""
    earlier = [s.active_sessions for s in records.samples if end_s - 2 * window_s <= s.t < end_s - window_s]
    later = [s.active_sessions for s in records.samples if end_s - window_s <= s.t < end_s]
    if not earlier or not later:
        return False, math.nan, math.nan
    before, after = float(np.mean(earlier)), float(np.mean(later))
    if before <= 0:
        return after <= 0, before, after
    return abs(after - before) / before <= tolerance, before, after


def past_cliff(hit_rate: float, plateau: float) -> bool:
    """A hit rate that has fallen far enough from the plateau for `fit_kappa` to count the cliff as found."""
    return math.isfinite(hit_rate) and hit_rate <= plateau - PLATEAU_DROP * (plateau - HIT_FLOOR)


# ------------------------------------------------------------------------------------------------ ramps
@dataclass
class RampProgress:
    ramp: int = 0  # 0-based
    step: int = 0
    model_s: float = 0.0
    answered: int = 0
    errors: int = 0


class _Ramp(Replay):
    """One live ramp: the replay client with arrivals decided step by step (settle mode) or scheduled."""

    def __init__(
        self,
        config: ReplayConfig,
        pool: Sequence[Session],
        rates: Sequence[float],
        plan_: RampPlan,
        settings: RampSettings,
        on_progress: Callable[[int, float], None],
    ) -> None:
        super().__init__(config, pool, progress=lambda model_s, counts: on_progress(self.step, model_s))
        self.pool = pool
        self.rates = list(rates)
        self.plan = plan_
        self.settings = settings
        self.step = 0
        self.steps: list[RampStep] = []
        self.failure = ""
        self.finished = False

    async def feed(self) -> None:
        if self.settings.step_minutes is not None:
            return  # the scheduled StepSchedule's arrivals are already running
        rng = np.random.default_rng([self.config.seed, 1])
        window = self.plan.window_min * 60
        minimum, timeout = self.plan.min_step_min * 60, self.plan.timeout_step_min * 60
        t = 0.0
        plateau = math.nan
        past = 0  # steps past the cliff so far
        for index, rate in enumerate(self.rates):
            if past >= PAST_CLIFF_STEPS:
                break  # the cliff and the floor are measured; more load only hurts production
            self.step = index
            start, chunk = t, 0
            while True:
                draws = poisson_arrivals(StepSchedule((rate,), window / 60), self.pool, rng)
                for arrival in draws:
                    self.add_arrival(
                        dataclasses.replace(
                            arrival,
                            time_s=arrival.time_s + t,
                            instance_id=f"{arrival.instance_id}@{index}.{chunk}",
                        )
                    )
                t += window
                chunk += 1
                await self._sleep_until(t)
                if t - start < minimum - 1e-9:
                    continue
                ok, before, after = settled(self.records, t, window, self.settings.settle_tolerance)
                x, hit, departures, active = window_sample(self.records, t - window, t)
                overloaded = index > 0 and past_cliff(hit, plateau)
                if ok or overloaded:
                    self.steps.append(_step(x, hit, departures, active, rate, (t - start) / 60, ok))
                    if index == 0:
                        plateau = hit
                    past += overloaded
                    break
                if t - start >= timeout - 1e-9:
                    self.failure = (
                        f"step {index + 1} ({rate:.2f} sessions/min) did not settle within"
                        f" {timeout / 60:.0f} model min: active sessions {before:.0f} -> {after:.0f} over the"
                        f" last two half lifetimes, hit rate {hit:.2f} still on the plateau"
                    )
                    self.stop(self.failure)
                    return
        self.finished = True
        self._stop.set()


def _step(x: float, hit: float, departures: float, active: float, rate: float, minutes: float,
          ok: bool | None) -> RampStep:  # fmt: skip
    return RampStep(
        working_set_over_cache=x,
        hit_rate=hit,
        departures_per_min=departures,
        rate_per_min=rate,
        active_sessions=active,
        minutes=minutes,
        settled=ok,
    )


async def preflight(
    target: str, wait_s: float = 0.0, echo: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Fail before any load when the target does not answer `/health`, or a gateway's `/ready` says its
    upstream is not healthy yet; returns its `/get_server_info` (empty when it has none, as a gateway or
    router may). With `wait_s`, an unreachable or unready target is asked again every few seconds until
    then: the operator starts the profiling Job together with the gateway it ramps through, which may take
    a minute to become Ready, and the gateway's upstream Service a moment more to route."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await _probe(target)
        except ProfileFailure as failure:
            if time.monotonic() + PREFLIGHT_RETRY_S > deadline:
                raise
            if echo is not None:
                echo(f"waiting for the target: {failure}")
            await asyncio.sleep(PREFLIGHT_RETRY_S)


async def _probe(target: str) -> dict[str, Any]:
    base = target.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=10)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            async with http.get(f"{base}/health") as response:
                if response.status != 200:
                    raise ProfileFailure(
                        f"target {target} is not healthy: GET /health answered {response.status}"
                    )
            async with http.get(f"{base}/ready") as response:  # a gateway's: is its upstream healthy?
                if response.status == 503:
                    detail = (await response.text())[:200]
                    raise ProfileFailure(f"target {target} is not ready: GET /ready answered 503 {detail}")
            try:
                async with http.get(f"{base}/get_server_info") as response:
                    info = await response.json(content_type=None) if response.status == 200 else {}
            except (aiohttp.ClientError, ValueError):
                info = {}
    except (aiohttp.ClientError, TimeoutError, OSError) as error:
        raise ProfileFailure(f"target {target} is unreachable: {type(error).__name__}: {error}") from None
    return info if isinstance(info, dict) else {}


@dataclass
class LiveRun:
    """Drives the ramps; `stop` (Ctrl-C) ends the current ramp at once and the run fails cleanly."""

    settings: RampSettings
    plan: RampPlan
    on_progress: Callable[[RampProgress], None] | None = None
    _current: _Ramp | None = None
    _interrupted: str = ""
    _deadline: float = field(default=0.0)

    def stop(self, reason: str) -> None:
        self._interrupted = reason
        if self._current is not None:
            self._current.stop(reason)

    async def run(self) -> ProfileDocument:
        s, p = self.settings, self.plan
        cache_tokens = s.deployment.cache_tokens
        self._deadline = time.monotonic() + s.budget_minutes * 60
        kappas, lambda_cs, samples, steps = [], [], [], []
        fixed = s.step_minutes is not None
        for ramp in range(p.ramps):
            seed = s.seed + ramp
            duration = s.step_minutes if fixed else p.timeout_step_min
            schedule = StepSchedule(tuple(p.rates) if fixed else (0.0,) * len(p.rates), duration)  # type: ignore[arg-type]
            pool = s.pool_factory(seed)
            config = ReplayConfig(
                target=s.target,
                schedule=schedule,
                reference_gpu=s.deployment.gpu,
                api=s.api,
                seed=seed,
                time_scale=s.time_scale,
                max_errors=s.max_errors,
                model=s.model,
                cache_tokens=cache_tokens,
                headers=s.headers,
                # the simulator's warm start: the steady population at the first rate, caches primed
                warm_sessions=estimate_warm_sessions(s.deployment.gpu, pool, p.rates[0]),
            )

            def progress(step: int, model_s: float, ramp: int = ramp) -> None:
                if fixed:
                    step = min(int(model_s // (s.step_minutes * 60)), len(p.rates) - 1)  # type: ignore[operator]
                if time.monotonic() > self._deadline and self._current is not None:
                    self._current.stop(f"the budget of {s.budget_minutes:g} wall minutes ran out")
                if self.on_progress is not None and self._current is not None:
                    counts = self._current.counts
                    self.on_progress(RampProgress(ramp, step, model_s, counts.answered, counts.errors))

            self._current = _Ramp(config, pool, p.rates, p, s, progress)
            if self._interrupted:
                raise ProfileFailure(self._interrupted)
            result = await self._current.run()
            ramp_steps = self._check(ramp, self._current, result.records)
            ramp_samples = [
                RampSample(
                    st.working_set_over_cache if st.working_set_over_cache is not None else math.nan,
                    st.hit_rate if st.hit_rate is not None else math.nan,
                    st.departures_per_min,
                )
                for st in ramp_steps
            ]
            try:
                kappas.append(fit_kappa(ramp_samples))
            except BasinError as error:
                raise ProfileFailure(f"ramp {ramp + 1}: {error}") from None
            lambda_cs.append(max(st.departures_per_min for st in ramp_steps))
            samples.append(ramp_samples)
            steps.append(ramp_steps)
        d = s.deployment
        fitted = combine(kappas, lambda_cs, samples, s.deployment_name or d.name, d.prefill_cache_tokens,
                         d.host_cache_tokens, d.decode_kv_tokens)  # fmt: skip
        if not fitted.lambda_c_per_min > 0:
            raise ProfileFailure("no session completed in any step: λc would be 0")
        return ProfileDocument(
            kappa=fitted.kappa,
            lambda_c_per_min=fitted.lambda_c_per_min,
            prefill_gpu_tokens=d.prefill_cache_tokens,
            host_tokens=d.host_cache_tokens,
            decode_kv_tokens=d.decode_kv_tokens,
            prefill_tokens_per_s=_prefill_tokens_per_s(d, s.pool_factory(s.seed)),
            prefill_replicas=d.prefill_instances,
            decode_replicas=d.decode_instances,
            gpu=d.gpu.name,
            deployment=fitted.deployment,
            fingerprint=s.fingerprint,
            profiled_at=dt.datetime.now(dt.UTC),
            source="live",
            target=s.target,
            workload=s.workload,
            step_minutes=s.step_minutes,
            kappas=fitted.kappas,
            lambda_cs_per_min=[float(v) for v in lambda_cs],
            ramps=steps,
            versions=versions(),
        )

    def _check(self, ramp: int, runner: _Ramp, records: RunRecords) -> list[RampStep]:
        """The ramp's steps, or the reason it cannot count (interrupted, errors, no settle, budget)."""
        s, counts = self.settings, runner.counts
        if self._interrupted:
            raise ProfileFailure(self._interrupted)
        if runner.failure:
            raise ProfileFailure(f"ramp {ramp + 1}: {runner.failure}")
        if counts.requests == 0:
            raise ProfileFailure(f"ramp {ramp + 1}: no request was sent")
        if counts.stopped_early or counts.errors > MAX_ERROR_SHARE * counts.requests:
            first = counts.first_errors[0] if counts.first_errors else "no detail"
            why = counts.stopped_early or f"{counts.errors} of {counts.requests} requests failed"
            raise ProfileFailure(f"ramp {ramp + 1} stopped: {why} (first error: {first})")
        if s.step_minutes is None:
            if not runner.finished:
                raise ProfileFailure(f"ramp {ramp + 1} ended before its last step")
            return runner.steps
        m = s.step_minutes * 60
        steps = []
        for index, rate in enumerate(self.plan.rates):
            start, end = (index + 1 - SAMPLED_SHARE) * m, (index + 1) * m
            x, hit, departures, active = window_sample(records, start, end)
            ok, _, _ = settled(records, end, (end - start) / 2, s.settle_tolerance)
            steps.append(_step(x, hit, departures, active, rate, s.step_minutes, ok))
        return steps


def _prefill_tokens_per_s(deployment: Deployment, pool: Sequence[Session]) -> float:
    from basin.fluid import FluidParameters

    return float(FluidParameters.from_workload(deployment, pool).prefill_tokens_per_s)


def deployment_from(
    info: dict[str, Any],
    preset: str | None = None,
    gpu: str | None = None,
    prefill: int | None = None,
    decode: int | None = None,
    host_ratio: float | None = None,
) -> Deployment:
    """The shape measured: explicit values first, then what the server says of itself
    (`/get_server_info`, as the emulator answers it), then the preset (default h200-1p3d)."""
    from basin.sim import get_deployment
    from basin.sim.deployments import shape_name

    def number(key: str) -> float | None:
        value = info.get(key)
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    served_gpu = info.get("gpu") if info.get("gpu") in ("h100", "h200") else None
    kind = gpu or served_gpu
    if kind is None and preset is None:
        preset = "h200-1p3d"
    base = (
        get_deployment(preset) if preset else get_deployment("h100-1p1d" if kind == "h100" else "h200-1p1d")
    )
    if kind is not None and base.gpu.name != kind:
        base = get_deployment("h100-1p1d" if kind == "h100" else "h200-1p1d")
    prefill = prefill or (int(number("prefill_instances") or 0) or None) or base.prefill_instances
    decode = decode or (int(number("decode_instances") or 0) or None) or base.decode_instances
    if host_ratio is None:
        host, cache = number("host_cache_tokens"), number("prefill_cache_tokens")
        host_ratio = host / cache if host is not None and cache else base.host_tier
    # Named by its shape (a preset's name where the shape is one), so the profile says what was measured.
    return base.with_options(
        name=shape_name(base.gpu.name, prefill, decode),
        prefill_instances=prefill,
        decode_instances=decode,
        host_tier=host_ratio,
    )
