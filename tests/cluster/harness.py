"""Cluster-test harness: the cluster handle, the operator subprocess, and polling to a deadline.

The fixtures in conftest.py start a real kube-apiserver + controller-manager (no kubelet), install the CRD,
and run the operator as a subprocess under the repository's least-privilege ClusterRole.

The session fixture builds the control plane once (cached in ~/.cache/basin-k8s) and starts it on free ports,
or uses a running cluster when BASIN_TEST_KUBECONFIG names an admin kubeconfig. Tests play the missing kubelet
by patching Pod status; each test gets its own namespace.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

REPO = Path(__file__).resolve().parents[2]
K8S = Path(__file__).parent / "k8s"
CRD = REPO / "crds" / "basindeployment.yaml"
CLUSTER_ROLE = REPO / "operator" / "deploy" / "clusterrole.yaml"
OPERATOR_NAMESPACE = "basin-system"
RESYNC_SECONDS = 1.0


def wait_for(
    check: Callable[[], Any], timeout: float = 30.0, what: str = "condition", every: float = 0.25
) -> Any:
    """Poll `check` until it returns something truthy, up to `timeout` seconds; fail naming `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except ApiException as error:
            if error.status not in (404, 409):
                raise
            last = None
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


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


@dataclass
class OperatorProcess:
    """`basin operator run` as a subprocess beside the cluster; its log is kept per start."""

    kubeconfig: Path
    folder: Path
    process: subprocess.Popen | None = None
    logs: list[Path] = field(default_factory=list)
    liveness_port: int = field(default_factory=free_port)

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
