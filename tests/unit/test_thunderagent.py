"""ThunderAgent: token accounting against the larger cache tier, pausing acting programs smallest first,
admission only when nothing waits, and force-resume after 30 minutes."""

from basin.policy import Admission, CallInfo, SessionInfo, Telemetry, ThunderAgent


def telemetry(now: float) -> Telemetry:
    return Telemetry(now, 0, 0, 0, 0.9, 0, 0, 0, 1000, 0)


def test_accounting_admission_pausing_and_resuming() -> None:
    policy = ThunderAgent(capacity_tokens=10_000)
    assert policy.on_session_arrival(0.0, SessionInfo("a", 0.0, "", 3_000)) is Admission.ADMIT
    assert policy.on_session_arrival(1.0, SessionInfo("b", 1.0, "", 2_000)) is Admission.ADMIT
    assert policy._used() == 5_200  # contexts plus 100 tokens per program
    policy.on_call_start(2.0, CallInfo("a", 0, 3_000))  # a reasons, b acts
    policy.on_call_end(3.0, CallInfo("b", 0, 2_000), 2_500)
    policy.on_call_end(4.0, CallInfo("a", 0, 3_000), 4_000)  # both acting now
    assert policy.on_session_arrival(5.0, SessionInfo("c", 5.0, "", 5_000)) is Admission.PARK  # would not fit
    policy.context["a"], policy.context["b"] = 7_000, 4_000  # contexts grew past capacity
    actions = policy.on_control(10.0, telemetry(10.0))
    assert actions.pause == ["b"]  # the smallest acting program goes first
    assert actions.admit == []  # something is paused: new programs wait
    policy.on_session_end(20.0, "a", completed=True)
    actions = policy.on_control(25.0, telemetry(25.0))
    assert actions.resume == ["b"]
    assert actions.admit == ["c"]  # nothing paused now, and it fits beside b


def test_force_resume_after_thirty_minutes() -> None:
    policy = ThunderAgent(capacity_tokens=5_000)
    policy.on_session_arrival(0.0, SessionInfo("big", 0.0, "", 4_000))
    policy.on_session_arrival(0.0, SessionInfo("other", 0.0, "", 500, warm=True))
    policy.context["big"] = 6_000
    assert policy.on_control(5.0, telemetry(5.0)).pause == ["other", "big"]
    assert policy.on_control(600.0, telemetry(600.0)).resume == ["other"]  # big still does not fit
    assert policy.on_control(1806.0, telemetry(1806.0)).resume == ["big"]  # waited 30 minutes
