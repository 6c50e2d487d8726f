"""Workload statistics, defined once, and the paper's published values they are checked against."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from basin.workload.model import Session


@dataclass(frozen=True)
class WorkloadStats:
    """Statistics of a set of sessions; docs/workloads.md gives the formula of each."""

    sessions: int
    calls: int
    calls_per_session: float
    median_prompt_tokens: float
    p90_prompt_tokens: float
    repeated_prompt_fraction: float
    median_output_tokens: float
    median_tool_gap_s: float
    median_peak_context_tokens: float
    median_first_prompt_tokens: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def compute_stats(sessions: Sequence[Session]) -> WorkloadStats:
    """Per-call statistics pool all calls of all sessions (as the paper's Fig. 3 does).

    The repeated fraction counts calls that have a predecessor: carried tokens over prompt tokens.
    Tool gaps count every gap that releases a next call (the last call of a session has none).
    """
    if not sessions:
        raise ValueError("no sessions to summarize")
    prompts = np.array([c.prompt_tokens for s in sessions for c in s.calls], dtype=float)
    outputs = np.array([c.output_tokens for s in sessions for c in s.calls], dtype=float)
    gaps = np.array([c.tool_gap_s for s in sessions for c in s.calls[:-1]], dtype=float)
    later = [c for s in sessions for c in s.calls[1:]]
    later_prompt = sum(c.prompt_tokens for c in later)
    repeated = sum(c.carried_tokens for c in later) / later_prompt if later_prompt else 0.0
    return WorkloadStats(
        sessions=len(sessions),
        calls=int(prompts.size),
        calls_per_session=prompts.size / len(sessions),
        median_prompt_tokens=float(np.median(prompts)),
        p90_prompt_tokens=float(np.percentile(prompts, 90)),
        repeated_prompt_fraction=repeated,
        median_output_tokens=float(np.median(outputs)),
        median_tool_gap_s=float(np.median(gaps)) if gaps.size else 0.0,
        median_peak_context_tokens=float(np.median([s.peak_context_tokens for s in sessions])),
        median_first_prompt_tokens=float(np.median([s.first_prompt_tokens for s in sessions])),
    )


# Published statistics (paper §3 Fig. 3 and §7.1; DESIGN.md). Keys are WorkloadStats fields.
PUBLISHED: dict[str, dict[str, float]] = {
    "terminal-bench": {
        "sessions": 216,
        "calls_per_session": 7108 / 216,
        "median_prompt_tokens": 25_600,
        "p90_prompt_tokens": 77_000,
        "repeated_prompt_fraction": 0.982,
        "median_output_tokens": 160,
        "median_tool_gap_s": 0.42,
        "median_peak_context_tokens": 40_000,
    },
    "swe-pro": {
        "sessions": 70,
        "median_prompt_tokens": 83_000,
        "median_tool_gap_s": 0.048,
        "median_peak_context_tokens": 107_000,
    },
}
