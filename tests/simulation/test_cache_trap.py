"""The cache trap on the calibrated H100 1P1D model (paper §3, Fig. 4-6), over seeds 0–11.

Outcomes near the tipping point depend on the seed (which sessions arrive when; docs/simulator.md), so
every claim here is made over twelve seeds (each seeds the workload and the arrivals), not a chosen one.
Issue 15's calibration table is `test_the_issue_15_calibration_bounds`, an expected failure until the
engine and workload meet it.
"""

from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest

from basin.evaluate import Summary
from basin.policy import make_policy
from basin.sim import Simulation, SimulationConfig, get_deployment
from basin.sim.costs import prefill_seconds
from basin.workload import RateSchedule, load_workload

SEEDS = range(12)
BASE_WINDOW_S = (300.0, 900.0)  # minutes 5-15: base load, after the warm start, before the surge


@dataclass(frozen=True)
class Run:
    summary: Summary
    uncached_share_of_capacity: float  # uncached prefill tokens/s at base load over prefill capacity
    calls_done_from_minute_25: int


@cache
def run(factor: float, seed: int, terminate: bool = False, rate: float = 3.3, minutes: float = 10.0) -> Run:
    pool = load_workload("terminal-bench", seed=seed)
    schedule = RateSchedule(
        base_rate=rate,
        duration_min=120,
        surge_factor=factor,
        surge_start_min=15,
        surge_minutes=minutes if factor != 1 else 0,
    )
    deployment = get_deployment("h100-1p1d")
    config = SimulationConfig(deployment, schedule, seed=seed, terminate_surge_sessions=terminate)
    result = Simulation(config, make_policy("hicache"), pool).run()
    # Prefill capacity at the Terminal-Bench median prompt (25.6K tokens, §3): ~31K tokens/s.
    capacity = 1 / prefill_seconds(deployment.gpu, 1, 25_600)
    start, end = BASE_WINDOW_S
    uncached = sum(
        c.uncached_tokens
        for c in result.records.calls
        if c.prefill_start_s is not None and start <= c.prefill_start_s < end
    )
    done = sum(1 for c in result.records.calls if c.done_s is not None and c.done_s >= 25 * 60)
    return Run(result.summary, uncached / (end - start) / capacity, done)


def runs(factor: float) -> list[Run]:
    return [run(factor, seed) for seed in SEEDS]


def trapped_seeds(factor: float) -> list[int]:
    return [seed for seed in SEEDS if run(factor, seed).summary.label == "trapped"]


def waiting_share(summary: Summary) -> float:
    """Share of used decode KV held by requests awaiting prefill, in the run's last window."""
    last = summary.windows[-1]
    return last.decode_kv_waiting_tokens / (last.decode_kv_waiting_tokens + last.decode_kv_decoding_tokens)


def test_base_load_is_healthy_on_every_seed_with_about_forty_sessions() -> None:
    summaries = [r.summary for r in runs(1.0)]
    assert [s.label for s in summaries] == ["healthy"] * len(SEEDS)
    assert all(s.median_ttft_late_s < 1.0 for s in summaries)
    # The paper measures 0.95 (the structural ceiling is 0.956, docs/simulator.md).
    assert np.median([s.hit_rate_pre for s in summaries]) >= 0.9
    assert min(s.hit_rate_late for s in summaries) >= 0.8
    active = np.median([np.mean([w.active_sessions for w in s.windows_20min]) for s in summaries])
    assert 30 <= active <= 55


def test_a_third_more_for_ten_minutes_traps_at_most_one_seed_of_twelve() -> None:
    assert len(trapped_seeds(1.33)) <= 1


@pytest.mark.slow
def test_every_run_the_doubling_traps_shows_the_trap() -> None:
    """Reuse gone, calls slow, fewer sessions served, and decode memory held by requests that wait for
    prefill (§3.2), in each trapped run, not in one chosen run."""
    trapped = trapped_seeds(2.0)
    assert len(trapped) >= 4
    ratios = []
    for seed in trapped:
        surge, calm = run(2.0, seed).summary, run(1.0, seed).summary
        assert surge.hit_rate_late <= 0.5
        assert surge.median_ttft_late_s > 5.0
        assert waiting_share(surge) > 0.5
        ratios.append(surge.goodput_sessions_per_h / calm.goodput_sessions_per_h)
    assert max(ratios) <= 0.8
    assert np.median(ratios) <= 0.5


@pytest.mark.slow
def test_terminating_the_surge_sessions_frees_every_seed_the_surge_alone_trapped() -> None:
    """The paper's §3.3 intervention. A seed that the +33 % surge traps as well is left out: its trap
    does not need the larger surge's sessions (measured: seed 9 stays trapped without them)."""
    own = [seed for seed in trapped_seeds(2.0) if seed not in trapped_seeds(1.33)]
    assert own
    for seed in own:
        assert run(2.0, seed, terminate=True).summary.label in ("healthy", "recovering")


def test_hit_rate_falls_off_a_cliff_past_twice_the_cache() -> None:
    points = []
    for rate in (2.5, 3.3, 4.5, 6.0):
        for window in run(1.0, seed=1, rate=rate).summary.windows:
            if not np.isnan(window.hit_rate):
                points.append((window.working_set_over_cache, window.hit_rate))
    ratio, hit = np.array(points).T
    assert (ratio < 1.5).sum() >= 10 and (ratio > 2.5).sum() >= 10
    assert np.median(hit[ratio < 1.5]) >= 0.8
    assert np.median(hit[ratio > 2.5]) <= 0.5


@pytest.mark.slow
def test_trapping_becomes_likely_only_with_the_larger_surge() -> None:
    """Across twelve seeds (workload and arrivals), the +100 % surge traps several times as many runs as
    the control and the +33 % surge. Measured on this calibration: 0, 1 and 4 of 12 (issue 15 asks for
    10 of 12 at +100 %, `test_the_issue_15_calibration_bounds`); over seeds 0–95, 0, 1 and 18 of 96."""
    trapped = {factor: len(trapped_seeds(factor)) for factor in (1.0, 1.33, 2.0)}
    assert trapped[1.0] <= 2
    assert trapped[1.33] <= 3
    assert trapped[2.0] >= 4
    assert trapped[2.0] >= 2 * max(trapped[1.0], 1)


@pytest.mark.slow
@pytest.mark.xfail(
    strict=True,
    reason="issue 15 item 1, 2 of its 10 bounds not met: +100 % traps 4 of 12 (bound 10), trapped "
    "goodput 0.23x the surge-free run's (bound 0.25-0.45; 0.28x over seeds 0-95); docs/simulator.md "
    "('Known gaps') says why",
)
def test_the_issue_15_calibration_bounds() -> None:
    """Issue 15's calibration table (h100-1p1d, Terminal-Bench-like, 3.3 sessions/min, seeds 0–11), every
    bound at once. Its words made numbers: "about two thirds" of decode KV is 0.55–0.8, calls completed
    from minute 25 "near 0.8x" the surge-free run's is 0.7–0.9, goodput "near a third" is 0.25–0.45 (all
    medians over the trapped seeds, each against its own surge-free run)."""
    calm, small, double = runs(1.0), runs(1.33), runs(2.0)
    trapped = [(r, c) for r, c in zip(double, calm, strict=True) if r.summary.label == "trapped"]
    base_hit = float(np.median([r.summary.hit_rate_pre for r in calm]))
    uncached = float(np.median([r.uncached_share_of_capacity for r in calm]))

    def median(values: list[float]) -> float:
        return float(np.median(values)) if values else float("nan")

    checks = {
        "no surge: healthy on 12 of 12": all(r.summary.label == "healthy" for r in calm),
        f"no surge: base hit rate {base_hit:.2f} >= 0.93": base_hit >= 0.93,
        f"uncached prefill at base 1/{1 / uncached:.1f} of capacity, within 1/16-1/8": 1 / 16
        <= uncached
        <= 1 / 8,
        "+33 %: recovers on >= 11 of 12": sum(r.summary.label != "trapped" for r in small) >= 11,
        f"+100 %: trapped on {len(trapped)} of 12, >= 10": len(trapped) >= 10,
    }
    hit = median([r.summary.hit_rate_late for r, _ in trapped])
    ttft = median([r.summary.median_ttft_late_s for r, _ in trapped])
    held = median([waiting_share(r.summary) for r, _ in trapped])
    calls = median([r.calls_done_from_minute_25 / c.calls_done_from_minute_25 for r, c in trapped])
    goodput = median(
        [r.summary.goodput_sessions_per_h / c.summary.goodput_sessions_per_h for r, c in trapped]
    )
    checks |= {
        f"trapped hit rate {hit:.2f} in 0.15-0.40": 0.15 <= hit <= 0.40,
        f"trapped median TTFT {ttft:.0f} s in 20-120 s": 20 <= ttft <= 120,
        f"decode KV held by requests awaiting prefill {held:.2f} in 0.55-0.8": 0.55 <= held <= 0.8,
        f"calls completed from minute 25 {calls:.2f}x the surge-free run's, in 0.7-0.9": 0.7 <= calls <= 0.9,
        f"goodput {goodput:.2f}x the surge-free run's, in 0.25-0.45": 0.25 <= goodput <= 0.45,
    }
    failed = [name for name, ok in checks.items() if not ok]
    assert not failed, "bounds not met: " + "; ".join(failed)


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
