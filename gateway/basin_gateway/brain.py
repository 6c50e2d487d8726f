"""The one brain: a `basin.policy` object driven by live traffic, exactly as the simulator drives it.

`Brain` owns the session table and translates HTTP events into the Policy interface (`on_session_arrival`,
`on_call_start`, `on_call_end`, `on_session_end`, `on_control`) and the policy's answers into what the
gateway does (forward, park with 429, shed or reject with 503, pause). It holds no rule of its own about
who may enter: every admission, ordering, lending and shedding decision is the policy's. What it adds are
the live bounds a simulator never needs (parked queue size, longest wait, idle sessions), each of which
ends a session through `on_session_end` so the policy's accounting stays whole.

It is synchronous and single-threaded: the event loop calls it between awaits, so a decision that reads
and changes the table is atomic without locks.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from basin.policy import (
    Admission,
    CallDirectives,
    CallInfo,
    Policy,
    SessionInfo,
    Telemetry,
    WarmReturns,
    is_warm_return,
)

log = logging.getLogger("basin.gateway")

FORWARD, PARK, SHED, REJECT = "forward", "park", "shed", "reject"
# Policy attributes that are sums over its sessions (BASIN's reservation ledger): rebuilt by adoption.
SESSION_DERIVED = frozenset({"reserved", "residents", "resident_context"})
NON_FINITE = ("nan", "inf", "-inf")


@dataclass
class Entry:
    """A session the gateway knows: its state, call count and current context."""

    sid: str
    state: str  # active | parked | shed
    arrived: float  # model seconds
    last_seen: float
    context: int = 0  # tokens: the current prompt while a call runs, prompt plus output after it
    calls: int = 0  # calls started
    in_flight: int = 0
    paused: bool = False  # told to hold at its next turn boundary (ThunderAgent, CONCUR)
    parked_answers: int = 0  # 429s given to it
    reason: str = ""
    first_tokens: int = 0
    peak: float | None = None  # the predictor's Ŵ (kept so a new leader's policy sees the same one)
    last_done: float = -math.inf  # model seconds: when its previous call was answered
    warm_return: bool = False  # the call in flight is a warm return (basin.policy.is_warm_return)

    def record(self) -> dict[str, Any]:
        """The session as the shared table keeps it."""
        return {
            "state": self.state,
            "arrived": self.arrived,
            "context": self.context,
            "calls": self.calls,
            "paused": self.paused,
            "reason": self.reason,
            "peak": self.peak,
            "first_tokens": self.first_tokens,
        }


@dataclass(frozen=True)
class Verdict:
    """What to do with one call: forward it (with directives), or answer 429 / 503 with a reason."""

    action: str
    reason: str = ""
    directives: CallDirectives | None = None
    index: int = 0  # the call's index within its session
    waited: float | None = None  # model seconds from arrival to this, the session's first forwarded call
    attempts: int = 0  # 429s this session has had (the gateway spaces out retries of long-parked ones)


@dataclass
class EngineReading:
    """Engine-side telemetry (scraped or from Prometheus); NaN or None where it was not available."""

    hit_rate: float = math.nan
    prefill_backlog_tokens: int = 0
    decode_waiting_requests: int = 0
    decode_kv_used_tokens: int = 0
    decode_kv_capacity_tokens: int = 0
    lent_tokens: int = 0
    fresh: bool = False


class Brain:
    def __init__(
        self,
        policy: Policy,
        max_parked: int,
        max_park_wait_s: float,
        idle_timeout_s: float,
    ) -> None:
        self.policy = policy
        self.max_parked = max_parked
        self.max_park_wait_s = max_park_wait_s
        self.idle_timeout_s = idle_timeout_s
        self.sessions: dict[str, Entry] = {}
        self.arrived = 0
        self.parked_count = 0
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (outcome, reason) -> sessions
        self.last_telemetry: Telemetry | None = None
        self.pins_ignored = 0
        self.warm = WarmReturns()  # warm returns answered since the last telemetry
        self.overruns = 0
        # The policy's predictor, wrapped so each session's Ŵ is kept with it: a new leader hands the
        # same Ŵ back to its policy (and the shared table carries a number, not the task text).
        self.peaks: dict[str, float] = {}  # predicted at this arrival, taken by its entry
        self.known: dict[str, float] = {}  # to hand back when a session is adopted or restored
        self.predict_inner = getattr(policy, "predict", None)
        if callable(self.predict_inner):
            policy.predict = self._predict  # type: ignore[attr-defined]  # admissions that left Σ Ŵ of several residents above B (an audit, never expected)

    def _predict(self, info: SessionInfo) -> float:
        peak = self.known.pop(info.session_id, None)
        if peak is None:
            assert self.predict_inner is not None
            peak = float(self.predict_inner(info))
        self.peaks[info.session_id] = peak
        return peak

    def set_predictor(self, predict: Any) -> None:
        """A new predictor (reload); sessions already predicted keep their Ŵ."""
        self.predict_inner = predict

    # ------------------------------------------------------------------ state
    def working_set(self) -> int:
        return sum(e.context for e in self.sessions.values() if e.state == "active")

    def active_count(self) -> int:
        return sum(1 for e in self.sessions.values() if e.state == "active")

    def _set_state(self, entry: Entry, state: str) -> None:
        if entry.state == "parked":
            self.parked_count -= 1
        if state == "parked":
            self.parked_count += 1
        entry.state = state

    def _drop(self, entry: Entry) -> None:
        self._set_state(entry, "gone")
        self.sessions.pop(entry.sid, None)

    # ------------------------------------------------------------------ calls
    def call(self, now: float, sid: str, task: str, prompt_tokens: int) -> Verdict:
        """A call arrived: decide it. A forwarded call has started (`on_call_start` was told)."""
        entry = self.sessions.get(sid)
        if entry is None:
            return self._arrive(now, sid, task, prompt_tokens)
        entry.last_seen = now
        if entry.state == "shed":
            self._drop(entry)
            return Verdict(SHED, entry.reason or "shed")
        if entry.state == "parked":
            entry.parked_answers += 1
            return Verdict(PARK, "parked", attempts=entry.parked_answers)
        if entry.paused:
            entry.parked_answers += 1
            return Verdict(PARK, "paused", attempts=entry.parked_answers)
        return self._start(now, entry, prompt_tokens)

    def _arrive(self, now: float, sid: str, task: str, prompt_tokens: int) -> Verdict:
        self.arrived += 1
        info = SessionInfo(sid, now, task, prompt_tokens)
        decision = self.policy.on_session_arrival(now, info)
        entry = Entry(sid, "active", now, now, context=prompt_tokens, first_tokens=prompt_tokens)
        entry.peak = self.peaks.pop(sid, None)
        if decision is Admission.REJECT:
            self.outcomes["rejected", "policy"] += 1
            self.policy.on_session_end(now, sid, False)
            return Verdict(REJECT, "policy")
        self.sessions[sid] = entry
        if decision is Admission.ADMIT:
            self._audit()
        if decision is Admission.PARK:
            if self.parked_count >= self.max_parked:
                self._drop(entry)
                self.policy.on_session_end(now, sid, False)
                self.outcomes["rejected", "parked-queue-full"] += 1
                return Verdict(REJECT, "parked-queue-full")
            entry.state = "active"  # counted by _set_state below
            self._set_state(entry, "parked")
            entry.parked_answers = 1
            return Verdict(PARK, "parked")
        return self._start(now, entry, prompt_tokens)

    def _start(self, now: float, entry: Entry, prompt_tokens: int) -> Verdict:
        index = entry.calls
        directives = self.policy.on_call_start(now, CallInfo(entry.sid, index, prompt_tokens))
        entry.calls += 1
        entry.in_flight += 1
        entry.context = prompt_tokens
        entry.warm_return = is_warm_return(now, entry.last_done)
        waited = now - entry.arrived if index == 0 else None
        return Verdict(FORWARD, "", directives, index, waited)

    def call_done(
        self,
        now: float,
        sid: str,
        index: int,
        prompt_tokens: int,
        context_tokens: int,
        cached_tokens: int | None = None,
    ) -> None:
        """A forwarded call finished with an answer; `context_tokens` is prompt plus output, `cached_tokens`
        its prompt's prefix-cache hit where the engine reported one."""
        entry = self.sessions.get(sid)
        if entry is None:
            return
        if entry.warm_return:
            self.warm.count(prompt_tokens, cached_tokens)
        entry.warm_return = False
        entry.in_flight = max(entry.in_flight - 1, 0)
        entry.last_seen = entry.last_done = now
        entry.context = context_tokens
        pin = self.policy.on_call_end(now, CallInfo(sid, index, prompt_tokens), context_tokens)
        if pin > 0:
            self.pins_ignored += 1  # refused policies pin; a pin no engine can honour is counted, not kept

    def end(self, now: float, sid: str, completed: bool, outcome: str = "", reason: str = "") -> bool:
        """The session left (final call answered, DELETE, disconnect, failure). False if it was unknown."""
        entry = self.sessions.get(sid)
        if entry is None:
            return False
        self._drop(entry)
        self.policy.on_session_end(now, sid, completed)
        self.outcomes[outcome or ("completed" if completed else "ended"), reason or "client"] += 1
        return True

    # ------------------------------------------------------------------ control
    def telemetry(self, now: float, reading: EngineReading) -> Telemetry:
        """A snapshot for the policy; the warm-return tally starts again with it. Where the engine reported
        no cached-token counts (OpenAI routes of an SGLang without --enable-cache-report), the engine-wide
        hit rate stands in for the warm returns'."""
        return Telemetry(
            now=now,
            active_sessions=self.active_count(),
            parked_sessions=self.parked_count,
            working_set_tokens=self.working_set(),
            hit_rate=reading.hit_rate,
            prefill_backlog_tokens=reading.prefill_backlog_tokens,
            decode_waiting_requests=reading.decode_waiting_requests,
            decode_kv_used_tokens=reading.decode_kv_used_tokens,
            decode_kv_capacity_tokens=reading.decode_kv_capacity_tokens,
            lent_tokens=reading.lent_tokens,
            warm_hit_rate=self.warm.take(stand_in=reading.hit_rate),
        )

    def control(self, now: float, reading: EngineReading) -> float | None:
        """One control step; returns the policy's next interval in model seconds (None: its default)."""
        telemetry = self.telemetry(now, reading)
        self.last_telemetry = telemetry
        actions = self.policy.on_control(now, telemetry)
        for sid in actions.admit:
            entry = self.sessions.get(sid)
            if entry is not None and entry.state == "parked":
                self._set_state(entry, "active")
        if actions.admit:
            self._audit()
        for sid in actions.shed:
            entry = self.sessions.get(sid)
            if entry is not None and entry.state == "parked":
                self._set_state(entry, "shed")  # its next retry gets 503 shed
                entry.reason = "policy"
                self.policy.on_session_end(now, sid, False)
                self.outcomes["shed", "policy"] += 1
        for sid in actions.pause:
            entry = self.sessions.get(sid)
            if entry is not None and entry.state == "active":
                entry.paused = True
        for sid in actions.resume:
            entry = self.sessions.get(sid)
            if entry is not None:
                entry.paused = False
        return actions.next_control_s

    def _audit(self) -> None:
        """Count an admission that left BASIN's reservations above its budget with several residents.

        Reads the policy's own ledger after its decision; it decides nothing (BASIN admits a session
        only if it fits, or when no resident remains)."""
        policy = self.policy
        reserved, budget, residents = (getattr(policy, n, None) for n in ("reserved", "budget", "residents"))
        numbers = isinstance(reserved, float) and isinstance(budget, float) and isinstance(residents, int)
        if numbers and residents > 1 and reserved > budget * (1 + 1e-9):  # type: ignore[operator]
            self.overruns += 1
            if self.overruns <= 5:
                log.warning(
                    "budget audit: %d residents reserve %.0f tokens over B = %.0f after an admission",
                    residents,
                    reserved,
                    budget,
                )

    def sweep(self, now: float) -> list[str]:
        """End sessions that went quiet and shed those parked too long; returns the ids ended."""
        ended = []
        for entry in list(self.sessions.values()):
            idle = now - entry.last_seen
            if entry.state == "parked" and now - entry.arrived >= self.max_park_wait_s:
                self._set_state(entry, "shed")
                entry.reason = "parked-too-long"
                self.policy.on_session_end(now, entry.sid, False)
                self.outcomes["shed", "parked-too-long"] += 1
            elif entry.state == "shed" and idle >= self.idle_timeout_s:
                self._drop(entry)  # nobody came back for its 503
            elif entry.in_flight == 0 and idle >= self.idle_timeout_s and entry.state != "shed":
                self.end(now, entry.sid, False, "ended", "idle-timeout")
                ended.append(entry.sid)
        return ended

    # ------------------------------------------------------------------ hand-over
    def adopt(self, now: float, sid: str, record: dict[str, Any]) -> None:
        """Take over a running session decided elsewhere (a replica during a Redis outage, or the
        previous leader): the policy is told it arrived warm, at its arrival time, then its context."""
        if sid in self.sessions:
            return
        arrived = float(record.get("arrived", now))
        first = int(record.get("first_tokens") or 0)
        info = SessionInfo(sid, arrived, "", first, warm=True)
        if record.get("peak") is not None:
            self.known[sid] = float(record["peak"])
        self.policy.on_session_arrival(arrived, info)
        self.known.pop(sid, None)
        self.arrived += 1
        calls = int(record.get("calls") or 0)
        context = int(record.get("context") or first)
        entry = Entry(
            sid,
            "active",
            arrived,
            now,
            context=context,
            calls=calls,
            first_tokens=first,
            paused=bool(record.get("paused")),
        )
        entry.peak = self.peaks.pop(sid, None)
        self.sessions[sid] = entry
        if calls:
            self.policy.on_call_end(now, CallInfo(sid, calls - 1, first), context)

    def restore(self, now: float, controller: dict[str, Any], records: dict[str, dict[str, Any]]) -> None:
        """Rebuild from the shared snapshot: running sessions warm, the controller's scalars (B, B0,
        flags, plateau …), then parked sessions re-queued by arrival (their keys as before)."""
        by_arrival = sorted(records.items(), key=lambda item: float(item[1].get("arrived", 0.0)))
        for sid, record in by_arrival:
            if record.get("state") == "active":
                self.adopt(now, sid, record)
        self.restore_controller(controller)
        for sid, record in by_arrival:
            state = record.get("state")
            arrived = float(record.get("arrived", now))
            if state == "parked":
                first = int(record.get("first_tokens") or 0)
                info = SessionInfo(sid, arrived, "", first)
                if record.get("peak") is not None:
                    self.known[sid] = float(record["peak"])
                decision = self.policy.on_session_arrival(arrived, info)
                self.known.pop(sid, None)
                entry = Entry(sid, "active", arrived, now, context=first, first_tokens=first)
                entry.peak = self.peaks.pop(sid, None)
                self.sessions[sid] = entry
                if decision is Admission.PARK:
                    self._set_state(entry, "parked")
            elif state == "shed":
                self.sessions[sid] = Entry(
                    sid, "shed", arrived, now, reason=str(record.get("reason", "shed"))
                )

    # ------------------------------------------------------------------ snapshot
    def controller_state(self) -> dict[str, Any]:
        """The policy's own state (B, B0, flags, plateau, smoothed rates, recent arrivals …): what a new
        leader needs to resume instead of starting cold. Sums over sessions are left out: adopting the
        sessions rebuilds them."""
        state: dict[str, Any] = {}
        for name, value in vars(self.policy).items():
            if name in SESSION_DERIVED:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                state[name] = str(value)  # "nan", "inf": JSON has no such numbers
            elif isinstance(value, bool | int | float | str) or value is None:
                state[name] = value
            elif isinstance(value, deque) and all(isinstance(v, int | float) for v in value):
                state[name] = list(value)
        return state

    def restore_controller(self, state: dict[str, Any]) -> None:
        current = vars(self.policy)
        for name, value in state.items():
            if name not in current or name in SESSION_DERIVED:
                continue
            if value in NON_FINITE:
                value = float(value)
            if isinstance(current[name], deque) and isinstance(value, list):
                current[name].clear()
                current[name].extend(value)
            elif current[name] is None or isinstance(current[name], bool | int | float | str):
                setattr(self.policy, name, value)
