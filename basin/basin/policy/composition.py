"""The paper's composition of baselines: ThunderAgent's admission bound, Crossflow's borrowing of decode
compute for prefill, and Continuum's program order with TTL pinning — each part unchanged."""

from __future__ import annotations

from basin.policy.base import Admission, CallDirectives, CallInfo, ControlActions, SessionInfo, Telemetry
from basin.policy.continuum import Continuum
from basin.policy.thunderagent import ThunderAgent


class Composition(ThunderAgent):
    name = "composition"
    engine_options = {"decode_prefill": True}  # noqa: RUF012  (Crossflow's borrowing)

    def __init__(self, capacity_tokens: int, prefill_tokens_per_s: float, prefill_gpu_tokens: int) -> None:
        super().__init__(capacity_tokens)
        self.continuum = Continuum(prefill_tokens_per_s, prefill_gpu_tokens)

    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission:
        self.continuum.on_session_arrival(now, session)
        return super().on_session_arrival(now, session)

    def on_call_start(self, now: float, call: CallInfo) -> CallDirectives:
        super().on_call_start(now, call)
        return self.continuum.on_call_start(now, call)

    def on_call_end(self, now: float, call: CallInfo, context_tokens: int) -> float:
        super().on_call_end(now, call, context_tokens)
        return self.continuum.on_call_end(now, call, context_tokens)

    def on_session_end(self, now: float, session_id: str, completed: bool) -> None:
        super().on_session_end(now, session_id, completed)
        self.continuum.on_session_end(now, session_id, completed)

    def on_control(self, now: float, telemetry: Telemetry) -> ControlActions:
        self.continuum.on_control(now, telemetry)  # Continuum's TTL reads the queueing delay
        return super().on_control(now, telemetry)
