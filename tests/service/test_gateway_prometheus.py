"""Telemetry through a real Prometheus server (Debian `prometheus`) scraping the emulator: the gateway's
control step reads SGLang's series with PromQL (`--prometheus`), and a Prometheus that goes away is a
stale reading, never a crash."""

from __future__ import annotations

import math
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from gateway_helpers import Process, free_port, metric, start_emulator, start_gateway, wait_for

pytestmark = pytest.mark.service


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[str], Process]]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not on PATH (Debian: apt-get install prometheus)")
    emulator = start_emulator("--deployment", "h200-1p1d", "--time-scale", "20")
    config = tmp_path / "prometheus.yml"
    target = emulator.url.removeprefix("http://")
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"scrape_configs:\n  - job_name: engines\n    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"

    def is_ready() -> bool:
        try:
            return requests.get(f"{url}/-/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    try:
        wait_for(is_ready, "prometheus", 60)
        yield url, process, emulator
    finally:
        process.terminate()
        process.wait(timeout=20)
        emulator.stop()


def test_the_controller_reads_engine_telemetry_through_prometheus(prometheus: tuple) -> None:
    url, process, emulator = prometheus
    gateway = start_gateway(
        emulator.url,
        "--deployment",
        "h200-1p1d",
        "--time-scale",
        "20",
        "--prometheus",
        url,
        "--engines",
        emulator.url,
    )
    try:
        assert "telemetry: Prometheus at" in gateway.text()
        history = " ".join(f"w{i}" for i in range(600))

        def hit_seen() -> bool:
            for k in range(3):  # each call resends the history, so the engine's prefix cache hits
                requests.post(
                    f"{gateway.url}/generate",
                    headers={"X-Session-ID": "p"},
                    timeout=30,
                    json={"text": f"{history} turn {k}", "sampling_params": {"max_new_tokens": 1}},
                )
            hit = metric(gateway.url, "basin_gateway_telemetry_hit_rate")
            return math.isfinite(hit) and hit > 0.5

        wait_for(hit_seen, "a hit rate read through Prometheus", 60)
        assert metric(gateway.url, "basin_gateway_telemetry_stale") == 0
        process.terminate()  # Prometheus goes away
        process.wait(timeout=20)
        wait_for(lambda: metric(gateway.url, "basin_gateway_telemetry_stale") == 1, "a stale reading", 30)
        assert math.isnan(metric(gateway.url, "basin_gateway_telemetry_hit_rate"))
        ok = requests.post(f"{gateway.url}/generate", json={"text": "still served"}, timeout=30)
        assert ok.status_code == 200
    finally:
        gateway.stop()
    assert "telemetry unavailable" in gateway.text() and "Traceback" not in gateway.text()
