"""The chart's dashboards and alert rules against a real Prometheus (Debian `prometheus`) that scraped the
gateway (with Redis) and the emulator through a short surge run (`basin replay`, x20 time scale): every
PromQL expression returns data, and the trap-signature and cliff alerts fire under HiCache alone
(`--policy passthrough`) and stay silent under BASIN.

The rules are loaded time-scaled (`alerts.render(20)`: every window and `for:` divided by 20, as the
emulator divides model time), so the 50 model minutes of the run are the 150 wall seconds Prometheus sees.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from gateway_helpers import (
    Process,
    free_port,
    replay_command,
    start_emulator,
    start_gateway,
    start_redis,
    wait_for,
)

from basin_gateway.build import preset_profile
from basin_gateway.local import surge_replay
from basin_monitoring import alerts, verify

pytestmark = [pytest.mark.service, pytest.mark.slow]

SCALE = 20
RATE_INTERVAL = "20s"  # what Grafana's $__rate_interval stands for here (a 6.7-model-minute window)
# `basin up`'s surge with 35 model minutes after it: on a quiet machine HiCache alone traps only from about
# minute 30 (a clean-clone CI run at load 2: hit 0.82 at minute 27, 0.0 at minute 33), so 34 minutes left the
# alerts too little of the trap to fire on.
SCENARIO = [*surge_replay(50), "--seed", "0"]
EARLY_WARNING, TRAP = "BasinApproachingCacheCliff", "BasinCacheTrap"
HELD = 0.8  # a late hit rate at which BASIN held the deployment (the gateway issue's target)
NOT_TRAPPED = 0.7  # a late hit rate HiCache alone keeps only when the surge did not trap it


def profile_document() -> str:
    """The profile `--deployment h200-1p3d` assumes, as the profiler would write it (measurement time and
    one ramp added: the profiling dashboard's panels read them)."""
    profile = dataclasses.asdict(preset_profile("h200-1p3d").profile)
    ramp = [
        {"working_set_over_cache": 0.9, "hit_rate": 0.95, "departures_per_min": 4.0},
        {"working_set_over_cache": 1.7, "hit_rate": 0.84, "departures_per_min": 7.5},
        {"working_set_over_cache": 2.4, "hit_rate": 0.35, "departures_per_min": 5.0},
    ]
    profiled_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 3600))
    return json.dumps({**profile, "profiled_at": profiled_at, "ramps": [ramp], "fingerprint": ""})


def start_prometheus(tmp: Path, targets: dict[str, str]) -> Process:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not on PATH (Debian: apt-get install prometheus)")
    rules = tmp / "basin.yaml"
    rules.write_text(alerts.render(SCALE))
    jobs = "".join(
        f"  - job_name: {job}\n    static_configs: [{{targets: ['{url.removeprefix('http://')}']}}]\n"
        for job, url in targets.items()
    )
    config = tmp / "prometheus.yml"
    config.write_text(
        # 3 s (a model minute) between scrapes, and as long to answer: on a loaded machine an emulator busy
        # with a trapped surge takes seconds, and a failed scrape leaves a gap that resets an alert's `for:`.
        "global: {scrape_interval: 3s, scrape_timeout: 3s, evaluation_interval: 1s}\n"
        f"rule_files: ['{rules}']\nscrape_configs:\n{jobs}"
    )
    port = free_port()
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    prometheus = Process(process, port, [])

    def ready() -> bool:
        try:
            return requests.get(f"{prometheus.url}/-/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    wait_for(ready, "prometheus", 60)
    return prometheus


@dataclasses.dataclass
class Run:
    prometheus: str
    start: float
    end: float
    result: dict
    exported: frozenset[str]  # metric families the gateway and the emulator expose (their HELP lines)

    def query_range(self, expr: str) -> list[dict]:
        answer = requests.get(
            f"{self.prometheus}/api/v1/query_range",
            params={"query": expr, "start": self.start, "end": self.end, "step": "2s"},
            timeout=30,
        ).json()
        assert answer["status"] == "success", (expr, answer)
        return answer["data"]["result"]

    def finite_values(self, expr: str) -> list[float]:
        return [
            float(v)
            for series in self.query_range(expr)
            for _, v in series["values"]
            if math.isfinite(float(v))
        ]

    def fired(self, alert: str) -> bool:
        return bool(self.finite_values(f'ALERTS{{alertname="{alert}", alertstate="firing"}}'))


def surge(policy: str, tmp: Path) -> Iterator[Run]:
    """One replay through one gateway (with Redis, so leader and Redis series exist), Prometheus watching."""
    tmp.mkdir()
    started: list[Process] = []
    try:
        emulator = start_emulator("--deployment", "h200-1p3d", "--time-scale", str(SCALE))
        started.append(emulator)
        redis = start_redis(tmp)
        started.append(redis)
        profile = tmp / "profile.json"
        profile.write_text(profile_document())
        gateway = start_gateway(
            emulator.url, "--profile", str(profile), "--time-scale", str(SCALE), "--policy", policy,
            "--redis", redis.url, "--deployment-name", f"monitoring-{policy}",
        )  # fmt: skip
        started.append(gateway)
        prometheus = start_prometheus(tmp, {"gateway": gateway.url, "engines": emulator.url})
        started.append(prometheus)
        out = tmp / "replay.json"
        start = time.time()
        command = replay_command(gateway.url, str(SCALE), out, *SCENARIO)
        replay = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        assert replay.returncode == 0, replay.stdout + replay.stderr
        time.sleep(3)  # two more scrapes and rule evaluations after the last call (not an assertion)
        end = time.time()
        exported = verify.exported_families(
            requests.get(f"{target}/metrics", timeout=10).text for target in (gateway.url, emulator.url)
        )
        for process in (gateway, redis, emulator):  # Prometheus keeps what it recorded, for the tests
            process.stop()
        yield Run(prometheus.url, start, end, json.loads(out.read_text()), exported)
    finally:
        for process in reversed(started):
            process.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    tmp = tmp_path_factory.mktemp("monitoring")
    generators = {policy: surge(policy, tmp / policy) for policy in ("passthrough", "basin")}
    try:
        yield {policy: next(generator) for policy, generator in generators.items()}
    finally:
        for generator in generators.values():
            generator.close()


def _show(run: Run, policy: str) -> None:
    """The signals the two alerts read, every ~3 model minutes, for the log."""
    signals = {
        "hit": "basin:prefix_hit_rate:rate",
        "baseline": "basin:prefix_hit_rate:baseline",
        "ttft50": "basin:ttft_seconds:p50",
        "active": "basin:sessions_active:leader",
        "W/cliff": "basin:working_set_tokens:leader / basin:cliff_tokens:max",
        "fall10m": f"basin:prefix_hit_rate:rate offset {alerts.scaled(alerts.W['trend'], SCALE)}"
        " - basin:prefix_hit_rate:rate",
    }
    table: dict[float, dict[str, float]] = {}
    for name, expr in signals.items():
        for series in run.query_range(expr):
            for t, v in series["values"][::5]:
                table.setdefault(round(t - run.start), {})[name] = round(float(v), 3)
    for t in sorted(table):
        print(policy, f"{t * SCALE / 60:5.1f} model min", table[t])


def test_the_cliff_and_trap_alerts_fire_under_hicache_alone_and_stay_silent_under_basin(
    runs: dict[str, Run],
) -> None:
    for policy, run in runs.items():
        _show(run, policy)
        fired = {a: run.fired(a) for a in (EARLY_WARNING, TRAP)}
        print(policy, fired, "late hit", run.result["hit_rate_late"], "load average", os.getloadavg())
    passthrough = runs["passthrough"]
    trapped_hit = passthrough.result["hit_rate_late"]
    if not (passthrough.fired(EARLY_WARNING) and passthrough.fired(TRAP)) and trapped_hit >= NOT_TRAPPED:
        # The alerts owe nothing to a deployment that was not trapped (this machine's x20 emulator keeps
        # HiCache alone healthy longer when the machine is quiet; the gateway surge test documents it).
        pytest.xfail(f"HiCache alone was not trapped on this run (late hit {trapped_hit:.2f})")
    assert passthrough.fired(EARLY_WARNING), f"late hit {trapped_hit:.2f}"
    assert passthrough.fired(TRAP), f"late hit {trapped_hit:.2f}"
    basin = runs["basin"]
    late_hit = basin.result["hit_rate_late"]
    if late_hit < HELD and (basin.fired(EARLY_WARNING) or basin.fired(TRAP)):
        # Silence is owed to a deployment BASIN keeps healthy. On the x20 emulator of a busy machine BASIN
        # itself slid once in seven runs (late hit 0.45 after releasing its parked sessions): the alerts
        # were right to fire; whether BASIN holds is the gateway surge test's question.
        pytest.xfail(f"BASIN itself slid on this run (late hit {late_hit:.2f} < {HELD}); the alerts fired")
    assert not basin.fired(EARLY_WARNING), f"late hit {late_hit:.2f}"
    assert not basin.fired(TRAP), f"late hit {late_hit:.2f}"


def test_every_dashboard_query_returns_data(runs: dict[str, Run]) -> None:
    """Under BASIN every series exists (HiCache alone has no budget or flags); a misspelled metric or label
    returns nothing and fails here."""
    run = runs["basin"]
    empty = verify.empty_dashboard_queries(lambda e: bool(run.finite_values(e)), RATE_INTERVAL)
    assert not empty, empty


def test_every_rule_expression_returns_data(runs: dict[str, Run]) -> None:
    """Each recording rule and each alert condition's signal (its threshold applied, the alert may rightly
    be silent) returns data in the run whose policy produces it, or names only exported metrics (a counter
    with labels has no series until its first event)."""
    run = runs["basin"]
    unknown = verify.unknown_rule_metrics(lambda e: bool(run.finite_values(e)), SCALE, run.exported)
    assert not unknown, unknown
