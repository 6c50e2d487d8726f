"""Profiling the cache cliff scale κ and the peak departure rate λc (paper §6.5).

A stepped load ramp raises arrivals step by step; at each step the active population settles and we
record the working set over cache (x = W/C) and the hit rate. κ aligns the reference hit-rate curve
(`basin.hitcurve.reference_hit_rate`, knee x_k ≈ 1.9) with the observed transition from the healthy plateau
to the low-reuse floor: we normalize the observed hit rates between plateau and floor, find where they
cross halfway, and scale the reference curve's halfway point onto it. BASIN takes the lower quartile of κ
over repeated ramps. `fit_kappa` takes plain samples, so the live profiler reuses it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from basin.errors import BasinError
from basin.hitcurve import HIT_AT_KNEE, HIT_FLOOR, reference_hit_rate

if TYPE_CHECKING:
    from basin.workload.model import Session

# Where the reference curve is halfway between its value at the knee and its floor.
_REFERENCE_X = np.linspace(0.0, 6.0, 60001)
_REFERENCE_H = reference_hit_rate(_REFERENCE_X)
REFERENCE_MIDPOINT = float(_REFERENCE_X[np.argmax(_REFERENCE_H <= (HIT_AT_KNEE + HIT_FLOOR) / 2)])
PLATEAU_DROP = 0.5  # a ramp must fall at least halfway from its plateau to count as having left it
PLATEAU_MIN_FALL = 0.2  # ... and at least this far in hit rate, whatever the plateau


@dataclass(frozen=True)
class RampSample:
    """One settled ramp step: working set over cache capacity, hit rate, and session departures."""

    working_set_over_cache: float
    hit_rate: float
    departures_per_min: float = 0.0


def fit_kappa(samples: Sequence[RampSample]) -> float:
    """κ from one ramp's samples, in order of rising load. Raises BasinError when the samples never leave
    the healthy plateau (the ramp did not reach the cliff) or carry no usable points."""
    points = [
        (s.working_set_over_cache, s.hit_rate)
        for s in samples
        if np.isfinite(s.working_set_over_cache) and np.isfinite(s.hit_rate)
    ]
    if len(points) < 3:
        raise BasinError(f"need at least 3 ramp samples with a hit rate, got {len(points)}")
    x, h = np.array(points).T
    order = np.argsort(x, kind="stable")
    x, h = x[order], h[order]
    plateau = float(np.max(h[: max(2, len(h) // 3)]))
    floor = float(np.min(h))
    halfway = (plateau + floor) / 2
    off_plateau = min(plateau - PLATEAU_MIN_FALL, plateau - PLATEAU_DROP * (plateau - HIT_FLOOR))
    if floor > off_plateau:
        raise BasinError(
            f"the ramp never left the healthy plateau (hit rate {floor:.2f}-{plateau:.2f} up to a working set"
            f" of {x.max():.2f}x the cache; leaving it takes a step at or below {off_plateau:.2f}): raise"
            " the ramp's top rate or add steps"
        )
    below = int(np.argmax(h <= halfway))
    if below == 0:
        crossing = float(x[0])
    else:
        x0, x1, h0, h1 = x[below - 1], x[below], h[below - 1], h[below]
        crossing = float(x0 + (h0 - halfway) * (x1 - x0) / (h0 - h1)) if h0 != h1 else float(x1)
    return crossing / REFERENCE_MIDPOINT


@dataclass(frozen=True)
class Profile:
    """What the gateway needs: κ (lower quartile over ramps), λc, and the capacities measured on."""

    kappa: float
    kappas: list[float]
    lambda_c_per_min: float
    prefill_gpu_tokens: int
    host_tokens: int
    decode_kv_tokens: int
    deployment: str
    ramps: list[list[RampSample]]

    def to_dict(self) -> dict:
        return asdict(self)


def combine(
    kappas: Sequence[float],
    lambda_cs: Sequence[float],
    ramps: list[list[RampSample]],
    deployment: str,
    prefill_gpu_tokens: int,
    host_tokens: int,
    decode_kv_tokens: int,
) -> Profile:
    return Profile(
        kappa=float(np.percentile(kappas, 25)),
        kappas=[float(k) for k in kappas],
        lambda_c_per_min=float(np.median(lambda_cs)),
        prefill_gpu_tokens=prefill_gpu_tokens,
        host_tokens=host_tokens,
        decode_kv_tokens=decode_kv_tokens,
        deployment=deployment,
        ramps=ramps,
    )


SETTLE_LIFETIMES = 3.0  # a ramp step lasts this many mean session lifetimes
MIN_STEP_MINUTES = 12.0
SAMPLED_SHARE = 1 / 3  # each step is sampled over its final third (after two lifetimes)


def settle_step_minutes(
    deployment_name: str, pool: Sequence[Session], host_tier: float | None = None
) -> float:
    """Ramp step long enough for the active population to settle after a rate change: three mean
    unloaded session lifetimes (a new rate's population builds up over about one lifetime, and
    lifetimes are long-tailed), at least 12 minutes. With tool time ×3 sessions last ~34 minutes, so a
    12-minute step never let the population (and the working set) reach its level at that rate."""
    from basin.sim import get_deployment
    from basin.sim.costs import unloaded_session_seconds

    gpu = get_deployment(deployment_name, host_tier=host_tier).gpu
    lifetime_min = float(np.mean([unloaded_session_seconds(gpu, s) for s in pool])) / 60
    return max(MIN_STEP_MINUTES, SETTLE_LIFETIMES * lifetime_min)


def simulate_ramp(
    deployment_name: str,
    rates: Sequence[float],
    step_minutes: float,
    seed: int,
    workload: str = "terminal-bench",
    host_tier: float | None = None,
    tool_time_scale: float = 1.0,
    shared_prefix: int | None = None,
    output_scale: float = 1.0,
    resend_outputs: bool = True,
) -> list[RampSample]:
    """Run one stepped ramp in the simulator; each step is sampled over its final third (settled)."""
    from basin.policy import make_policy
    from basin.sim import Simulation, SimulationConfig, get_deployment
    from basin.workload import load_workload
    from basin.workload.arrivals import StepSchedule

    deployment = get_deployment(deployment_name, host_tier=host_tier)
    schedule = StepSchedule(tuple(rates), step_minutes)
    pool = load_workload(workload, seed, tool_time_scale, output_scale, None, shared_prefix, resend_outputs)
    sim = Simulation(SimulationConfig(deployment, schedule, seed=seed), make_policy("hicache"), pool)
    result = sim.run()
    records = result.records
    samples = []
    for index in range(len(rates)):
        start = (index + 1 - SAMPLED_SHARE) * step_minutes * 60
        end = (index + 1) * step_minutes * 60
        states = [s for s in records.samples if start <= s.t < end]
        cached = prompt = 0
        for call in records.calls:
            if call.prefill_start_s is not None and start <= call.prefill_start_s < end:
                cached += call.cached_tokens
                prompt += call.prompt_tokens
        done = sum(1 for s in records.sessions if s.done_s is not None and start <= s.done_s < end)
        working_set = np.mean([s.working_set_tokens for s in states]) if states else np.nan
        samples.append(
            RampSample(
                working_set_over_cache=float(working_set / records.cache_tokens),
                hit_rate=cached / prompt if prompt else float("nan"),
                departures_per_min=done / ((end - start) / 60),
            )
        )
    return samples


def profile_simulated(
    deployment_name: str,
    ramps: int = 4,
    steps: int = 8,
    step_minutes: float | None = None,
    host_tier: float | None = None,
    workload: str = "terminal-bench",
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    tool_time_scale: float = 1.0,
    require_cliff: bool = True,
    shared_prefix: int | None = None,
    output_scale: float = 1.0,
    resend_outputs: bool = True,
) -> Profile:
    """κ and λc of a deployment from `ramps` simulated ramps (seeds seed, seed+1, ...). The ramp spans
    0.4x to 2x the fluid model's departure peak, so it crosses the cliff where there is one; with
    `require_cliff=False` a ramp that stays on the plateau (a decode-first deployment) gives κ = 1.
    `step_minutes` defaults to `settle_step_minutes` (three mean session lifetimes); `shared_prefix`,
    `output_scale` and `resend_outputs` as in `load_workload`."""
    from basin.fluid import FluidModel, FluidParameters, analyze
    from basin.sim import get_deployment
    from basin.workload import load_workload

    if ramps < 1 or steps < 3:
        raise BasinError("need at least 1 ramp of at least 3 steps")
    deployment = get_deployment(deployment_name, host_tier=host_tier)
    pool = load_workload(workload, seed, tool_time_scale, output_scale, None, shared_prefix, resend_outputs)
    if step_minutes is None:
        step_minutes = settle_step_minutes(deployment_name, pool, host_tier)
    model = FluidModel(FluidParameters.from_workload(deployment, pool))
    peak = analyze(model, 0.0).d_peak_per_min
    rates = list(np.linspace(0.4 * peak, 2.0 * peak, steps))
    kappas, lambda_cs, all_samples = [], [], []
    for ramp in range(ramps):
        samples = simulate_ramp(
            deployment_name,
            rates,
            step_minutes,
            seed + ramp,
            workload,
            host_tier,
            tool_time_scale,
            shared_prefix,
            output_scale,
            resend_outputs,
        )
        try:
            kappas.append(fit_kappa(samples))
        except BasinError:
            if require_cliff:
                raise
            kappas.append(1.0)
        lambda_cs.append(max(s.departures_per_min for s in samples))
        all_samples.append(samples)
        if progress is not None:
            progress(ramp + 1)
    return combine(
        kappas,
        lambda_cs,
        all_samples,
        deployment.name,
        deployment.prefill_cache_tokens,
        deployment.host_cache_tokens,
        deployment.decode_kv_tokens,
    )
