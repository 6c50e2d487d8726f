"""CONCUR (agent-level concurrency control) as the paper ports it: AIMD on the number of active agents.

Every interval the window of active agents grows by one while decode KV occupancy stays below its high
watermark and the prefix hit rate stays at or above 0.7 (the paper raises CONCUR's threshold from 0.2 to
0.7 to place it within the observed range); it shrinks multiplicatively when either signal crosses.
Active agents beyond the window are paused at their next turn boundary, newest first; below it, paused
agents resume (oldest first) and then new agents are admitted in arrival order. KV occupancy is decode's
(requests reserved, transferring or running), as in the paper's port. The hit rate is smoothed over
~30 s, so single noisy intervals do not halve the window.
"""

from __future__ import annotations

import math

from basin.policy.base import Admission, ControlActions, Policy, SessionInfo, Telemetry

HIT_THRESHOLD = 0.7
KV_HIGH_WATERMARK = 0.9
INCREASE = 1.0
DECREASE = 0.5
INTERVAL_S = 5.0
HIT_SMOOTHING_S = 30.0  # the hit-rate signal is an exponential average over about this long


class Concur(Policy):
    name = "concur"
    control_interval_s = INTERVAL_S

    def __init__(self) -> None:
        self.window = math.inf  # no limit until the first congestion signal
        self.arrival: dict[str, float] = {}
        self.active: set[str] = set()
        self.paused: set[str] = set()
        self.waiting: dict[str, float] = {}  # new agents not admitted yet, by arrival
        self.hit = math.nan

    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission:
        self.arrival[session.session_id] = now
        if session.warm or (len(self.active) < self.window and not self.waiting and not self.paused):
            self.active.add(session.session_id)
            return Admission.ADMIT
        self.waiting[session.session_id] = now
        return Admission.PARK

    def on_session_end(self, now: float, session_id: str, completed: bool) -> None:
        self.active.discard(session_id)
        self.paused.discard(session_id)
        self.waiting.pop(session_id, None)
        self.arrival.pop(session_id, None)

    def _arrival_order(self, sid: str) -> tuple[float, str]:
        """Arrival time, ties broken by id: sets iterate in a per-process hash order."""
        return self.arrival[sid], sid

    def on_control(self, now: float, telemetry: Telemetry) -> ControlActions:
        occupancy = (
            telemetry.decode_kv_used_tokens / telemetry.decode_kv_capacity_tokens
            if telemetry.decode_kv_capacity_tokens
            else 0.0
        )
        if not math.isnan(telemetry.hit_rate):
            weight = 1.0 - math.exp(-INTERVAL_S / HIT_SMOOTHING_S)
            self.hit = (
                telemetry.hit_rate
                if math.isnan(self.hit)
                else self.hit + weight * (telemetry.hit_rate - self.hit)
            )
        reuse_low = not math.isnan(self.hit) and self.hit < HIT_THRESHOLD
        # The window never runs far ahead of the agents there are to run.
        demand = len(self.active) + len(self.paused) + len(self.waiting)
        if occupancy > KV_HIGH_WATERMARK or reuse_low:
            self.window = max(1.0, min(self.window, len(self.active)) * DECREASE)
        elif not math.isinf(self.window):
            self.window = min(self.window + INCREASE, demand + INCREASE)
        actions = ControlActions()
        limit = self.window
        if len(self.active) > limit:
            excess = len(self.active) - int(limit)
            for sid in sorted(self.active, key=self._arrival_order, reverse=True)[:excess]:
                self.active.discard(sid)
                self.paused.add(sid)
                actions.pause.append(sid)
        for sid in sorted(self.paused, key=self._arrival_order):
            if len(self.active) >= limit:
                break
            self.paused.discard(sid)
            self.active.add(sid)
            actions.resume.append(sid)
        for sid in sorted(self.waiting, key=self.waiting.__getitem__):
            if len(self.active) >= limit:
                break
            del self.waiting[sid]
            self.active.add(sid)
            actions.admit.append(sid)
        return actions
