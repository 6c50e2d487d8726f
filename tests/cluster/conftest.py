"""Cluster-test fixtures: the cluster (built once, cached in ~/.cache/basin-k8s; or BASIN_TEST_KUBECONFIG),
the CRD, the operator under its least-privilege ClusterRole, and one namespace per test."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest
from harness import K8S, Cluster, OperatorProcess, free_port, install_crd, operator_kubeconfig
from kubernetes import config


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    existing = os.environ.get("BASIN_TEST_KUBECONFIG")
    if existing:
        yield Cluster(existing, config.new_client_from_config(config_file=existing))
        return
    build = subprocess.run(["bash", str(K8S / "build-kube.sh")], capture_output=True, text=True, check=False)
    if build.returncode != 0:
        pytest.fail(
            f"building the Kubernetes control plane failed:\n{build.stdout[-3000:]}\n{build.stderr[-3000:]}"
        )
    folder = tmp_path_factory.mktemp("k8s") / "cluster"
    ports = {name: str(free_port()) for name in ("API_PORT", "ETCD_PORT", "PEER_PORT", "KCM_PORT")}
    env = {**os.environ, "D": str(folder), **ports}
    started = subprocess.run(
        ["bash", str(K8S / "start-cluster.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    try:
        if started.returncode != 0:
            pytest.fail(f"starting the cluster failed:\n{started.stdout}\n{started.stderr}")
        kubeconfig = started.stdout.strip().splitlines()[-1]
        yield Cluster(kubeconfig, config.new_client_from_config(config_file=kubeconfig))
    finally:
        subprocess.run(
            ["bash", str(K8S / "stop-cluster.sh")], env=env, capture_output=True, timeout=60, check=False
        )


@pytest.fixture(scope="session")
def crd(cluster: Cluster) -> dict:
    """The CRD from crds/ installed and established (early: the garbage collector rescans types ~30 s)."""
    return install_crd(cluster)


@pytest.fixture(scope="session")
def operator_process(
    cluster: Cluster, crd: dict, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    folder = tmp_path_factory.mktemp("operator")
    handle = OperatorProcess(operator_kubeconfig(cluster, folder), folder)
    handle.start()
    yield handle
    handle.stop()
    text = handle.text()
    assert "Traceback" not in text, f"the operator logged a traceback:\n{text[-6000:]}"


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.core.create_namespace({"metadata": {"name": name}})
    yield name
    cluster.core.delete_namespace(name)
