"""Agent workloads: the session/call model, synthetic generators, the Mooncake trace loader, arrival
processes and the JSONL session file. `load_workload` is the one entry point the CLI and every
component use to turn a user's `--workload` into sessions."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from basin.errors import BasinError, InputFileError
from basin.workload.arrivals import Arrival, RateSchedule, poisson_arrivals, trace_arrivals
from basin.workload.model import Call, Session
from basin.workload.mooncake import load_mooncake, looks_like_trace
from basin.workload.sessionfile import read_sessions, write_sessions
from basin.workload.stats import PUBLISHED, WorkloadStats, compute_stats
from basin.workload.synthetic import PROFILES, generate
from basin.workload.transforms import scale_outputs, scale_tool_time, share_prefix

SYNTHETIC = tuple(PROFILES)

__all__ = [
    "PUBLISHED",
    "SYNTHETIC",
    "Arrival",
    "Call",
    "RateSchedule",
    "Session",
    "WorkloadSpec",
    "WorkloadStats",
    "compute_stats",
    "load_workload",
    "poisson_arrivals",
    "trace_arrivals",
    "write_sessions",
]


def _first_record(path: Path) -> object:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                try:
                    return json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputFileError(str(path), number, f"not valid JSON ({exc.msg})") from None
    raise InputFileError(str(path), None, "the file is empty")


def load_workload(
    spec: str,
    seed: int = 0,
    tool_time_scale: float = 1.0,
    output_scale: float = 1.0,
    sessions: int | None = None,
    shared_prefix: int | None = None,
    resend_outputs: bool = True,
) -> list[Session]:
    """Sessions for `spec`: a synthetic workload name, a session file, or a Mooncake trace (detected
    from its first line). `sessions` limits a synthetic workload's size or a file's first sessions;
    `shared_prefix` opens every session's first prompt with that many tokens all sessions share;
    `resend_outputs` as in `scale_outputs`."""
    if tool_time_scale < 0:
        raise BasinError(f"--tool-time-scale must not be negative, got {tool_time_scale}")
    if output_scale <= 0:
        raise BasinError(f"--output-scale must be positive, got {output_scale}")
    if sessions is not None and sessions < 1:
        raise BasinError(f"--sessions must be at least 1, got {sessions}")
    if shared_prefix is not None and shared_prefix < 0:
        raise BasinError(f"--shared-prefix must not be negative, got {shared_prefix}")
    if spec in PROFILES:
        loaded = generate(spec, seed=seed, sessions=sessions)
    else:
        path = Path(spec)
        if path.is_dir():
            raise BasinError(f"workload {spec!r} is a folder; give a session file or a Mooncake trace")
        if not path.is_file():
            choices = ", ".join(SYNTHETIC)
            raise BasinError(
                f"unknown workload {spec!r}: choose one of {choices},"
                " or give the path of a session file or a Mooncake trace"
            )
        loaded = load_mooncake(path) if looks_like_trace(_first_record(path)) else read_sessions(path)
        if sessions is not None:
            loaded = loaded[:sessions]
    if shared_prefix is not None:
        if any(call.blocks for session in loaded for call in session.calls):
            # The simulator keys such prompts by their blocks: they already say what sessions share.
            raise BasinError(f"--shared-prefix: {spec} names its prompts' blocks (what is shared)")
        loaded = [share_prefix(session, shared_prefix) for session in loaded]
    return [scale_outputs(scale_tool_time(s, tool_time_scale), output_scale, resend_outputs) for s in loaded]


@dataclass(frozen=True)
class WorkloadSpec:
    """A workload as a command names it: `load_workload`'s arguments, to load it where it is needed
    (again in a worker process, for the planner)."""

    spec: str
    seed: int = 0
    tool_time_scale: float = 1.0
    output_scale: float = 1.0
    sessions: int | None = None
    resend_outputs: bool = True

    @property
    def scaled(self) -> bool:
        """Whether a scale knob changes the source's sessions."""
        return self.tool_time_scale != 1 or self.output_scale != 1

    def load(self, shared_prefix: int | None = None) -> list[Session]:
        return load_workload(
            self.spec, self.seed, self.tool_time_scale, self.output_scale, self.sessions, shared_prefix,
            self.resend_outputs,
        )  # fmt: skip
