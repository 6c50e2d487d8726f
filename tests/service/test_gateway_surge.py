"""The issue's headline check: two gateway replicas sharing one brain through a real Redis, behind a
round-robin balancer, in front of the time-scaled 1P3D emulator under a x5 surge (`basin replay --api
sglang`). BASIN against HiCache alone (`--policy passthrough`) on the same arrivals."""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from gateway_helpers import (
    Process,
    RoundRobin,
    metrics,
    replay_command,
    start_emulator,
    start_redis,
    start_replicas,
)

from basin_gateway.local import surge_replay

pytestmark = [pytest.mark.service, pytest.mark.slow]

SCALE = "20"
SCENARIO = [*surge_replay(), "--seed", "0"]  # `basin up`'s surge
# Model seconds the emulator's event loop ran late on average (50 ms of wall time at x20): on a quiet machine
# 0.71 through BASIN's run (late hit 0.83), 0.20 through HiCache alone's.
LAG_LIMIT_S = 1.0


class Watch:
    """Samples both replicas while a run goes: who leads, the leader's budget audit, local decisions."""

    def __init__(self, gateways: list[Process]) -> None:
        self.gateways = gateways
        self.samples: list[dict[str, float]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        names = ("leader", "budget_tokens", "reserved_tokens", "budget_overruns", "local_decisions")
        while not self.stop.wait(1.0):
            for index, gateway in enumerate(self.gateways):
                try:
                    values = metrics(gateway.url)  # one scrape per replica and second: light on the gateways
                except requests.RequestException:
                    continue
                self.samples.append(
                    {"replica": index, **{n: values.get(f"basin_gateway_{n}", math.nan) for n in names}}
                )

    def __enter__(self) -> Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def run(policy: str, tmp: Path) -> tuple[dict, list[dict[str, float]], list[str], float]:
    """One replay through two replicas sharing a fresh Redis, in front of a fresh emulator."""
    started: list[Process] = []  # stopped whatever fails, even while starting
    try:
        emulator = start_emulator("--deployment", "h200-1p3d", "--time-scale", SCALE)
        started.append(emulator)
        redis = start_redis(tmp)
        started.append(redis)
        common = [
            "--deployment",
            "h200-1p3d",
            "--time-scale",
            SCALE,
            "--policy",
            policy,
            "--redis",
            redis.url,
            "--deployment-name",
            f"surge-{policy}",
        ]
        gateways = start_replicas(emulator.url, *common)
        started.extend(gateways)
        balancer = RoundRobin([g.port for g in gateways]).serve()
        out = tmp / f"{policy}.json"
        command = replay_command(balancer.url, SCALE, out, *SCENARIO)
        with Watch(gateways) as watch:
            replay = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        assert replay.returncode == 0, replay.stdout + replay.stderr
        info = requests.get(f"{emulator.url}/get_server_info", timeout=10).json()
        lag = float(info["loop_lag_mean_s"]) * float(SCALE)  # model seconds the emulator ran late
        return json.loads(out.read_text()), watch.samples, [g.text() for g in gateways], lag
    finally:
        for process in reversed(started):
            process.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple]]:
    tmp = tmp_path_factory.mktemp("surge")
    yield {policy: run(policy, tmp) for policy in ("basin", "passthrough")}


def test_basin_keeps_reuse_and_beats_hicache_alone(runs: dict[str, tuple]) -> None:
    basin, passthrough = runs["basin"][0], runs["passthrough"][0]
    print(
        "BASIN",
        {
            k: basin[k]
            for k in (
                "goodput_sessions_per_h",
                "hit_rate_late",
                "completed_fraction",
                "shed_fraction",
                "parked_answers",
                "requests",
            )
        },
    )
    print(
        "passthrough",
        {
            k: passthrough[k]
            for k in ("goodput_sessions_per_h", "hit_rate_late", "completed_fraction", "requests")
        },
    )
    lags = {policy: run[3] for policy, run in runs.items()}
    print("emulator loop lag (model s):", lags, "load average:", os.getloadavg())
    assert basin["measured_sessions"] == passthrough["measured_sessions"] > 300  # the same arrivals
    assert basin["parked_answers"] > 0 and passthrough["parked_answers"] == 0
    # The targets. Goodput: BASIN at least 1.5x HiCache alone on the same arrivals (the simulator at
    # 9/min, seeds 0-2: 1.8-2.1x; live at 8/min under the former 30 ms H200 decode step, where the simulator
    # gave 1.6-2.0x: 2.8x on a quiet machine, 5.4x at load 4 and 5.5x at load 12, where the lagging emulator
    # traps HiCache alone harder). Both replays start warm, as the simulator does: from a cold start the surge
    # at minute 3 met a quarter of the steady population and HiCache alone barely trapped (1.14x).
    ratio = basin["goodput_sessions_per_h"] / max(passthrough["goodput_sessions_per_h"], 1.0)
    assert basin["hit_rate_late"] > passthrough["hit_rate_late"]
    # Late hit rate >= 0.8 (0.83 on a quiet machine at 8/min; the simulator at 9/min: 0.90-0.93 on seeds 0-2).
    # An emulator that runs late stretches every call in model time, and BASIN's reuse slides with it (0.76 at
    # load 4, 0.71 at load 12), and so can its goodput (a clean-clone CI run: 412 sessions/h, 1.45x, with
    # BASIN's emulator 1.33 model s late; rerun at 0.73 s late, 912 and 1.97x): past LAG_LIMIT_S the figures
    # measure the machine, and a miss of either target is an expected failure.
    missed = ratio < 1.5 or basin["hit_rate_late"] < 0.8
    if missed and lags["basin"] > LAG_LIMIT_S:
        pytest.xfail(
            f"goodput {ratio:.2f}x, late hit {basin['hit_rate_late']:.2f} with the emulator"
            f" {lags['basin']:.2f} model s late"
        )
    assert ratio >= 1.5, (ratio, lags)
    assert basin["hit_rate_late"] >= 0.8, (basin["hit_rate_late"], lags)


def test_every_request_is_answered(runs: dict[str, tuple]) -> None:
    """2xx, 429, 503 or a counted 5xx: no connection error, no broken answer, nothing hung."""
    for policy, (result, _, logs, _) in runs.items():
        assert result["connection_errors"] == 0 and result["failed_requests"] == 0, (
            policy,
            result["first_errors"],
        )
        assert not result["stopped_early"], policy
        for log in logs:
            assert "Traceback" not in log, log[log.index("Traceback") - 300 :][:3000]


def test_two_replicas_never_admit_past_the_budget(runs: dict[str, tuple]) -> None:
    """One ledger: exactly one replica leads throughout, followers decide nothing themselves, and no
    admission of the leader's policy leaves its reservations above B (its own audit counter)."""
    samples = runs["basin"][1]
    assert any(math.isfinite(s["budget_tokens"]) for s in samples if s["leader"] == 1), (
        "admission never engaged"
    )
    leaders = {s["replica"] for s in samples if s["leader"] == 1}
    assert len(leaders) == 1
    assert all(s["local_decisions"] == 0 for s in samples)
    assert all(s["budget_overruns"] == 0 for s in samples)
