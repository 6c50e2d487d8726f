"""The gateway's brain: HTTP-side events become Policy calls, the policy's answers become verdicts, and the
policy's accounting stays whole whichever way a session ends."""

from __future__ import annotations

import math

import pytest

from basin.policy import BasinConfig, DeploymentProfile, SessionInfo, make_policy
from basin_gateway.brain import FORWARD, PARK, REJECT, SHED, Brain, EngineReading
from basin_gateway.settings import Settings

PROFILE = DeploymentProfile(
    kappa=1.0,
    lambda_c_per_min=1.0,
    prefill_gpu_tokens=10_000,
    host_tokens=0,
    decode_kv_tokens=100_000,
    prefill_tokens_per_s=1000.0,
)
PEAK = 4_000.0


def basin_brain(**bounds: float) -> Brain:
    policy = make_policy("basin", PROFILE, lambda info: PEAK, BasinConfig(shed_after_s=100.0))
    return Brain(
        policy,
        int(bounds.get("max_parked", 100)),
        bounds.get("max_park_wait_s", 10_000.0),
        bounds.get("idle_timeout_s", 500.0),
    )


def engage(brain: Brain, now: float) -> None:
    """Fill the brain until a control step engages admission (W ≥ B0 = 0.9 · 1.9 · 10K = 17.1K)."""
    for i in range(6):
        assert brain.call(now, f"warm{i}", "", 3_000).action == FORWARD
    brain.control(now, EngineReading(hit_rate=0.9, fresh=True))
    assert brain.policy.admit  # type: ignore[attr-defined]


def test_admission_parks_then_a_control_step_admits_the_retry() -> None:
    brain = basin_brain()
    engage(brain, 30.0)
    policy = brain.policy
    while (verdict := brain.call(31.0, "late", "", 3_000)).action == FORWARD:  # fills B with new sessions
        brain.end(31.0, "late", True)
    assert verdict.action == PARK and brain.parked_count == 1
    assert brain.call(32.0, "late", "", 3_000).action == PARK  # the same call retried: still parked
    for i in range(6):
        brain.end(33.0, f"warm{i}", True)
    brain.control(35.0, EngineReading(hit_rate=0.9, fresh=True))
    verdict = brain.call(36.0, "late", "", 3_000)
    assert verdict.action == FORWARD and verdict.index == 0 and verdict.waited == pytest.approx(5.0)
    assert verdict.directives is not None and verdict.directives.priority is not None  # ordering is on
    assert brain.parked_count == 0
    brain.end(40.0, "late", True)
    assert policy.residents == 0 and math.isclose(policy.reserved, 0.0, abs_tol=1e-6)  # type: ignore[attr-defined]


def test_the_policy_sheds_a_parked_session_and_its_retry_gets_503() -> None:
    brain = basin_brain()
    engage(brain, 30.0)
    brain.policy.budget = 1.0  # type: ignore[attr-defined]  # nobody fits
    brain.policy.arrivals.extend([0.0] * 1000)  # type: ignore[attr-defined]  # long-run rate above λc
    assert brain.call(31.0, "s", "", 100).action == PARK
    brain.control(200.0, EngineReading(fresh=True))
    assert brain.sessions["s"].state == "shed"
    verdict = brain.call(201.0, "s", "", 100)
    assert (verdict.action, verdict.reason) == (SHED, "policy")
    assert "s" not in brain.sessions and brain.parked_count == 0
    assert brain.outcomes["shed", "policy"] == 1


def test_bounds_reject_when_the_parked_queue_is_full_and_shed_after_the_longest_wait() -> None:
    brain = basin_brain(max_parked=1, max_park_wait_s=50.0)
    engage(brain, 30.0)
    brain.policy.budget = 1.0  # type: ignore[attr-defined]
    assert brain.call(31.0, "a", "", 100).action == PARK
    verdict = brain.call(31.0, "b", "", 100)
    assert (verdict.action, verdict.reason) == (REJECT, "parked-queue-full")
    assert "b" not in brain.policy.sessions  # type: ignore[attr-defined]  # the policy was told
    brain.sweep(90.0)
    assert brain.call(91.0, "a", "", 100).reason == "parked-too-long"
    assert "a" not in brain.policy.sessions  # type: ignore[attr-defined]


def test_idle_sessions_end_and_release_their_reservation() -> None:
    brain = basin_brain(idle_timeout_s=100.0)
    assert brain.call(0.0, "s", "", 1_000).action == FORWARD
    brain.sweep(500.0)
    assert "s" in brain.sessions  # a call in flight is never idle
    brain.call_done(500.0, "s", 0, 1_000, 1_200)
    assert brain.sessions["s"].context == 1_200 and brain.working_set() == 1_200
    brain.sweep(650.0)
    assert "s" not in brain.sessions and brain.policy.residents == 0  # type: ignore[attr-defined]
    assert brain.outcomes["ended", "idle-timeout"] == 1


def test_paused_sessions_wait_at_their_next_call_until_resumed() -> None:
    policy = make_policy("thunderagent", DeploymentProfile(1.0, 1.0, 100_000, 0, 100_000))
    brain = Brain(policy, 100, 1e9, 1e9)
    for i in range(3):
        assert brain.call(0.0, f"s{i}", "", 5_000).action == FORWARD
        brain.call_done(1.0, f"s{i}", 0, 5_000, 45_000)
    brain.control(30.0, EngineReading(fresh=True))  # 135K of 100K capacity: ThunderAgent pauses
    paused = [sid for sid, e in brain.sessions.items() if e.paused]
    assert paused
    verdict = brain.call(31.0, paused[0], "", 45_000)
    assert (verdict.action, verdict.reason) == (PARK, "paused")
    for sid in brain.sessions.keys() - set(paused):
        brain.end(32.0, sid, True)
    brain.control(60.0, EngineReading(fresh=True))  # room again: resumed
    assert brain.call(61.0, paused[0], "", 45_000).action == FORWARD


def test_a_controller_snapshot_restores_into_a_fresh_brain() -> None:
    brain = basin_brain()
    engage(brain, 30.0)
    brain.policy.budget = 20_000.0  # type: ignore[attr-defined]
    assert brain.call(31.0, "p", "a task", 9_000).action in (PARK, FORWARD)
    records = {sid: e.record() for sid, e in brain.sessions.items()}
    state = brain.controller_state()
    assert state["budget"] == 20_000.0 and state["admit"] is True and "reserved" not in state
    assert all(record["peak"] == PEAK for record in records.values())  # Ŵ travels, not the task text
    fresh = basin_brain()
    fresh.set_predictor(lambda info: 1.0)  # another predictor: the restored sessions keep their Ŵ
    fresh.restore(40.0, state, records)
    before = {sid: s.predicted_peak for sid, s in brain.policy.sessions.items()}  # type: ignore[attr-defined]
    assert {sid: s.predicted_peak for sid, s in fresh.policy.sessions.items()} == before  # type: ignore[attr-defined]
    assert fresh.policy.budget == 20_000.0 and fresh.policy.admit  # type: ignore[attr-defined]
    assert fresh.policy.reserved == brain.policy.reserved  # type: ignore[attr-defined]
    assert fresh.parked_count == brain.parked_count
    assert set(fresh.sessions) == set(brain.sessions)


def test_warm_sessions_are_resident_even_under_admission() -> None:
    brain = basin_brain()
    engage(brain, 30.0)
    brain.policy.budget = 1.0  # type: ignore[attr-defined]
    brain.adopt(31.0, "w", {"arrived": 20.0, "first_tokens": 100, "context": 500, "calls": 2})
    assert brain.sessions["w"].state == "active"
    assert brain.policy.sessions["w"].resident  # type: ignore[attr-defined]
    assert brain.call(32.0, "w", "", 600).action == FORWARD


@pytest.mark.parametrize("policy", ["continuum", "composition", "crossflow"])
def test_policies_needing_engine_features_stock_sglang_lacks_are_refused(policy: str) -> None:
    from basin.errors import BasinError

    with pytest.raises(BasinError, match="cannot run live"):
        Settings(policy=policy)


def test_passthrough_is_hicache_alone() -> None:
    assert Settings(policy="passthrough").policy_name == "hicache"
    brain = Brain(make_policy("hicache"), 1, 1.0, 1.0)
    assert all(brain.call(0.0, f"s{i}", "", 10**6).action == FORWARD for i in range(50))
    assert SessionInfo  # the interface the gateway drives is the simulator's


def test_warm_returns_hit_rate_counts_only_calls_back_within_a_minute() -> None:
    brain = basin_brain()
    assert brain.call(0.0, "s", "", 1_000).action == FORWARD
    brain.call_done(1.0, "s", 0, 1_000, 1_200, cached_tokens=0)  # a first call: not a return
    brain.call(11.0, "s", "", 1_500)  # back after 10 s: warm
    brain.call_done(12.0, "s", 1, 1_500, 1_700, cached_tokens=1_200)
    brain.call(300.0, "s", "", 2_000)  # back after a long tool run: cold, whatever it hits
    brain.call_done(301.0, "s", 2, 2_000, 2_100, cached_tokens=0)
    reading = EngineReading(hit_rate=0.4, fresh=True)
    assert brain.telemetry(310.0, reading).warm_hit_rate == pytest.approx(0.8)
    assert math.isnan(brain.telemetry(320.0, reading).warm_hit_rate)  # the tally starts again
    brain.call(330.0, "s", "", 2_500)
    brain.call_done(331.0, "s", 3, 2_500, 2_600)  # the engine did not report its cached tokens
    # The engine did not say: the engine-wide rate stands in.
    assert brain.telemetry(340.0, reading).warm_hit_rate == pytest.approx(0.4)
