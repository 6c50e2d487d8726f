"""The operator's children as real Pods on a real node, from the images `make images` builds.

A cluster of its own (the session cluster's tests play the kubelet, which a node would fight): etcd,
apiserver, controller-manager and scheduler (start-cluster.sh with SCHED_PORT), one node with containerd,
kubelet and kube-proxy (node-up.sh PROXY=1) holding images/out/basin.tar and redis.tar, the operator as a
process beside it under its ClusterRole. A BasinDeployment in emulated-engine mode with imagePullPolicy
Never must get its emulator, Redis and gateway Pods Running and Ready and answering through their
Services, a call through the gateway Service must reach the emulator, and the profiling Job's Pod must
profile through the gateway and write the profile, so the BasinDeployment becomes Ready.

The host gives the Pods what a cluster's add-ons would (nodenet.py): DNS for Service names and a relay to
the apiserver, which listens on 127.0.0.1 only. One node per machine: the fixture holds a lock file.
node-down.sh always runs, whatever fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import requests
from harness import (
    K8S,
    REPO,
    Cluster,
    OperatorProcess,
    free_port,
    install_crd,
    operator_kubeconfig,
    wait_for,
)
from kubernetes import client, config
from nodenet import ApiRelay, ClusterDns, service_addresses

from basin import __version__
from basin_operator import constants as c

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow]

IMAGES = [REPO / "images" / "out" / "basin.tar", REPO / "images" / "out" / "redis.tar"]
BRIDGE_IP = "10.88.77.1"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "basin-k8s"
NAME = "demo"
SMALL = {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}


def _run(script: str, env: dict[str, str], timeout: float, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(K8S / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _describe(cluster: Cluster, namespace: str) -> str:
    """Pods with their phases, container states and recent events: what a failure message needs."""
    lines = []
    for pod in cluster.core.list_namespaced_pod(namespace).items:
        states = [
            f"{s.name}: ready={s.ready} restarts={s.restart_count} {s.state.to_dict()}"
            for s in pod.status.container_statuses or []
        ]
        lines.append(f"{pod.metadata.name} {pod.status.phase} {pod.status.pod_ip} {states}")
    for event in cluster.core.list_namespaced_event(namespace).items[-25:]:
        lines.append(f"event {event.involved_object.name}: {event.reason} {event.message}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, OperatorProcess]]:
    missing = [str(p) for p in IMAGES if not p.is_file()]
    if missing:
        pytest.fail(f"run `make images` first (the node test loads {', '.join(missing)})")
    build = subprocess.run(["bash", str(K8S / "build-kube.sh")], capture_output=True, text=True, check=False)
    if build.returncode != 0:
        pytest.fail(f"building Kubernetes failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}")
    CACHE.mkdir(parents=True, exist_ok=True)
    lock = (CACHE / "node.lock").open("w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # one node per machine: the bridge, iptables and kubelet ports
    folder = tmp_path_factory.mktemp("node-k8s") / "cluster"
    ports = {
        name: str(free_port()) for name in ("API_PORT", "ETCD_PORT", "PEER_PORT", "KCM_PORT", "SCHED_PORT")
    }
    env = {**os.environ, "D": str(folder), **ports, "PROXY": "1", "CLUSTER_DNS": BRIDGE_IP}
    services: list[ApiRelay | ClusterDns] = []
    operator: OperatorProcess | None = None
    node_started = False
    try:
        started = _run("start-cluster.sh", env, 180)
        if started.returncode != 0:
            pytest.fail(f"starting the cluster failed:\n{started.stdout}\n{started.stderr}")
        kubeconfig = started.stdout.strip().splitlines()[-1]
        cluster = Cluster(kubeconfig, config.new_client_from_config(config_file=kubeconfig))
        install_crd(cluster)  # early: the garbage collector rescans types every ~30 s
        node_started = True
        node = _run("node-up.sh", env, 600, *map(str, IMAGES))
        if node.returncode != 0 or not node.stdout.strip().endswith("True"):
            pytest.fail(f"the node did not come up:\n{node.stdout[-3000:]}\n{node.stderr[-3000:]}")

        relay = ApiRelay(BRIDGE_IP, int(ports["API_PORT"]))
        dns = ClusterDns(BRIDGE_IP, service_addresses(client.CoreV1Api(cluster.api)))
        for service in (relay, dns):
            service.start()
            services.append(service)
        # The `kubernetes` Service (10.0.0.1:443) onto the relay: in-cluster clients reach the apiserver.
        cluster.core.create_namespaced_endpoints(
            "default",
            {
                "metadata": {"name": "kubernetes"},
                "subsets": [
                    {
                        "addresses": [{"ip": BRIDGE_IP}],
                        "ports": [{"name": "https", "port": relay.port, "protocol": "TCP"}],
                    }
                ],
            },
        )
        folder_op = tmp_path_factory.mktemp("node-operator")
        operator = OperatorProcess(operator_kubeconfig(cluster, folder_op), folder_op)
        operator.start()
        yield cluster, operator
    finally:
        if operator is not None:
            operator.stop()  # first: it would recreate what node-down.sh deletes
        with contextlib.suppress(subprocess.TimeoutExpired):
            if node_started:
                down = _run("node-down.sh", env, 300)
                print(down.stdout, down.stderr)
        for service in services:
            service.stop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            _run("stop-cluster.sh", env, 120)
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    text = operator.text() if operator is not None else ""
    assert "Traceback" not in text, f"the operator logged a traceback:\n{text[-6000:]}"


def _deployment(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{c.GROUP}/{c.VERSION}",
        "kind": c.KIND,
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"path": "Qwen/Qwen3-0.6B"},
            "gpuKind": "h100",
            "prefill": {"hicache": {"hostRatio": 0}},  # the emulator preset h100-1p1d
            # The images `make images` built and node-up.sh loaded: no registry, so never pull.
            "images": {
                "basin": f"{c.BASIN_IMAGE}:{__version__}",
                "redis": f"{c.REDIS_IMAGE}:{__version__}",
                "pullPolicy": "Never",
            },
            "emulator": {"enabled": True, "timeScale": 40, "resources": SMALL},
            "gateway": {"replicas": 1, "resources": SMALL},
            "redis": {"resources": SMALL},
            # The operator starts the Job with the gateway; the Job waits for it (BASIN_PROFILE_WAIT_SECONDS).
            "profiling": {
                "ramps": 1,
                "steps": 5,
                "stepSeconds": 600,
                "backoffSeconds": 10,
                "maxBackoffSeconds": 30,
                "resources": SMALL,
            },
        },
    }


def _ready_pod(cluster: Cluster, namespace: str, component: str) -> client.V1Pod | None:
    selector = f"{c.LABEL_INSTANCE}={NAME},{c.LABEL_COMPONENT}={component}"
    for pod in cluster.core.list_namespaced_pod(namespace, label_selector=selector).items:
        ready = any(k.type == "Ready" and k.status == "True" for k in pod.status.conditions or [])
        if pod.status.phase == "Running" and ready:
            return pod
    return None


def _cluster_ip(cluster: Cluster, namespace: str, component: str) -> str:
    ip = cluster.core.read_namespaced_service(c.child_name(NAME, component), namespace).spec.cluster_ip
    assert ip and ip != "None"
    return str(ip)


def _condition(obj: dict[str, Any], kind: str) -> str | None:
    for condition in obj.get("status", {}).get("conditions", []):
        if condition["type"] == kind:
            return str(condition["status"])
    return None


def test_emulated_deployment_runs_as_pods_and_serves_through_its_services(
    node_cluster: tuple[Cluster, OperatorProcess],
) -> None:
    cluster, operator = node_cluster
    namespace = f"n-{uuid.uuid4().hex[:8]}"
    cluster.core.create_namespace({"metadata": {"name": namespace}})
    cluster.custom.create_namespaced_custom_object(
        c.GROUP, c.VERSION, namespace, c.PLURAL, _deployment(namespace)
    )

    pods = {}
    for component in ("redis", "emulator", "gateway"):
        pod = wait_for(
            lambda component=component: _ready_pod(cluster, namespace, component),
            420,
            f"a Running and Ready {component} Pod; now:\n{_describe(cluster, namespace)}",
            every=2,
        )
        pods[component] = pod
        container = pod.spec.containers[0]
        assert container.image_pull_policy == "Never"
        assert container.image.startswith(c.REDIS_IMAGE if component == "redis" else c.BASIN_IMAGE)
        assert pod.status.pod_ip.startswith("10.88.77.")

    # The gateway's model-second clock runs at the emulator's pace (x40), as it says when it starts.
    log = cluster.core.read_namespaced_pod_log(pods["gateway"].metadata.name, namespace)
    assert "time x40" in log, log[-3000:]

    # Redis through its (headless) Service: the name resolves to the Pod, which answers.
    (address,) = service_addresses(cluster.core)(f"{NAME}-redis.{namespace}.svc.cluster.local") or [None]
    assert address == pods["redis"].status.pod_ip
    assert redis.Redis(host=address, port=c.REDIS_PORT, socket_timeout=10).ping()

    # The emulator through the router Service (kube-proxy's ClusterIP), as the gateway calls it.
    router = f"http://{_cluster_ip(cluster, namespace, 'router')}:{c.ROUTER_PORT}"
    assert requests.get(f"{router}/health", timeout=10).status_code == 200
    info = requests.get(f"{router}/get_server_info", timeout=10).json()
    assert info, info

    # The gateway through its Service: alive, its upstream and Redis reachable from inside the Pod network.
    gateway = f"http://{_cluster_ip(cluster, namespace, 'gateway')}:{c.GATEWAY_PORT}"
    assert requests.get(f"{gateway}/health", timeout=10).status_code == 200
    ready = wait_for(
        lambda: (r := requests.get(f"{gateway}/ready", timeout=10)).status_code == 200 and r,
        120,
        "the gateway's /ready",
        every=2,
    )
    print("gateway /ready:", ready.text)

    # One call through the gateway Service reaches the emulator (its answer, its token counts).
    def call() -> requests.Response | None:
        answer = requests.post(
            f"{gateway}/v1/completions",
            json={"model": "Qwen/Qwen3-0.6B", "prompt": "list the files in the repo", "max_tokens": 8},
            headers={"X-Session-ID": f"node-test-{uuid.uuid4().hex[:6]}", "X-Session-Final": "1"},
            timeout=60,
        )
        if answer.status_code == 429:  # parked: the gateway says to call again
            return None
        return answer

    answer = wait_for(call, 180, "a call through the gateway that is not parked", every=2)
    assert answer.status_code == 200, (answer.status_code, answer.headers, answer.text)
    body = answer.json()
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0, body
    emulator_metrics = requests.get(f"{router}/metrics", timeout=10).text
    assert "sglang:" in emulator_metrics

    # The profiling Job's Pod ramps through the gateway Service and writes the profile ConfigMap through
    # the apiserver; the operator takes it and the BasinDeployment becomes Ready.
    def ready_deployment() -> dict[str, Any] | None:
        obj = cluster.custom.get_namespaced_custom_object(c.GROUP, c.VERSION, namespace, c.PLURAL, NAME)
        profiling = obj.get("status", {}).get("profiling") or {}
        # The Job starts with the gateway and waits for it to answer: its first attempt must succeed.
        if profiling.get("state") == "Failed":
            pytest.fail(f"the profiling Job failed: {profiling}\n{_describe(cluster, namespace)}")
        return obj if _condition(obj, "Ready") == "True" else None

    obj = wait_for(ready_deployment, 900, "the BasinDeployment to be Ready", every=5)
    assert obj["status"]["phase"] == "Ready"
    assert obj["status"]["profiling"]["attempt"] == 1, obj["status"]["profiling"]
    profile = obj["status"]["profile"]
    assert profile["kappa"] > 0 and profile["lambdaCPerMin"] > 0 and profile["state"] == "fresh"
    jobs = cluster.batch.list_namespaced_job(namespace).items
    assert any(job.status.succeeded for job in jobs), [job.status for job in jobs]
    print("profiling:", obj["status"]["profiling"], "profile:", profile)

    # The gateway takes the profile (it forwards everything while it waits for one): BASIN runs.
    def running_basin() -> dict[str, Any] | None:
        state = requests.get(f"{gateway}/ready", timeout=10)
        return state.json() if state.status_code == 200 and state.json().get("policy") == "basin" else None

    print("gateway /ready:", wait_for(running_basin, 300, "the gateway to run BASIN on the profile", every=3))
    assert "Traceback" not in operator.text()
