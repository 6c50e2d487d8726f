"""The gateway finds its engines the way the operator configures it: pods by label selector, through a
real kube-apiserver (no kubelet here: the test plays it and marks the pods Running and Ready at
127.0.0.1, where an emulator stands in for both roles)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import requests
from harness import Cluster
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster

SERVICE = Path(__file__).parents[1] / "service"
sys.path.insert(0, str(SERVICE))
from gateway_helpers import metric, start_emulator, start_gateway, wait_for  # noqa: E402


def _pod(cluster: Cluster, namespace: str, name: str, role: str, ready: bool) -> None:
    body = {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "engine", "basin.dev/role": role}},
        "spec": {
            "containers": [{"name": "engine", "image": "sglang"}],
            "automountServiceAccountToken": False,
        },
    }
    try:  # the ServiceAccount admission wants the namespace's default account (no controller made it yet)
        cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": "default"}})
    except ApiException as exc:
        if exc.status != 409:
            raise
    cluster.core.create_namespaced_pod(namespace, body)
    status = {
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
    }
    cluster.core.patch_namespaced_pod_status(name, namespace, status)


def test_engines_are_found_by_the_operator_s_selectors(cluster: Cluster, namespace: str) -> None:
    emulator = start_emulator("--deployment", "h200-1p1d", "--time-scale", "20")
    try:
        _pod(cluster, namespace, "prefill-0", "prefill", ready=True)
        _pod(cluster, namespace, "decode-0", "decode", ready=False)  # not Ready: not scraped
        env = {
            "BASIN_KUBECONFIG": cluster.kubeconfig,
            "BASIN_NAMESPACE": namespace,
            "BASIN_PREFILL_SELECTOR": "basin.dev/role=prefill",
            "BASIN_DECODE_SELECTOR": "basin.dev/role=decode",
            "BASIN_ENGINE_PORT": str(emulator.port),
        }
        gateway = start_gateway(emulator.url, "--deployment", "h200-1p1d", "--time-scale", "20", env=env)
        try:
            wait_for(
                lambda: f"engines for telemetry: http://127.0.0.1:{emulator.port}" in gateway.text(),
                "the pod list",
                30,
            )
            wait_for(lambda: metric(gateway.url, "basin_gateway_telemetry_stale") == 0, "fresh telemetry", 30)
            for k in range(3):
                body = {"text": " ".join(["w7"] * 300) + f" {k}", "sampling_params": {"max_new_tokens": 1}}
                assert requests.post(f"{gateway.url}/generate", json=body, timeout=30).status_code == 200
            wait_for(
                lambda: math.isfinite(metric(gateway.url, "basin_gateway_telemetry_hit_rate")), "a reading"
            )
        finally:
            gateway.stop()
        assert "Traceback" not in gateway.text()
    finally:
        emulator.stop()


def test_calls_go_directly_to_the_ready_engine_pods(cluster: Cluster, namespace: str) -> None:
    """`BASIN_DIRECT_ENGINES=1` (what the operator sets): no call is placed until a prefill and a decode pod
    are Ready, then each call's two halves reach them with the prefill pod's bootstrap port."""
    from test_gateway_direct import Engine

    engine = Engine()  # both pods' IP and port lead to it: it receives both halves of each call
    env = {
        "BASIN_KUBECONFIG": cluster.kubeconfig,
        "BASIN_NAMESPACE": namespace,
        "BASIN_PREFILL_SELECTOR": "basin.dev/role=prefill",
        "BASIN_DECODE_SELECTOR": "basin.dev/role=decode",
        "BASIN_ENGINE_PORT": str(engine.stub.port),
        "BASIN_DIRECT_ENGINES": "1",
        "BASIN_BOOTSTRAP_PORT": "8998",
    }
    _pod(cluster, namespace, "prefill-0", "prefill", ready=True)
    gateway = start_gateway("http://127.0.0.1:9", "--policy", "passthrough", env=env)
    try:
        body = {"text": "fix it", "sampling_params": {"max_new_tokens": 1}}
        refused = requests.post(f"{gateway.url}/generate", json=body, timeout=30)
        assert refused.status_code == 503 and refused.headers["X-Basin-Reason"] == "no-engines"
        models = requests.get(f"{gateway.url}/v1/models", timeout=10)  # read-only routes too, not the router
        assert models.status_code == 503 and models.headers["X-Basin-Reason"] == "no-engines"
        assert requests.get(f"{gateway.url}/ready", timeout=10).status_code == 503
        _pod(cluster, namespace, "decode-0", "decode", ready=True)
        wait_for(lambda: f"; decode {engine.stub.url}" in gateway.text(), "the decode pod's discovery", 30)
        answer = requests.post(
            f"{gateway.url}/generate", json=body, headers={"X-Session-ID": "s"}, timeout=30
        )
        assert answer.status_code == 200
        wait_for(lambda: len(engine.generations()) == 2, "both halves")
        halves = engine.generations()
        assert halves[0] == halves[1] and halves[0]["bootstrap_port"] == 8998
        assert halves[0]["bootstrap_host"] == "127.0.0.1"
        wait_for(lambda: requests.get(f"{gateway.url}/ready", timeout=10).status_code == 200, "ready")
    finally:
        gateway.stop()
    assert "Traceback" not in gateway.text()
