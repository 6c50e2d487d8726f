"""CONCUR: AIMD on the number of active agents with turn-boundary pausing; and the simulator's holding of
paused sessions at their next call."""

import math

from basin.policy import Admission, Concur, SessionInfo, Telemetry
from basin.policy.base import ControlActions, Policy


def telemetry(now: float, hit: float = 0.95, used: int = 0) -> Telemetry:
    return Telemetry(now, 0, 0, 0, hit, 0, 0, used, 1000, 0)


def _admitted(n: int) -> Concur:
    policy = Concur()
    for i in range(n):
        assert policy.on_session_arrival(float(i), SessionInfo(f"s{i}", float(i), "", 100)) is Admission.ADMIT
    return policy


def _warm_up(policy: Concur, hit: float, used: int = 0, until: float = 30.0) -> float:
    """Feed the first 30 s of readings (the smoothing warm-up); returns the next control time."""
    t = 5.0
    while t <= until:
        policy.on_control(t, telemetry(t, hit=hit, used=used))
        t += 5.0
    return t


def test_cuts_only_when_utilisation_is_high_and_reuse_has_fallen() -> None:
    """CONCUR's AND rule: a full cache with good reuse, or poor reuse with room to spare, is no thrashing."""
    policy = _admitted(10)
    t = _warm_up(policy, hit=0.95, used=950)  # over U_high, reuse healthy: no cut
    assert math.isinf(policy.window)
    low_u = _admitted(10)
    _warm_up(low_u, hit=0.3, used=600)  # reuse poor, utilisation under U_high: no cut
    assert math.isinf(low_u.window)
    for _ in range(12):  # reuse falls while utilisation stays high
        actions = policy.on_control(t, telemetry(t, hit=0.2, used=950))
        t += 5.0
        if not math.isinf(policy.window):
            break
    assert policy.window == 5.0
    assert actions.pause == ["s9", "s8", "s7", "s6", "s5"]  # newest first
    assert policy.on_session_arrival(t, SessionInfo("new", t, "", 100)) is Admission.PARK
    for _ in range(5):  # still congested: no second cut within one smoothing period
        policy.on_control(t, telemetry(t, hit=0.2, used=950))
        t += 5.0
    assert policy.window == 5.0
    policy.on_control(t + 5.0, telemetry(t + 5.0, hit=0.2, used=950))
    assert policy.window == 2.5


def test_grows_only_below_the_low_watermark() -> None:
    policy = _admitted(10)
    t = _warm_up(policy, hit=0.2, used=950)
    policy.on_control(t, telemetry(t, hit=0.2, used=950))
    assert policy.window == 5.0
    for k in range(1, 4):  # between the watermarks the window holds
        policy.on_control(t + 5.0 * k, telemetry(t + 5.0 * k, hit=0.95, used=600))
    assert policy.window == 5.0
    t += 20.0
    for k in range(3):  # below U_low: +1 per interval; paused agents resume oldest first
        actions = policy.on_control(t + 5.0 * k, telemetry(t + 5.0 * k, hit=0.95, used=100))
        if k == 0:
            assert actions.resume == ["s5"]
    assert policy.window == 8.0


def test_first_reading_is_smoothed_not_taken_raw() -> None:
    """A run's first interval is mostly cold first prompts: one low reading must not cut the window."""
    policy = _admitted(8)
    policy.on_control(5.0, telemetry(5.0, hit=0.1, used=950))  # cold start, cache busy
    assert math.isnan(policy.hit) and math.isinf(policy.window)
    for t in range(10, 35, 5):
        policy.on_control(float(t), telemetry(float(t), hit=0.95, used=950))
    assert policy.hit > 0.8  # the warm-up mean, (0.1 + 5 x 0.95) / 6
    assert math.isinf(policy.window)


def test_no_reading_no_decision_and_an_idle_window_reopens() -> None:
    """Intervals without prefill (NaN hit rate) leave the smoothed rate alone; an empty engine (low
    utilisation) lets the window grow again instead of cutting it forever."""
    policy = _admitted(4)
    t = _warm_up(policy, hit=0.2, used=950)
    policy.on_control(t, telemetry(t, hit=0.2, used=950))
    assert policy.window == 2.0
    before = policy.hit
    for k in range(1, 4):
        policy.on_control(t + 5.0 * k, telemetry(t + 5.0 * k, hit=math.nan, used=0))
    assert policy.hit == before
    assert policy.window == 5.0


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
