"""The gateway live: `basin gateway run --prefill … --decode …` in front of the real SGLang pair of the
`live_pair` fixture, addressing both engines directly. What each engine logs it received (SGLang's own
request log) shows what the gateway's calls carry on every route, which through sglang-router 0.3.2 they
do not (test_live.py, `test_router_carries`); the gateway's own telemetry reads both engines.

The gateway runs from the project's main venv (`make test` builds it; BASIN_CLI names its `basin`): this
SGLang venv has SGLang's dependencies, not the gateway's (Redis, scikit-learn)."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from test_live import basin, call_body, calls_since, generate, poll, token_ids

pytestmark = [pytest.mark.live, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def main_venv_basin() -> str:
    cli = os.environ.get("BASIN_CLI") or str(REPO / ".venv" / "bin" / "basin")
    if not Path(cli).exists():
        pytest.fail(f"no gateway to run: {cli} does not exist (run `make venv`, or set BASIN_CLI)")
    return cli


@pytest.fixture(scope="module")
def live_gateway(live_pair: Any) -> Iterator[Any]:
    sys.path.insert(0, str(REPO / "gateway"))
    from basin_gateway.local import start_server

    pair = live_pair
    command = [
        main_venv_basin(), "gateway", "run", "--host", "127.0.0.1", "--port", "0", "--policy", "basin",
        "--prefill", pair.prefill_url, str(pair.bootstrap_port), "--decode", pair.decode_url,
    ]  # fmt: skip
    gateway = start_server(command, r"serving at http://127\.0\.0\.1:(\d+)", "the gateway")
    yield gateway
    gateway.stop()
    assert "Traceback" not in gateway.text()


def metric(url: str, name: str) -> float:
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == name:
            return float(value)
    return math.nan


@pytest.mark.parametrize("route", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_the_gateway_s_calls_reach_both_engines_with_every_field(
    live_pair: Any, live_gateway: Any, route: str
) -> None:
    pair, session = live_pair, f"gateway{route.replace('/', '-')}"
    rid, priority = f"g{route[-4:]}-1", 5
    seen = {role: len(pair.received(role)) for role in ("prefill", "decode")}
    units = basin(pair, "decode")["lent_units"]
    body = {**call_body(route, session, rid, priority), "model": str(pair.model)}
    answer = requests.post(
        f"{live_gateway.url}{route}", json=body, headers={"X-Session-ID": session}, timeout=300
    )
    assert answer.status_code == 200, answer.text
    entries = []
    for role in ("prefill", "decode"):
        new = poll(lambda role=role: calls_since(pair, role, seen[role]), f"{role} logs the {route} call")
        assert len(new) == 1, new
        entries.append(new[0]["obj"])
    for obj in entries:
        assert obj["rid"] == rid and obj["priority"] == priority
        custom = (obj.get("sampling_params") or {}).get("custom_params") or {}
        # the session's key is the gateway's; the client's own lending mark is not (only the policy lends)
        assert custom.get("basin_session") == session and "basin_lend" not in custom
    assert entries[0]["bootstrap_room"] == entries[1]["bootstrap_room"]  # the two halves of one call
    assert basin(pair, "decode")["lent_units"] == units


def test_the_gateway_reads_both_engines_telemetry(live_pair: Any, live_gateway: Any) -> None:
    """Telemetry scraped from prefill and decode directly: fresh, with a measured hit rate.

    A reading's hit rate is cached tokens over prompt tokens since the previous reading (30 s apart by
    default), so it is finite only when calls ran in between: small calls keep flowing while we wait."""
    url = live_gateway.url
    # SGLang's /health runs a short generation: on a busy CPU it may miss the gateway's 2 s bound once
    poll(lambda: requests.get(f"{url}/ready", timeout=10).status_code == 200, "ready", 60)
    poll(lambda: metric(url, "basin_gateway_telemetry_stale") == 0, "fresh telemetry", 120)
    stop = threading.Event()
    answers: list[int] = []

    def traffic() -> None:
        prompt = token_ids(48, 7)  # the same prompt each time: the later calls hit the cache
        while not stop.is_set():
            body = {**generate(prompt, 2, rid=f"telemetry-{len(answers)}"), "model": str(live_pair.model)}
            answer = requests.post(
                f"{url}/generate", json=body, headers={"X-Session-ID": "telemetry"}, timeout=300
            )
            answers.append(answer.status_code)
            stop.wait(1.0)

    sender = threading.Thread(target=traffic, daemon=True)
    sender.start()
    try:
        poll(lambda: math.isfinite(metric(url, "basin_gateway_telemetry_hit_rate")), "a hit rate", 120)
    finally:
        stop.set()
        sender.join(timeout=300)
    assert set(answers) <= {200}, answers
    assert metric(url, "basin_gateway_telemetry_failures_total") == 0


def test_sglang_s_own_request_metrics_survive_the_plugin(live_pair: Any, live_gateway: Any) -> None:
    """SGLang's HTTP-process metrics (prompt tokens, TTFT) are on /metrics beside the scheduler's: the
    plugin no longer imports prometheus_client before SGLang sets its multiprocess folder
    (tests/engine/test_plugin.py). The gateway's hit rate reads prompt and cached tokens (the latter
    appears with the first cache hit)."""
    for role in ("prefill", "decode"):
        assert live_pair.metrics(role)["sglang:prompt_tokens_total"] > 0, role
    assert live_pair.metrics("decode")["sglang:time_to_first_token_seconds_count"] > 0


def test_basin_s_lending_and_ordering_reach_the_live_engines(live_pair: Any, tmp_path: Path) -> None:
    """`basin gateway run --policy basin` with a profile whose tiny κ puts the live pair past BASIN's
    thresholds at once: after a control step lending and ordering are engaged, and the session's next
    call carries the policy's lend mark and priority to both engines; decode keeps its unit."""
    sys.path.insert(0, str(REPO / "gateway"))
    from basin_gateway.local import start_server

    pair = live_pair
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "kappa": 0.001, "lambda_c_per_min": 1.0, "prefill_gpu_tokens": pair.max_total_tokens,
        "host_tokens": 0, "decode_kv_tokens": pair.max_total_tokens, "prefill_tokens_per_s": 1000.0,
        "fingerprint": "",
    }))  # fmt: skip
    command = [
        main_venv_basin(), "gateway", "run", "--host", "127.0.0.1", "--port", "0", "--policy", "basin",
        "--profile", str(profile), "--prefill", pair.prefill_url, str(pair.bootstrap_port),
        "--decode", pair.decode_url,
    ]  # fmt: skip
    env = {"BASIN_POLICY_INTERVAL_S": "1", "BASIN_POLICY_FAST_INTERVAL_S": "1"}
    gateway = start_server(command, r"serving at http://127\.0\.0\.1:(\d+)", "the gateway", env=env)
    try:
        session, url = "gateway-basin", gateway.url

        def send(rid: str, prompt: list[int]) -> list[dict[str, Any]]:
            seen = {role: len(pair.received(role)) for role in ("prefill", "decode")}
            body = {**generate(prompt, 4, rid=rid), "model": str(pair.model)}  # no priority, no marks
            headers = {"X-Session-ID": session}
            answer = requests.post(f"{url}/generate", json=body, headers=headers, timeout=300)
            assert answer.status_code == 200, answer.text
            return [
                poll(lambda role=role: calls_since(pair, role, seen[role]), f"{role} logs {rid}")[0]["obj"]
                for role in ("prefill", "decode")
            ]

        first = token_ids(120, seed=11)
        send("gb-1", first)  # the session is admitted and resident: BASIN's working set is now past its B0
        poll(lambda: metric(url, "basin_gateway_lending_active") == 1, "lending engaged", 120)
        poll(lambda: metric(url, "basin_gateway_ordering_active") == 1, "ordering engaged", 120)
        units = basin(pair, "decode")["lent_units"]
        for obj in send("gb-2", first + token_ids(40, seed=12)):  # the conversation grew
            custom = obj["sampling_params"]["custom_params"]
            assert custom == {"basin_session": session, "basin_lend": True}
            assert isinstance(obj["priority"], int)
        poll(lambda: basin(pair, "decode")["lent_units"] == units + 1, "decode keeps the lent unit", 60)
    finally:
        gateway.stop()
    assert "Traceback" not in gateway.text()
