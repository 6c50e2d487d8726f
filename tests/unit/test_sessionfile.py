import io
import json
from pathlib import Path

import pytest

from basin.errors import InputFileError
from basin.workload import load_workload
from basin.workload.sessionfile import read_sessions, session_to_dict, write_sessions
from basin.workload.synthetic import generate
from basin.workload.transforms import share_prefix


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "sessions.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _good_line(session_id: str = "s-1") -> str:
    return json.dumps(
        {
            "session_id": session_id,
            "task": "Fix it.",
            "calls": [
                {"prompt_tokens": 100, "new_tokens": 100, "output_tokens": 10, "tool_gap_s": 0.5},
                {"prompt_tokens": 130, "new_tokens": 20, "output_tokens": 5},
            ],
        }
    )


def test_round_trip_preserves_every_field(tmp_path: Path) -> None:
    sessions = [share_prefix(s, 4_000) for s in generate("terminal-bench", seed=2, sessions=30)]
    buffer = io.StringIO()
    assert write_sessions(sessions, buffer) == 30
    path = _write(tmp_path, buffer.getvalue().splitlines())
    assert read_sessions(path) == sessions
    assert load_workload(str(path)) == sessions


def test_mooncake_sessions_round_trip_with_arrival(tmp_path: Path, mooncake_slice: Path) -> None:
    sessions = load_workload(str(mooncake_slice))
    buffer = io.StringIO()
    write_sessions(sessions, buffer)
    assert read_sessions(_write(tmp_path, buffer.getvalue().splitlines())) == sessions


def test_optional_fields_default(tmp_path: Path) -> None:
    (session,) = read_sessions(_write(tmp_path, [_good_line()]))
    assert session.calls[1].tool_gap_s == 0.0
    assert session.peak_context_tokens == 135
    assert session_to_dict(session)["peak_context_tokens"] == 135


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"session_id": "x"}', "missing required key 'calls'"),
        ('{"session_id": "x", "calls": []}', "non-empty list"),
        (
            '{"session_id": "x", "calls": [{"prompt_tokens": 10, "new_tokens": 5, "output_tokens": 1}]}',
            "first call",
        ),
        (
            '{"session_id": "x", "calls": [{"prompt_tokens": 10, "new_tokens": 10, "output_tokens": -1}]}',
            "must not be negative",
        ),
        (
            '{"session_id": "x", "calls": [{"prompt_tokens": 10, "new_tokens": 10, "output_tokens": 1,'
            ' "tool_gap_s": -2}]}',
            "tool_gap_s must not be negative",
        ),
        (
            '{"session_id": "x", "calls": [{"prompt_tokens": "10", "new_tokens": 10, "output_tokens": 1}]}',
            "must be an integer",
        ),
        (
            '{"session_id": "x", "calls": [{"prompt_tokens": 10, "new_tokens": 10, "output_tokens": 1},'
            ' {"prompt_tokens": 50, "new_tokens": 5, "output_tokens": 1}]}',
            "previous call's prompt and output",
        ),
        (
            '{"session_id": "x", "v": 9,'
            ' "calls": [{"prompt_tokens": 1, "new_tokens": 1, "output_tokens": 1}]}',
            "version 9 is not supported",
        ),
        ('{"session_id": "x", "extra": 1, "calls": []}', "unknown keys"),
        (
            '{"session_id": "x", "shared_prefix_tokens": 11, "calls": [{"prompt_tokens": 10,'
            ' "new_tokens": 10, "output_tokens": 1}]}',
            "shared_prefix_tokens must be between 0 and the first prompt",
        ),
        (
            '{"session_id": "x", "shared_prefix_tokens": 2.5, "calls": [{"prompt_tokens": 10,'
            ' "new_tokens": 10, "output_tokens": 1}]}',
            "shared_prefix_tokens must be an integer",
        ),
        (
            '{"session_id": "x", "peak_context_tokens": 5, "calls": [{"prompt_tokens": 10, "new_tokens": 10,'
            ' "output_tokens": 1}]}',
            "peak_context_tokens is 5",
        ),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path, [_good_line("a"), "", bad])
    with pytest.raises(InputFileError) as caught:
        read_sessions(path)
    assert caught.value.line == 3
    assert str(caught.value).startswith(f"{path}:3: ")
    assert message in str(caught.value)


def test_duplicate_session_ids_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match=":2: duplicate session_id 's-1'"):
        read_sessions(_write(tmp_path, [_good_line(), _good_line()]))


def test_empty_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(InputFileError, match="no sessions"):
        read_sessions(path)
