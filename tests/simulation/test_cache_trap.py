"""The cache trap on the calibrated H100 1P1D model (paper §3, Fig. 4-6), with pinned seeds.

Outcomes near the tipping point are stochastic (as in the paper's metastability argument); docs/
simulator.md reports how often each scenario traps across seeds. These tests pin one seed per claim.
"""

from functools import cache

import numpy as np
import pytest

from basin.evaluate import Summary
from basin.policy import make_policy
from basin.sim import Simulation, SimulationConfig, get_deployment
from basin.workload import RateSchedule, load_workload

SEED = 3  # a seed where the +100 % surge traps; see docs/simulator.md for the other seeds


@cache
def run(
    factor: float, seed: int = SEED, terminate: bool = False, rate: float = 3.3, minutes: float = 10.0
) -> Summary:
    pool = load_workload("terminal-bench", seed=seed)
    schedule = RateSchedule(
        base_rate=rate,
        duration_min=120,
        surge_factor=factor,
        surge_start_min=15,
        surge_minutes=minutes if factor != 1 else 0,
    )
    config = SimulationConfig(
        get_deployment("h100-1p1d"), schedule, seed=seed, terminate_surge_sessions=terminate
    )
    return Simulation(config, make_policy("hicache"), pool).run().summary


def test_base_load_is_healthy_with_about_forty_sessions() -> None:
    summary = run(1.0)
    assert summary.label == "healthy"
    assert summary.median_ttft_late_s < 1.0
    # The paper measures 0.95 (the structural ceiling is 0.956, docs/simulator.md).
    assert summary.hit_rate_pre >= 0.9
    assert summary.hit_rate_late >= 0.9
    active = np.mean([w.active_sessions for w in summary.windows_20min])
    assert 30 <= active <= 55


def test_a_third_more_for_ten_minutes_is_not_trapped() -> None:
    assert run(1.33).label != "trapped"


def test_doubling_for_ten_minutes_traps_the_engine() -> None:
    surge, calm = run(2.0), run(1.0)
    assert surge.label == "trapped"
    assert surge.hit_rate_late <= 0.5
    assert surge.median_ttft_late_s > 5.0
    assert surge.goodput_sessions_per_h <= 0.5 * calm.goodput_sessions_per_h


def test_terminating_the_surge_sessions_lets_it_recover() -> None:
    assert run(2.0, terminate=True).label in ("healthy", "recovering")


def test_requests_awaiting_prefill_hold_decode_memory_in_the_trap() -> None:
    last = run(2.0).windows[-1]
    assert last.decode_kv_waiting_tokens > last.decode_kv_decoding_tokens


def test_hit_rate_falls_off_a_cliff_past_twice_the_cache() -> None:
    points = []
    for rate in (2.5, 3.3, 4.5, 6.0):
        for window in run(1.0, seed=1, rate=rate).windows:
            if not np.isnan(window.hit_rate):
                points.append((window.working_set_over_cache, window.hit_rate))
    ratio, hit = np.array(points).T
    assert (ratio < 1.5).sum() >= 10 and (ratio > 2.5).sum() >= 10
    assert np.median(hit[ratio < 1.5]) >= 0.8
    assert np.median(hit[ratio > 2.5]) <= 0.5


@pytest.mark.slow
def test_trapping_becomes_likely_only_with_the_larger_surge() -> None:
    """Across twelve seeds (workload and arrivals), the +100 % surge traps most runs; the control and the
    +33 % surge rarely. Measured on this calibration: 1, 2 and 6 of 12."""
    trapped = {
        factor: sum(run(factor, seed=seed).label == "trapped" for seed in range(12))
        for factor in (1.0, 1.33, 2.0)
    }
    assert trapped[1.0] <= 2
    assert trapped[1.33] <= 3
    assert trapped[2.0] >= 5
    assert trapped[2.0] >= 2 * max(trapped[1.0], 1)


def test_same_seed_same_run() -> None:
    pool = load_workload("terminal-bench", seed=3)
    schedule = RateSchedule(base_rate=3.3, duration_min=30)
    first, second = (
        Simulation(
            SimulationConfig(get_deployment("h100-1p1d"), schedule, seed=3), make_policy("hicache"), pool
        )
        .run()
        .summary.to_dict()
        for _ in range(2)
    )
    assert first == second


@pytest.mark.parametrize("preset", ["h100-1p1d", "h200-1p1d", "h200-1p2d", "h200-1p3d", "h200-2p6d"])
def test_every_preset_serves_a_light_load_and_keeps_its_books(preset: str) -> None:
    pool = load_workload("terminal-bench", seed=0)
    schedule = RateSchedule(base_rate=2.0, duration_min=30)
    sim = Simulation(SimulationConfig(get_deployment(preset), schedule, seed=0), make_policy("hicache"), pool)
    summary = sim.run().summary
    assert summary.windows[-1].median_ttft_s < 1.0
    assert summary.hit_rate_late > 0.8
    for prefill in sim.engine.prefills:
        prefill.cache.check()
    for decode in sim.engine.decodes:
        assert 0 <= decode.used <= decode.capacity
    assert all(s.outcome in ("completed", "unfinished") for s in sim.records.sessions)
