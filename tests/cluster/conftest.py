"""Cluster-test fixtures: the cluster (built once, cached in ~/.cache/basin-k8s; or BASIN_TEST_KUBECONFIG),
the CRD, the operator under its least-privilege ClusterRole, and one namespace per test."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from harness import (
    CLUSTER_ROLE,
    CRD,
    K8S,
    OPERATOR_NAMESPACE,
    Cluster,
    OperatorProcess,
    free_port,
    service_account_token,
    wait_for,
    write_token_kubeconfig,
)
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException


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
    body = yaml.safe_load(CRD.read_text())
    ext = client.ApiextensionsV1Api(cluster.api)
    try:
        ext.create_custom_resource_definition(body)
    except ApiException as error:
        if error.status != 409:
            raise
        current = ext.read_custom_resource_definition(body["metadata"]["name"])
        body["metadata"]["resourceVersion"] = current.metadata.resource_version
        ext.replace_custom_resource_definition(body["metadata"]["name"], body)

    def established() -> bool:
        status = ext.read_custom_resource_definition(body["metadata"]["name"]).status
        return any(c.type == "Established" and c.status == "True" for c in status.conditions or [])

    wait_for(established, 60, "the CRD to be established")
    return body


def _operator_kubeconfig(cluster: Cluster, folder: Path) -> Path:
    """A kubeconfig with the token of a ServiceAccount bound to the repository's ClusterRole only."""
    admin = yaml.safe_load(Path(cluster.kubeconfig).read_text())
    core, rbac = cluster.core, cluster.rbac
    for create in (
        lambda: core.create_namespace({"metadata": {"name": OPERATOR_NAMESPACE}}),
        lambda: core.create_namespaced_service_account(
            OPERATOR_NAMESPACE, {"metadata": {"name": "basin-operator"}}
        ),
        lambda: rbac.create_cluster_role(yaml.safe_load(CLUSTER_ROLE.read_text())),
        lambda: rbac.create_cluster_role_binding(
            {
                "metadata": {"name": "basin-operator"},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": "basin-operator",
                },
                "subjects": [
                    {"kind": "ServiceAccount", "name": "basin-operator", "namespace": OPERATOR_NAMESPACE}
                ],
            }
        ),
    ):
        try:
            create()
        except ApiException as error:
            if error.status != 409:
                raise
    if os.environ.get("BASIN_TEST_KUBECONFIG"):  # a reused cluster may hold an older ClusterRole
        rbac.replace_cluster_role("basin-operator", yaml.safe_load(CLUSTER_ROLE.read_text()))

    user_token = service_account_token(core, "basin-operator", OPERATOR_NAMESPACE)
    path = folder / "operator.kubeconfig"
    write_token_kubeconfig(admin, user_token, path)
    return path


@pytest.fixture(scope="session")
def operator_process(
    cluster: Cluster, crd: dict, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    folder = tmp_path_factory.mktemp("operator")
    handle = OperatorProcess(_operator_kubeconfig(cluster, folder), folder)
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
