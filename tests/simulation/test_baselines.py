"""Baselines as their authors built them (issue 15): under healthy load a baseline's control must not
cost goodput that HiCache alone keeps."""

import pytest

from basin.sim import Simulation, SimulationConfig, get_deployment
from basin.sim.policies import build_policy, default_profile
from basin.workload import RateSchedule, load_workload


def _goodput(policy: str, preset: str, load: float, seed: int) -> tuple[float, str]:
    deployment = get_deployment(preset)
    pool = load_workload("terminal-bench", seed=seed)
    rate = load * default_profile(deployment, pool).lambda_c_per_min  # the fluid model's departure peak
    schedule = RateSchedule(base_rate=rate, duration_min=120)
    sim = Simulation(
        SimulationConfig(deployment, schedule, seed=seed), build_policy(policy, deployment, pool, seed), pool
    )
    summary = sim.run().summary
    return summary.goodput_sessions_per_h, summary.label


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(5))
def test_concur_keeps_hicache_goodput_under_healthy_steady_load(seed: int) -> None:
    """Issue 15: under healthy steady load CONCUR is within 10 % of HiCache alone, on seeds 0-4. h200-1p3d at
    0.85 of the critical rate: the OR rule with a raw first reading cut the window on cold prompts and lost
    46 % on seed 2 (410 vs 761 sessions/h); the AND rule leaves a healthy engine alone. The `steady` suite's
    cells (0.6 and 0.8 of the profiled λc) measured the same, seeds 0-4: CONCUR's goodput equal to HiCache
    alone's in all ten (534 [517-555] and 706 [685-719] sessions/h, with U_high 0.9), as its cut needs decode
    KV use above U_high with the smoothed hit rate below 0.7, which a healthy engine never shows."""
    hicache, label = _goodput("hicache", "h200-1p3d", 0.85, seed)
    assert label == "healthy"  # the premise: a load HiCache alone sustains
    concur, _ = _goodput("concur", "h200-1p3d", 0.85, seed)
    assert abs(concur - hicache) <= 0.1 * hicache
