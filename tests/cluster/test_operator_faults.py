"""Faults a review of the operator found (issue 17), each against the real apiserver: deletion while the
operator is down, drift of owned fields, stale status keys, debounced scale, Job pile-up, the engine flags
of reservation at prefill completion, the gateway's Role, and rolling only the children a change concerns.
"""

from __future__ import annotations

import pytest
from harness import Cluster, OperatorProcess, wait_for
from kubernetes.client.exceptions import ApiException
from test_operator import (
    EXPECTED,
    GROUP,
    PLURAL,
    VERSION,
    children,
    create,
    finish_job,
    get,
    kubectl,
    resource,
    running_job,
    wait_condition,
)

pytestmark = pytest.mark.cluster


def wait_children(cluster: Cluster, namespace: str, name: str = "x") -> None:
    wait_for(
        lambda: all(children(cluster, namespace, name)[k] == v for k, v in EXPECTED.items()), 60, "children"
    )


def gone(cluster: Cluster, namespace: str, name: str) -> bool:
    try:
        get(cluster, namespace, name)
    except ApiException as error:
        if error.status == 404:
            return True
        raise
    return False


def test_deleting_while_the_operator_is_down_completes(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    """No finalizer holds the resource: with the operator stopped (or uninstalled), deletion still
    completes and the children are garbage-collected."""
    create(cluster, namespace, resource("x"))
    wait_children(cluster, namespace)
    running_job(cluster, namespace, "x")
    assert not get(cluster, namespace, "x")["metadata"].get("finalizers")
    operator_process.stop()
    try:
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "x")
        wait_for(lambda: gone(cluster, namespace, "x"), 30, "the BasinDeployment to be deleted")
        wait_for(
            lambda: all(not names for names in children(cluster, namespace, "x").values()),
            120,
            "the children to be garbage-collected",
            every=1.0,
        )
    finally:
        operator_process.start()


def test_a_retry_record_drops_the_failed_attempts_message(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    """Status is merge-patched: keys the new record lacks must be nulled, not left from the last one."""
    create(cluster, namespace, resource("x"))
    first = running_job(cluster, namespace, "x")
    finish_job(cluster, namespace, first["job"], None, succeed=False)
    failed = wait_condition(cluster, namespace, "x", "Profiled", "False", "ProfilingFailed")
    assert failed["status"]["profiling"]["message"] and failed["status"]["profiling"]["retryAt"]
    retry = running_job(cluster, namespace, "x", exclude=(first["job"],))
    assert "message" not in retry and "retryAt" not in retry, retry


def test_hand_edits_of_owned_fields_are_put_back(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    """`kubectl scale` and `kubectl set image` on a child leave its spec-hash annotation alone; the fields
    the operator sets must still come back (server-side apply under its field manager), while fields it
    does not set stay with whoever set them."""
    create(cluster, namespace, resource("x"))
    wait_children(cluster, namespace)
    image = (
        cluster.apps.read_namespaced_deployment("x-prefill", namespace).spec.template.spec.containers[0].image
    )
    kubectl(cluster, "-n", namespace, "scale", "deployment/x-prefill", "--replicas=5")
    kubectl(cluster, "-n", namespace, "set", "image", "deployment/x-decode", "engine=elsewhere/sglang:hacked")
    kubectl(cluster, "-n", namespace, "label", "deployment/x-gateway", "team=serving")

    def put_back() -> bool:
        prefill = cluster.apps.read_namespaced_deployment("x-prefill", namespace)
        decode = cluster.apps.read_namespaced_deployment("x-decode", namespace)
        return prefill.spec.replicas == 1 and decode.spec.template.spec.containers[0].image == image

    wait_for(put_back, 30, "the replicas and the image put back")
    gateway = cluster.apps.read_namespaced_deployment("x-gateway", namespace)
    assert gateway.metadata.labels["team"] == "serving"  # not the operator's field: left alone
    assert any(
        f.manager == "basin-operator" and f.operation == "Apply" for f in gateway.metadata.managed_fields
    )
