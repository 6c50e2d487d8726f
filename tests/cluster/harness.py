"""Cluster-test harness: the cluster handle, the operator subprocess, and polling to a deadline.

The fixtures in conftest.py start a real kube-apiserver + controller-manager (no kubelet), install the CRD,
and run the operator as a subprocess under the repository's least-privilege ClusterRole.

The session fixture builds the control plane once (cached in ~/.cache/basin-k8s) and starts it on free ports,
or uses a running cluster when BASIN_TEST_KUBECONFIG names an admin kubeconfig. Tests play the missing kubelet
by patching Pod status; each test gets its own namespace.
"""

from __future__ import annotations

import base64
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

REPO = Path(__file__).resolve().parents[2]
K8S = Path(__file__).parent / "k8s"
CRD = REPO / "crds" / "basindeployment.yaml"
CLUSTER_ROLE = REPO / "operator" / "deploy" / "clusterrole.yaml"
OPERATOR_NAMESPACE = "basin-system"
RESYNC_SECONDS = 1.0


def wait_for(
    check: Callable[[], Any],
    timeout: float = 30.0,
    what: str = "condition",
    every: float = 0.25,
    fail: Callable[[str], Any] = pytest.fail,
    transient: tuple[type[Exception], ...] = (),
) -> Any:
    """Poll `check` until it returns something truthy, up to `timeout` seconds; an API 404/409 or one of
    the `transient` errors counts as not yet. Then `fail` (pytest's, or the e2e run's) names `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except ApiException as error:
            if error.status not in (404, 409):
                raise
            last = None
        except transient as error:
            last = f"{type(error).__name__}: {error}"
            time.sleep(every)
            continue
        if last:
            return last
        time.sleep(every)
    fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")
    raise AssertionError("unreachable: `fail` returned")


def service_account_token(core: client.CoreV1Api, name: str, namespace: str) -> str:
    """A token of the ServiceAccount from the TokenRequest API (Kubernetes >= 1.22 stops creating token
    Secrets, and 1.24 drops `ServiceAccount.secrets`), else, on a cluster without that API, from the token
    Secret the token controller made."""
    try:
        answer = core.create_namespaced_service_account_token(
            name, namespace, {"spec": {"expirationSeconds": 86_400}}
        )
        return str(answer.status.token)
    except ApiException as error:
        if error.status not in (404, 405):
            raise

    def from_secret() -> str | None:
        account = core.read_namespaced_service_account(name, namespace)
        for ref in account.secrets or []:
            secret = core.read_namespaced_secret(ref.name, namespace)
            if secret.data and secret.data.get("token"):
                return base64.b64decode(secret.data["token"]).decode()
        return None

    return str(wait_for(from_secret, 60, f"the {name} ServiceAccount's token Secret"))


def write_token_kubeconfig(admin: dict[str, Any], token: str, path: Path) -> None:
    """A kubeconfig for the admin kubeconfig's cluster that authenticates with `token`."""
    cluster_entry = admin["clusters"][0]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster_entry],
                "users": [{"name": "basin-operator", "user": {"token": token}}],
                "contexts": [
                    {"name": "op", "context": {"cluster": cluster_entry["name"], "user": "basin-operator"}}
                ],
                "current-context": "op",
            }
        )
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Cluster:
    kubeconfig: str
    api: client.ApiClient

    @property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api)

    @property
    def apps(self) -> client.AppsV1Api:
        return client.AppsV1Api(self.api)

    @property
    def batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self.api)

    @property
    def rbac(self) -> client.RbacAuthorizationV1Api:
        return client.RbacAuthorizationV1Api(self.api)

    @property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api)


def install_crd(cluster: Cluster) -> dict:
    """The CRD from crds/ installed (or replaced) and established."""
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


def operator_kubeconfig(cluster: Cluster, folder: Path) -> Path:
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


@dataclass
class OperatorProcess:
    """`basin operator run` as a subprocess beside the cluster; its log is kept per start."""

    kubeconfig: Path
    folder: Path
    process: subprocess.Popen | None = None
    logs: list[Path] = field(default_factory=list)
    liveness_port: int = field(default_factory=free_port)
    extra_args: list[str] = field(default_factory=list)  # e.g. ["--namespace", NS] for a namespaced install

    def start(self) -> None:
        log = self.folder / f"operator-{len(self.logs)}.log"
        self.logs.append(log)
        command = [
            str(Path(sys.executable).with_name("basin")),
            "operator",
            "run",
            "--kubeconfig",
            str(self.kubeconfig),
            "--resync-seconds",
            str(RESYNC_SECONDS),
            "--log-json",
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            *self.extra_args,
        ]
        self.process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
        wait_for(lambda: "basin operator watching" in log.read_text(), 60, "the operator to start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def text(self) -> str:
        return "\n".join(log.read_text() for log in self.logs if log.exists())
