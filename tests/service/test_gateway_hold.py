"""Parked calls held open (`--hold-parked`) for clients that cannot retry: the same replay through a
gateway whose tiny κ parks at once, answered 429 at once, then held. Held calls are asked again after
each control step and forwarded once admitted; only a hold that runs out answers 429."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import requests
from gateway_helpers import (
    TINY_KAPPA_PROFILE,
    metric,
    replay_command,
    start_emulator,
    start_gateway,
    wait_for,
)

pytestmark = [pytest.mark.service, pytest.mark.slow]

SCALE = "20"
HOLD_S = 20.0  # wall seconds: 400 model seconds at x20


def run(tmp: Path, *hold: str) -> tuple[dict, float, float]:
    """A cold 10-minute replay at 6 sessions/min; its result, and the gateway's 429s and rechecks."""
    profile = tmp / "profile.json"
    profile.write_text(json.dumps(TINY_KAPPA_PROFILE))
    emulator = start_emulator("--deployment", "h200-1p1d", "--time-scale", SCALE)
    gateway = start_gateway(emulator.url, "--profile", str(profile), "--time-scale", SCALE, *hold)
    try:
        out = tmp / f"replay{len(hold)}.json"
        scenario = ("--base-rate", "6", "--duration-min", "10", "--seed", "1", "--warm-sessions", "0")
        command = replay_command(gateway.url, SCALE, out, *scenario)
        replay = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        assert replay.returncode == 0, replay.stdout + replay.stderr
        parked = metric(gateway.url, "basin_gateway_parked_answers_total")
        rechecks = metric(gateway.url, "basin_gateway_hold_rechecks_total")
        assert metric(gateway.url, "basin_gateway_held_calls") == 0  # every hold ended with its call
        return json.loads(out.read_text()), parked, rechecks
    finally:
        gateway.stop()
        emulator.stop()
        assert "Traceback" not in gateway.text()


def test_held_calls_are_forwarded_once_admitted_instead_of_answered_429(tmp_path: Path) -> None:
    plain, plain_429, plain_rechecks = run(tmp_path)
    held, held_429, held_rechecks = run(tmp_path, "--hold-parked", f"{HOLD_S:g}")
    for result in (plain, held):
        assert result["connection_errors"] == 0 and result["failed_requests"] == 0, result["first_errors"]
        assert result["answered"] > 20
    assert plain_429 > 20 and plain_rechecks == 0  # admission parked, and nothing was held
    assert held_rechecks > 0  # held calls were asked again, step after step
    # The client sees a 429 only where a hold ran out: far fewer than one per control step.
    assert held["parked_answers"] <= held_429 <= held["parked_answers"] + held["cut_off"]  # answers read
    assert held_429 < plain_429 / 3, (held_429, plain_429)
    assert held["measured_sessions"] == plain["measured_sessions"]  # the same arrivals


def test_a_client_that_leaves_while_held_ends_its_session(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(TINY_KAPPA_PROFILE))
    emulator = start_emulator("--deployment", "h200-1p1d", "--time-scale", SCALE)
    gateway = start_gateway(
        emulator.url, "--profile", str(profile), "--time-scale", SCALE, "--hold-parked", "60"
    )
    try:
        # Sessions arrive one by one until admission engages and parks one: its client gives up waiting.
        body = {"input_ids": list(range(30_000)), "sampling_params": {"max_new_tokens": 1}}
        held = None
        for n in range(40):
            try:
                answer = requests.post(
                    f"{gateway.url}/generate", json=body, headers={"X-Session-ID": f"s{n}"}, timeout=3
                )
            except requests.Timeout:
                held = n
                break
            assert answer.status_code == 200
            time.sleep(0.5)  # a control step (5 model seconds while busy) between arrivals
        assert held is not None, "admission never parked a first call"
        active = metric(gateway.url, "basin_gateway_sessions_active")
        wait_for(lambda: metric(gateway.url, "basin_gateway_held_calls") == 0, "the hold released", 30)
        assert metric(gateway.url, "basin_gateway_hold_rechecks_total") >= 1  # it was held, and asked again
        assert metric(gateway.url, "basin_gateway_parked_answers_total") == 0  # never answered 429
        assert metric(gateway.url, "basin_gateway_sessions_parked") == 0  # b's parked entry went with it
        assert metric(gateway.url, "basin_gateway_sessions_active") == active  # the residents stay
    finally:
        gateway.stop()
        emulator.stop()
    assert "Traceback" not in gateway.text()
