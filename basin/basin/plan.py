"""What-if capacity planning against the cache trap: which prefill:decode split and host tier of N GPUs
absorbs the largest surge at a given base load (paper §5 applied to a purchase or a re-split).

For every split and tier the fluid model (`basin.fluid`) gives the first limit, the departure peak D(N*),
the vulnerable range and the equilibria at the base rate. A surge is then played through the model's
population balance dN/dt = λ(t) − D(N): the population starts at the stable equilibrium N_s, grows while
arrivals exceed departures, and after the surge it recovers only if it ended below the unstable
equilibrium N_u (past it, departures stay below arrivals and the population keeps growing: the trap).
The largest recoverable surge is found by bisection on the surge factor. `verify` replays the top
candidates in the simulator under a policy and compares its run label with the model's verdict.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace

import numpy as np

from basin.errors import BasinError
from basin.fluid import Analysis, FluidModel, FluidParameters, analyze
from basin.policy.basin import DeploymentProfile
from basin.profile_schema import ProfileDocument
from basin.sim.costs import prefill_seconds
from basin.sim.deployments import GPUS, Deployment, GpuCalibration, shape_name
from basin.workload import WorkloadSpec
from basin.workload.model import Session

STEP_MIN = 1 / 12  # integration step of the population balance, minutes (5 s)
MAX_SURGE_FACTOR = 50.0  # the bisection's ceiling: "recovers from anything up to ×50"
RECOVERED_SHARE = 0.05  # drained once the excess over N_s is down to this share of its peak
# A surge is recovered from when the population drains within this long after it ends: the hour the
# paper watches after its surges (§3.2), and what a deployment that is merely slow to drain fails.
DRAIN_LIMIT_MIN = 60.0
SURGE_START_MIN = 15.0  # verification runs: the suites' trigger time
VERIFY_MINUTES_AFTER = 85.0  # verification runs last until this long after the surge ends


@dataclass(frozen=True)
class Surge:
    factor: float  # arrivals during the surge, as a multiple of the base rate
    minutes: float

    def __post_init__(self) -> None:
        if self.factor < 1 or self.minutes <= 0:
            raise BasinError(f"a surge needs a factor >= 1 and positive minutes, got {self}")

    @classmethod
    def parse(cls, text: str) -> Surge:
        """`F:MINUTES`, e.g. `5:20` for five times the base rate during twenty minutes."""
        try:
            factor, minutes = (float(part) for part in text.split(":"))
        except ValueError:
            raise BasinError(f"--surge takes FACTOR:MINUTES (e.g. 5:20), got {text!r}") from None
        return cls(factor, minutes)


@dataclass(frozen=True)
class Candidate:
    """One split and host tier, judged by the fluid model."""

    name: str
    prefill: int
    decode: int
    host_tier: float
    first_limit: str  # cache or decode
    state: str  # the model's state at the base rate (vulnerable, overloaded, ...)
    departure_peak_per_min: float
    low_reuse_per_min: float
    vulnerable_range_per_min: tuple[float, float]
    n_stable: float | None
    n_unstable: float | None
    surge_peak_population: float | None  # N at the end of the given surge
    recovers: bool  # the given surge drains within DRAIN_LIMIT_MIN without control
    drain_minutes: float | None  # back near N_s after the given surge (None: it does not recover)
    max_recoverable_factor: float  # the largest surge factor for the given minutes that recovers (≤ 50)

    @property
    def headroom(self) -> float:
        """Sort key: the largest recoverable surge, then the departure peak."""
        return self.max_recoverable_factor + self.departure_peak_per_min / 1e6

    def to_dict(self) -> dict:
        out = asdict(self)
        out["vulnerable_range_per_min"] = list(self.vulnerable_range_per_min)
        return out


@dataclass(frozen=True)
class Verification:
    """A simulator run of one candidate under the surge, beside the model's verdict."""

    name: str
    host_tier: float
    policy: str
    label: str
    goodput_sessions_per_h: float
    model_recovers: bool

    @property
    def simulated_recovers(self) -> bool:
        return self.label in ("healthy", "recovering")

    @property
    def agrees(self) -> bool:
        return self.simulated_recovers == self.model_recovers

    def to_dict(self) -> dict:
        return {**asdict(self), "simulated_recovers": self.simulated_recovers, "agrees": self.agrees}


def splits(gpus: int) -> list[tuple[int, int]]:
    """Every prefill:decode split of `gpus` GPUs with at least one of each."""
    if gpus < 2:
        raise BasinError(f"a prefill-decode deployment needs at least 2 GPUs, got {gpus}")
    return [(p, gpus - p) for p in range(1, gpus)]


def deployment_for(gpu: str | GpuCalibration, prefill: int, decode: int, host_tier: float) -> Deployment:
    """A split of `gpu` (a preset's name, or a calibration such as `Basis.gpu` from a profile)."""
    if isinstance(gpu, str):
        if gpu not in GPUS:
            raise BasinError(f"unknown GPU {gpu!r}; choose {', '.join(GPUS)}")
        gpu = GPUS[gpu]
    deployment = Deployment(shape_name(gpu.name, prefill, decode), gpu, prefill, decode, host_tier=host_tier)
    deployment.validate()
    return deployment


def calibrated_gpu(
    preset: GpuCalibration,
    pool: Sequence[Session],
    prefill_gpu_tokens: int,
    decode_kv_tokens: int,
    prefill_tokens_per_s: float,
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
) -> GpuCalibration:
    """`preset` with one instance's share of measured aggregates: prefix cache, decode KV and (when
    measured, > 0) the prefill rate on `pool`, which rescales the preset's prefill cost."""
    if not pool:
        raise BasinError("the workload holds no sessions")
    if prefill_replicas < 1 or decode_replicas < 1:
        raise BasinError("a deployment needs at least one prefill and one decode replica")
    slower = 1.0
    if prefill_tokens_per_s > 0:
        prompt = float(np.mean([c.prompt_tokens for s in pool for c in s.calls]))
        preset_rate = 1.0 / prefill_seconds(preset, 1, int(prompt / 2))  # one instance, as FluidParameters
        slower = preset_rate / (prefill_tokens_per_s / prefill_replicas)
    calibrated = replace(
        preset,
        prefill_cache_tokens=prefill_gpu_tokens // prefill_replicas,
        decode_kv_tokens=decode_kv_tokens // decode_replicas,
        prefill_s_per_token=preset.prefill_s_per_token * slower,
        prefill_s_per_token_position=preset.prefill_s_per_token_position * slower,
    )
    if calibrated.prefill_cache_tokens < 1 or calibrated.decode_kv_tokens < 1:
        raise BasinError("capacities below one token per replica")
    return calibrated


@dataclass(frozen=True)
class Basis:
    """Where a plan's κ and capacities come from: a GPU preset, or a live profile (`--profile`).

    A profile measures one deployment; its capacities are aggregates over its replicas, so they are
    divided back to one instance and every split is built from those instances. Its prefill rate
    rescales the preset's prefill cost (position dependence kept); decode costs stay the preset's,
    since a profile does not measure them."""

    gpu: GpuCalibration
    kappa: float
    source: str  # "presets" or "profile"
    profile: ProfileDocument | None = None
    path: str | None = None

    @classmethod
    def presets(cls, gpu: str, kappa: float = 1.0) -> Basis:
        if gpu not in GPUS:
            raise BasinError(f"unknown GPU {gpu!r}; choose {', '.join(GPUS)}")
        if kappa <= 0:
            raise BasinError(f"--kappa must be positive, got {kappa}")
        return cls(GPUS[gpu], kappa, "presets")

    @classmethod
    def from_profile(
        cls, doc: ProfileDocument, gpu: str, pool: Sequence[Session], path: str = "profile.json"
    ) -> Basis:
        """Per-instance capacities of `doc` on the `gpu` preset's costs; `pool` is the workload the
        profile's prefill rate was measured with (the rate depends on the mean prompt position)."""
        preset = cls.presets(gpu).gpu
        if doc.gpu is not None and doc.gpu != gpu:
            raise BasinError(f"{path} was measured on {doc.gpu}, not {gpu}: pass --gpu {doc.gpu}")
        calibrated = calibrated_gpu(
            preset,
            pool,
            doc.prefill_gpu_tokens,
            doc.decode_kv_tokens,
            doc.prefill_tokens_per_s,
            doc.prefill_replicas,
            doc.decode_replicas,
        )
        return cls(calibrated, doc.kappa, "profile", doc, path)

    def describe(self) -> str:
        """One line for the table: which numbers are measured and which are the preset's."""
        if self.profile is None:
            return f"capacities and costs: the {self.gpu.name.upper()} preset calibration; κ = {self.kappa:g}"
        doc = self.profile
        when = doc.profiled_at.strftime("%Y-%m-%d %H:%M UTC")
        what = doc.deployment or f"{doc.prefill_replicas}P{doc.decode_replicas}D"
        rate = doc.prefill_tokens_per_s / doc.prefill_replicas
        return (
            f"κ = {self.kappa:.3g} and capacities from profile {self.path} ({doc.source}, {what},"
            f" {when}): per instance prefill cache {self.gpu.prefill_cache_tokens:,}, decode KV"
            f" {self.gpu.decode_kv_tokens:,} tokens, prefill {rate:,.0f} tokens/s; decode costs: the preset's"
        )

    def to_dict(self) -> dict:
        out: dict = {"capacities": self.source, "kappa": self.kappa}
        out["per_instance"] = {
            "prefill_cache_tokens": self.gpu.prefill_cache_tokens,
            "decode_kv_tokens": self.gpu.decode_kv_tokens,
        }
        if self.profile is not None:
            doc = self.profile
            out["profile"] = {
                "path": self.path,
                "source": doc.source,
                "deployment": doc.deployment,
                "fingerprint": doc.fingerprint,
                "profiled_at": doc.model_dump(mode="json")["profiled_at"],
                "prefill_replicas": doc.prefill_replicas,
                "decode_replicas": doc.decode_replicas,
                "lambda_c_per_min": doc.lambda_c_per_min,
            }
        return out


class PopulationBalance:
    """dN/dt = λ(t) − D(N) on the model's departure curve, integrated in steps of `STEP_MIN`."""

    def __init__(self, model: FluidModel) -> None:
        self.n = model.population_grid()
        self.d = model.departures_per_min(self.n)
        # Below this population every session is in a call or a tool run with no queue to wait in: the
        # closed-loop bound is the tightest. Above it calls queue for prefill or decode (degraded service).
        service = np.minimum(model.prefill_bound(self.n), model.decode_bound())
        peak = self.n[int(np.argmax(self.d))]
        free = (model.closed_loop(self.n) <= service) & (self.n <= peak)
        self.queue_free = float(self.n[free].max()) if free.any() else 0.0

    def departures(self, population: float) -> float:
        return float(np.interp(population, self.n, self.d))

    def through_surge(self, start: float, rate: float, surge: Surge) -> float:
        """The population at the end of `surge` on top of `rate`, starting from `start`."""
        population = start
        for _ in range(max(1, round(surge.minutes / STEP_MIN))):
            population = max(population + (surge.factor * rate - self.departures(population)) * STEP_MIN, 0.0)
        return population

    def drain_minutes(self, peak: float, stable: float, rate: float) -> float | None:
        """Minutes from `peak` until calls no longer queue (the population is back below the queue-free
        level, or within RECOVERED_SHARE of `stable`); None when that takes longer than DRAIN_LIMIT_MIN.
        Sessions beyond that level only lengthen tool runs in progress: service is not degraded."""
        target = max(self.queue_free, stable + RECOVERED_SHARE * (peak - stable))
        population, minutes = peak, 0.0
        while population > target:
            population += (rate - self.departures(population)) * STEP_MIN
            minutes += STEP_MIN
            if minutes > DRAIN_LIMIT_MIN:
                return None
        return minutes


def judge(
    deployment: Deployment,
    pool: Sequence[Session],
    base_rate: float,
    surge: Surge,
    kappa: float = 1.0,
) -> Candidate:
    """The fluid model's verdict on one deployment: limits, equilibria, the surge and the largest one."""
    model = FluidModel(FluidParameters.from_workload(deployment, pool, kappa))
    analysis = analyze(model, base_rate)
    balance = PopulationBalance(model)
    stable = analysis.n_stable

    def outcome(factor: float) -> tuple[bool, float | None, float | None]:
        return _outcome(balance, analysis, stable, Surge(factor, surge.minutes))

    given, end, drain = outcome(surge.factor)
    largest = _largest_factor(lambda factor: outcome(factor)[0])
    return Candidate(
        name=deployment.name,
        prefill=deployment.prefill_instances,
        decode=deployment.decode_instances,
        host_tier=deployment.host_tier,
        first_limit=analysis.first_limit,
        state=analysis.state,
        departure_peak_per_min=analysis.d_peak_per_min,
        low_reuse_per_min=analysis.d_low_per_min,
        vulnerable_range_per_min=analysis.vulnerable_range_per_min,
        n_stable=stable,
        n_unstable=analysis.n_unstable,
        surge_peak_population=end,
        recovers=given,
        drain_minutes=drain,
        max_recoverable_factor=largest,
    )


def _outcome(
    balance: PopulationBalance, analysis: Analysis, start: float | None, surge: Surge
) -> tuple[bool, float | None, float | None]:
    """(recovers, population at the surge's end, drain minutes) for `surge` on top of the analysis's
    base rate, from population `start` (None: no stable state to start from)."""
    stable, unstable, rate = analysis.n_stable, analysis.n_unstable, analysis.base_rate_per_min
    if stable is None or start is None:  # the base rate alone exceeds the departure peak
        return False, None, None
    end = balance.through_surge(start, rate, surge)
    if unstable is not None and end >= unstable:
        return False, end, None  # past N_u departures stay below arrivals: trapped
    drain = balance.drain_minutes(end, stable, rate)
    return drain is not None, end, drain


def _largest_factor(recovers: Callable[[float], bool]) -> float:
    """The largest surge factor in [1, MAX_SURGE_FACTOR] that `recovers` (bisection; 0: not even ×1)."""
    if not recovers(1.0):
        return 0.0
    if recovers(MAX_SURGE_FACTOR):
        return MAX_SURGE_FACTOR
    low, high = 1.0, MAX_SURGE_FACTOR
    while high - low > 0.01:
        middle = (low + high) / 2
        low, high = (middle, high) if recovers(middle) else (low, middle)
    return low


def running_deployment(
    profile: DeploymentProfile,
    pool: Sequence[Session],
    gpu: str = "h200",
    prefill_replicas: int = 1,
    decode_replicas: int = 1,
) -> Deployment:
    """The deployment a gateway's profile describes: measured capacities and prefill rate on the `gpu`
    preset's decode costs, with the profile's host tier (host tokens over GPU prefix tokens)."""
    preset = Basis.presets(gpu).gpu
    calibrated = calibrated_gpu(
        preset,
        pool,
        profile.prefill_gpu_tokens,
        profile.decode_kv_tokens,
        profile.prefill_tokens_per_s,
        prefill_replicas,
        decode_replicas,
    )
    return deployment_for(
        calibrated, prefill_replicas, decode_replicas, profile.host_tokens / profile.prefill_gpu_tokens
    )


@dataclass(frozen=True)
class Headroom:
    """The fluid model of a running deployment at its measured load (the gateway's `basin_plan_*`)."""

    arrival_rate_per_min: float
    population: float  # active sessions now
    departure_peak_per_min: float  # D(N*)
    rate_headroom_per_min: float  # D(N*) − λ: sustained extra arrivals before overload
    # N_u at λ: past it the population keeps growing; +inf when λ is below the low-reuse rate (any crowd
    # drains), 0 when λ exceeds D(N*) (every population grows)
    cliff_population: float
    cliff_headroom_sessions: float  # N_u − N (negative: already past it)
    surge_minutes: float
    recoverable_surge_factor: float | None  # the largest ×λ surge from now that recovers (None: λ = 0)


def headroom_now(model: FluidModel, rate: float, population: float, surge_minutes: float) -> Headroom:
    """How far the running deployment is from the cliff: the plan's numbers with the measured rate and
    the population now in place of N_s (a population already swollen absorbs a smaller surge)."""
    analysis = analyze(model, max(rate, 0.0))
    if analysis.n_stable is None:
        cliff = 0.0
    else:
        cliff = math.inf if analysis.n_unstable is None else analysis.n_unstable
    factor: float | None = None
    if rate > 0:
        balance = PopulationBalance(model)
        start = max(population, 0.0)

        def recovers(f: float) -> bool:
            return _outcome(balance, analysis, start, Surge(f, surge_minutes))[0]

        factor = _largest_factor(recovers)
    return Headroom(
        arrival_rate_per_min=rate,
        population=population,
        departure_peak_per_min=analysis.d_peak_per_min,
        rate_headroom_per_min=analysis.d_peak_per_min - rate,
        cliff_population=cliff,
        cliff_headroom_sessions=cliff - population,
        surge_minutes=surge_minutes,
        recoverable_surge_factor=factor,
    )


def plan(
    gpus: int,
    gpu: str | GpuCalibration,
    pool: Sequence[Session],
    base_rate: float,
    surge: Surge,
    host_tiers: Sequence[float],
    kappa: float = 1.0,
) -> list[Candidate]:
    """Every split of `gpus` GPUs × every host tier, best first (largest recoverable surge); `gpu` is a
    preset's name or a profiled calibration (`Basis.gpu`)."""
    if base_rate <= 0:
        raise BasinError(f"--base-rate must be positive, got {base_rate}")
    if not host_tiers or any(t < 0 for t in host_tiers):
        tiers = ", ".join(f"{t:g}" for t in host_tiers)
        raise BasinError(f"host tiers must be non-negative multiples of the GPU cache, got [{tiers}]")
    candidates = [
        judge(deployment_for(gpu, p, d, tier), pool, base_rate, surge, kappa)
        for p, d in splits(gpus)
        for tier in host_tiers
    ]
    return sorted(candidates, key=lambda c: c.headroom, reverse=True)


def recommendation(candidates: Sequence[Candidate], surge: Surge) -> str:
    """One sentence: the best candidate and why, against the best one that traps under the surge."""
    best = candidates[0]
    what = f"{best.prefill}P{best.decode}D with {_tier(best.host_tier)}"
    if best.max_recoverable_factor == 0:
        return f"none of these splits sustains the base rate; the closest is {what}"
    largest = best.max_recoverable_factor
    bound = f"x{largest:.1f}" if largest < MAX_SURGE_FACTOR else f"at least x{MAX_SURGE_FACTOR:g}"
    sentence = f"{what}: recovers from {bound} for {surge.minutes:g} min"
    if not best.recovers:
        sentence += f" (no split recovers from the planned x{surge.factor:g})"
    trapped = [c for c in candidates if not c.recovers]
    if best.recovers and trapped:
        worst = trapped[0]
        other = f"{worst.prefill}P{worst.decode}D with {_tier(worst.host_tier)}"
        sentence += f"; {other} does not recover from x{surge.factor:g}"
    return sentence


def _tier(host_tier: float) -> str:
    return "GPU-only caching" if host_tier == 0 else f"a {host_tier:g}x host tier"


def _verify_one(
    job: tuple[Candidate, str | GpuCalibration, WorkloadSpec, float, Surge, str, float | None],
) -> Verification:
    candidate, gpu, workload, base_rate, surge, policy, kappa = job
    from basin.sim import Simulation, SimulationConfig
    from basin.sim.policies import build_policy
    from basin.workload import RateSchedule

    deployment = deployment_for(gpu, candidate.prefill, candidate.decode, candidate.host_tier)
    pool = workload.load()
    schedule = RateSchedule(
        base_rate=base_rate,
        duration_min=SURGE_START_MIN + surge.minutes + VERIFY_MINUTES_AFTER,
        surge_factor=surge.factor,
        surge_start_min=SURGE_START_MIN,
        surge_minutes=surge.minutes,
    )
    built = build_policy(policy, deployment, pool, workload.seed, kappa=kappa)
    config = SimulationConfig(deployment, schedule, seed=workload.seed)
    summary = Simulation(config, built, pool).run().summary
    return Verification(
        candidate.name,
        candidate.host_tier,
        policy,
        summary.label,
        summary.goodput_sessions_per_h,
        candidate.recovers,
    )


def verify(
    candidates: Sequence[Candidate],
    gpu: str | GpuCalibration,
    workload: WorkloadSpec,
    base_rate: float,
    surge: Surge,
    policy: str,
    kappa: float | None = None,
    processes: int = 1,
    progress: Callable[[int], None] | None = None,
) -> list[Verification]:
    """Simulate each candidate under the surge with `policy`, in parallel over `processes`; the run lasts
    until 85 minutes after the surge, so its label says whether the engine recovered (paper §7.1)."""
    jobs = [(c, gpu, workload, base_rate, surge, policy, kappa) for c in candidates]
    results: list[Verification] = []
    if processes <= 1:
        for job in jobs:
            results.append(_verify_one(job))
            if progress is not None:
                progress(len(results))
        return results
    with ProcessPoolExecutor(processes) as executor:
        for result in executor.map(_verify_one, jobs):
            results.append(result)
            if progress is not None:
                progress(len(results))
    return results


def plot_plan(candidates: Sequence[Candidate], surge: Surge, out: str, title: str) -> None:
    """The largest recoverable surge factor by split (groups) and host tier (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    split_names = sorted({(c.prefill, c.decode) for c in candidates})
    tiers = sorted({c.host_tier for c in candidates})
    by_key = {(c.prefill, c.decode, c.host_tier): c for c in candidates}
    ceiling = max([c.max_recoverable_factor for c in candidates] + [surge.factor]) * 1.15
    width = 0.8 / len(tiers)
    fig, ax = plt.subplots(figsize=(max(6.4, 1.4 * len(split_names)), 4.0), constrained_layout=True)
    for index, tier in enumerate(tiers):
        xs, heights = [], []
        for position, (p, d) in enumerate(split_names):
            value = by_key[(p, d, tier)].max_recoverable_factor
            xs.append(position + (index - (len(tiers) - 1) / 2) * width)
            heights.append(value)
        ax.bar(xs, heights, width, label="GPU-only" if tier == 0 else f"host tier {tier:g}x")
    ax.axhline(surge.factor, color="tab:red", linestyle="--", label=f"planned surge x{surge.factor:g}")
    ax.set_xticks(range(len(split_names)), [f"{p}P{d}D" for p, d in split_names])
    ax.set_ylabel(f"largest recoverable surge ({surge.minutes:g} min)")
    ax.set_ylim(0, ceiling)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class GridVerdict:
    """One deployment of the paper's grid: the model's surge verdict beside the simulator's."""

    deployment: str
    host_tier: float
    tool_scale: float
    base_rate: float
    model_recovers: bool
    simulated_label: str

    @property
    def agrees(self) -> bool:
        return self.model_recovers == (self.simulated_label in ("healthy", "recovering"))


def _grid_point(job: tuple[str, float, float, Surge, float, int]) -> GridVerdict:
    preset, host_tier, tool_scale, surge, base_fraction, seed = job
    from basin.sim import get_deployment

    deployment = get_deployment(preset, host_tier=host_tier)
    workload = WorkloadSpec("terminal-bench", seed, tool_scale)
    pool = workload.load()
    peak = analyze(FluidModel(FluidParameters.from_workload(deployment, pool)), 0.0).d_peak_per_min
    rate = base_fraction * peak
    candidate = judge(deployment, pool, rate, surge)
    check = _verify_one((candidate, deployment.gpu.name, workload, rate, surge, "hicache", None))
    return GridVerdict(preset, host_tier, tool_scale, rate, candidate.recovers, check.label)


def grid_verdicts(
    surge: Surge,
    base_fraction: float = 0.5,
    seed: int = 0,
    processes: int = 1,
    progress: Callable[[int], None] | None = None,
) -> list[GridVerdict]:
    """The paper's 36 deployments (`basin.grid`), each at `base_fraction` of its model departure peak
    with `surge` on top: does the model's recover/trap verdict match the simulator's run label?"""
    from basin.grid import HOST_TIERS, PRESETS, TOOL_SCALES

    jobs = [
        (preset, tier, tool, surge, base_fraction, seed)
        for preset in PRESETS
        for tier in HOST_TIERS
        for tool in TOOL_SCALES
    ]
    results: list[GridVerdict] = []
    with ProcessPoolExecutor(max(processes, 1)) as executor:
        for result in executor.map(_grid_point, jobs):
            results.append(result)
            if progress is not None:
                progress(len(results))
    return results
