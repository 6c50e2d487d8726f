"""Switching a policy on mid-run (paper §7.8 "late", Fig. 21b): SGLang with HiCache alone until `start_s`,
then the wrapped policy, told of every live session as if it had found them running."""

from __future__ import annotations

from dataclasses import dataclass, replace

from basin.policy.base import (
    Admission,
    CallDirectives,
    CallInfo,
    ControlActions,
    Policy,
    SessionInfo,
    Telemetry,
)


@dataclass
class _Live:
    info: SessionInfo
    context: int
    last_call: CallInfo | None = None


class LateStart(Policy):
    name = "late"

    def __init__(self, inner: Policy, start_s: float) -> None:
        self.inner = inner
        self.start_s = start_s
        self.started = False
        self.live: dict[str, _Live] = {}
        self.engine_options = inner.engine_options  # type: ignore[misc]
        self.control_interval_s = inner.control_interval_s or 30.0  # type: ignore[misc]

    def _hand_over(self) -> None:
        """Tell the inner policy of every live session, admitted and at its current context."""
        self.started = True
        for live in self.live.values():
            self.inner.on_session_arrival(live.info.arrival_s, replace(live.info, warm=True))
            if live.last_call is not None:
                self.inner.on_call_end(live.info.arrival_s, live.last_call, live.context)

    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission:
        if self.started:
            return self.inner.on_session_arrival(now, session)
        self.live[session.session_id] = _Live(session, session.first_prompt_tokens)
        return Admission.ADMIT

    def on_call_start(self, now: float, call: CallInfo) -> CallDirectives:
        return self.inner.on_call_start(now, call) if self.started else CallDirectives()

    def on_call_end(self, now: float, call: CallInfo, context_tokens: int) -> float:
        if self.started:
            return self.inner.on_call_end(now, call, context_tokens)
        live = self.live.get(call.session_id)
        if live is not None:
            live.context, live.last_call = context_tokens, call
        return 0.0

    def on_session_end(self, now: float, session_id: str, completed: bool) -> None:
        if self.started:
            self.inner.on_session_end(now, session_id, completed)
        else:
            self.live.pop(session_id, None)

    def on_control(self, now: float, telemetry: Telemetry) -> ControlActions:
        if not self.started and now >= self.start_s:
            self._hand_over()
        if not self.started:
            return ControlActions()
        return self.inner.on_control(now, telemetry)
