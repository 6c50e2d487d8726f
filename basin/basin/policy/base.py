"""The policy interface shared by the simulator and the live gateway.

A policy is told of session arrivals, call starts and ends and session ends, gets a telemetry snapshot
every control interval, and answers with decisions: admit, park or reject a new session; the queue
priority of a call; lending on or off; which parked sessions to admit or shed. It never reads a clock or
a socket: time comes in as an argument, so the same object runs in simulation and behind HTTP.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import ClassVar

# A call that returns within this long of its session's previous call is a *warm return*: its prefix was
# used a moment ago, so a miss means the working set no longer fits the cache (Denning's page-fault
# frequency), whereas a return from a long tool run may miss under any load. Assumed: a minute, twice
# BASIN's control interval; the median tool gap is under a second (docs/workloads.md).
WARM_RETURN_S = 60.0


def is_warm_return(now: float, previous_answer_s: float) -> bool:
    """Whether a call starting at `now` is a warm return (its session's previous call answered at
    `previous_answer_s`; -inf for a first call)."""
    return now - previous_answer_s < WARM_RETURN_S


@dataclass(slots=True)
class WarmReturns:
    """The warm-return hit rate between two telemetry snapshots, counted from answers as a gateway sees
    them (the simulator and the gateway keep one each)."""

    cached: int = 0  # prompt tokens served from the prefix cache
    prompt: int = 0
    unreported: int = 0  # answers that carried no cached-token count

    def count(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        """One warm return answered; an engine may over-count cached tokens, so they are capped at the
        prompt."""
        if cached_tokens is None:
            self.unreported += 1
        elif prompt_tokens > 0:
            self.cached += min(cached_tokens, prompt_tokens)
            self.prompt += prompt_tokens

    def take(self, stand_in: float = float("nan")) -> float:
        """The hit rate since the last take, and start again. `stand_in` answers when warm returns came back
        but none carried a count; NaN when none came back."""
        rate = float("nan") if not self.unreported else stand_in
        if self.prompt:
            rate = self.cached / self.prompt
        self.cached = self.prompt = self.unreported = 0
        return rate


class Admission(Enum):
    ADMIT = "admit"  # the first call goes to the engine now
    PARK = "park"  # the session waits at the gateway until a control step admits it
    REJECT = "reject"  # the session is refused (counts as failed)


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """What a gateway knows of a session when it arrives (its first call)."""

    session_id: str
    arrival_s: float
    task: str
    first_prompt_tokens: int
    source_id: str = ""  # the trajectory replayed, when known (simulation); lets oracles look it up
    warm: bool = False  # already running when the policy started: admitted whatever the answer


@dataclass(frozen=True, slots=True)
class CallInfo:
    """A call as the gateway sees it: its session, position and prompt."""

    session_id: str
    call_index: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Telemetry:
    """The engine and gateway state a control step reads (from SGLang's metrics when live)."""

    now: float
    active_sessions: int  # admitted, not finished, including tool-idle ones
    parked_sessions: int
    working_set_tokens: int  # sum of the current contexts of active sessions
    hit_rate: float  # prefix hit rate since the previous snapshot (NaN when no prefill started)
    prefill_backlog_tokens: int  # outstanding uncached prefill tokens (Q_P)
    decode_waiting_requests: int  # requests waiting for decode memory (Q_D)
    decode_kv_used_tokens: int
    decode_kv_capacity_tokens: int
    lent_tokens: int
    # Prefix hit rate of warm returns since the previous snapshot: calls whose session's previous call ended
    # less than WARM_RETURN_S before (NaN when none started prefill).
    warm_hit_rate: float = float("nan")


@dataclass(slots=True)
class CallDirectives:
    priority: float | None = None  # lower runs first; None: arrival order (SGLang's FCFS)
    lend: bool = False  # ask decode to keep the prompt as a lent unit


@dataclass(slots=True)
class ControlActions:
    admit: list[str] = field(default_factory=list)  # parked sessions to admit now
    shed: list[str] = field(default_factory=list)  # parked sessions to refuse now
    pause: list[str] = field(default_factory=list)  # active sessions to hold at their next turn boundary
    resume: list[str] = field(default_factory=list)  # paused sessions to let go on
    next_control_s: float | None = None  # when to call on_control again (None: the policy's default)


class Policy(ABC):
    """Base class of every session policy; subclasses register by `name` in `basin.policy.POLICIES`."""

    name: ClassVar[str]
    control_interval_s: ClassVar[float | None] = None  # None: never called for control
    # Engine behaviour the system brings with it (deployment options the simulator applies).
    engine_options: ClassVar[dict[str, object]] = {}

    @abstractmethod
    def on_session_arrival(self, now: float, session: SessionInfo) -> Admission: ...

    def on_call_start(self, now: float, call: CallInfo) -> CallDirectives:
        return CallDirectives()

    def on_call_end(self, now: float, call: CallInfo, context_tokens: int) -> float:
        """A call finished; `context_tokens` is the session's context now (prompt plus output).

        Returns how many seconds to pin the session's prompt in the prefill cache while its tool runs
        (0: no pin); the pin also ends when the session's next call starts prefill."""
        return 0.0

    def on_session_end(self, now: float, session_id: str, completed: bool) -> None:  # noqa: B027
        """A session left: completed, or terminated."""

    def on_control(self, now: float, telemetry: Telemetry) -> ControlActions:
        return ControlActions()
