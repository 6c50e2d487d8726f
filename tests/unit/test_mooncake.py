import itertools
import json
from pathlib import Path

import pytest

from basin.errors import InputFileError
from basin.workload import load_workload
from basin.workload.mooncake import (
    BLOCK_TOKENS,
    ReferenceService,
    chain_requests,
    load_mooncake,
    read_trace,
    sessions_from_trace,
)


def test_each_turn_extends_its_predecessors_full_blocks(mooncake_slice: Path) -> None:
    chains = chain_requests(read_trace(mooncake_slice))
    multi = [c for c in chains if len(c) > 1]
    assert len(multi) > 50, "the slice holds multi-turn conversations"
    for chain in chains:
        for previous, request in itertools.pairwise(chain):
            full = previous.input_length // BLOCK_TOKENS
            assert full >= 2
            assert request.hash_ids[:full] == previous.hash_ids[:full]
            assert len(request.hash_ids) > full
            assert request.timestamp_s >= previous.timestamp_s
    # Every request lands in exactly one session.
    assert sum(len(c) for c in chains) == len(read_trace(mooncake_slice))


def test_sessions_are_ordered_with_non_negative_gaps(mooncake_slice: Path) -> None:
    sessions = load_mooncake(mooncake_slice)
    arrivals = [s.trace_arrival_s for s in sessions]
    assert arrivals == sorted(arrivals)
    for session in sessions:
        session.validate()
        assert all(c.tool_gap_s >= 0 for c in session.calls)
        assert session.calls[-1].tool_gap_s == 0
        assert session.task == ""


def test_gap_is_time_from_expected_end_to_next_turn(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 100, "hash_ids": [7, 1, 2]},
        {"timestamp": 30_000, "input_length": 2100, "output_length": 50, "hash_ids": [7, 1, 3, 4, 5]},
        {"timestamp": 31_000, "input_length": 2600, "output_length": 10, "hash_ids": [7, 1, 3, 4, 6, 8]},
        {"timestamp": 500, "input_length": 700, "output_length": 10, "hash_ids": [7, 9]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    service = ReferenceService(prefill_tokens_per_s=1000.0, decode_s_per_token=0.1)
    sessions = sessions_from_trace(read_trace(path), service)
    assert [len(s.calls) for s in sessions] == [3, 1]
    first, second, third = sessions[0].calls
    assert second.new_tokens == 2100 - 2 * BLOCK_TOKENS
    # 0 s + 1500 new tokens at 1000/s + 100 outputs at 0.1 s = 11.5 s; the next turn comes at 30 s.
    assert first.tool_gap_s == pytest.approx(18.5)
    # 30 s + 1076/1000 + 5 = 36.076 s is after the next turn (31 s): the gap is clamped to zero.
    assert second.tool_gap_s == 0.0
    assert third.carried_tokens == 4 * BLOCK_TOKENS
    assert sessions[1].trace_arrival_s == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("nope", "not valid JSON"),
        ('{"timestamp": 1}', "missing keys"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": [1]}', "input_length"),
        ('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": []}', "hash_ids"),
        ('{"timestamp": 1, "input_length": 1000, "output_length": 1, "hash_ids": [1]}', "expected 2"),
    ],
)
def test_malformed_trace_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "trace.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(InputFileError) as caught:
        load_workload(str(path))
    assert str(caught.value).startswith(f"{path}:2: ")
    assert message in str(caught.value)


def test_limit_reads_only_the_first_requests(mooncake_slice: Path) -> None:
    assert len(read_trace(mooncake_slice, limit=100)) == 100


def test_trace_arrivals_replay_the_traces_own_timestamps(mooncake_slice: Path) -> None:
    """`--arrivals trace`: every session once, at its offset in the trace, no warm start."""
    from basin.sim import Simulation, SimulationConfig, get_deployment
    from basin.sim.policies import build_policy
    from basin.workload import RateSchedule, trace_arrivals

    pool = load_mooncake(mooncake_slice)
    arrivals = trace_arrivals(pool, duration_min=60)
    assert [a.time_s for a in arrivals] == sorted(s.trace_arrival_s for s in pool)
    assert len({a.instance_id for a in arrivals}) == len(pool) and not any(a.warm for a in arrivals)
    early = trace_arrivals(pool, duration_min=2)  # only those starting in the first two minutes
    assert early and all(a.time_s < 120 for a in early) and len(early) < len(pool)

    deployment = get_deployment("h200-1p3d")
    sim = Simulation(
        SimulationConfig(deployment, RateSchedule(base_rate=0, duration_min=15), arrivals="trace"),
        build_policy("hicache", deployment, pool, 0),
        pool,
    )
    sim.run()
    assert sim.warm_sessions == 0
    released = sorted(r.arrival_s for r in sim.records.sessions)
    assert released == sorted(s.trace_arrival_s for s in pool)
    # Every request of the slice starts with block 0 (a shared system prompt): session starts hit it.
    first = [c for c in sim.records.calls if c.call_index == 0 and c.prefill_start_s is not None]
    assert sum(c.cached_tokens >= BLOCK_TOKENS for c in first) >= 0.95 * len(first)
    assert any(c.cached_tokens > BLOCK_TOKENS for c in first)  # branches reuse more than that


def _trace(tmp_path: Path, rows: list[tuple[float, int, list[int]]]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": t * 1000, "input_length": n, "output_length": 8, "hash_ids": ids}) + "\n"
            for t, n, ids in rows
        )
    )
    return path


def test_a_session_start_sharing_blocks_with_an_earlier_request_reuses_them(tmp_path: Path) -> None:
    """A branch (a request extending a turn that already has a successor) starts a new session, and a
    different conversation shares the system-prompt block: both find those blocks cached, where they
    used to start cold on fresh pages."""
    from basin.sim import Simulation, SimulationConfig, get_deployment
    from basin.sim.policies import build_policy
    from basin.workload import RateSchedule

    path = _trace(
        tmp_path,
        [
            (0, 4 * BLOCK_TOKENS, [0, 1, 2, 3]),
            (5, 5 * BLOCK_TOKENS, [0, 1, 2, 3, 4]),  # the conversation's next turn
            (10, 5 * BLOCK_TOKENS, [0, 1, 2, 3, 5]),  # a branch from the first turn: a new session
            (15, 3 * BLOCK_TOKENS, [0, 7, 8]),  # another conversation, same system prompt
        ],
    )
    pool = load_mooncake(path)
    assert [len(s.calls) for s in pool] == [2, 1, 1]
    deployment = get_deployment("h200-1p3d")
    sim = Simulation(
        SimulationConfig(deployment, RateSchedule(base_rate=0, duration_min=2), arrivals="trace"),
        build_policy("hicache", deployment, pool, 0),
        pool,
    )
    sim.run()
    first_calls = {c.session_id: c for c in sim.records.calls if c.call_index == 0}
    branch, other = first_calls[pool[1].session_id], first_calls[pool[2].session_id]
    assert branch.cached_tokens == 4 * BLOCK_TOKENS  # the four blocks it shares with the first turn
    assert other.cached_tokens == BLOCK_TOKENS  # the shared system-prompt block
    assert first_calls[pool[0].session_id].cached_tokens == 0  # the very first request is cold


def test_output_scale_drops_a_traces_block_ids_unless_the_prompts_are_kept(mooncake_slice: Path) -> None:
    """Resent outputs change the prompts the block ids named; kept prompts are still those blocks."""
    resent = load_workload(str(mooncake_slice), output_scale=2.0, sessions=20)
    kept = load_workload(str(mooncake_slice), output_scale=2.0, sessions=20, resend_outputs=False)
    assert not any(call.blocks for session in resent for call in session.calls)
    original = load_workload(str(mooncake_slice), sessions=20)
    assert any(call.blocks for session in original for call in session.calls)
    for before, after in zip(original, kept, strict=True):
        assert [c.blocks for c in after.calls] == [c.blocks for c in before.calls]
        assert [c.output_tokens for c in after.calls] == [2 * c.output_tokens for c in before.calls]
