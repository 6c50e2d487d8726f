"""CONCUR: AIMD on the number of active agents with turn-boundary pausing; and the simulator's holding of
paused sessions at their next call."""

import math

from basin.policy import Admission, Concur, SessionInfo, Telemetry
from basin.policy.base import ControlActions, Policy


def telemetry(now: float, hit: float = 0.95, used: int = 0) -> Telemetry:
    return Telemetry(now, 0, 0, 0, hit, 0, 0, used, 1000, 0, 1.0)


def test_window_grows_additively_and_shrinks_multiplicatively() -> None:
    policy = Concur()
    for i in range(10):
        assert policy.on_session_arrival(float(i), SessionInfo(f"s{i}", float(i), "", 100)) is Admission.ADMIT
    assert math.isinf(policy.window)
    actions = policy.on_control(20.0, telemetry(20.0, used=950))  # decode KV over its high watermark
    assert policy.window == 5.0
    assert actions.pause == ["s9", "s8", "s7", "s6", "s5"]  # newest first
    assert policy.on_session_arrival(21.0, SessionInfo("new", 21.0, "", 100)) is Admission.PARK
    for t in range(25, 60, 5):  # healthy signals: +1 per interval; paused agents resume oldest first
        actions = policy.on_control(float(t), telemetry(float(t)))
        if actions.resume:
            assert actions.resume == ["s5"]
            break
    assert policy.window == 6.0


def test_low_reuse_shrinks_the_window_after_smoothing() -> None:
    policy = Concur()
    for i in range(8):
        policy.on_session_arrival(0.0, SessionInfo(f"s{i}", float(i), "", 100))
    policy.on_control(5.0, telemetry(5.0, hit=0.95))
    policy.on_control(10.0, telemetry(10.0, hit=0.6))  # one bad interval: the smoothed rate holds
    assert math.isinf(policy.window)
    for t in range(15, 120, 5):
        policy.on_control(float(t), telemetry(float(t), hit=0.3))
    assert policy.window < 8


def test_warm_sessions_are_active_from_the_start() -> None:
    policy = Concur()
    policy.window = 1.0
    assert policy.on_session_arrival(0.0, SessionInfo("w", 0.0, "", 100, warm=True)) is Admission.ADMIT
    assert "w" in policy.active


class _PauseOnce(Policy):
    """Pauses every active session at the first control step and resumes them at the third."""

    name = "pause-once"
    control_interval_s = 60.0

    def __init__(self) -> None:
        self.sessions: list[str] = []
        self.steps = 0

    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission:
        self.sessions.append(session.session_id)
        return Admission.ADMIT

    def on_control(self, now: float, telemetry: Telemetry) -> ControlActions:
        self.steps += 1
        if self.steps == 1:
            return ControlActions(pause=list(self.sessions))
        if self.steps == 3:
            return ControlActions(resume=list(self.sessions))
        return ControlActions()


def test_simulator_holds_paused_sessions_at_their_turn_boundary() -> None:
    from basin.sim import Simulation, SimulationConfig, get_deployment
    from basin.workload import RateSchedule, load_workload

    pool = load_workload("terminal-bench", seed=0, sessions=30)
    sim = Simulation(
        SimulationConfig(
            get_deployment("h100-1p1d"), RateSchedule(base_rate=0.0, duration_min=6), seed=0, warm_sessions=20
        ),
        _PauseOnce(),
        pool,
    )
    sim.run()
    released = sorted(c.released_s for c in sim.records.calls)
    # Nothing enters the engine between the pause (60 s) and the resume (180 s).
    assert any(t < 60.0 for t in released)
    quiet = [t for t in released if 60.0 < t < 180.0]
    assert not quiet
    assert any(t >= 180.0 for t in released)
