"""The BASIN controller (paper §6, Algorithm 1): a clock-free state machine behind the policy interface.

- Every session gets a fixed key p_i = a_i + Ŵ_i / r at its first call (arrival time plus predicted peak
  context over a token rate); the key orders admission, the prefill queue and the decode-memory queue.
- Admission (Denning's working-set principle): parked and new sessions form one queue by key; the head
  enters while Σ Ŵ of residents + Ŵ_head ≤ B, or when no residents remain. Admission engages at
  W = N·c̄ ≥ B0 and releases once W < α_R·B0 has held for a cool-down. B starts at B0·Σ Ŵ/W, the
  reservations that stand for a working set of B0 (peaks run ahead of contexts). While engaged, B adapts
  page-fault-frequency style within a bounded range around B0: up by a step per Δ (the feedback lag)
  while sessions are parked and reuse is on its healthy plateau, down by a step per control step while
  reuse has deteriorated and the engine is queueing (more than `backlog_tokens_s` of prefill work, or
  requests waiting for decode memory: misses that the engine absorbs do not feed the trap) — also below
  the residents' Σ Ŵ (it stops entry, it never evicts). Reuse is the hit rate of *warm returns* (calls
  back within `WARM_RETURN_S` of their previous call's end): a fault on a prefix used a minute ago means
  the working set no longer fits, while a return from a long tool run misses whatever the load. After
  release B grows gradually, spreading re-entry. The plateau is learned while nobody is parked and
  prefill keeps up (also under admission, which may be engaged from the first step on); until then it
  is the reference curve's healthy hit rate.
- B0 = min(m·κ·x_k·C_eff, C_eff), with C = max(C_G, C_H) and C_eff = max(C, C_G + L) for lent capacity L.
- Ordering engages on a persistent prefill backlog or decode-memory wait, at W ≥ α_O·B0, or while
  admission is active. Lending engages at W ≥ α_L·B0 (B0 of the prefill tiers alone) or while admission
  is active, if decode has spare memory.
- Shedding: when the long-run arrival rate exceeds the profiled peak departure rate λc and the head of
  the parked queue has waited T_s, the lowest-priority parked session is shed, one per interval.
- Control interval Δ = 30 s, 5 s while a backlog or any control persists.

The arrival-time variant (the paper's hardware prototype) orders by arrival and admits by the residents'
current contexts instead of predicted peaks.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from basin.errors import BasinError
from basin.hitcurve import HIT_PLATEAU, KNEE
from basin.policy.base import (
    Admission,
    CallDirectives,
    CallInfo,
    ControlActions,
    Policy,
    SessionInfo,
    Telemetry,
)


@dataclass(frozen=True)
class BasinConfig:
    """Controller parameters: the paper's defaults (§6.6) and our implementation settings."""

    interval_s: float = 30.0  # Δ
    fast_interval_s: float = 5.0  # Δ while a backlog or a control persists
    margin: float = 0.9  # m
    alpha_lend: float = 0.8  # α_L
    alpha_order: float = 0.9  # α_O
    alpha_release: float = 0.8  # α_R
    lend_cap: float = 0.5  # φ, share of decode memory that may be lent
    shed_after_s: float = 900.0  # T_s
    priority_rate: float = 30.0  # r, tokens per second
    # Implementation settings (the paper varies them in §7.9 without publishing exact values).
    cooldown_s: float = 60.0
    backlog_persist_s: float = 10.0  # a backlog counts once it has lasted this long
    backlog_tokens_s: float = 2.0  # ... and holds more than this many seconds of prefill work (also what
    # makes lost reuse count as deterioration, at once)
    context_smoothing_s: float = 1800.0  # time constant of c̄
    budget_range: tuple[float, float] = (0.5, 8.0)  # B within this range times B0
    budget_step: float = 0.05  # B rises by this share of B0 per Δ, falls by it per control step
    plateau_tolerance: float = 0.02  # warm-return reuse is on its plateau within this of the healthy rate
    deteriorated_drop: float = 0.05  # warm-return reuse has deteriorated this far below the plateau
    arrival_window_s: float = 3600.0  # the long-run arrival rate averages over this window
    decode_spare: float = 0.8  # lending needs decode KV use below this share and no decode wait
    # Ablations (paper §7.8): switch one mechanism off.
    lending: bool = True
    admission: bool = True
    ordering: bool = True

    def __post_init__(self) -> None:
        positive = {
            "interval_s": self.interval_s,
            "fast_interval_s": self.fast_interval_s,
            "margin": self.margin,
            "priority_rate": self.priority_rate,
            "context_smoothing_s": self.context_smoothing_s,
            "budget_step": self.budget_step,
            "arrival_window_s": self.arrival_window_s,
        }
        for name, value in positive.items():
            if not value > 0:
                raise BasinError(f"BASIN parameter {name} must be positive, got {value}")
        for name in ("alpha_lend", "alpha_order", "alpha_release", "lend_cap", "decode_spare"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise BasinError(f"BASIN parameter {name} must be in (0, 1], got {value}")
        low, high = self.budget_range
        if not 0 < low <= 1 <= high:
            raise BasinError(f"budget range must satisfy 0 < low <= 1 <= high, got {self.budget_range}")
        if self.shed_after_s < 0 or self.cooldown_s < 0 or self.backlog_persist_s < 0:
            raise BasinError("shedding horizon, cool-down and backlog persistence must not be negative")


@dataclass(frozen=True)
class DeploymentProfile:
    """What the profiler measured: the cliff scale, the peak departure rate and the capacities."""

    kappa: float
    lambda_c_per_min: float
    prefill_gpu_tokens: int
    host_tokens: int
    decode_kv_tokens: int
    prefill_tokens_per_s: float = 0.0  # for the backlog threshold; 0 = any backlog counts

    def __post_init__(self) -> None:
        if self.kappa <= 0 or self.lambda_c_per_min <= 0 or self.prefill_gpu_tokens <= 0:
            raise BasinError("a profile needs positive κ, λc and prefill capacity")


@dataclass
class _Session:
    key: float
    predicted_peak: float
    arrival_s: float
    context: float = 0.0
    resident: bool = False


@dataclass
class _ParkedQueue:
    """Parked sessions by key: the head (lowest key) for admission, the tail for shedding. O(log n)."""

    low: list[tuple[float, int, str]] = field(default_factory=list)
    high: list[tuple[float, int, str]] = field(default_factory=list)
    members: set[str] = field(default_factory=set)
    seq: itertools.count = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self.members)

    def push(self, sid: str, key: float) -> None:
        n = next(self.seq)
        heapq.heappush(self.low, (key, n, sid))
        heapq.heappush(self.high, (-key, -n, sid))
        self.members.add(sid)

    def _top(self, heap: list[tuple[float, int, str]]) -> str | None:
        while heap and heap[0][2] not in self.members:
            heapq.heappop(heap)
        return heap[0][2] if heap else None

    def head(self) -> str | None:
        return self._top(self.low)

    def tail(self) -> str | None:
        return self._top(self.high)

    def remove(self, sid: str) -> None:
        self.members.discard(sid)


class Basin(Policy):
    """BASIN with predicted peaks (`predict` gives Ŵ of a new session, in tokens)."""

    name = "basin"
    control_interval_s = 30.0
    # §6.2: "Reserving decode KV at prefill completion prevents requests awaiting prefill from occupying
    # this headroom" (the decode memory lending borrows).
    engine_options = {"allocation": "prefill_complete"}  # noqa: RUF012

    def __init__(
        self,
        profile: DeploymentProfile,
        predict: Callable[[SessionInfo], float],
        config: BasinConfig | None = None,
    ) -> None:
        self.profile = profile
        self.predict = predict
        self.config = config or BasinConfig()
        self.sessions: dict[str, _Session] = {}
        self.parked = _ParkedQueue()
        self.reserved = 0.0  # Σ Ŵ (or current contexts, arrival-time variant) of residents
        self.residents = 0
        self.resident_context = 0.0  # Σ current contexts of residents (for c̄, in O(1))
        self.admit = False
        self.order = False
        self.lend = False
        self.budget = math.inf
        self.context_mean: float | None = None  # c̄
        self.hit = math.nan  # smoothed warm-return hit rate
        self.plateau = HIT_PLATEAU  # healthy-plateau hit rate: the reference curve's until learned
        self.release_since: float | None = None
        self.order_since: float | None = None
        self.backlog_since: float | None = None
        self.last_control: float | None = None
        self.last_shed = -math.inf
        self.last_adapt = -math.inf  # when B last moved while admission was engaged
        self.arrivals: deque[float] = deque()  # recent arrival times (long-run rate)
        self.b0 = math.inf

    # ------------------------------------------------------------------ keys and demand
    def key(self, arrival_s: float, predicted_peak: float) -> float:
        return arrival_s + predicted_peak / self.config.priority_rate

    def demand(self, session: _Session) -> float:
        """What a resident reserves against the budget."""
        return session.predicted_peak

    def _c_bar(self) -> float:
        return self.context_mean if self.context_mean is not None else 0.0

    def working_set(self) -> float:
        return self.residents * self._c_bar()

    # ------------------------------------------------------------------ policy interface
    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission:
        peak = max(float(self.predict(session)), float(session.first_prompt_tokens))
        state = _Session(self.key(now, peak), peak, now, context=float(session.first_prompt_tokens))
        self.sessions[session.session_id] = state
        self.arrivals.append(now)
        if self.context_mean is None:
            self.context_mean = float(session.first_prompt_tokens)
        # A warm session is already running (the interface's contract): resident whatever the budget says.
        if session.warm or (not self.admit and not len(self.parked) and math.isinf(self.budget)):
            self._make_resident(session.session_id)
            return Admission.ADMIT
        self.parked.push(session.session_id, state.key)
        # Only the newcomer can be admitted here (others enter through a control step's actions).
        if self.parked.head() == session.session_id and self._fits(state):
            self.parked.remove(session.session_id)
            self._make_resident(session.session_id)
            return Admission.ADMIT
        return Admission.PARK

    def on_call_start(self, now: float, call: CallInfo) -> CallDirectives:
        state = self.sessions.get(call.session_id)
        priority = state.key if state is not None and self.order else None
        return CallDirectives(priority=priority, lend=self.lend)

    def on_call_end(self, now: float, call: CallInfo, context_tokens: int) -> float:
        state = self.sessions.get(call.session_id)
        if state is None:
            return 0.0
        if state.resident:
            self.reserved += self._demand_change(state, float(context_tokens))
            self.resident_context += context_tokens - state.context
        state.context = float(context_tokens)
        return 0.0  # BASIN retains contexts by lending, not by pinning

    def _demand_change(self, state: _Session, context: float) -> float:
        return 0.0  # predicted peaks are fixed until completion

    def on_session_end(self, now: float, session_id: str, completed: bool) -> None:
        state = self.sessions.pop(session_id, None)
        if state is None:
            return
        if state.resident:
            self.residents -= 1
            self.reserved -= self.demand(state)
            self.resident_context -= state.context
        else:
            self.parked.remove(session_id)

    # ------------------------------------------------------------------ admission
    def _make_resident(self, sid: str) -> None:
        state = self.sessions[sid]
        state.resident = True
        self.residents += 1
        self.reserved += self.demand(state)
        self.resident_context += state.context

    def _fits(self, state: _Session) -> bool:
        return not self.residents or self.reserved + self.demand(state) <= self.budget

    def _admit_heads(self) -> list[str]:
        admitted = []
        while (sid := self.parked.head()) is not None:
            if not self._fits(self.sessions[sid]):
                break
            self.parked.remove(sid)
            self._make_resident(sid)
            admitted.append(sid)
        return admitted

    # ------------------------------------------------------------------ the control step
    def on_control(self, now: float, telemetry: Telemetry) -> ControlActions:
        cfg, prof = self.config, self.profile
        elapsed = cfg.interval_s if self.last_control is None else max(now - self.last_control, 1e-9)
        self.last_control = now
        self._observe(now, telemetry, elapsed)
        w = self.working_set()

        # Capacity (lines 3-6).
        c = max(prof.prefill_gpu_tokens, prof.host_tokens)
        b00 = min(cfg.margin * prof.kappa * KNEE * c, c)
        spare = (
            telemetry.decode_waiting_requests == 0
            and telemetry.decode_kv_capacity_tokens > 0
            and telemetry.decode_kv_used_tokens < cfg.decode_spare * telemetry.decode_kv_capacity_tokens
        )
        self.lend = cfg.lending and (w >= cfg.alpha_lend * b00 or self.admit) and spare
        lent = min(telemetry.lent_tokens, cfg.lend_cap * prof.decode_kv_tokens)
        c_eff = max(c, prof.prefill_gpu_tokens + lent)
        self.b0 = b0 = min(cfg.margin * prof.kappa * KNEE * c_eff, c_eff)

        # Entry (lines 7-12).
        low, high = cfg.budget_range[0] * b0, cfg.budget_range[1] * b0
        step = cfg.budget_step * b0
        backlog = self._backlog_persists(now, telemetry)
        on_plateau = math.isnan(self.hit) or self.hit >= self.plateau - cfg.plateau_tolerance
        # Lost reuse sustains the trap only through queueing (§5): a miss the engine absorbs at once costs
        # prefill time it had to spare, and a dip of the noisy reading alone must not lower B.
        deteriorated = (
            not math.isnan(self.hit)
            and self.hit < self.plateau - cfg.deteriorated_drop
            and self._queueing(telemetry)
        )
        if not cfg.admission:
            self.admit = False
        elif w >= b0 or (self.admit and w >= cfg.alpha_release * b0):
            self.admit = True
            self.release_since = None
        elif self.admit:
            self.release_since = now if self.release_since is None else self.release_since
            if now - self.release_since >= cfg.cooldown_s:
                self.admit = False
        if self.admit:
            if math.isinf(self.budget):
                # Engage at the reservations that correspond to a working set of B0: B limits Σ Ŵ (peaks),
                # B0 bounds W (current contexts), and peaks run ahead of contexts. Starting at B0 itself
                # parked every newcomer until B had climbed past the residents' Σ Ŵ, tens of minutes.
                self.budget = b0 * max(self.reserved / w, 1.0) if w > 0 else b0
            # Up at most one step per Δ: a rise shows in reuse only once the sessions it let in have made
            # calls. Down at every control step: by the time warm returns miss, the surge is in.
            if deteriorated and now - self.last_adapt >= cfg.fast_interval_s:
                self.budget -= step
                self.last_adapt = now
            elif len(self.parked) and on_plateau and now - self.last_adapt >= cfg.interval_s:
                self.budget += step
                self.last_adapt = now
            self.budget = min(max(self.budget, low), high)
        elif len(self.parked):
            self.budget = b0 if math.isinf(self.budget) else min(self.budget + step, high)
        else:
            self.budget = math.inf
        if not len(self.parked) and not backlog and not math.isnan(self.hit):
            # The healthy plateau: reuse while nobody waits and prefill keeps up, also while admission is
            # engaged (it may be from the first step on). A slow average, not a running maximum: a maximum
            # of noisy readings sits above the plateau and makes ordinary readings look like deterioration.
            self.plateau = 0.95 * self.plateau + 0.05 * self.hit

        # Scheduling (lines 13-15): ordering on persistent backlog, high demand, or admission.
        wants_order = cfg.ordering and (backlog or w >= cfg.alpha_order * b0 or self.admit)
        if wants_order:
            self.order, self.order_since = True, None
        elif self.order:
            self.order_since = now if self.order_since is None else self.order_since
            if now - self.order_since >= cfg.cooldown_s:
                self.order = False

        # Admission (line 16) and shedding (lines 17-18).
        admitted = self._admit_heads()
        shed = []
        head = self.parked.head()
        if (
            head is not None
            and self._long_run_rate(now) > prof.lambda_c_per_min
            and now - self.sessions[head].arrival_s >= cfg.shed_after_s
            and now - self.last_shed >= cfg.interval_s
        ):  # one per (base) interval
            self.last_shed = now
            tail = self.parked.tail()
            assert tail is not None
            self.parked.remove(tail)
            del self.sessions[tail]
            shed.append(tail)
        busy = backlog or self.admit or self.order or len(self.parked) > 0
        return ControlActions(
            admit=admitted, shed=shed, next_control_s=cfg.fast_interval_s if busy else cfg.interval_s
        )

    def _observe(self, now: float, telemetry: Telemetry, elapsed: float) -> None:
        cfg = self.config
        if self.residents:
            mean = self.resident_context / self.residents
            if self.context_mean is None:
                self.context_mean = mean
            else:
                weight = 1.0 - math.exp(-elapsed / cfg.context_smoothing_s)
                self.context_mean += (mean - self.context_mean) * weight
        reuse = telemetry.warm_hit_rate
        if not math.isnan(reuse):
            self.hit = reuse if math.isnan(self.hit) else 0.5 * self.hit + 0.5 * reuse
        horizon = now - cfg.arrival_window_s
        while self.arrivals and self.arrivals[0] < horizon:
            self.arrivals.popleft()

    def _long_run_rate(self, now: float) -> float:
        window = min(self.config.arrival_window_s, max(now, 1.0))
        return len(self.arrivals) / (window / 60.0)

    def _queueing(self, telemetry: Telemetry) -> bool:
        """Prefill holds more than `backlog_tokens_s` of work, or requests wait for decode memory."""
        threshold = self.config.backlog_tokens_s * self.profile.prefill_tokens_per_s
        return telemetry.prefill_backlog_tokens > threshold or telemetry.decode_waiting_requests > 0

    def _backlog_persists(self, now: float, telemetry: Telemetry) -> bool:
        if not self._queueing(telemetry):
            self.backlog_since = None
            return False
        self.backlog_since = now if self.backlog_since is None else self.backlog_since
        return now - self.backlog_since >= self.config.backlog_persist_s


class BasinArrival(Basin):
    """The paper's hardware prototype: arrival-time order and admission by current contexts."""

    name = "basin-arrival"

    def key(self, arrival_s: float, predicted_peak: float) -> float:
        return arrival_s

    def demand(self, session: _Session) -> float:
        return session.context

    def _demand_change(self, state: _Session, context: float) -> float:
        return context - state.context
