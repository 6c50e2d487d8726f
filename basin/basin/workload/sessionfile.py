"""The JSONL session file: one session per line, read by the simulator, the replay client, the
profiler and the predictor. docs/session-file.md documents the format."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from basin.errors import InputFileError
from basin.workload.model import Call, Session

FORMAT_VERSION = 1
_SESSION_KEYS = {
    "v",
    "session_id",
    "workload",
    "task",
    "trace_arrival_s",
    "peak_context_tokens",
    "calls",
    "shared_prefix_tokens",
}
_CALL_KEYS = {"prompt_tokens", "new_tokens", "output_tokens", "tool_gap_s", "blocks"}


def session_to_dict(session: Session) -> dict[str, Any]:
    record: dict[str, Any] = {
        "v": FORMAT_VERSION,
        "session_id": session.session_id,
        "workload": session.workload,
        "task": session.task,
        "peak_context_tokens": session.peak_context_tokens,
        "calls": [
            {
                "prompt_tokens": c.prompt_tokens,
                "new_tokens": c.new_tokens,
                "output_tokens": c.output_tokens,
                "tool_gap_s": c.tool_gap_s,
            }
            | ({"blocks": list(c.blocks)} if c.blocks else {})
            for c in session.calls
        ],
    }
    if session.trace_arrival_s is not None:
        record["trace_arrival_s"] = session.trace_arrival_s
    if session.shared_prefix_tokens:
        record["shared_prefix_tokens"] = session.shared_prefix_tokens
    return record


def write_sessions(sessions: Iterable[Session], out: TextIO) -> int:
    """Write sessions as JSONL; returns how many were written."""
    count = 0
    for session in sessions:
        out.write(json.dumps(session_to_dict(session), separators=(",", ":")) + "\n")
        count += 1
    return count


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def session_from_dict(record: Any) -> Session:
    """Parse and validate one session record; raises ValueError naming what is wrong."""
    if not isinstance(record, dict):
        raise ValueError("a session line must be a JSON object")
    unknown = set(record) - _SESSION_KEYS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)}; expected some of {sorted(_SESSION_KEYS)}")
    version = record.get("v", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ValueError(
            f"session format version {version!r} is not supported (this Basin reads version {FORMAT_VERSION})"
        )
    for key in ("session_id", "calls"):
        if key not in record:
            raise ValueError(f"missing required key {key!r}")
    session_id, task = record["session_id"], record.get("task", "")
    if not isinstance(session_id, str) or not isinstance(task, str):
        raise ValueError("session_id and task must be strings")
    raw_calls = record["calls"]
    if not isinstance(raw_calls, list) or not raw_calls:
        raise ValueError("calls must be a non-empty list")
    calls = []
    for index, raw in enumerate(raw_calls):
        if not isinstance(raw, dict):
            raise ValueError(f"call {index} must be a JSON object")
        missing = _CALL_KEYS - {"tool_gap_s", "blocks"} - set(raw)
        if missing or set(raw) - _CALL_KEYS:
            raise ValueError(
                f"call {index} must have keys {sorted(_CALL_KEYS)} (tool_gap_s and blocks optional),"
                f" got {sorted(raw)}"
            )
        blocks = raw.get("blocks", [])
        if not isinstance(blocks, list):
            raise ValueError(f"call {index} blocks must be a list of integers, got {blocks!r}")
        calls.append(
            Call(
                prompt_tokens=_integer(raw["prompt_tokens"], f"call {index} prompt_tokens"),
                new_tokens=_integer(raw["new_tokens"], f"call {index} new_tokens"),
                output_tokens=_integer(raw["output_tokens"], f"call {index} output_tokens"),
                tool_gap_s=_number(raw.get("tool_gap_s", 0.0), f"call {index} tool_gap_s"),
                blocks=tuple(_integer(b, f"call {index} blocks") for b in blocks),
            )
        )
    arrival = record.get("trace_arrival_s")
    session = Session(
        session_id=session_id,
        task=task,
        calls=tuple(calls),
        workload=str(record.get("workload", "")),
        trace_arrival_s=None if arrival is None else _number(arrival, "trace_arrival_s"),
        shared_prefix_tokens=_integer(record.get("shared_prefix_tokens", 0), "shared_prefix_tokens"),
    )
    session.validate()
    if "peak_context_tokens" in record and record["peak_context_tokens"] != session.peak_context_tokens:
        raise ValueError(
            f"peak_context_tokens is {record['peak_context_tokens']!r} but the calls reach"
            f" {session.peak_context_tokens}"
        )
    return session


def iter_sessions(path: str | Path) -> Iterator[Session]:
    """Read a session file lazily; a bad line raises InputFileError naming the file and line."""
    seen: set[str] = set()
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                session = session_from_dict(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InputFileError(str(path), number, f"not valid JSON ({exc.msg})") from None
            except ValueError as exc:
                raise InputFileError(str(path), number, str(exc)) from None
            if session.session_id in seen:
                raise InputFileError(str(path), number, f"duplicate session_id {session.session_id!r}")
            seen.add(session.session_id)
            yield session


def read_sessions(path: str | Path) -> list[Session]:
    sessions = list(iter_sessions(path))
    if not sessions:
        raise InputFileError(str(path), None, "the file holds no sessions")
    return sessions
