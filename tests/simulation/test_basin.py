"""BASIN against HiCache alone on the paper's main cache-first scenario (H200 1P3D, 2x host tier,
x5 surge for 20 minutes from about half the critical rate: 9/min, where simulated ramps put λc at
17.9-18.9/min on seeds 0-4)."""

import dataclasses
from functools import cache

import pytest

from basin.evaluate import Summary
from basin.evaluate.suites import ABLATION_SCENARIOS, Scenario
from basin.evaluate.summary import hit_rate_between
from basin.sim import Simulation, SimulationConfig, SimulationResult, get_deployment
from basin.sim.policies import build_policy
from basin.workload import load_workload

# Seed 0 in the quick run; seeds 1-4 with the slow tests (issue 15: claims hold on seeds 0-4).
SEEDS = [0, *(pytest.param(seed, marks=pytest.mark.slow) for seed in range(1, 5))]
# The ablation suite's x5 surges, with their fixed base rates: 2x host tier, and GPU-only.
HOST_TIER_SURGE, GPU_ONLY_SURGE = ABLATION_SCENARIOS[:2]


def simulate(
    scenario: Scenario, policy: str, seed: int, prediction: str = "predictor", **config_changes: bool | float
) -> tuple[Simulation, SimulationResult]:
    """One run of a fixed-rate ablation scenario: `policy` with its profile defaults, `config_changes`
    replacing fields of BASIN's `BasinConfig` (an ablation switch, or a parameter)."""
    deployment = get_deployment(scenario.deployment, host_tier=scenario.host_tier)
    pool = load_workload("terminal-bench", seed=seed)
    agent_policy = build_policy(policy, deployment, pool, seed, prediction)
    if config_changes:
        agent_policy.config = dataclasses.replace(agent_policy.config, **config_changes)  # type: ignore[attr-defined]
    sim = Simulation(SimulationConfig(deployment, scenario.schedule(), seed=seed), agent_policy, pool)
    return sim, sim.run()


@cache
def run(policy: str, prediction: str = "predictor", seed: int = 0) -> Summary:
    return simulate(HOST_TIER_SURGE, policy, seed, prediction)[1].summary


def test_hicache_alone_is_trapped_by_the_surge() -> None:
    summary = run("hicache")
    assert summary.label == "trapped"
    assert summary.completed_fraction < 0.5


def test_basin_keeps_reuse_and_multiplies_goodput() -> None:
    basin, hicache = run("basin"), run("hicache")
    assert basin.label in ("healthy", "recovering")
    assert basin.hit_rate_late >= 0.85
    assert basin.goodput_sessions_per_h >= 2.5 * hicache.goodput_sessions_per_h  # paper: 3.13-4.17x
    assert basin.completed_fraction >= 0.95  # the paper's surge-sweep targets: >= 95 %, shedding <= 3 %
    assert basin.shed_fraction <= 0.03


def test_arrival_time_variant_also_escapes_the_trap() -> None:
    assert run("basin-arrival").label in ("healthy", "recovering")
    assert run("basin-arrival").goodput_sessions_per_h >= 2.5 * run("hicache").goodput_sessions_per_h


@pytest.mark.parametrize("seed", SEEDS)
def test_exact_peaks_do_at_least_as_well_as_predictions(seed: int) -> None:
    """Issue 15: the oracle (each session's true peak context) does at least as well as the trained
    predictor. Measured, sessions/h, predictor -> oracle: seed 0 947 -> 981, 1 962 -> 1,023, 2 936 -> 985,
    3 977 -> 1,031, 4 957 -> 999; oracle/predictor 1.04-1.06, both healthy on every seed, late hit rate
    0.951-0.956 either way."""
    oracle, predicted = run("basin", "oracle", seed), run("basin", "predictor", seed)
    assert oracle.label in ("healthy", "recovering")
    assert oracle.goodput_sessions_per_h >= predicted.goodput_sessions_per_h


@cache
def lending_run(lending: bool, seed: int) -> tuple[Summary, float, int]:
    """GPU-only 1P3D, x5 surge from 8/min (about 0.6 of its λc, 12.4-13.3/min), BASIN with lending on or off:
    the summary, the hit rate of prompts that start prefill during the surge, and the number of prompts served
    from a lent unit."""
    sim, result = simulate(GPU_ONLY_SURGE, "basin", seed, lending=lending)
    records = result.records
    assert records.trigger_s is not None and records.trigger_end_s is not None
    surge_hit = hit_rate_between(records, records.trigger_s, records.trigger_end_s)
    return result.summary, surge_hit, sim.engine.counters.unit_fetches


@pytest.mark.parametrize("seed", SEEDS)
def test_lending_serves_next_turns_from_decode_memory_without_a_host_tier(seed: int) -> None:
    """Lent units serve next turns by transfer, and the budget spends the capacity they add (B0 counts
    it) on admitting more sessions. Measured, lending off -> on, seeds 0-4:
    - goodput, sessions/h: 680 -> 725, 629 -> 687, 654 -> 713, 652 -> 734, 651 -> 729; ratio 1.07-1.13,
      mean 1.10 (paper Fig. 23, GPU-only: 0.50-0.89 of BASIN's goodput without lending). Seeds 1 and 2
      lend least (419 and 650 fetches against 1,184-1,615): units are adopted only while decode memory
      has room;
    - shed: 6.7-7.3 % -> 0.7-4.8 %;
    - the hit rate of prompts starting prefill in the surge stays within 0.05 (0.893-0.905 -> 0.850-0.887):
      the extra cache holds extra sessions rather than raising reuse. From 6/min (0.47 λc) lending was worth
      only 1.03-1.08x: the surge left decode memory little to lend against. Under the 30 ms H200 decode step
      (λc 9.3-10.7) 6/min was the same 0.6 λc and lending was worth 1.04-1.15x. Before the budget fell only
      while the engine queued (issue 15), lending was worth 1.12-1.31x: without it B fell on every dip of
      reuse. Before the budget bound at all (it fell only on a persistent prefill backlog) lending raised that
      hit rate by 0.011-0.033 and goodput by 0-4 %. The mean is `test_lending_pays_on_average`."""
    (lent, lent_surge_hit, fetches), (kept, kept_surge_hit, no_fetches) = (
        lending_run(True, seed),
        lending_run(False, seed),
    )
    assert fetches > 0 and no_fetches == 0
    assert lent.goodput_sessions_per_h > kept.goodput_sessions_per_h
    assert lent.shed_fraction < kept.shed_fraction
    assert lent_surge_hit >= kept_surge_hit - 0.05


@pytest.mark.slow
def test_lending_pays_on_average() -> None:
    """Over seeds 0-4 lending is worth at least 8 % of goodput on GPU-only 1P3D (measured 1.10x)."""
    ratios = [
        lending_run(True, seed)[0].goodput_sessions_per_h / lending_run(False, seed)[0].goodput_sessions_per_h
        for seed in range(5)
    ]
    assert sum(ratios) / len(ratios) >= 1.08


@cache
def no_order_run(seed: int) -> tuple[Summary, int]:
    """The main scenario with BASIN's priority order off: the summary and the most sessions parked at once."""
    result = simulate(HOST_TIER_SURGE, "basin", seed, ordering=False)[1]
    return result.summary, max(sample.parked_sessions for sample in result.records.samples)


@pytest.mark.parametrize("seed", SEEDS)
def test_admission_alone_holds_the_surge_without_the_priority_order(seed: int) -> None:
    """Issue 15 (paper Fig. 23: 0.81-0.95 of full BASIN without the order): the budget parks sessions and
    keeps the engine out of the trap. Measured, sessions/h, seeds 0-4: 956, 955, 952, 983, 955, all
    healthy; 0.99-1.02 of full BASIN; 0.6-1.9 % shed; 211-349 parked at most. With decode KV reserved before
    prefill (SGLang's default) instead of at prefill completion (§6.2), requests awaiting prefill took
    lent memory back on seed 0 and it only recovered (561). Before the budget followed warm returns (it
    fell only on a prefill backlog and never below the residents' reservations) every seed was trapped
    or barely recovering (212-469)."""
    summary, parked = no_order_run(seed)
    assert parked > 0
    assert summary.label in ("healthy", "recovering")
    assert summary.goodput_sessions_per_h >= 0.75 * run("basin", "predictor", seed).goodput_sessions_per_h


@pytest.mark.parametrize("seed", SEEDS)
def test_continuum_keeps_reuse_and_basin_still_leads(seed: int) -> None:
    """Continuum's pinning keeps reuse through the surge; BASIN still completes more on every seed.
    Measured, sessions/h, Continuum -> BASIN, seeds 0-4: 898 -> 947, 914 -> 962, 897 -> 936, 956 -> 977,
    899 -> 957 (1.02-1.06x, mean 1.05x; paper Fig. 14: 1.64x). Continuum is 3.6-3.8x HiCache alone."""
    continuum, basin = run("continuum", seed=seed), run("basin", seed=seed)
    hicache = run("hicache", seed=seed)
    assert continuum.label in ("healthy", "recovering")
    assert continuum.goodput_sessions_per_h >= 2 * hicache.goodput_sessions_per_h
    assert basin.goodput_sessions_per_h > continuum.goodput_sessions_per_h


@pytest.mark.slow
def test_basin_leads_continuum_on_average_over_seeds() -> None:
    """The margin's mean over seeds 0-4, so one lucky seed cannot carry it. Measured 1.05x (1.02-1.06 per
    seed; 1.03x under the 30 ms H200 decode step; 1.09x on the engine before the joint recalibration); the
    paper's 1.64x comes with sessions near the slowdown SLO, where ours keep slack (docs/simulator.md, "Known
    gaps in the calibration")."""
    ratios = [
        run("basin", seed=seed).goodput_sessions_per_h / run("continuum", seed=seed).goodput_sessions_per_h
        for seed in range(5)
    ]
    assert sum(ratios) / len(ratios) >= 1.02


def test_concur_contains_the_surge_less_well_than_basin() -> None:
    concur, basin = run("concur"), run("basin")
    assert basin.goodput_sessions_per_h >= 1.5 * concur.goodput_sessions_per_h  # paper: CONCUR 0.52 of BASIN


def test_concur_contains_the_surge_with_the_host_tier() -> None:
    """Paper §7.2: CONCUR preserves reuse with the host tier. Its watermarks are fitted to that (basin.policy.
    concur); with the first ones (0.9 and 0.7) it cut only after reuse had collapsed and trapped with HiCache
    alone (268 vs 243 sessions/h, seed 0)."""
    concur, hicache = run("concur"), run("hicache")
    assert concur.goodput_sessions_per_h >= 1.3 * hicache.goodput_sessions_per_h
    assert concur.hit_rate_late >= 0.6 > hicache.hit_rate_late


def test_thunderagent_keeps_reuse_by_making_new_sessions_wait() -> None:
    thunder, basin = run("thunderagent"), run("basin")
    assert thunder.hit_rate_late >= 0.8
    assert thunder.median_first_call_wait_s >= 600  # paper: median first-call waits of 26-39 minutes
    assert basin.goodput_sessions_per_h >= 1.5 * thunder.goodput_sessions_per_h


def test_crossflow_borrows_decode_compute_but_loses_reuse() -> None:
    crossflow, basin = run("crossflow"), run("basin")
    assert crossflow.hit_rate_late < basin.hit_rate_late - 0.3
    assert basin.goodput_sessions_per_h >= 1.3 * crossflow.goodput_sessions_per_h


SUSTAINED_OVERLOAD = ABLATION_SCENARIOS[3]


@cache
def sustained_run(policy: str, admission: bool = True, seed: int = 0) -> tuple[Summary, float, float]:
    """An hour of sustained overload (x4.5 of 9/min, about 2.2 λc, minutes 15-75, 2x host tier): the
    summary, and the mean active sessions and prefill backlog (tokens) over minutes 60-75, the window
    where the paper reports them."""
    changes = {} if admission else {"admission": False}
    result = simulate(SUSTAINED_OVERLOAD, policy, seed, **changes)[1]
    window = [s for s in result.records.samples if 60 * 60 <= s.t < 75 * 60]
    active = sum(s.active_sessions for s in window) / len(window)
    backlog = sum(s.prefill_backlog_tokens or 0 for s in window) / len(window)
    return result.summary, active, backlog


@pytest.mark.parametrize("seed", SEEDS)
def test_admission_holds_the_population_under_sustained_overload(seed: int) -> None:
    """Paper §7.9: under an hour of sustained overload with the host tier, admission cuts the active
    sessions in minutes 60-75 from 852 to 252 and the prefill queue from 620 requests to 14, shedding 82
    sessions. Measured, seeds 0-4: 876-1,015 active and 628-759 queued without it, 253-278 and 14-49 with
    it, 2.3-2.8 % shed; BASIN 1.21-1.40x Continuum, whose age-ordered queue holds 1,100-1,200 sessions.
    The paper's goodput gain from admission here (1.25x) is not reproduced: without it our BASIN keeps
    1.03-1.08x (docs/policies.md, the ablation suite)."""
    basin, active, backlog = sustained_run("basin", seed=seed)
    _, open_active, open_backlog = sustained_run("basin", admission=False, seed=seed)
    continuum = sustained_run("continuum", seed=seed)[0]
    assert basin.shed_fraction > 0
    assert active <= 0.4 * open_active
    assert backlog <= 0.15 * open_backlog
    assert basin.goodput_sessions_per_h >= 1.15 * continuum.goodput_sessions_per_h


@cache
def sustained_goodput(seed: int, priority_rate: float) -> float:
    summary = simulate(SUSTAINED_OVERLOAD, "basin", seed, priority_rate=priority_rate)[1].summary
    return summary.goodput_sessions_per_h


@pytest.mark.parametrize("seed", SEEDS)
def test_the_priority_rate_trades_goodput_under_sustained_overload(seed: int) -> None:
    """Paper §7.9 (Fig. 24a): r = 10 tokens/s, a stronger preference for small footprints, raises goodput by
    7-33 %; r = 100, closer to arrival order, lowers it to 0.80-0.96. Under the hour of sustained overload the
    order decides which sessions finish within the slowdown SLO. Measured (the sensitivity suite, seeds 0-4):
    r 10 1.14-1.22x BASIN's r 30, r 100 0.76-0.86x; shed 1.6-2.1 % / 2.3-2.8 % / 2.9-3.5 %."""
    small_first, default, arrival_order = (sustained_goodput(seed, r) for r in (10.0, 30.0, 100.0))
    assert small_first >= 1.08 * default
    assert arrival_order <= 0.92 * default
