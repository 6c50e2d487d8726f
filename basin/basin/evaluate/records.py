"""Raw records of a run, shared by simulations and live replays; docs/metrics.md defines each metric."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CallRecord:
    session_id: str
    call_index: int
    prompt_tokens: int
    output_tokens: int
    released_s: float
    prefill_start_s: float | None = None
    cached_tokens: int = 0  # prefix-cache hit (GPU or host tier) at prefill start
    prefill_done_s: float | None = None
    uncached_tokens: int = 0  # prompt tokens prefill computed
    first_token_s: float | None = None
    done_s: float | None = None
    itl_violating_steps: float = 0.0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.released_s


@dataclass(slots=True)
class SessionRecord:
    session_id: str
    arrival_s: float
    reference_s: float  # unloaded session time (slowdown's denominator)
    warm: bool = False
    in_surge: bool = False
    first_call_s: float | None = None  # first call released to the engine (after any parking)
    first_token_s: float | None = None
    done_s: float | None = None
    outcome: str = "unfinished"  # completed, shed, rejected, terminated, failed (replay errors), unfinished
    decode_steps: int = 0
    itl_violating_steps: float = 0.0

    @property
    def started(self) -> bool:
        return self.first_token_s is not None

    @property
    def first_call_wait_s(self) -> float | None:
        """Arrival to the first token (§7.1): parking at the gateway and the engine's queues alike, so a
        system that releases a session at once but keeps its first call queued still shows the wait."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    def first_call_wait_until_s(self, end_s: float) -> float | None:
        """The first-call wait, or for a session still waiting at `end_s` (no first token, not refused or
        ended) the wait so far: a lower bound, so a run that never serves its new sessions cannot report
        a short wait by leaving them out. None for sessions refused or ended before their first token."""
        if self.first_token_s is not None:
            return self.first_token_s - self.arrival_s
        if self.outcome == "unfinished":
            return max(0.0, end_s - self.arrival_s)
        return None

    @property
    def admission_wait_s(self) -> float | None:
        """Arrival to the first call's release to the engine (the gateway's part of the wait only)."""
        return None if self.first_call_s is None else self.first_call_s - self.arrival_s

    @property
    def slowdown(self) -> float | None:
        if self.done_s is None or self.reference_s <= 0:
            return None
        return (self.done_s - self.arrival_s) / self.reference_s

    @property
    def itl_violation_share(self) -> float:
        return self.itl_violating_steps / self.decode_steps if self.decode_steps else 0.0


@dataclass(slots=True)
class Sample:
    """Engine and gateway state at one instant (the simulator samples every few seconds). A live replay
    sees only the client's side: it leaves the engine's fields None (not observed)."""

    t: float
    active_sessions: int
    parked_sessions: int
    working_set_tokens: int
    decode_kv_decoding_tokens: int | None = None  # held by requests that are decoding
    decode_kv_waiting_tokens: int | None = None  # reserved by requests awaiting prefill or transfer
    prefill_backlog_tokens: int | None = None
    decode_waiting_requests: int | None = None


@dataclass
class RunRecords:
    """Everything a run recorded; `basin.evaluate.summarize` turns it into metrics."""

    duration_s: float
    calls: list[CallRecord] = field(default_factory=list)
    sessions: list[SessionRecord] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    trigger_s: float | None = None  # surge start, when there is one
    trigger_end_s: float | None = None
    cache_tokens: int = 0  # prefix cache capacity the working set is compared with
