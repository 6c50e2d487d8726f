"""One brain: on the simulator's own event stream, the gateway's Brain (with its own BASIN object) takes
exactly the decisions the simulator's BASIN takes — admit, park, shed, priority, lending — call by call.

The simulator runs a ×5 surge that engages admission and shedding; a mirror policy hands every event to
both the simulator's policy and a gateway Brain and compares what each answers. Any rule the gateway
re-implemented, or any event it translated differently, would make them diverge."""

from __future__ import annotations

from collections import Counter

import pytest

from basin.policy import Admission, BasinConfig, CallDirectives, CallInfo, ControlActions, Policy, SessionInfo
from basin.policy import Telemetry as PolicyTelemetry
from basin.sim import Simulation, SimulationConfig, get_deployment
from basin.sim.policies import build_policy
from basin.workload import load_workload
from basin.workload.arrivals import RateSchedule
from basin_gateway.brain import FORWARD, PARK, SHED, Brain, EngineReading

pytestmark = pytest.mark.slow


class Mirror(Policy):
    """The simulator's policy, with a gateway Brain shadowing every event and checked against it."""

    name = "mirror"

    def __init__(self, inner: Policy, twin: Policy) -> None:
        self.inner = inner
        self.brain = Brain(twin, max_parked=10**9, max_park_wait_s=1e12, idle_timeout_s=1e12)
        self.control_interval_s = inner.control_interval_s  # type: ignore[misc]
        self.started: set[str] = set()
        self.peaks: dict[str, float] = {}
        self.brain.set_predictor(lambda info: self.peaks[info.session_id])
        self.tally: Counter[str] = Counter()
        self.simulation: Simulation | None = None  # set before it runs: answers carry cached tokens

    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission:
        # The peak prediction is an input, not a rule: the twin gets the simulator's for this session
        # (the gateway never sees `source_id`, by which the simulator looks its cross-fitted one up).
        self.peaks[session.session_id] = self.inner.predict(session)  # type: ignore[attr-defined]
        decision = self.inner.on_session_arrival(now, session)
        verdict = self.brain.call(now, session.session_id, session.task, session.first_prompt_tokens)
        expected = {Admission.ADMIT: FORWARD, Admission.PARK: PARK}[decision]
        assert verdict.action == expected, (now, session.session_id, decision, verdict)
        self.tally[verdict.action] += 1
        if verdict.action == FORWARD:
            self.started.add(session.session_id)  # the brain started its first call already
        return decision

    def on_call_start(self, now: float, call: CallInfo) -> CallDirectives:
        directives = self.inner.on_call_start(now, call)
        if call.call_index == 0 and call.session_id in self.started:
            self.started.discard(call.session_id)
            return directives
        verdict = self.brain.call(now, call.session_id, "", call.prompt_tokens)
        assert verdict.action == FORWARD and verdict.index == call.call_index, (now, call, verdict)
        assert verdict.directives == directives, (now, call, verdict.directives, directives)
        return directives

    def on_call_end(self, now: float, call: CallInfo, context_tokens: int) -> float:
        assert self.simulation is not None
        record = self.simulation.sessions[call.session_id].call_record
        assert record is not None and record.call_index == call.call_index
        self.brain.call_done(
            now, call.session_id, call.call_index, call.prompt_tokens, context_tokens, record.cached_tokens
        )
        return self.inner.on_call_end(now, call, context_tokens)

    def on_session_end(self, now: float, session_id: str, completed: bool) -> None:
        self.inner.on_session_end(now, session_id, completed)
        entry = self.brain.sessions.get(session_id)
        if entry is not None and entry.state == "shed":
            assert self.brain.call(now, session_id, "", 0).action == SHED  # the retry the client would send
        else:
            self.brain.end(now, session_id, completed)

    def on_control(self, now: float, telemetry: PolicyTelemetry) -> ControlActions:
        actions = self.inner.on_control(now, telemetry)
        reading = EngineReading(
            telemetry.hit_rate,
            telemetry.prefill_backlog_tokens,
            telemetry.decode_waiting_requests,
            telemetry.decode_kv_used_tokens,
            telemetry.decode_kv_capacity_tokens,
            telemetry.lent_tokens,
            True,
        )
        interval = self.brain.control(now, reading)
        assert interval == actions.next_control_s
        admitted = {sid for sid, e in self.brain.sessions.items() if e.state == "active"}
        assert set(actions.admit) <= admitted
        shed = {sid for sid, e in self.brain.sessions.items() if e.state == "shed"}
        assert set(actions.shed) <= shed
        self.tally["admitted by control"] += len(actions.admit)
        self.tally["shed"] += len(actions.shed)
        twin = self.brain.policy
        for name in ("budget", "b0", "admit", "order", "lend", "reserved", "plateau"):
            mine, theirs = getattr(twin, name), getattr(self.inner, name)
            assert mine == theirs or (mine != mine and theirs != theirs), (now, name, mine, theirs)  # NaN
        return actions


@pytest.mark.parametrize("policy", ["basin", "basin-arrival"])
def test_the_gateway_decides_as_the_simulator_on_the_same_events(policy: str) -> None:
    deployment = get_deployment("h100-1p1d")
    pool = load_workload("terminal-bench", seed=1)
    config = BasinConfig(shed_after_s=300.0)  # sheds within this short run

    def make() -> Policy:
        built = build_policy(policy, deployment, pool, seed=1)
        built.config = config  # type: ignore[attr-defined]
        return built

    mirror = Mirror(make(), make())
    schedule = RateSchedule(
        base_rate=3.3, duration_min=40, surge_factor=5, surge_start_min=5, surge_minutes=20
    )
    config_run = SimulationConfig(deployment, schedule, seed=1, warm_sessions=0)
    mirror.simulation = Simulation(config_run, mirror, pool)
    mirror.simulation.run()
    tally = mirror.tally
    print(policy, dict(tally))
    assert tally[FORWARD] > 50 and tally[PARK] > 20 and tally["admitted by control"] > 10, tally
    if policy == "basin":
        assert tally["shed"] > 0, tally  # the arrival-time variant parks but sheds nobody here
