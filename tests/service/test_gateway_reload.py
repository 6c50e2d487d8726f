"""The mounted profile changes under a running gateway (a ConfigMap update): it is taken up without a
restart and without a failed request; one measured on another deployment is refused."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import requests
from gateway_helpers import metric, start_emulator, start_gateway, wait_for

pytestmark = pytest.mark.service


def profile(kappa: float, fingerprint: str) -> str:
    return json.dumps(
        {
            "kappa": kappa,
            "lambda_c_per_min": 5.0,
            "prefill_gpu_tokens": 1_000_000,
            "host_tokens": 0,
            "decode_kv_tokens": 2_000_000,
            "fingerprint": fingerprint,
        }
    )


def replace(path: Path, text: str) -> None:
    """As the kubelet updates a ConfigMap volume: a new file swapped in at once."""
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    os.replace(fresh, path)


def test_profile_updates_are_taken_up_live(tmp_path: Path) -> None:
    emulator = start_emulator("--deployment", "h200-1p1d", "--time-scale", "20")
    path = tmp_path / "profile.json"
    path.write_text("")  # the operator's ConfigMap before the first profiling run
    gateway = start_gateway(
        emulator.url, "--profile", str(path), "--time-scale", "20", env={"BASIN_PROFILE_FINGERPRINT": "ours"}
    )
    answers: list[int] = []
    stop = threading.Event()

    def traffic() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            body = {"text": f"call {n}", "sampling_params": {"max_new_tokens": 1}}
            answers.append(requests.post(f"{gateway.url}/generate", json=body, timeout=30).status_code)

    client = threading.Thread(target=traffic)
    client.start()
    try:
        assert "waiting for a profile" in gateway.text()
        assert metric(gateway.url, "basin_gateway_profile_info", 'fingerprint="",source="none"') == 1
        replace(path, profile(1.0, "ours"))
        source = f'fingerprint="ours",source="{path}"'
        wait_for(lambda: metric(gateway.url, "basin_gateway_profile_info", source) == 1, "the first profile")
        wait_for(
            lambda: metric(gateway.url, "basin_gateway_b0_tokens") == 1_000_000, "B0 = min(m·κ·x_k·C, C)"
        )
        replace(path, profile(0.5, "ours"))
        wait_for(
            lambda: metric(gateway.url, "basin_gateway_b0_tokens") == pytest.approx(0.9 * 0.5 * 1.9 * 1e6),
            "B0 from the new κ",
        )
        replace(path, profile(0.1, "theirs"))
        wait_for(lambda: metric(gateway.url, "basin_gateway_profile_refused") == 1, "the refusal")
        assert metric(gateway.url, "basin_gateway_b0_tokens") == pytest.approx(0.9 * 0.5 * 1.9 * 1e6)
        replace(path, "{not json")
        wait_for(lambda: "profile not reloaded" in gateway.text(), "the malformed file logged")
    finally:
        stop.set()
        client.join(30)
        gateway.stop()
        emulator.stop()
    assert answers and set(answers) == {200}  # nothing dropped while profiles changed
    assert "is for deployment 'theirs'" in gateway.text() and "Traceback" not in gateway.text()
