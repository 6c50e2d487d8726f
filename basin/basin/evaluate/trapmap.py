"""How often a finite surge traps the engine (paper §4, Fig. 7): HiCache alone on a grid of base loads
and surge sizes, every cell over several seeds.

Near the tipping point a surge's outcome depends on which sessions happen to be active together
(docs/simulator.md), so one run per cell says little. A cell counts the seeds whose run ends trapped
(§7.1's label), names them, and describes the trapped runs (late hit rate, median TTFT). It also counts
the runs whose L_late exceeds 10 s, the paper's own summary for these sweeps (§4): a run can be slow to the
end without losing reuse (overloaded), or keep reuse low without staying slow. The calibration table of
docs/simulator.md (h100-1p1d at 3.3 sessions/min, seeds 0–11) is one row of such a map.

`offered` also runs every cell's arrivals on an engine that never runs out of cache or KV memory and
records the peak working set and the peak number of active sessions they bring: the demand each seed puts
on the engine, apart from how the engine copes. A surge whose offered peak stays within the control's
own excursions cannot trap reliably by the working set alone (docs/simulator.md, "Known gaps").
`trap_threshold` finds the offered peak that best separates trapped runs from the rest.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from basin.errors import BasinError

if TYPE_CHECKING:
    from basin.sim import Deployment

PERSISTENT_LATENCY_S = 10.0  # §4: an L_late above 10 s marks persistent high latency


@dataclass(frozen=True)
class MapSpec:
    """The grid: absolute base rates (sessions/min) × surge factors (1.0 is the no-surge control) × seeds."""

    deployment: str
    base_rates: tuple[float, ...]
    surge_factors: tuple[float, ...]
    seeds: tuple[int, ...]
    # The deployment model's options, as `basin simulate` takes them (None: the preset's).
    host_tier: float | None = None
    allocation: str | None = None
    router: str | None = None
    transfer: str | None = None
    state_slots: int | None = None
    waiting_prefix_refresh: bool | None = None
    workload: str = "terminal-bench"
    tool_time_scale: float = 1.0
    shared_prefix: int | None = None
    surge_start_min: float = 15.0
    surge_minutes: float = 10.0
    duration_min: float = 120.0
    offered: bool = False  # also measure every run's demand on an engine that never binds

    def validate(self) -> None:
        if not self.base_rates or min(self.base_rates) <= 0:
            raise BasinError("base rates must be positive sessions/min")
        if not self.surge_factors or min(self.surge_factors) < 1:
            raise BasinError("surge factors must be at least 1 (1: no surge)")
        if not self.seeds:
            raise BasinError("give at least one seed")
        if self.surge_minutes <= 0 or self.surge_start_min < 0:
            raise BasinError("the surge needs a positive length and a start at or after minute 0")
        if self.surge_start_min + self.surge_minutes + 35 > self.duration_min:
            # §7.1: the windows that decide "trapped" end at least 35 minutes after the trigger.
            raise BasinError("--duration-min must reach 35 minutes past the surge's end to label a trap")

    def deployment_model(self) -> Deployment:
        """The deployment every run simulates; an unknown name or option is a `BasinError`."""
        from basin.sim import get_deployment

        return get_deployment(
            self.deployment,
            host_tier=self.host_tier,
            allocation=self.allocation,
            router=self.router,
            transfer=self.transfer,
            state_slots=self.state_slots,
            waiting_prefix_refresh=self.waiting_prefix_refresh,
        )

    @property
    def runs(self) -> list[tuple[float, float, int]]:
        return [(r, f, s) for r in self.base_rates for f in self.surge_factors for s in self.seeds]


@dataclass(frozen=True)
class Outcome:
    base_rate: float
    surge_factor: float
    seed: int
    label: str
    hit_rate_pre: float
    hit_rate_late: float
    median_ttft_late_s: float
    goodput_sessions_per_h: float
    l_late_s: float  # the largest 2-minute-window median TTFT in the final 30 minutes (§4)
    # With `offered`: the peak working set over the deployment's `cache_tokens` and the peak active
    # sessions that the same arrivals bring to an engine that never binds (None without it).
    offered_peak_working_set: float | None = None
    offered_peak_sessions: int | None = None


def never_binding(deployment: Deployment) -> Deployment:
    """The same engine with a prefix cache and decode memory no run fills: no eviction, no waiting for
    memory, so sessions live their unloaded lifetimes (prefill and decode keep their speeds)."""
    unbounded = 1 << 40
    gpu = replace(
        deployment.gpu,
        prefill_cache_tokens=unbounded,
        decode_kv_tokens=unbounded,
        recurrent_state_slots=None,
    )
    return replace(deployment, gpu=gpu, host_tier=0.0)


def run_one(spec: MapSpec, base_rate: float, factor: float, seed: int) -> Outcome:
    """One run of HiCache alone: the cell (base_rate, factor) on `seed`."""
    from basin.policy import make_policy
    from basin.sim import Simulation, SimulationConfig
    from basin.workload import RateSchedule, load_workload

    deployment = spec.deployment_model()
    pool = load_workload(
        spec.workload, seed=seed, tool_time_scale=spec.tool_time_scale, shared_prefix=spec.shared_prefix
    )
    schedule = RateSchedule(
        base_rate=base_rate,
        duration_min=spec.duration_min,
        surge_factor=factor,
        surge_start_min=spec.surge_start_min,
        surge_minutes=spec.surge_minutes if factor != 1 else 0.0,
    )
    config = SimulationConfig(deployment, schedule, seed=seed)
    summary = Simulation(config, make_policy("hicache"), pool).run().summary
    offered_ws, offered_sessions = None, None
    if spec.offered:
        config = SimulationConfig(never_binding(deployment), schedule, seed=seed)
        samples = Simulation(config, make_policy("hicache"), pool).run().records.samples
        offered_ws = max(s.working_set_tokens for s in samples) / deployment.cache_tokens
        offered_sessions = max(s.active_sessions for s in samples)
    return Outcome(
        base_rate,
        factor,
        seed,
        summary.label,
        summary.hit_rate_pre,
        summary.hit_rate_late,
        summary.median_ttft_late_s,
        summary.goodput_sessions_per_h,
        summary.l_late_s,
        offered_ws,
        offered_sessions,
    )


def run_map(spec: MapSpec, jobs: int = 1, advance: Callable[[], None] | None = None) -> list[Outcome]:
    """Every run of the grid, in grid order whatever the number of worker processes."""
    spec.validate()
    runs = spec.runs
    results: dict[tuple[float, float, int], Outcome] = {}
    if jobs <= 1:
        for run in runs:
            results[run] = run_one(spec, *run)
            if advance:
                advance()
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(runs))) as pool:
            futures = {pool.submit(run_one, spec, *run): run for run in runs}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if advance:
                    advance()
    return [results[run] for run in runs]


@dataclass(frozen=True)
class Cell:
    """A (base rate, surge factor) cell over its seeds."""

    base_rate: float
    surge_factor: float
    outcomes: tuple[Outcome, ...]

    @property
    def trapped(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.label == "trapped"]

    @property
    def trapped_share_interval(self) -> tuple[float, float]:
        """95 % Clopper–Pearson interval for the chance that a surge traps this cell: the seeds are
        independent draws, so k of n says how likely a trap is only within such bounds (2 of 12 fits
        anything from 2 % to 48 %)."""
        from scipy.stats import binomtest

        interval = binomtest(len(self.trapped), len(self.outcomes)).proportion_ci(0.95, method="exact")
        return float(interval.low), float(interval.high)

    @property
    def persistently_slow(self) -> list[Outcome]:
        """Runs whose L_late exceeds 10 s: how the paper's §4 sweeps (Figs. 7 and 8) count a surge's harm."""
        return [o for o in self.outcomes if o.l_late_s > PERSISTENT_LATENCY_S]

    @property
    def labels(self) -> Counter[str]:
        return Counter(o.label for o in self.outcomes)

    def median(self, field: str, trapped_only: bool = False) -> float:
        runs = self.trapped if trapped_only else self.outcomes
        values = [getattr(o, field) for o in runs if not math.isnan(getattr(o, field))]
        return float(np.median(values)) if values else math.nan

    def spread(self, field: str) -> tuple[float, float, float]:
        """(median, min, max) of an offered-demand field over the seeds; NaNs when it was not measured."""
        values = [getattr(o, field) for o in self.outcomes if getattr(o, field) is not None]
        if not values:
            return math.nan, math.nan, math.nan
        return float(np.median(values)), float(min(values)), float(max(values))


def cells(outcomes: Sequence[Outcome]) -> list[Cell]:
    """Outcomes grouped by cell, in grid order."""
    grouped: dict[tuple[float, float], list[Outcome]] = {}
    for outcome in outcomes:
        grouped.setdefault((outcome.base_rate, outcome.surge_factor), []).append(outcome)
    return [Cell(rate, factor, tuple(runs)) for (rate, factor), runs in grouped.items()]


@dataclass(frozen=True)
class Threshold:
    """A cut on one offered-demand field and how the runs fall around it: of the `trapped` runs,
    `trapped_above` offered more than `value`; of the `others` (every other state), `others_above` did."""

    field: str
    value: float
    trapped_above: int
    trapped: int
    others_above: int
    others: int


def trap_threshold(outcomes: Sequence[Outcome], field: str) -> Threshold | None:
    """The cut on an offered-demand field (`offered_peak_working_set` or `offered_peak_sessions`) that
    best tells trapped runs from the rest: the largest share of trapped runs above it less the share of
    other runs above it (Youden's J, so a rare trap is not outvoted), midway between the two runs it falls
    between, the lowest on a tie. None without offered demand, without both trapped and other runs, or
    when every run offers the same. If the trap follows the working set, steady and surge runs share one
    cut whatever the base rate (docs/simulator.md, Known gaps)."""
    measured = sorted((o for o in outcomes if getattr(o, field) is not None), key=lambda o: getattr(o, field))
    if not measured:
        return None
    values = np.array([getattr(o, field) for o in measured], dtype=float)
    trapped = np.array([o.label == "trapped" for o in measured])
    n_trapped, n_others = int(trapped.sum()), int((~trapped).sum())
    cuts = [k for k in range(1, len(values)) if values[k] > values[k - 1]]
    if not n_trapped or not n_others or not cuts:
        return None
    # Cutting after the k lowest runs leaves trapped[k:] above the cut.
    trapped_above = np.concatenate((np.cumsum(trapped[::-1])[::-1], [0]))
    others_above = np.concatenate((np.cumsum(~trapped[::-1])[::-1], [0]))
    best = max(cuts, key=lambda k: trapped_above[k] / n_trapped - others_above[k] / n_others)
    return Threshold(
        field,
        float(values[best - 1] + values[best]) / 2,
        int(trapped_above[best]),
        n_trapped,
        int(others_above[best]),
        n_others,
    )


def surge_name(factor: float) -> str:
    """1 → "none", 2 → "+100 %"."""
    return "none" if factor == 1 else f"+{(factor - 1) * 100:.0f} %"


def payload(spec: MapSpec, outcomes: Sequence[Outcome]) -> dict:
    return {
        "spec": asdict(spec),
        "policy": "hicache",
        "outcomes": [asdict(o) for o in outcomes],
    }


def plot_map(spec: MapSpec, outcomes: Sequence[Outcome], out: str | Path) -> None:
    """The paper's Fig. 7 panel: the share of seeds trapped per cell, with the count written in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = {(c.base_rate, c.surge_factor): c for c in cells(outcomes)}
    rates, factors = list(spec.base_rates), list(spec.surge_factors)
    share = np.array([[len(grid[r, f].trapped) / len(grid[r, f].outcomes) for f in factors] for r in rates])
    fig, ax = plt.subplots(
        figsize=(2.4 + 1.1 * len(factors), 2.0 + 0.5 * len(rates)), constrained_layout=True
    )
    image = ax.imshow(share, cmap="Reds", vmin=0, vmax=1, origin="lower", aspect="auto")
    for i, rate in enumerate(rates):
        for j, factor in enumerate(factors):
            cell = grid[rate, factor]
            ax.text(
                j,
                i,
                f"{len(cell.trapped)}/{len(cell.outcomes)}",
                ha="center",
                va="center",
                color="white" if share[i, j] > 0.6 else "black",
            )
    ax.set_xticks(range(len(factors)), [surge_name(f) for f in factors])
    ax.set_yticks(range(len(rates)), [f"{r:g}" for r in rates])
    ax.set_xlabel(f"surge ({spec.surge_minutes:g} min)")
    ax.set_ylabel("base rate (/min)")
    ax.set_title(f"{spec.deployment}, HiCache alone: seeds trapped", fontsize=10)
    fig.colorbar(image, ax=ax, label="share trapped")
    fig.savefig(out, dpi=120)
    plt.close(fig)
