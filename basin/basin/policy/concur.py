"""CONCUR (Chen et al., "CONCUR: Proactive agent-level admission control for efficient agentic batch
inference", arXiv:2601.22705) as the BASIN paper ports it (§7.1, ref. [9]): AIMD on the number of active
agents, driven by KV-cache utilisation and the prefix hit rate.

The rule (CONCUR's cache-aware congestion controller, with the port's signals):
- *Cut* (multiplicative decrease, halve the window) only when both signals agree that the cache is
  thrashing: utilisation U > U_high AND the smoothed hit rate has fallen below the hit-rate threshold
  (0.7: the paper raises CONCUR's 0.2 "to place it within the observed range"). High utilisation with
  good reuse is a full, working cache; low reuse with room to spare is cold prompts, not thrashing.
  At most one cut per smoothing period, so the effect of a cut is seen before the next (once per
  feedback delay, as TCP cuts once per round trip).
- *Grow* (additive increase, +1 agent per interval) only while U < U_low; between the two watermarks
  the window holds.
- U is decode KV occupancy (requests reserved, transferring or running), as in the paper's port.
- The hit rate is an exponential average over ~30 s whose first value is the mean of the first 30 s of
  readings, not one raw 5-s sample: a run's first interval is mostly cold first prompts, and a raw
  seed there halves a window that no thrashing asked to halve. No hit-rate decision before then.
Active agents beyond the window pause at their next turn boundary, newest first; below it, paused
agents resume (oldest first) and then new agents are admitted in arrival order. The window starts
unlimited. The BASIN paper does not list its port's settings. U_high = 0.7 and U_low = 0.5 are fitted to
the two outcomes it publishes for the port on H200 1P3D (§7.2, §7.5): with a 2x host tier CONCUR keeps
reuse and 0.52 of BASIN's goodput, GPU-only its hit rate falls before the window contracts and it keeps
0.24. With our first watermarks, 0.9 and 0.7, it cut only after reuse had collapsed and was trapped
with HiCache alone under the host-tier surge (docs/policies.md). The step, the halving and the
smoothing are our settings.
"""

from __future__ import annotations

import math

from basin.policy.base import Admission, ControlActions, Policy, SessionInfo, Telemetry

HIT_THRESHOLD = 0.7
U_HIGH = 0.7
U_LOW = 0.5
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
        self.hit = math.nan  # smoothed hit rate; NaN until the warm-up has passed
        self._warmup: list[float] = []  # readings of the first smoothing period
        self._last_cut = -math.inf

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

    def _smooth_hit(self, reading: float) -> None:
        """Average the readings of the first smoothing period, then follow them exponentially."""
        if math.isnan(reading):
            return
        if math.isnan(self.hit):
            self._warmup.append(reading)
            if len(self._warmup) * INTERVAL_S >= HIT_SMOOTHING_S:
                self.hit = sum(self._warmup) / len(self._warmup)
            return
        weight = 1.0 - math.exp(-INTERVAL_S / HIT_SMOOTHING_S)
        self.hit += weight * (reading - self.hit)

    def on_control(self, now: float, telemetry: Telemetry) -> ControlActions:
        utilisation = (
            telemetry.decode_kv_used_tokens / telemetry.decode_kv_capacity_tokens
            if telemetry.decode_kv_capacity_tokens
            else 0.0
        )
        self._smooth_hit(telemetry.hit_rate)
        reuse_falling = not math.isnan(self.hit) and self.hit < HIT_THRESHOLD
        # The window never runs far ahead of the agents there are to run.
        demand = len(self.active) + len(self.paused) + len(self.waiting)
        if utilisation > U_HIGH and reuse_falling:
            if now - self._last_cut >= HIT_SMOOTHING_S:
                self.window = max(1.0, min(self.window, len(self.active)) * DECREASE)
                self._last_cut = now
        elif utilisation < U_LOW and not math.isinf(self.window):
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
