"""The session/call model every part of Basin shares.

An agent session is a sequence of model calls separated by tool runs. Each call resends the
conversation so far, so a call's prompt is a prefix carried over from the previous call (its prompt and
its output) plus a new suffix that no earlier call of the session has seen.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Call:
    """One model call of a session.

    `new_tokens` is the suffix of the prompt that is not a prefix carried over from the previous call's
    prompt and output; for the first call of a session it is the whole prompt. New tokens are never
    cached by their own session, but a first prompt can begin with the workload's shared prefix
    (`Session.shared_prefix_tokens`), which other sessions have sent before. `tool_gap_s` is the time
    from this call's response to the release of the next call (0 for the last call).
    """

    prompt_tokens: int
    new_tokens: int
    output_tokens: int
    tool_gap_s: float = 0.0
    # Content ids of the prompt's blocks, when the source trace gives them (Mooncake: one per 512
    # tokens). Equal ids are equal content, so prompts of different sessions share those pages.
    blocks: tuple[int, ...] = ()

    @property
    def carried_tokens(self) -> int:
        """Prompt tokens repeated from the previous call (its prompt and output)."""
        return self.prompt_tokens - self.new_tokens

    @property
    def context_tokens(self) -> int:
        """Context held at the end of this call: prompt plus output."""
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Session:
    """One agent trajectory: a task text and its calls in order."""

    session_id: str
    task: str
    calls: tuple[Call, ...]
    workload: str = ""
    # Offset of the session's arrival in its source trace, when it came from one (Mooncake); synthetic
    # sessions have none and get their arrival from an arrival process.
    trace_arrival_s: float | None = None
    # Leading tokens of the first prompt that every session of `workload` sends alike (the agent's system
    # prompt and tool schema): equal content across sessions, so one session's copy in the cache serves
    # every other session's first call.
    shared_prefix_tokens: int = 0

    @property
    def peak_context_tokens(self) -> int:
        """The largest context the session reaches: the target the peak-context predictor learns."""
        return max(call.context_tokens for call in self.calls)

    @property
    def first_prompt_tokens(self) -> int:
        return self.calls[0].prompt_tokens

    def validate(self) -> None:
        """Raise ValueError if the calls break the carried-prefix invariants."""
        if not self.session_id:
            raise ValueError("session_id is empty")
        if not self.calls:
            raise ValueError(f"session {self.session_id!r} has no calls")
        if not 0 <= self.shared_prefix_tokens <= self.calls[0].prompt_tokens:
            raise ValueError(
                f"session {self.session_id!r}: shared_prefix_tokens must be between 0 and the first prompt"
                f" ({self.calls[0].prompt_tokens}), got {self.shared_prefix_tokens}"
            )
        previous: Call | None = None
        for index, call in enumerate(self.calls):
            where = f"session {self.session_id!r} call {index}"
            if call.prompt_tokens < 1:
                raise ValueError(f"{where}: prompt_tokens must be at least 1, got {call.prompt_tokens}")
            if call.output_tokens < 0:
                raise ValueError(f"{where}: output_tokens must not be negative, got {call.output_tokens}")
            if not 0 <= call.new_tokens <= call.prompt_tokens:
                raise ValueError(
                    f"{where}: new_tokens must be between 0 and prompt_tokens ({call.prompt_tokens}),"
                    f" got {call.new_tokens}"
                )
            if call.tool_gap_s < 0:
                raise ValueError(f"{where}: tool_gap_s must not be negative, got {call.tool_gap_s}")
            if previous is None:
                if call.new_tokens != call.prompt_tokens:
                    raise ValueError(
                        f"{where}: the first call has no predecessor, so new_tokens must equal"
                        f" prompt_tokens ({call.prompt_tokens}), got {call.new_tokens}"
                    )
            elif call.carried_tokens > previous.context_tokens:
                raise ValueError(
                    f"{where}: carries {call.carried_tokens} tokens but the previous call's prompt and"
                    f" output hold only {previous.context_tokens}"
                )
            previous = call
