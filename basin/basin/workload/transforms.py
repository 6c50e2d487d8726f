"""Sensitivity knobs applied to any workload (paper §7: tool time and output length scaled ×3)."""

from __future__ import annotations

from dataclasses import replace

from basin.workload.model import Call, Session


def scale_tool_time(session: Session, factor: float) -> Session:
    """Multiply every tool gap by `factor`."""
    if factor < 0:
        raise ValueError(f"tool-time scale must not be negative, got {factor}")
    if factor == 1:
        return session
    calls = tuple(replace(c, tool_gap_s=c.tool_gap_s * factor) for c in session.calls)
    return replace(session, calls=calls)


def scale_outputs(session: Session, factor: float, resend: bool = True) -> Session:
    """Multiply output lengths by `factor` (a non-empty output keeps at least one token).

    With `resend`, later prompts resend the outputs, so each prompt grows by the extra output tokens of
    all earlier calls; the new suffixes stay as they were. Without it only the outputs change: the extra
    tokens are reasoning the agent does not resend, or a replay that keeps the recorded prompts (what
    the paper's outputs x3 profile fits, docs/simulator.md); a trace keeps its block ids.
    """
    if factor <= 0:
        raise ValueError(f"output scale must be positive, got {factor}")
    if factor == 1:
        return session

    def scaled(tokens: int) -> int:
        return max(1, round(tokens * factor)) if tokens else 0

    if not resend:
        return replace(
            session, calls=tuple(replace(c, output_tokens=scaled(c.output_tokens)) for c in session.calls)
        )
    calls: list[Call] = []
    extra = 0
    for call in session.calls:
        output = scaled(call.output_tokens)
        prompt = call.prompt_tokens + extra
        new = prompt if not calls else call.new_tokens
        # A trace's block ids go: the prompts they named no longer exist once the outputs change.
        calls.append(
            Call(prompt_tokens=prompt, new_tokens=new, output_tokens=output, tool_gap_s=call.tool_gap_s)
        )
        extra += output - call.output_tokens
    return replace(session, calls=tuple(calls))


def share_prefix(session: Session, tokens: int) -> Session:
    """Open the session's first prompt with the workload's shared prefix of `tokens` tokens (a system
    prompt and tool schema every session sends alike); a shorter first prompt is all shared prefix."""
    if tokens < 0:
        raise ValueError(f"shared prefix must not be negative, got {tokens}")
    return replace(session, shared_prefix_tokens=min(tokens, session.first_prompt_tokens))
