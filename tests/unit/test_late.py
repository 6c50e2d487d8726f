"""Switching a policy on mid-run: HiCache alone before the start, then the inner policy with the books of
every live session."""

from basin.policy import Admission, CallInfo, DeploymentProfile, SessionInfo, Telemetry
from basin.policy.basin import Basin, BasinConfig
from basin.policy.late import LateStart

PROFILE = DeploymentProfile(
    kappa=1.0,
    lambda_c_per_min=10.0,
    prefill_gpu_tokens=100_000,
    host_tokens=0,
    decode_kv_tokens=400_000,
    prefill_tokens_per_s=10_000,
)


def telemetry(now: float) -> Telemetry:
    return Telemetry(now, 0, 0, 0, 0.9, 0, 0, 0, 400_000, 0)


def test_hicache_until_the_start_then_the_inner_policy_with_live_sessions() -> None:
    inner = Basin(PROFILE, lambda info: 30_000.0, BasinConfig(context_smoothing_s=1.0))
    late = LateStart(inner, start_s=100.0)
    for i in range(6):
        assert (
            late.on_session_arrival(float(i), SessionInfo(f"s{i}", float(i), "", 10_000)) is Admission.ADMIT
        )
        assert late.on_call_start(float(i), CallInfo(f"s{i}", 0, 10_000)).priority is None
        assert late.on_call_end(float(i) + 5, CallInfo(f"s{i}", 0, 10_000), 25_000) == 0.0
    late.on_session_end(50.0, "s5", completed=True)
    assert late.on_control(60.0, telemetry(60.0)).admit == [] and inner.residents == 0  # not started yet
    late.on_control(100.0, telemetry(100.0))
    assert late.started
    assert inner.residents == 5 and inner.resident_context == 5 * 25_000
    assert inner.sessions["s0"].key == 0.0 + 30_000 / 30  # keyed by the original arrival
    assert inner.admit  # W = 5 x 25K >= B0 = 100K: admission engages right away
    assert late.on_session_arrival(101.0, SessionInfo("new", 101.0, "", 10_000)) is Admission.PARK
