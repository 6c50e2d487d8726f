"""ThunderAgent as the paper ports it: programs admitted and paused against the cache's token capacity.

Every 5 s it accounts used = Σ context of reasoning programs (a call in flight) + Σ context of acting
programs (running a tool) + 100 tokens per program, against the KV capacity bounded by the larger cache
tier. It first resumes paused programs (oldest pause first; force-resume after 30 min), then admits new
programs in arrival order only when nothing paused waits and they fit, then pauses while over capacity:
acting programs smallest first, then reasoning ones, which stop at their turn end.

The paper's resume order puts paused programs whose tool has finished ("pending reasoning") ahead of new
and still-acting ones; the policy interface does not see when a paused program's tool ends, so paused
programs resume in the order they were paused.
"""

from __future__ import annotations

from basin.policy.base import (
    Admission,
    CallDirectives,
    CallInfo,
    ControlActions,
    Policy,
    SessionInfo,
    Telemetry,
)

PER_PROGRAM_TOKENS = 100
INTERVAL_S = 5.0
FORCE_RESUME_S = 1800.0


class ThunderAgent(Policy):
    name = "thunderagent"
    control_interval_s = INTERVAL_S

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens
        self.context: dict[str, float] = {}
        self.reasoning: set[str] = set()
        self.acting: set[str] = set()
        self.paused: dict[str, float] = {}  # program -> when paused
        self.waiting: dict[str, float] = {}  # new programs -> arrival

    def _used(self) -> float:
        running = self.reasoning | self.acting
        return sum(self.context[s] for s in running) + PER_PROGRAM_TOKENS * len(running)

    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission:
        sid = session.session_id
        self.context[sid] = float(session.first_prompt_tokens)
        fits = self._used() + self.context[sid] + PER_PROGRAM_TOKENS <= self.capacity
        if session.warm or (fits and not self.paused and not self.waiting):
            self.acting.add(sid)  # about to issue its call
            return Admission.ADMIT
        self.waiting[sid] = now
        return Admission.PARK

    def on_call_start(self, now: float, call: CallInfo) -> CallDirectives:
        sid = call.session_id
        self.context[sid] = float(call.prompt_tokens)
        self.acting.discard(sid)
        self.reasoning.add(sid)
        return CallDirectives()

    def on_call_end(self, now: float, call: CallInfo, context_tokens: int) -> float:
        sid = call.session_id
        self.context[sid] = float(context_tokens)
        if sid in self.reasoning:
            self.reasoning.discard(sid)
            self.acting.add(sid)
        return 0.0

    def on_session_end(self, now: float, session_id: str, completed: bool) -> None:
        for table in (self.context, self.paused, self.waiting):
            table.pop(session_id, None)
        self.reasoning.discard(session_id)
        self.acting.discard(session_id)

    def _size_order(self, sid: str) -> tuple[float, str]:
        return self.context[sid], sid

    def on_control(self, now: float, telemetry: Telemetry) -> ControlActions:
        actions = ControlActions()
        used = self._used()
        for sid in sorted(self.paused, key=self.paused.__getitem__):
            need = self.context[sid] + PER_PROGRAM_TOKENS
            if used + need <= self.capacity or now - self.paused[sid] >= FORCE_RESUME_S:
                del self.paused[sid]
                self.acting.add(sid)
                actions.resume.append(sid)
                used += need
        if not self.paused:
            for sid in sorted(self.waiting, key=self.waiting.__getitem__):
                need = self.context[sid] + PER_PROGRAM_TOKENS
                if used + need > self.capacity:
                    break
                del self.waiting[sid]
                self.acting.add(sid)
                actions.admit.append(sid)
                used += need
        # Smallest first, ties by id (sets iterate in a per-process hash order).
        victims = sorted(self.acting, key=self._size_order) + sorted(self.reasoning, key=self._size_order)
        for sid in victims:
            if used <= self.capacity:
                break
            self.acting.discard(sid)
            self.reasoning.discard(sid)
            self.paused[sid] = now
            actions.pause.append(sid)
            used -= self.context[sid] + PER_PROGRAM_TOKENS
        return actions
