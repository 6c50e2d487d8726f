"""Session arrival processes: Poisson with a piecewise-constant rate, and a warm start.

Arrivals draw trajectories from a pool in shuffled rounds (every trajectory once per round), so long
runs replay the pool evenly, as the paper's driver replays its recorded trajectories.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from basin.errors import BasinError
from basin.workload.model import Session


@dataclass(frozen=True)
class RateSchedule:
    """Arrival rate over a run, in sessions per minute.

    `base_rate` until the surge, `base_rate * surge_factor` during it, then `post_surge_rate` (the base
    rate if not given) until `duration_min`. A surge factor of 2.0 is a "+100 %" surge.
    """

    base_rate: float
    duration_min: float
    surge_factor: float = 1.0
    surge_start_min: float = 0.0
    surge_minutes: float = 0.0
    post_surge_rate: float | None = None

    def __post_init__(self) -> None:
        if self.base_rate < 0:
            raise BasinError(f"base rate must not be negative, got {self.base_rate}")
        if self.post_surge_rate is not None and self.post_surge_rate < 0:
            raise BasinError(f"post-surge rate must not be negative, got {self.post_surge_rate}")
        if self.duration_min <= 0:
            raise BasinError(f"duration must be positive, got {self.duration_min} min")
        if self.surge_factor < 0:
            raise BasinError(f"surge factor must not be negative, got {self.surge_factor}")
        if self.surge_start_min < 0 or self.surge_minutes < 0:
            raise BasinError("surge start and length must not be negative")
        if self.surge_minutes > 0 and self.surge_end_min > self.duration_min:
            raise BasinError(
                f"the surge ends at minute {self.surge_end_min:g}, past the end of the run"
                f" ({self.duration_min:g} min)"
            )

    @property
    def surge_end_min(self) -> float:
        return self.surge_start_min + self.surge_minutes

    def segments(self) -> list[tuple[float, float, float, bool]]:
        """(start_min, end_min, rate_per_min, in_surge) pieces covering the run."""
        if self.surge_minutes <= 0:
            return [(0.0, self.duration_min, self.base_rate, False)]
        after = self.base_rate if self.post_surge_rate is None else self.post_surge_rate
        pieces = [
            (0.0, self.surge_start_min, self.base_rate, False),
            (self.surge_start_min, self.surge_end_min, self.base_rate * self.surge_factor, True),
            (self.surge_end_min, self.duration_min, after, False),
        ]
        return [p for p in pieces if p[1] > p[0]]

    def expected_arrivals(self, start_min: float = 0.0, end_min: float | None = None) -> float:
        end = self.duration_min if end_min is None else end_min
        return sum(rate * max(0.0, min(b, end) - max(a, start_min)) for a, b, rate, _ in self.segments())


@dataclass(frozen=True)
class StepSchedule:
    """A stepped load ramp: `rates[i]` sessions per minute during step i, each `step_minutes` long
    (the κ profiler's ramp). No surge."""

    rates: tuple[float, ...]
    step_minutes: float
    surge_minutes: float = 0.0
    surge_start_min: float = 0.0
    surge_end_min: float = 0.0

    def __post_init__(self) -> None:
        if not self.rates:
            raise BasinError("a ramp needs at least one step")
        if any(r < 0 for r in self.rates):
            raise BasinError(f"ramp rates must not be negative, got {self.rates}")
        if self.step_minutes <= 0:
            raise BasinError(f"step length must be positive, got {self.step_minutes} min")

    @property
    def base_rate(self) -> float:
        return self.rates[0]

    @property
    def duration_min(self) -> float:
        return self.step_minutes * len(self.rates)

    def segments(self) -> list[tuple[float, float, float, bool]]:
        m = self.step_minutes
        return [(i * m, (i + 1) * m, rate, False) for i, rate in enumerate(self.rates)]


Schedule = RateSchedule | StepSchedule


@dataclass(frozen=True)
class Arrival:
    """A session entering the system at `time_s`, starting at call `first_call` (0 unless warm).

    A warm session is active from time 0 and releases `first_call` at `time_s`."""

    time_s: float
    session: Session
    instance_id: str
    first_call: int = 0
    in_surge: bool = False
    warm: bool = False


class _PoolDrawer:
    """Draws trajectories in shuffled rounds, naming each use uniquely."""

    def __init__(self, pool: Sequence[Session], rng: np.random.Generator) -> None:
        if not pool:
            raise BasinError("the workload holds no sessions")
        self._pool, self._rng, self._order, self._count = pool, rng, [], 0

    def draw(self) -> tuple[Session, str]:
        if not self._order:
            self._order = list(self._rng.permutation(len(self._pool)))
        session = self._pool[int(self._order.pop())]
        self._count += 1
        return session, f"{session.session_id}#{self._count}"


def _call_tool_time(session: Session) -> np.ndarray:
    return np.array([1.0 + c.tool_gap_s for c in session.calls])


def poisson_arrivals(
    schedule: Schedule,
    pool: Sequence[Session],
    rng: np.random.Generator,
    warm_sessions: int = 0,
    call_seconds: Callable[[Session], np.ndarray] = _call_tool_time,
) -> list[Arrival]:
    """Warm-start sessions at time 0, then Poisson arrivals following `schedule`, in time order.

    Warm sessions are what steady operation would hold (the paper's runs start from 42 active sessions
    joined mid-trajectory): an active session seen at a random instant is a long one more often (drawn
    with probability proportional to its lifetime) and sits at a call chosen in proportion to the time
    spent there. `call_seconds` gives the time a session spends per call (its service plus tool gap);
    by default one second plus the gap.
    """
    if warm_sessions < 0:
        raise BasinError(f"warm sessions must not be negative, got {warm_sessions}")
    if not pool:
        raise BasinError("the workload holds no sessions")
    arrivals = []
    if warm_sessions:
        per_call = [call_seconds(s) for s in pool]
        lifetimes = np.array([t.sum() for t in per_call])
        chosen = rng.choice(len(pool), size=warm_sessions, p=lifetimes / lifetimes.sum())
        for number, index in enumerate(chosen, start=1):
            session, times = pool[int(index)], per_call[int(index)]
            current = int(rng.choice(len(times), p=times / times.sum()))
            # The session is in call `current` or the tool gap after it: the next call comes after the
            # unexpired part of that gap.
            first_call = min(current + 1, len(times) - 1)
            release = float(rng.uniform(0.0, session.calls[current].tool_gap_s))
            arrivals.append(
                Arrival(release, session, f"{session.session_id}#w{number}", first_call=first_call, warm=True)
            )
    drawer = _PoolDrawer(pool, rng)
    for start, end, rate, in_surge in schedule.segments():
        if rate <= 0:
            continue
        t = start
        while True:
            t += rng.exponential(1.0 / rate)
            if t >= end:
                break
            session, instance = drawer.draw()
            arrivals.append(Arrival(t * 60.0, session, instance, in_surge=in_surge))
    return arrivals


def trace_arrivals(pool: Sequence[Session], duration_min: float) -> list[Arrival]:
    """Each session once, at its own offset in its source trace (`Session.trace_arrival_s`, shifted so
    the first starts at 0), for the sessions that start within the run; no warm start. For traces
    (Mooncake) whose timing is the point: the bursts are the trace's, not a Poisson process's."""
    timed = [(s.trace_arrival_s, s) for s in pool if s.trace_arrival_s is not None]
    if not timed:
        raise BasinError("--arrivals trace needs sessions with trace timestamps (a Mooncake trace)")
    start = min(t for t, _ in timed)
    arrivals = [Arrival(t - start, s, s.session_id) for t, s in timed if t - start < duration_min * 60]
    return sorted(arrivals, key=lambda a: (a.time_s, a.instance_id))
