"""The session driver: partly-open, closed-loop agent sessions on the engine model, under a policy.

New sessions arrive independently of the engine (Poisson, optional warm start); each session releases
its next call only after the previous call completes and its tool gap elapses, so slow service keeps
sessions active longer. The policy decides admission, call priorities and parked-session actions.
"""

from __future__ import annotations

import gc
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from basin.errors import BasinError
from basin.evaluate import CallRecord, RunRecords, Sample, SessionRecord, Summary, summarize
from basin.policy import Admission, CallInfo, Policy, SessionInfo, Telemetry, WarmReturns, is_warm_return
from basin.sim.costs import unloaded_call_times, unloaded_session_seconds
from basin.sim.deployments import PAGE_TOKENS, Deployment, GpuCalibration
from basin.sim.engine import PDEngine, Request
from basin.sim.env import Environment
from basin.workload import Arrival, Session, poisson_arrivals, trace_arrivals
from basin.workload.arrivals import Schedule
from basin.workload.model import Call
from basin.workload.mooncake import BLOCK_TOKENS

SAMPLE_INTERVAL_S = 10.0


@dataclass(eq=False)
class SessionState:
    arrival: Arrival
    record: SessionRecord
    next_call: int
    pages: list[int] = field(default_factory=list)  # page keys of the latest prompt
    request: Request | None = None
    call_record: CallRecord | None = None
    context_tokens: int = 0  # counted in the working set while active
    status: str = "new"  # parked, active, done, shed, rejected, terminated
    last_done_s: float = -math.inf  # when its previous call ended

    @property
    def session(self) -> Session:
        return self.arrival.session

    @property
    def sid(self) -> str:
        return self.arrival.instance_id


@dataclass(frozen=True)
class SimulationConfig:
    deployment: Deployment
    schedule: Schedule
    seed: int = 0
    warm_sessions: int | None = None  # None: Little's law estimate at the base rate
    terminate_surge_sessions: bool = False  # §3.3: end every surge session when the surge ends
    arrivals: str = "poisson"  # or "trace": each session once at its own trace time (no warm start)


@dataclass
class SimulationResult:
    summary: Summary
    records: RunRecords
    events: int
    wall_seconds: float
    warm_sessions: int


def estimate_warm_sessions(gpu: GpuCalibration, pool: Sequence[Session], base_rate: float) -> int:
    """Steady-state population at `base_rate` on an idle engine of this GPU (Little's law: rate x
    lifetime). The simulator's warm start, and the replay's, so both begin at the same population."""
    mean_lifetime = float(np.mean([unloaded_session_seconds(gpu, s) for s in pool]))
    return round(base_rate / 60.0 * mean_lifetime)


class Simulation:
    def __init__(
        self,
        config: SimulationConfig,
        policy: Policy,
        pool: Sequence[Session],
        progress: Callable[[float], None] | None = None,
    ) -> None:
        if not pool:
            raise BasinError("the workload holds no sessions")
        self.config = config
        self.policy = policy
        self.env = Environment()
        deployment = config.deployment
        if policy.engine_options:
            deployment = deployment.with_options(**policy.engine_options)
        self.engine = PDEngine(self.env, deployment, self)
        self.rng = np.random.default_rng(config.seed)
        self.progress = progress
        schedule = config.schedule
        self.duration_s = schedule.duration_min * 60.0
        gpu = config.deployment.gpu
        if config.arrivals == "trace":
            self.warm_sessions = 0
            self.arrivals = trace_arrivals(pool, schedule.duration_min)
        elif config.arrivals == "poisson":
            warm = config.warm_sessions
            if warm is None:
                warm = estimate_warm_sessions(gpu, pool, schedule.base_rate)
            self.warm_sessions = warm
            self.arrivals = poisson_arrivals(
                schedule,
                pool,
                self.rng,
                warm_sessions=warm,
                call_seconds=lambda s: unloaded_call_times(gpu, s),
            )
        else:
            raise BasinError(f"unknown arrival process {config.arrivals!r}; choose poisson or trace")
        self.records = RunRecords(
            duration_s=self.duration_s,
            trigger_s=schedule.surge_start_min * 60 if schedule.surge_minutes > 0 else None,
            trigger_end_s=schedule.surge_end_min * 60 if schedule.surge_minutes > 0 else None,
            cache_tokens=config.deployment.cache_tokens,
        )
        self.sessions: dict[str, SessionState] = {}
        self.parked: dict[str, SessionState] = {}
        self.paused: set[str] = set()  # active sessions told to pause at their next turn boundary
        self.held: set[str] = set()  # paused sessions whose next call is waiting
        self.active: dict[str, SessionState] = {}
        self.working_set = 0
        self._next_page = 1  # page keys are numbered in the order pages are first seen
        self._content_pages: dict[tuple[int, int], int] = {}  # (trace block id, page in block) -> key
        self._shared_pages: dict[str, list[int]] = {}  # workload -> page keys of its shared prefix
        self._rids = itertools.count(1)
        self._hit_cached = 0
        self._hit_prompt = 0
        self._warm = WarmReturns()
        self._reference: dict[str, float] = {}

    # ------------------------------------------------------------------ run
    def run(self) -> SimulationResult:
        """Run to the end. Python's cyclic garbage collector is paused meanwhile (and restored after):
        a run allocates millions of short-lived tuples, and the collector's passes over the run's
        long-lived records cost ~15 % of the time while finding nothing (the run's structures break
        their own cycles: an evicted cache node is unlinked, a finished call leaves its session)."""
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if collecting:
                gc.enable()

    def _run(self) -> SimulationResult:
        started = time.perf_counter()
        env = self.env
        for arrival in self.arrivals:
            if arrival.warm:
                self._warm_start(arrival)
            else:
                env.schedule_at(arrival.time_s, self._arrive, arrival)
        env.schedule(0.0, self._sample)
        if self.policy.control_interval_s is not None:
            env.schedule(self.policy.control_interval_s, self._control)
        trigger_end = self.records.trigger_end_s
        if self.config.terminate_surge_sessions and trigger_end is not None:
            env.schedule_at(trigger_end, self._terminate_surge_sessions)
        step = self.duration_s / 100
        t = 0.0
        while t < self.duration_s:
            t = min(t + step, self.duration_s)
            env.run(t)
            if self.progress is not None:
                self.progress(t)
        summary = summarize(self.records)
        return SimulationResult(
            summary, self.records, env.events, time.perf_counter() - started, self.warm_sessions
        )

    # ------------------------------------------------------------------ sessions
    def _new_state(self, arrival: Arrival) -> SessionState:
        session = arrival.session
        key = session.session_id
        if key not in self._reference:
            self._reference[key] = unloaded_session_seconds(self.config.deployment.gpu, session)
        record = SessionRecord(
            arrival.instance_id,
            arrival.time_s,
            self._reference[key],
            warm=arrival.warm,
            in_surge=arrival.in_surge,
        )
        self.records.sessions.append(record)
        state = SessionState(arrival, record, next_call=arrival.first_call)
        self.sessions[state.sid] = state
        return state

    def _warm_start(self, arrival: Arrival) -> None:
        """A session joined mid-trajectory: its previous prompt is cached, its next call comes soon."""
        state = self._new_state(arrival)
        self.policy.on_session_arrival(0.0, self._info(state))  # warm sessions are admitted initially
        if arrival.first_call > 0:
            previous = state.session.calls[arrival.first_call - 1]
            state.pages = self._known_pages(state.session, previous)
            state.pages.extend(self._new_pages(previous.prompt_tokens // PAGE_TOKENS - len(state.pages)))
            keys = tuple(state.pages)
            prefill = self.engine.route_prefill(Request(0, state, state.sid, previous.prompt_tokens, 0, keys))
            if prefill.cache.allocate(len(keys)):
                prefill.cache.insert(keys, 0.0, len(keys))
            state.context_tokens = previous.context_tokens
        self._activate(state)
        self.env.schedule_at(arrival.time_s, self._release_call, state)

    def _info(self, state: SessionState) -> SessionInfo:
        return SessionInfo(
            state.sid,
            state.arrival.time_s,
            state.session.task,
            state.session.calls[state.next_call].prompt_tokens,
            source_id=state.session.session_id,
            warm=state.arrival.warm,
        )

    def _arrive(self, arrival: Arrival) -> None:
        state = self._new_state(arrival)
        decision = self.policy.on_session_arrival(self.env.now, self._info(state))
        if decision is Admission.ADMIT:
            self._activate(state)
            self._release_call(state)
        elif decision is Admission.PARK:
            state.status = "parked"
            self.parked[state.sid] = state
        else:
            self._finish_session(state, "rejected")

    def _activate(self, state: SessionState) -> None:
        state.status = "active"
        self.active[state.sid] = state
        self.working_set += state.context_tokens

    def _block_pages(self, call: Call) -> list[int]:
        """Page keys of a prompt whose trace names its blocks (`Call.blocks`): the same block id gives the
        same keys in every session, so a session start that shares blocks with an earlier request (a
        branch, a common system prompt) hits them in the cache instead of starting cold."""
        per_block = BLOCK_TOKENS // PAGE_TOKENS
        full_pages = min(call.prompt_tokens // PAGE_TOKENS, len(call.blocks) * per_block)
        keys = []
        for page in range(full_pages):
            content = (call.blocks[page // per_block], page % per_block)
            if content not in self._content_pages:
                self._content_pages[content] = self._new_pages(1)[0]
            keys.append(self._content_pages[content])
        return keys

    def _conversation_pages(self, state: SessionState, index: int) -> tuple[int, ...]:
        """Page keys of call `index`'s prompt: pages carried from the previous prompt keep their keys,
        the rest (the previous output, tool results, new text) are new content. Prompts from a trace
        with block ids take their keys from the blocks instead."""
        call = state.session.calls[index]
        full_pages = call.prompt_tokens // PAGE_TOKENS
        if call.blocks or (index == state.arrival.first_call and not state.pages):
            pages = self._known_pages(state.session, call)
        else:
            previous = state.session.calls[index - 1]
            kept = min(call.carried_tokens, previous.prompt_tokens) // PAGE_TOKENS
            pages = state.pages[: min(kept, len(state.pages))]
        pages.extend(self._new_pages(full_pages - len(pages)))
        state.pages = pages
        return tuple(pages)

    def _known_pages(self, session: Session, call: Call) -> list[int]:
        """The leading page keys a prompt has by content, not by carrying them from its predecessor: its
        blocks' pages when its trace names them, else the workload's shared prefix (which opens every prompt
        of the session, since each grows from the first)."""
        return self._block_pages(call) if call.blocks else self._opening_pages(session)

    def _opening_pages(self, session: Session) -> list[int]:
        """Page keys of the workload's shared prefix that opens `session`'s first prompt: the same keys for
        every session of the workload, so its first call finds them cached once any session has sent them."""
        pages = session.shared_prefix_tokens // PAGE_TOKENS
        if not pages:
            return []
        keys = self._shared_pages.setdefault(session.workload, [])
        keys.extend(self._new_pages(pages - len(keys)))
        return keys[:pages]

    def _new_pages(self, count: int) -> range:
        """`count` fresh page keys (none when `count` <= 0), as one range rather than one call each."""
        first = self._next_page
        self._next_page = first + max(count, 0)
        return range(first, self._next_page)

    def _release_call(self, state: SessionState) -> None:
        if state.status != "active":
            return
        if state.sid in self.paused:
            self.held.add(state.sid)  # a paused session waits at its turn boundary
            return
        now = self.env.now
        index = state.next_call
        call = state.session.calls[index]
        if state.record.first_call_s is None:
            state.record.first_call_s = now
        keys = self._conversation_pages(state, index)
        directives = self.policy.on_call_start(now, CallInfo(state.sid, index, call.prompt_tokens))
        request = Request(
            next(self._rids),
            state,
            state.sid,
            call.prompt_tokens,
            call.output_tokens,
            keys,
            priority=directives.priority,
            lend=directives.lend,
        )
        self.working_set += call.prompt_tokens - state.context_tokens
        state.context_tokens = call.prompt_tokens
        state.request = request
        state.call_record = CallRecord(state.sid, index, call.prompt_tokens, call.output_tokens, now)
        self.records.calls.append(state.call_record)
        self.engine.submit(request)

    def _finish_session(self, state: SessionState, outcome: str) -> None:
        now = self.env.now
        self.engine.unpin(state.sid)
        self.paused.discard(state.sid)
        self.held.discard(state.sid)
        if state.request is not None:
            self.engine.abort(state.request)
            state.request = None
        self.parked.pop(state.sid, None)
        if self.active.pop(state.sid, None) is not None:
            self.working_set -= state.context_tokens
        state.status = outcome
        state.record.outcome = outcome
        if outcome == "completed":
            state.record.done_s = now
        self.policy.on_session_end(now, state.sid, outcome == "completed")

    def _terminate_surge_sessions(self) -> None:
        for state in list(self.sessions.values()):
            if state.arrival.in_surge and state.status in ("active", "parked"):
                self._finish_session(state, "terminated")

    # ------------------------------------------------------------------ engine observer
    def on_prefill_start(self, request: Request, now: float) -> None:
        record = request.owner.call_record
        record.prefill_start_s = now
        record.cached_tokens = request.cached_tokens
        self._hit_cached += request.cached_tokens
        self._hit_prompt += request.prompt_tokens

    def on_prefill_done(self, request: Request, now: float, uncached_tokens: int) -> None:
        record = request.owner.call_record
        record.prefill_done_s = now
        record.uncached_tokens = uncached_tokens

    def on_first_token(self, request: Request, now: float) -> None:
        state: SessionState = request.owner
        state.call_record.first_token_s = now  # type: ignore[union-attr]
        if state.record.first_token_s is None:
            state.record.first_token_s = now

    def on_request_done(self, request: Request, now: float) -> None:
        state: SessionState = request.owner
        record = state.call_record
        assert record is not None
        record.done_s = now
        # A warm return (basin.policy.is_warm_return) counted when answered, as the gateway sees it.
        if is_warm_return(record.released_s, state.last_done_s):
            self._warm.count(record.prompt_tokens, record.cached_tokens)
        state.last_done_s = now
        record.itl_violating_steps = request.itl_violating_steps
        state.record.decode_steps += request.output_tokens
        state.record.itl_violating_steps += request.itl_violating_steps
        state.request = None
        index = state.next_call
        call = state.session.calls[index]
        self.working_set += call.output_tokens
        state.context_tokens += call.output_tokens
        pin_s = self.policy.on_call_end(
            now, CallInfo(state.sid, index, call.prompt_tokens), state.context_tokens
        )
        state.next_call += 1
        if state.next_call < len(state.session.calls):
            if pin_s > 0:
                self.engine.pin(request, pin_s, rank=state.arrival.time_s)
            self.env.schedule(call.tool_gap_s, self._release_call, state)
        else:
            self._finish_session(state, "completed")

    # ------------------------------------------------------------------ periodic work
    def _sample(self) -> None:
        engine = self.engine
        waiting = engine.decode_reserved_waiting_tokens()
        self.records.samples.append(
            Sample(
                t=self.env.now,
                active_sessions=len(self.active),
                parked_sessions=len(self.parked),
                working_set_tokens=self.working_set,
                decode_kv_decoding_tokens=engine.decode_used_tokens() - waiting,
                decode_kv_waiting_tokens=waiting,
                prefill_backlog_tokens=engine.prefill_backlog_tokens(),
                decode_waiting_requests=engine.decode_waiting_requests(),
            )
        )
        self.env.schedule(SAMPLE_INTERVAL_S, self._sample)

    def telemetry(self) -> Telemetry:
        engine = self.engine
        hit = self._hit_cached / self._hit_prompt if self._hit_prompt else float("nan")
        self._hit_cached = self._hit_prompt = 0
        return Telemetry(
            now=self.env.now,
            active_sessions=len(self.active),
            parked_sessions=len(self.parked),
            working_set_tokens=self.working_set,
            hit_rate=hit,
            warm_hit_rate=self._warm.take(),
            prefill_backlog_tokens=engine.prefill_backlog_tokens(),
            decode_waiting_requests=engine.decode_waiting_requests(),
            decode_kv_used_tokens=engine.decode_used_tokens(),
            decode_kv_capacity_tokens=engine.decode_capacity_tokens(),
            lent_tokens=engine.lent_tokens(),
        )

    def _control(self) -> None:
        actions = self.policy.on_control(self.env.now, self.telemetry())
        for sid in actions.admit:
            state = self.parked.pop(sid, None)
            if state is not None:
                self._activate(state)
                self._release_call(state)
        for sid in actions.shed:
            state = self.parked.get(sid)
            if state is not None:
                self._finish_session(state, "shed")
        for sid in actions.pause:
            if sid in self.active:
                self.paused.add(sid)
        for sid in actions.resume:
            self.paused.discard(sid)
            if sid in self.held:
                self.held.discard(sid)
                self._release_call(self.sessions[sid])
        interval = actions.next_control_s or self.policy.control_interval_s
        assert interval is not None
        self.env.schedule(interval, self._control)
