"""`basin up`, as a user runs it: the emulator, the gateway on a throwaway Redis and the surge replay,
ending with the replay's summary."""

from __future__ import annotations

import subprocess

import pytest
from gateway_helpers import BASIN

pytestmark = pytest.mark.service


def test_up_runs_the_local_stack_end_to_end() -> None:
    result = subprocess.run(
        [BASIN, "up", "--duration-min", "16", "--time-scale", "60", "--deployment", "h200-1p1d"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Redis at 127.0.0.1:" in result.stdout  # the service tests' machines have redis-server
    assert "the replay, as the client saw it" in result.stdout
    summary = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in result.stdout.splitlines()
        if line.count("│") == 3
    }
    assert int(summary["requests"]) > 0
    assert 0.0 < float(summary["completed_fraction"]) <= 1.0


def test_up_refuses_a_replay_shorter_than_its_surge() -> None:
    command = [BASIN, "up", "--duration-min", "10"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode != 0
    assert "at least 16" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
