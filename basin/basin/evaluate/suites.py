"""Evaluation suites: named sets of simulated scenarios × systems, each row judged by the same metrics.

`ablation` (paper §7.8, Fig. 23): BASIN with one mechanism removed — the priority order, admission,
lending — lending alone, and the arrival-time controller, against full BASIN, Continuum and HiCache
alone, on cache-first 1P3D scenarios.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from basin.evaluate.summary import Summary


@dataclass(frozen=True)
class Scenario:
    name: str
    deployment: str
    host_tier: float
    base_rate: float
    surge_factor: float
    surge_minutes: float
    surge_start_min: float = 15.0
    duration_min: float = 120.0


@dataclass(frozen=True)
class System:
    name: str
    policy: str
    config_changes: tuple[tuple[str, bool], ...] = ()


@dataclass(frozen=True)
class Row:
    scenario: str
    system: str
    goodput_sessions_per_h: float
    completed_fraction: float
    shed_fraction: float
    median_slowdown: float
    p90_first_call_wait_s: float
    label: str
    relative_to_basin: float = math.nan

    def to_dict(self) -> dict:
        return {
            k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in dataclasses.asdict(self).items()
        }


ABLATION_SCENARIOS = (
    Scenario("1P3D host x2, x5 surge 20 min", "h200-1p3d", 2.0, 8.0, 5.0, 20.0),
    Scenario("1P3D GPU-only, x5 surge 20 min", "h200-1p3d", 0.0, 6.0, 5.0, 20.0),
    Scenario("1P3D host x2, x3 surge 40 min", "h200-1p3d", 2.0, 8.0, 3.0, 40.0),
)
ABLATION_SYSTEMS = (
    System("BASIN", "basin"),
    System("without priority order", "basin", (("ordering", False),)),
    System("without admission", "basin", (("admission", False),)),
    System("without lending", "basin", (("lending", False),)),
    System("lending only", "basin", (("admission", False), ("ordering", False))),
    System("arrival-time controller", "basin-arrival"),
    System("Continuum", "continuum"),
    System("ThunderAgent", "thunderagent"),
    System("CONCUR", "concur"),
    System("Crossflow", "crossflow"),
    System("HiCache alone", "hicache"),
)
SUITES = {"ablation": (ABLATION_SCENARIOS, ABLATION_SYSTEMS)}


def run_scenario(scenario: Scenario, system: System, seed: int, workload: str = "terminal-bench") -> Summary:
    from basin.policy import BasinConfig
    from basin.sim import Simulation, SimulationConfig, get_deployment
    from basin.sim.policies import build_policy
    from basin.workload import RateSchedule, load_workload

    deployment = get_deployment(scenario.deployment, host_tier=scenario.host_tier)
    pool = load_workload(workload, seed=seed)
    schedule = RateSchedule(
        base_rate=scenario.base_rate,
        duration_min=scenario.duration_min,
        surge_factor=scenario.surge_factor,
        surge_start_min=scenario.surge_start_min,
        surge_minutes=scenario.surge_minutes,
    )
    policy = build_policy(system.policy, deployment, pool, seed)
    if system.config_changes:
        config = dataclasses.replace(BasinConfig(), **dict(system.config_changes))
        policy.config = config  # type: ignore[attr-defined]
    return Simulation(SimulationConfig(deployment, schedule, seed=seed), policy, pool).run().summary


def run_suite(name: str, seed: int = 0, progress: Callable[[int], None] | None = None) -> list[Row]:
    scenarios, systems = SUITES[name]
    rows: list[Row] = []
    done = 0
    for scenario in scenarios:
        results = []
        for system in systems:
            summary = run_scenario(scenario, system, seed)
            results.append((system, summary))
            done += 1
            if progress is not None:
                progress(done)
        reference = results[0][1].goodput_sessions_per_h
        for system, s in results:
            rows.append(
                Row(
                    scenario=scenario.name,
                    system=system.name,
                    goodput_sessions_per_h=s.goodput_sessions_per_h,
                    completed_fraction=s.completed_fraction,
                    shed_fraction=s.shed_fraction,
                    median_slowdown=s.median_slowdown,
                    p90_first_call_wait_s=s.p90_first_call_wait_s,
                    label=s.label,
                    relative_to_basin=s.goodput_sessions_per_h / reference if reference else math.nan,
                )
            )
    return rows


def plot_suite(rows: list[Row], out: str, title: str) -> None:
    """Goodput of each system relative to full BASIN, one group of bars per scenario."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    scenarios = list(dict.fromkeys(r.scenario for r in rows))
    systems = list(dict.fromkeys(r.system for r in rows))
    width = 0.8 / len(systems)
    fig, ax = plt.subplots(figsize=(10, 4), constrained_layout=True)
    for i, system in enumerate(systems):
        values = [
            next(r.relative_to_basin for r in rows if r.scenario == sc and r.system == system)
            for sc in scenarios
        ]
        ax.bar(np.arange(len(scenarios)) + i * width, values, width, label=system)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(np.arange(len(scenarios)) + 0.4 - width / 2, scenarios, fontsize=8)
    ax.set_ylabel("Goodput relative to BASIN")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, ncol=4)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(out, dpi=120)
    plt.close(fig)
