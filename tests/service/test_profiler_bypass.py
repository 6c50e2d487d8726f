"""The profiling Job's ramp through the gateway: with the admin token the operator shares between the two,
its calls carry the bypass header and the gateway neither parks nor counts them; without it the same
ramp is admitted like any client's (here parked, by a profile whose tiny κ engages admission)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from gateway_helpers import TINY_KAPPA_PROFILE, metric, start_emulator, start_gateway

from basin.sim.deployments import get_deployment
from basin.workload import load_workload
from basin.workload.arrivals import StepSchedule
from basin_profiler.job import ramp_headers
from basin_profiler.replay import Replay, ReplayConfig

pytestmark = [pytest.mark.service, pytest.mark.slow]

SCALE = 20.0
TOKEN = "profiler-shared-secret"
PROFILE = TINY_KAPPA_PROFILE  # admission engages at once


def ramp(target: str, headers: dict[str, str]) -> Replay:
    config = ReplayConfig(
        target=target,
        schedule=StepSchedule((8.0,), 10.0),
        reference_gpu=get_deployment("h200-1p1d").gpu,
        api="sglang",
        time_scale=SCALE,
        headers=headers,
    )
    replay = Replay(config, load_workload("terminal-bench", seed=0))
    asyncio.run(replay.run())
    return replay


def test_the_ramp_bypasses_the_gateway_only_with_the_shared_token(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    emulator = start_emulator("--deployment", "h200-1p1d", "--time-scale", f"{SCALE:g}")
    gateway = start_gateway(
        emulator.url,
        "--profile",
        str(profile),
        "--time-scale",
        f"{SCALE:g}",
        env={"BASIN_ADMIN_TOKEN": TOKEN},
    )
    try:
        job_env = {"BASIN_GATEWAY_URL": gateway.url, "BASIN_ADMIN_TOKEN": TOKEN}  # as the operator sets it
        bypassed = ramp(gateway.url, ramp_headers(job_env))
        assert bypassed.counts.answered > 20 and bypassed.counts.failed_requests == 0
        assert bypassed.counts.parked_answers == 0
        assert metric(gateway.url, "basin_gateway_parked_answers_total") == 0
        assert metric(gateway.url, "basin_gateway_sessions_active") == 0  # the gateway kept no session

        admitted = ramp(gateway.url, {})
        assert admitted.counts.parked_answers > 0  # the same ramp, as a client: parked
        # Every 429 the client read, the gateway counted; it may have sent a few more to requests still
        # out when the ramp ended, which the client cancelled unread.
        parked = metric(gateway.url, "basin_gateway_parked_answers_total")
        counts = admitted.counts
        assert counts.parked_answers <= parked <= counts.parked_answers + counts.cut_off
    finally:
        gateway.stop()
        emulator.stop()
    assert "Traceback" not in gateway.text()


def test_the_ramp_sends_the_bypass_only_through_the_gateway_and_with_a_token() -> None:
    gateway = {"BASIN_GATEWAY_URL": "http://x-gateway:8080", "BASIN_ADMIN_TOKEN": TOKEN}
    assert ramp_headers(gateway) == {"X-Basin-Bypass": "1", "X-Basin-Admin-Token": TOKEN}
    assert ramp_headers({**gateway, "BASIN_PROFILE_TARGET": "http://x-router:8000"}) == {}
    assert ramp_headers({**gateway, "BASIN_ADMIN_TOKEN": ""}) == {}
