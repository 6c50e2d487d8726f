"""Rebuild multi-turn agent sessions from the Mooncake conversation trace.

The trace (kvcache-ai/Mooncake, Apache-2.0) has no session ids. Each request lists one hash id per
512-token block of its prompt; a later turn of the same conversation resends the earlier prompt, so its
hash ids extend the earlier request's full blocks (the earlier request's last, partial block changes once
more text follows it). We chain each request to the latest earlier request whose full blocks it extends
the furthest; a request that extends a turn which already has a successor (a branch) or extends nothing
starts a new session.

Each call keeps its hash ids (`Call.blocks`), so the simulator gives equal blocks equal pages: a session
whose first prompt shares blocks with an earlier request (a branch, or the shared system prompt) finds
them cached instead of starting cold. `trace_arrivals` replays the sessions at the trace's own times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from basin.errors import InputFileError
from basin.tokens import common_prefix
from basin.workload.model import Call, Session

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    line: int
    timestamp_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReferenceService:
    """Unloaded service rates used to find when a turn would have ended, so that tool gaps are the
    time from that end to the next turn. `h100()` takes them from the simulator's H100 calibration."""

    prefill_tokens_per_s: float
    decode_s_per_token: float

    @classmethod
    def h100(cls) -> ReferenceService:
        """The H100 engine model's own rates: saturated prefill at the Terminal-Bench median context
        (31K tokens/s, §3) and its batch-one decode step (one copy of the calibration, not a second)."""
        from basin.sim.costs import decode_step_seconds, prefill_seconds
        from basin.sim.deployments import H100
        from basin.workload.stats import PUBLISHED

        median_context = PUBLISHED["terminal-bench"]["median_prompt_tokens"]
        return cls(
            prefill_tokens_per_s=1 / prefill_seconds(H100, 1, median_context),
            decode_s_per_token=decode_step_seconds(H100, 1, median_context),
        )

    def duration_s(self, uncached_tokens: int, output_tokens: int) -> float:
        return uncached_tokens / self.prefill_tokens_per_s + output_tokens * self.decode_s_per_token


def parse_trace_line(line: str, path: str, number: int) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InputFileError(path, number, f"not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise InputFileError(path, number, "a trace line must be a JSON object")
    missing = {"timestamp", "input_length", "output_length", "hash_ids"} - set(record)
    if missing:
        raise InputFileError(path, number, f"missing keys {sorted(missing)}")
    timestamp, input_length = record["timestamp"], record["input_length"]
    output_length, hash_ids = record["output_length"], record["hash_ids"]
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool) or timestamp < 0:
        raise InputFileError(path, number, f"timestamp must be a non-negative number, got {timestamp!r}")
    for name, value, low in (("input_length", input_length, 1), ("output_length", output_length, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise InputFileError(path, number, f"{name} must be an integer >= {low}, got {value!r}")
    if (
        not isinstance(hash_ids, list)
        or not hash_ids
        or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids)
    ):
        raise InputFileError(path, number, "hash_ids must be a non-empty list of integers")
    blocks = -(-input_length // BLOCK_TOKENS)
    if len(hash_ids) != blocks:
        raise InputFileError(
            path,
            number,
            f"{len(hash_ids)} hash_ids for {input_length} tokens;"
            f" expected {blocks} ({BLOCK_TOKENS}-token blocks)",
        )
    return TraceRequest(number, timestamp / 1000.0, input_length, output_length, tuple(hash_ids))


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """Read trace lines (the first `limit` requests, if given), ordered by timestamp."""
    requests = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if limit is not None and len(requests) >= limit:
                break
            if line.strip():
                requests.append(parse_trace_line(line, str(path), number))
    if not requests:
        raise InputFileError(str(path), None, "the trace holds no requests")
    return sorted(requests, key=lambda r: r.timestamp_s)


def chain_requests(requests: list[TraceRequest]) -> list[list[TraceRequest]]:
    """Group requests into conversations by prefix relations of their hash ids."""
    # Map each request's full-block prefix (and full id list) to the latest request that ends there.
    tail_of: dict[tuple[int, ...], int] = {}
    successor: dict[int, int] = {}
    parent: dict[int, int] = {}
    for index, request in enumerate(requests):
        ids = request.hash_ids
        for length in range(len(ids) - 1, 1, -1):  # a shared first block alone is a system prompt
            candidate = tail_of.get(ids[:length])
            if candidate is not None:
                if candidate not in successor:
                    successor[candidate] = index
                    parent[index] = candidate
                break
        full_blocks = request.input_length // BLOCK_TOKENS
        tail_of[ids[:full_blocks]] = index
        tail_of[ids] = index
    chains = []
    for index in range(len(requests)):
        if index in parent:
            continue
        chain = [requests[index]]
        while index in successor:
            index = successor[index]
            chain.append(requests[index])
        chains.append(chain)
    return chains


def sessions_from_trace(
    requests: list[TraceRequest], service: ReferenceService | None = None
) -> list[Session]:
    """Turn chained trace requests into sessions ordered by arrival."""
    service = service or ReferenceService.h100()
    sessions = []
    for chain in chain_requests(requests):
        calls: list[Call] = []
        for position, request in enumerate(chain):
            if position == 0:
                new = request.input_length
            else:
                previous = chain[position - 1]
                carried = common_prefix(previous.hash_ids, request.hash_ids) * BLOCK_TOKENS
                carried = min(carried, request.input_length, previous.input_length + previous.output_length)
                new = request.input_length - carried
            gap = 0.0
            if position + 1 < len(chain):
                end = request.timestamp_s + service.duration_s(new, request.output_length)
                gap = round(max(0.0, chain[position + 1].timestamp_s - end), 4)
            calls.append(Call(request.input_length, new, request.output_length, gap, request.hash_ids))
        first = chain[0]
        sessions.append(
            Session(
                session_id=f"mc-{first.line:06d}",
                task="",
                calls=tuple(calls),
                workload="mooncake",
                trace_arrival_s=first.timestamp_s,
            )
        )
    return sessions


def load_mooncake(
    path: str | Path, limit: int | None = None, service: ReferenceService | None = None
) -> list[Session]:
    """Load a Mooncake conversation trace as sessions (`limit`: read only the first requests)."""
    return sessions_from_trace(read_trace(path, limit), service)


def looks_like_trace(record: object) -> bool:
    return isinstance(record, dict) and "hash_ids" in record
