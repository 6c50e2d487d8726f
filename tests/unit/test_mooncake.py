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
