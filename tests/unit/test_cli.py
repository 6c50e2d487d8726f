"""The `basin` command as a user runs it: a real subprocess, exit codes and output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from basin.workload import PUBLISHED


def basin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "basin", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_stats_json_meets_published_targets() -> None:
    result = basin("workload", "stats", "--workload", "terminal-bench", "--seed", "1", "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    for key in (
        "sessions",
        "calls_per_session",
        "median_prompt_tokens",
        "p90_prompt_tokens",
        "repeated_prompt_fraction",
        "median_output_tokens",
        "median_tool_gap_s",
        "median_peak_context_tokens",
    ):
        assert key in stats
    for key, target in PUBLISHED["terminal-bench"].items():
        assert stats[key] == pytest.approx(target, rel=0.10), key


def test_stats_table_shows_paper_column() -> None:
    result = basin("workload", "stats", "--workload", "swe-pro")
    assert result.returncode == 0, result.stderr
    assert "median_peak_context_tokens" in result.stdout
    assert "107,000" in result.stdout


def test_export_then_stats_reads_the_file(tmp_path: Path) -> None:
    out = tmp_path / "tb.jsonl"
    result = basin(
        "workload",
        "export",
        "--workload",
        "terminal-bench",
        "--seed",
        "3",
        "--sessions",
        "25",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert len(out.read_text().splitlines()) == 25
    stats = json.loads(basin("workload", "stats", "--workload", str(out), "--json").stdout)
    direct = json.loads(
        basin(
            "workload", "stats", "--workload", "terminal-bench", "--seed", "3", "--sessions", "25", "--json"
        ).stdout
    )
    assert stats["median_prompt_tokens"] == direct["median_prompt_tokens"]
    assert stats["sessions"] == 25


def test_every_subcommand_has_help() -> None:
    for args in ([], ["workload"], ["workload", "stats"], ["workload", "export"]):
        result = basin(*args, "--help")
        assert result.returncode == 0 and "Usage:" in result.stdout, args


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["workload", "stats", "--workload", "terminal-bnech"], "choose one of terminal-bench, swe-pro"),
        (["workload", "stats", "--workload", "swe-pro", "--output-scale", "0"], "--output-scale"),
        (["workload", "stats", "--workload", "swe-pro", "--sessions", "0"], "--sessions"),
        (["workload", "stats"], "Missing option '--workload'"),
    ],
)
def test_user_errors_exit_nonzero_without_traceback(args: list[str], message: str) -> None:
    result = basin(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_file_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"session_id": "a", "calls": [{"prompt_tokens": 5, "new_tokens": 5, "output_tokens": 1}]}'
    path.write_text(good + '\n{"session_id": "b", "calls": [{"prompt_tokens": -5}]}\n')
    result = basin("workload", "stats", "--workload", str(path))
    assert result.returncode == 2
    assert f"{path}:2:" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreadable_output_path_is_a_clean_error(tmp_path: Path) -> None:
    result = basin("workload", "export", "--workload", "swe-pro", "--out", str(tmp_path / "no" / "x.jsonl"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
