"""The BASIN controller as a pure state machine: keys, admission, activation and release, ordering,
lending, budget adaptation and shedding (paper §6, Algorithm 1)."""

import math

import pytest

from basin.errors import BasinError
from basin.policy import (
    Admission,
    Basin,
    BasinArrival,
    BasinConfig,
    CallInfo,
    DeploymentProfile,
    SessionInfo,
    Telemetry,
    WarmReturns,
    is_warm_return,
)

PROFILE = DeploymentProfile(
    kappa=1.0,
    lambda_c_per_min=10.0,
    prefill_gpu_tokens=100_000,
    host_tokens=0,
    decode_kv_tokens=400_000,
    prefill_tokens_per_s=10_000,
)
# B0 = min(0.9 * 1.0 * 1.9 * 100K, 100K) = 100K tokens.


def telemetry(now: float, **changes: float) -> Telemetry:
    values = dict(
        now=now,
        active_sessions=0,
        parked_sessions=0,
        working_set_tokens=0,
        hit_rate=0.9,
        warm_hit_rate=0.95,
        prefill_backlog_tokens=0,
        decode_waiting_requests=0,
        decode_kv_used_tokens=0,
        decode_kv_capacity_tokens=400_000,
        lent_tokens=0,
    )
    values.update(changes)
    return Telemetry(**values)  # type: ignore[arg-type]


def controller(peaks: dict[str, float], cls: type[Basin] = Basin, **config: float) -> Basin:
    config.setdefault("context_smoothing_s", 1.0)  # let c̄ follow the residents at once in these tests
    return cls(PROFILE, lambda info: peaks[info.session_id], BasinConfig(**config))


def arrive(policy: Basin, sid: str, now: float, first: int = 10_000) -> Admission:
    return policy.on_session_arrival(now, SessionInfo(sid, now, "task", first))


def test_keys_are_arrival_plus_predicted_peak_over_rate() -> None:
    policy = controller({"a": 30_000, "b": 3_000, "c": 10_000})
    arrive(policy, "a", 0.0)
    arrive(policy, "b", 100.0, first=1_000)
    assert policy.sessions["a"].key == pytest.approx(0 + 30_000 / 30)
    assert policy.sessions["b"].key == pytest.approx(100 + 3_000 / 30)
    arrive(policy, "c", 200.0, first=40_000)  # a prediction below the first prompt is raised to it
    assert policy.sessions["c"].predicted_peak == 40_000
    arrival = controller({"a": 30_000}, cls=BasinArrival)
    arrive(arrival, "a", 7.0)
    assert arrival.sessions["a"].key == 7.0


def test_admission_engages_at_the_reference_budget_and_parks_by_key() -> None:
    peaks = {f"s{i}": 30_000 for i in range(6)} | {"small": 5_000, "late": 5_000}
    policy = controller(peaks)
    for i in range(6):  # nothing active yet: everyone enters
        assert arrive(policy, f"s{i}", float(i)) is Admission.ADMIT
        policy.on_call_end(float(i), CallInfo(f"s{i}", 0, 10_000), 20_000)
    actions = policy.on_control(10.0, telemetry(10.0))  # W = 6 x c̄ >= B0 = 100K
    assert policy.admit and policy.order
    assert actions.next_control_s == 5.0
    assert arrive(policy, "late", 11.0) is Admission.PARK
    assert arrive(policy, "small", 12.0) is Admission.PARK
    # Residents leave; the heads enter in key order as the budget allows.
    for i in range(6):
        policy.on_session_end(20.0, f"s{i}", completed=True)
    actions = policy.on_control(20.0, telemetry(20.0))
    assert actions.admit == ["late", "small"]


def test_the_budget_engages_at_the_reservations_that_stand_for_a_working_set_of_b0() -> None:
    """B limits predicted peaks, B0 the working set of current contexts: engaging at B0 itself would park
    every newcomer until B had climbed past the residents' peaks, though their contexts fit."""
    policy = controller({f"s{i}": 60_000 for i in range(6)} | {"new": 30_000})
    for i in range(6):
        arrive(policy, f"s{i}", 0.0)
        policy.on_call_end(0.0, CallInfo(f"s{i}", 0, 10_000), 20_000)  # W = 120K, Σ Ŵ = 360K
    policy.on_control(5.0, telemetry(5.0))
    assert policy.admit
    assert policy.budget == pytest.approx(100_000 * 360 / 120)
    assert arrive(policy, "new", 6.0) is Admission.PARK  # 360K + 30K > 300K
    for i in range(2):
        policy.on_session_end(7.0, f"s{i}", completed=True)
    assert policy.on_control(10.0, telemetry(10.0)).admit == ["new"]  # 240K + 30K fits


def test_the_head_enters_when_no_residents_remain_even_if_too_large() -> None:
    policy = controller({"a": 30_000, "huge": 10_000_000})
    arrive(policy, "a", 0.0)
    policy.admit, policy.budget = True, 100_000.0
    assert arrive(policy, "huge", 1.0) is Admission.PARK
    policy.on_session_end(2.0, "a", completed=True)
    assert policy.on_control(3.0, telemetry(3.0)).admit == ["huge"]


def test_release_needs_the_cooldown() -> None:
    policy = controller({f"s{i}": 20_000 for i in range(6)}, cooldown_s=60.0)
    for i in range(6):
        arrive(policy, f"s{i}", 0.0)
        policy.on_call_end(0.0, CallInfo(f"s{i}", 0, 10_000), 20_000)
    policy.on_control(5.0, telemetry(5.0))
    assert policy.admit
    for i in range(4):  # W drops to 2 x c̄, well below α_R · B0
        policy.on_session_end(6.0, f"s{i}", completed=True)
    policy.on_control(10.0, telemetry(10.0))
    assert policy.admit  # the cool-down has not passed
    policy.on_control(75.0, telemetry(75.0))
    assert not policy.admit
    policy.on_control(80.0, telemetry(80.0))
    assert math.isinf(policy.budget)  # nothing parked: the budget is unrestricted again


def test_ordering_engages_on_a_persistent_backlog() -> None:
    policy = controller({"a": 10_000}, backlog_persist_s=10.0, cooldown_s=30.0)
    arrive(policy, "a", 0.0)
    assert policy.on_call_start(0.0, CallInfo("a", 0, 10_000)).priority is None
    busy = {"prefill_backlog_tokens": 50_000}  # 5 s of prefill work, above the 2 s threshold
    policy.on_control(30.0, telemetry(30.0, **busy))
    assert not policy.order  # not persistent yet
    policy.on_control(45.0, telemetry(45.0, **busy))
    assert policy.order
    assert policy.on_call_start(46.0, CallInfo("a", 1, 11_000)).priority == policy.sessions["a"].key
    policy.on_control(50.0, telemetry(50.0))
    assert policy.order  # released only after the cool-down
    policy.on_control(85.0, telemetry(85.0))
    assert not policy.order


def test_lending_engages_with_demand_and_spare_decode_memory() -> None:
    policy = controller({f"s{i}": 20_000 for i in range(5)})
    for i in range(5):
        arrive(policy, f"s{i}", 0.0)
        policy.on_call_end(0.0, CallInfo(f"s{i}", 0, 10_000), 17_000)  # W = 85K >= α_L · B00 = 80K
    policy.on_control(5.0, telemetry(5.0))
    assert policy.lend
    assert policy.on_call_start(6.0, CallInfo("s0", 1, 18_000)).lend
    policy.on_control(10.0, telemetry(10.0, decode_waiting_requests=3))
    assert not policy.lend  # requests wait for decode memory: no spare memory to lend


def _parked_controller(**config: float) -> Basin:
    """Admission engaged with one session parked behind six residents reserving 30K each (B0 = 100K)."""
    policy = controller({f"s{i}": 30_000 for i in range(8)}, budget_step=0.1, **config)
    policy.on_control(0.0, telemetry(0.0))  # healthy plateau observed
    for i in range(6):
        arrive(policy, f"s{i}", 1.0)
        policy.on_call_end(1.0, CallInfo(f"s{i}", 0, 10_000), 20_000)
    policy.on_control(2.0, telemetry(2.0))
    assert arrive(policy, "s6", 3.0) is Admission.PARK
    policy.on_control(5.0, telemetry(5.0))
    assert policy.admit and len(policy.parked) == 1
    return policy


def test_budget_steps_once_per_interval_and_falls_below_the_reservations_when_reuse_fails() -> None:
    policy = _parked_controller(budget_range=(0.5, 2.0))  # s6 needs 210K: above the ceiling
    start = policy.budget
    for t in range(10, 40, 5):  # six control steps, one Δ (30 s) after the last move: one step of 10K
        policy.on_control(float(t), telemetry(float(t)))
    assert policy.budget == pytest.approx(start + 10_000)
    for t in range(35, 800, 5):
        policy.on_control(float(t), telemetry(float(t)))
    assert policy.budget == pytest.approx(2.0 * policy.b0)
    assert len(policy.parked) == 1  # the ceiling holds s6 out
    # Prefixes used a minute ago miss and the recomputation queues (3 s of prefill work): it does not fit.
    thrashing = dict(warm_hit_rate=0.5, prefill_backlog_tokens=30_000)
    for t in range(800, 1400, 5):
        policy.on_control(float(t), telemetry(float(t), **thrashing))
    assert policy.budget == pytest.approx(0.5 * policy.b0)  # below the residents' 180K: entry stops
    assert policy.residents == 6  # nobody is evicted


@pytest.mark.parametrize(
    ("queue", "falls"),
    [
        ({}, False),  # the engine absorbs the misses at once
        ({"prefill_backlog_tokens": 15_000}, False),  # 1.5 s of prefill work: under backlog_tokens_s
        ({"prefill_backlog_tokens": 30_000}, True),
        ({"decode_waiting_requests": 3}, True),
    ],
)
def test_lost_reuse_lowers_the_budget_only_while_the_engine_queues(
    queue: dict[str, float], falls: bool
) -> None:
    """Lost reuse sustains the trap through queueing: a dip the engine absorbs is not deterioration."""
    policy = _parked_controller()
    start = policy.budget
    for t in range(10, 60, 5):
        policy.on_control(float(t), telemetry(float(t), warm_hit_rate=0.8, **queue))
    assert (policy.budget < start) is falls
    assert policy.budget <= start  # off its plateau B does not rise either


def test_cold_returns_missing_do_not_lower_the_budget() -> None:
    """Long tool runs evict prefixes under any load: the whole hit rate falls, warm returns still hit."""
    policy = _parked_controller()
    start = policy.budget
    for t in range(10, 100, 5):
        policy.on_control(float(t), telemetry(float(t), hit_rate=0.5, prefill_backlog_tokens=50_000))
    assert policy.budget > start


def test_the_plateau_starts_at_the_reference_and_follows_the_average_warm_hit_rate() -> None:
    policy = controller({})
    assert policy.plateau == pytest.approx(0.95)  # basin.hitcurve's healthy plateau until learned
    for t in range(200):
        hit = 0.99 if t % 5 == 0 else 0.96
        policy.on_control(float(5 * t), telemetry(float(5 * t), warm_hit_rate=hit))
    assert 0.96 < policy.plateau < 0.975  # the average of 0.96 and the odd 0.99, not the peaks


def test_the_plateau_is_learned_under_admission_but_not_from_a_backlogged_engine() -> None:
    policy = controller({"big": 150_000})
    arrive(policy, "big", 0.0)
    policy.on_call_end(0.0, CallInfo("big", 0, 10_000), 150_000)
    policy.on_control(1.0, telemetry(1.0, warm_hit_rate=0.99))  # W = 150K >= B0: admission from the start
    assert policy.admit and policy.plateau > 0.95  # nobody parked, prefill keeps up
    learned = policy.plateau
    for t in range(5, 60, 5):  # reuse collapses and the recomputation piles up
        policy.on_control(float(t), telemetry(float(t), warm_hit_rate=0.2, prefill_backlog_tokens=50_000))
    assert policy.plateau > learned - 0.1  # two samples before the backlog persists (10 s), none after it


def test_shedding_takes_the_lowest_priority_parked_session_once_per_interval() -> None:
    peaks = {"r": 200_000, "old_big": 90_000, "old_small": 2_000, "new": 50_000}
    policy = controller(peaks, shed_after_s=900.0)
    arrive(policy, "r", 0.0)
    policy.on_call_end(0.0, CallInfo("r", 0, 10_000), 150_000)
    policy.on_control(1.0, telemetry(1.0))  # W = 150K >= B0: admission on
    for sid, t in (("old_big", 2.0), ("old_small", 3.0), ("new", 4.0)):
        assert arrive(policy, sid, t) is Admission.PARK
    for t in range(300):  # a flood keeps the long-run rate above λc = 10/min
        policy.arrivals.append(5.0 + t / 10)
    policy.on_control(500.0, telemetry(500.0))
    assert len(policy.parked) == 3  # the head has not waited T_s yet
    first = policy.on_control(1000.0, telemetry(1000.0))
    assert first.shed == ["old_big"]  # the largest key: 2 + 90K/30
    assert policy.on_control(1005.0, telemetry(1005.0)).shed == []  # one per interval
    assert policy.on_control(1031.0, telemetry(1031.0)).shed == ["new"]


def test_arrival_variant_admits_by_current_context() -> None:
    policy = controller({f"s{i}": 10**9 for i in range(4)}, cls=BasinArrival)
    arrive(policy, "s0", 0.0, first=20_000)
    assert policy.reserved == 20_000  # the current context, not the (huge) prediction
    policy.on_call_end(1.0, CallInfo("s0", 0, 20_000), 26_000)
    assert policy.reserved == 26_000


@pytest.mark.parametrize(
    "bad",
    [
        dict(margin=0),
        dict(alpha_lend=1.5),
        dict(budget_range=(2.0, 3.0)),
        dict(shed_after_s=-1),
        dict(priority_rate=-30),
    ],
)
def test_invalid_parameters_are_rejected(bad: dict) -> None:
    with pytest.raises(BasinError):
        BasinConfig(**bad)


def test_warm_returns_cap_an_over_counted_hit_and_stand_in_only_for_unreported_answers() -> None:
    tally = WarmReturns()
    tally.count(1_000, 1_500)  # an engine that counts a prefix twice: capped at the prompt
    tally.count(1_000, 500)
    assert tally.take(stand_in=0.1) == pytest.approx(0.75)  # counts were reported: no stand-in
    assert math.isnan(tally.take(stand_in=0.1))  # nothing came back since
    tally.count(1_000, None)
    assert tally.take(stand_in=0.1) == pytest.approx(0.1)
    assert is_warm_return(100.0, 50.0) and not is_warm_return(100.0, 30.0)
    assert not is_warm_return(100.0, -math.inf)  # a first call
