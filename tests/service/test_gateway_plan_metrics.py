"""`basin_plan_*` on a running gateway's `/metrics` (leader of two replicas on a real redis-server, in
front of the emulator): the plan's figures for the profile in force appear once the load is measured,
and a burst of new sessions brings the cliff closer and the recoverable surge down."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from gateway_helpers import Process, metric, start_emulator, start_gateway, start_redis, wait_for

pytestmark = pytest.mark.service

SCALE = "20"
# An H200 1P1D with a 2x host tier as `basin profile` would write it (κ, capacities, prefill rate).
PROFILE = {
    "kappa": 1.0,
    "lambda_c_per_min": 13.0,
    "prefill_gpu_tokens": 2_180_000,
    "host_tokens": 4_360_000,
    "decode_kv_tokens": 3_320_000,
    "prefill_tokens_per_s": 56_000.0,
    "prefill_replicas": 1,
    "decode_replicas": 1,
    "gpu": "h200",
    "workload": "terminal-bench",
    "profiled_at": "2026-12-01T10:00:00Z",
    "fingerprint": "plan-test",
}
PLAN = (
    "basin_plan_arrival_rate_per_min",
    "basin_plan_sessions",
    "basin_plan_departure_peak_per_min",
    "basin_plan_rate_headroom_per_min",
    "basin_plan_cliff_headroom_sessions",
)


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[Process, Process]]:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    started: list[Process] = []
    try:
        emulator = start_emulator("--deployment", "h200-1p1d", "--time-scale", SCALE)
        started.append(emulator)
        server = start_redis(tmp_path)
        started.append(server)
        common = ["--profile", str(profile), "--policy", "passthrough", "--time-scale", SCALE,
                  "--redis", server.url, "--idle-timeout", "100000"]  # fmt: skip
        leader = start_gateway(emulator.url, *common)
        started.append(leader)
        wait_for(lambda: metric(leader.url, "basin_gateway_leader") == 1, "the first replica's lease")
        follower = start_gateway(emulator.url, *common)
        started.append(follower)
        yield leader, follower
    finally:
        for process in reversed(started):
            process.stop()
    for process in started[2:]:
        assert "Traceback" not in process.text()


def plan_figures(url: str) -> dict[str, float]:
    """The basin_plan_* samples of one scrape (labelled ones keyed with their labels)."""
    values = {}
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("basin_plan_"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def first_calls(url: str, sessions: list[str]) -> None:
    def one(sid: str) -> int:
        body = {"text": f"task {sid}", "sampling_params": {"max_new_tokens": 2}}
        answer = requests.post(f"{url}/generate", json=body, headers={"X-Session-ID": sid}, timeout=60)
        return answer.status_code

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, sessions)) == [200] * len(sessions)


def settled(url: str, sessions: int) -> dict[str, float]:
    """The figures once they are computed from `sessions` active sessions."""
    box: dict[str, dict[str, float]] = {}

    def ready() -> bool:
        box["f"] = plan_figures(url)
        return box["f"].get("basin_plan_sessions") == sessions and all(name in box["f"] for name in PLAN)

    wait_for(ready, f"basin_plan_* from {sessions} sessions", timeout=60)
    return box["f"]


def test_plan_figures_follow_the_load_on_the_deciding_replica(replicas: tuple[Process, Process]) -> None:
    leader, follower = replicas
    info = 'basin_plan_info{capacities="profile",gpu="h200",split="1P1D",workload="terminal-bench"}'
    wait_for(lambda: plan_figures(leader.url).get(info) == 1.0, "the model of the profile in force")

    first_calls(leader.url, ["calm-1", "calm-2"])
    calm = settled(leader.url, 2)
    surge = 'basin_plan_recoverable_surge_factor{minutes="10"}'
    assert calm["basin_plan_arrival_rate_per_min"] > 0 and calm[surge] > 1
    # The model's departure peak for this profile (`basin plan --profile` on the same file gives it).
    assert 10 < calm["basin_plan_departure_peak_per_min"] < 20
    assert calm["basin_plan_rate_headroom_per_min"] == pytest.approx(
        calm["basin_plan_departure_peak_per_min"] - calm["basin_plan_arrival_rate_per_min"]
    )

    first_calls(leader.url, [f"burst-{i}" for i in range(40)])
    busy = settled(leader.url, 42)
    print(f"calm: {calm}\nbusy: {busy}")
    assert busy["basin_plan_arrival_rate_per_min"] > calm["basin_plan_arrival_rate_per_min"]
    assert busy["basin_plan_rate_headroom_per_min"] < calm["basin_plan_rate_headroom_per_min"]
    assert busy["basin_plan_cliff_headroom_sessions"] < calm["basin_plan_cliff_headroom_sessions"]
    assert not math.isinf(busy["basin_plan_cliff_headroom_sessions"])
    assert busy[surge] < calm[surge]
    assert busy['basin_plan_recoverable_surge_factor{minutes="20"}'] <= busy[surge]
    assert busy["basin_plan_departure_peak_per_min"] == calm["basin_plan_departure_peak_per_min"]
    assert busy["basin_plan_cliff_headroom_sessions"] == busy["basin_plan_cliff_sessions"] - 42

    # The follower's brain sees no arrivals: it publishes no figures rather than a false calm.
    assert metric(follower.url, "basin_gateway_leader") == 0
    assert not any(key.startswith("basin_plan_") for key in plan_figures(follower.url))
