"""Two gateway replicas sharing a real redis-server: a Redis restart mid-run, and the leader killed mid-run.

A profile with a tiny κ makes admission engage under a light replay, so the budget B is live (and
moving) when things fail."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from gateway_helpers import (
    TINY_KAPPA_PROFILE,
    Process,
    RoundRobin,
    metric,
    replay_command,
    start_emulator,
    start_redis,
    start_replicas,
    wait_for,
)

pytestmark = pytest.mark.service

SCALE = "20"
TTL = 1.0
PROFILE = TINY_KAPPA_PROFILE
B0 = 0.9 * 0.02 * 1.9 * 1_000_000  # m·κ·x_k·C


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[Process, Process, list[Process]]]:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    started: list[Process] = []  # stopped whatever fails, even while starting
    try:
        emulator = start_emulator("--deployment", "h200-1p1d", "--time-scale", SCALE)
        started.append(emulator)
        server = start_redis(tmp_path)
        started.append(server)
        common = [
            "--profile",
            str(profile),
            "--time-scale",
            SCALE,
            "--redis",
            server.url,
            "--lease-ttl",
            str(TTL),
        ]
        gateways = start_replicas(emulator.url, *common)
        started.extend(gateways)
        yield emulator, server, gateways
    finally:
        for process in reversed(started):
            process.stop()


def replay(target: str, out: Path) -> subprocess.Popen[str]:
    args = replay_command(target, SCALE, out, "--base-rate", "4", "--duration-min", "10", "--seed", "3")
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished(process: subprocess.Popen[str], out: Path) -> dict:
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output
    result = json.loads(out.read_text())
    assert result["connection_errors"] == 0 and result["failed_requests"] == 0, result["first_errors"]
    assert result["answered"] > 20  # a real run (on a loaded machine fewer calls complete in the time)
    return result


def leader_of(gateways: list[Process]) -> Process | None:
    leaders = [g for g in gateways if g.process.poll() is None and metric(g.url, "basin_gateway_leader") == 1]
    assert len(leaders) <= 1, "two replicas believe they lead"
    return leaders[0] if leaders else None


def test_a_redis_restart_mid_run_keeps_serving_and_reconciles(stack: tuple, tmp_path: Path) -> None:
    _, server, gateways = stack
    balancer = RoundRobin([g.port for g in gateways]).serve()
    out = tmp_path / "replay.json"
    client = replay(balancer.url, out)
    wait_for(lambda: math.isfinite(metric(gateways[0].url, "basin_gateway_budget_tokens")), "admission", 120)
    budget_before = metric(gateways[0].url, "basin_gateway_budget_tokens")
    server.stop()  # Redis goes away (no persistence: it comes back empty)
    wait_for(lambda: all(metric(g.url, "basin_gateway_redis_up") == 0 for g in gateways), "both see it", 30)
    restarted = start_redis(tmp_path, port=server.port)
    try:
        wait_for(
            lambda: all(metric(g.url, "basin_gateway_redis_up") == 1 for g in gateways), "reconnection", 30
        )
        wait_for(lambda: leader_of(gateways) is not None, "a leader again", 30)
        table = redis.Redis(port=restarted.port)
        wait_for(lambda: table.hlen("basin:{local}:sessions") > 0, "the session table rewritten", 30)
        finished(client, out)
    finally:
        restarted.stop()
    leader = leader_of(gateways)
    assert leader is gateways[0]  # the leader from before the outage kept its lease and its brain
    assert math.isfinite(budget_before)
    assert metric(leader.url, "basin_gateway_redis_errors_total") >= 1
    for gateway in gateways:
        assert "Redis unavailable" in gateway.text() and "Redis is back" in gateway.text()
        assert "Traceback" not in gateway.text()


def test_the_other_replica_takes_over_a_killed_leader_and_resumes_its_budget(
    stack: tuple, tmp_path: Path
) -> None:
    _, server, gateways = stack
    old, follower = gateways
    out = tmp_path / "replay.json"
    client = replay(follower.url, out)  # every decision crosses Redis to the leader
    table = redis.Redis(port=server.port)

    def snapshot_budget() -> float:
        raw = table.get("basin:{local}:controller")
        return float(json.loads(raw)["budget"]) if raw else math.nan

    # The leader snapshots its controller every few steps: wait until the snapshot itself holds a moved
    # budget (the live gauge can move a step before the snapshot does).
    wait_for(lambda: math.isfinite(snapshot_budget()) and snapshot_budget() != B0, "a moving budget", 120)
    assert metric(follower.url, "basin_gateway_leader") == 0
    old.stop(kill=True)
    killed = time.monotonic()
    # What the dead leader last wrote (the follower writes nothing before it leads).
    snapshot = json.loads(table.get("basin:{local}:controller"))
    wait_for(lambda: metric(follower.url, "basin_gateway_leader") == 1, "the follower's lease", 10)
    took = time.monotonic() - killed
    assert took <= 2 * TTL + 0.5, took  # within two lease TTLs (plus the polling step)
    finished(client, out)
    resumed = re.search(
        r"leader now \(token (\d+)\): resumed (\d+) sessions from the snapshot, budget (\S+)", follower.text()
    )
    assert resumed is not None, follower.text()
    token, sessions, budget = int(resumed.group(1)), int(resumed.group(2)), float(resumed.group(3))
    assert token >= 2 and sessions >= 1
    assert math.isfinite(budget) and budget != B0  # B resumed, not reset to its start value
    assert budget == pytest.approx(float(snapshot["budget"]))  # exactly the dead leader's last B
    assert "Traceback" not in follower.text()
