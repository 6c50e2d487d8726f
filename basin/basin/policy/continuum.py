"""Continuum (Li et al., "Continuum: Efficient and robust multi-turn LLM agent scheduling with KV cache
time-to-live", arXiv:2511.02230; the BASIN paper's ref. [43]) as the paper ports it to SGLang PD: KV
retention across tool calls with a time-to-live, and program-level first-come-first-served order.

- When a call ends and its session goes to a tool, its prompt stays pinned in the prefill cache for a
  TTL chosen, as Continuum chooses it, from both costs an eviction causes: the *reload* (recomputing the
  context, R = context / prefill rate) and the *queueing delay* the returning call then suffers behind
  the other waiting work (D = outstanding prefill work / prefill rate, read from telemetry every 5 s;
  a pinned follow-up goes to the head of the queue, an evicted one waits its turn). Against that, a pin
  holds its share s of the prefill GPU cache for as long as it lasts, at the rate R·s. The TTL is the
  quantile t of the observed tool durations that maximizes the expected net benefit
  P(gap <= t)·(R + D) − E[min(gap, t)]·R·s; no pin when no quantile pays off.
- Both engine queues order calls by their program's arrival (FCFS at program level), with the
  follow-ups of pinned programs first.
- Under memory pressure the engine releases the pins of the latest-arriving programs first.
Everything is admitted; there is no admission control.

Tool types are not visible to our workloads, so one duration distribution serves all tools.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from basin.policy.base import (
    Admission,
    CallDirectives,
    CallInfo,
    ControlActions,
    Policy,
    SessionInfo,
    Telemetry,
)

PINNED_FIRST = 1e9  # subtracted from a pinned follow-up's key: ahead of every unpinned call
HISTORY = 2000  # recent tool durations kept
MIN_HISTORY = 20  # no pins before this many durations have been seen
QUANTILES = np.linspace(0.05, 0.99, 48)
INTERVAL_S = 5.0  # how often the queueing delay is read (the gateway's metrics poll)


class Continuum(Policy):
    name = "continuum"
    control_interval_s = INTERVAL_S

    def __init__(self, prefill_tokens_per_s: float, prefill_gpu_tokens: int) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.prefill_gpu_tokens = prefill_gpu_tokens
        self.arrival: dict[str, float] = {}
        self.call_end: dict[str, float] = {}
        self.pinned_until: dict[str, float] = {}
        self.gaps: deque[float] = deque(maxlen=HISTORY)
        self._sorted: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._seen = 0
        self.queue_delay_s = 0.0  # what an evicted call would wait behind outstanding prefill work

    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission:
        self.arrival[session.session_id] = now
        return Admission.ADMIT

    def on_call_start(self, now: float, call: CallInfo) -> CallDirectives:
        sid = call.session_id
        if sid in self.call_end:
            self.gaps.append(now - self.call_end.pop(sid))
        key = self.arrival.get(sid, now)
        if self.pinned_until.pop(sid, -1.0) >= now:
            key -= PINNED_FIRST
        return CallDirectives(priority=key)

    def _curves(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Candidate TTLs with P(gap <= t) and E[min(gap, t)], refreshed every 50 new durations."""
        if self._sorted is None or len(self.gaps) - self._seen >= 50 or len(self.gaps) < 50:
            gaps = np.sort(np.fromiter(self.gaps, dtype=float))
            candidates = np.quantile(gaps, QUANTILES)
            within = np.searchsorted(gaps, candidates, side="right")
            prefix = np.concatenate(([0.0], np.cumsum(gaps)))
            n = gaps.size
            self._sorted = (candidates, within / n, (prefix[within] + candidates * (n - within)) / n)
            self._seen = len(self.gaps)
        return self._sorted

    def ttl(self, context_tokens: int) -> float:
        """The TTL with the best expected net benefit for this context, or 0 (do not pin).

        Net benefit P(gap <= t)·(R + D) − E[min(gap, t)]·R·share, divided by R: the reload R, the queueing
        delay D an evicted call would add, and the context's share of the prefill GPU cache."""
        if len(self.gaps) < MIN_HISTORY or context_tokens <= 0:
            return 0.0
        candidates, p_hit, expected_hold = self._curves()
        reload_s = context_tokens / self.prefill_tokens_per_s
        gain = 1.0 + self.queue_delay_s / reload_s
        value = gain * p_hit - (context_tokens / self.prefill_gpu_tokens) * expected_hold
        best = int(np.argmax(value))
        return float(candidates[best]) if value[best] > 0 else 0.0

    def on_call_end(self, now: float, call: CallInfo, context_tokens: int) -> float:
        self.call_end[call.session_id] = now
        ttl = self.ttl(context_tokens)
        if ttl > 0:
            self.pinned_until[call.session_id] = now + ttl
        return ttl

    def on_control(self, now: float, telemetry: Telemetry) -> ControlActions:
        """Track the queueing delay an eviction would add: outstanding uncached prefill work (Q_P) at the
        prefill rate."""
        self.queue_delay_s = telemetry.prefill_backlog_tokens / self.prefill_tokens_per_s
        return ControlActions()

    def on_session_end(self, now: float, session_id: str, completed: bool) -> None:
        for table in (self.arrival, self.call_end, self.pinned_until):
            table.pop(session_id, None)
