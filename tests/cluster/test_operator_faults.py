"""Faults a review of the operator found (issue 17), each against the real apiserver: deletion while the
operator is down, drift of owned fields, stale status keys, debounced scale, Job pile-up, the engine flags
of reservation at prefill completion, the gateway's Role, and rolling only the children a change concerns.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from harness import (
    REPO,
    Cluster,
    OperatorProcess,
    service_account_token,
    wait_for,
    write_token_kubeconfig,
)
from kubernetes import client
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
    make_all_ready,
    profile_for,
    resource,
    running_job,
    set_pods_ready,
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


def test_a_spec_scale_waits_for_the_debounce_and_recovery_is_debounced_too(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    """An autoscaler on the scale subresource must not restart profiling on every step: a spec scale is
    profiled once the new shape has held for the debounce, and the running Job is kept meanwhile; ready
    replicas that recover are profiled again only once they hold again."""
    create(cluster, namespace, resource("x", profiling={"debounceSeconds": 4}))
    first = running_job(cluster, namespace, "x")
    make_all_ready(cluster, namespace, "x")
    cluster.custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, PLURAL, "x", {"spec": {"replicas": 2}}
    )
    generation = get(cluster, namespace, "x")["metadata"]["generation"]
    wait_for(
        lambda: get(cluster, namespace, "x")["status"].get("observedGeneration") == generation,
        30,
        "the operator to see the scaled spec",
    )
    assert get(cluster, namespace, "x")["status"]["profiling"]["job"] == first["job"]
    assert cluster.batch.read_namespaced_job(first["job"], namespace).metadata.deletion_timestamp is None
    set_pods_ready(cluster, namespace, "x", "prefill", 2)
    second = running_job(cluster, namespace, "x", exclude=(first["job"],))
    assert (second["prefillReplicas"], second["trigger"]) == (2, "scale")
    finish_job(cluster, namespace, second["job"], profile_for(second, 1.2, 7.0))
    wait_condition(cluster, namespace, "x", "Profiled", "True")

    # One prefill pod stops being ready and stays so: the serving shape is profiled ...
    set_pods_ready(cluster, namespace, "x", "prefill", 1, ready=False)
    # (the first Job was deleted when superseded, so this one may reuse its name)
    third = running_job(cluster, namespace, "x", exclude=(second["job"],))
    assert (third["prefillReplicas"], third["trigger"]) == (1, "ready replicas")
    assert third["fingerprint"] == first["fingerprint"]
    # ... and when it is ready again, the spec's shape only once that has held again.
    set_pods_ready(cluster, namespace, "x", "prefill", 2)
    wait_for(
        lambda: get(cluster, namespace, "x")["status"]["readyObserved"]["prefill"] == 2,
        30,
        "the operator to see the recovered replicas",
    )
    assert get(cluster, namespace, "x")["status"]["profiling"]["job"] == third["job"]
    fourth = running_job(cluster, namespace, "x", exclude=(second["job"], third["job"]))
    assert (fourth["prefillReplicas"], fourth["fingerprint"]) == (2, second["fingerprint"])


def test_finished_profiling_jobs_do_not_pile_up(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    """Every retry used to leave its failed Job (and pod) behind for good; now the current Job and the
    latest finished one stay, older ones go, and every Job has a deadline."""
    create(cluster, namespace, resource("x"))
    first = running_job(cluster, namespace, "x")
    job = cluster.batch.read_namespaced_job(first["job"], namespace)
    assert job.spec.active_deadline_seconds == 2 * 4 * 8 * 720 + 600
    finish_job(cluster, namespace, first["job"], None, succeed=False)
    second = running_job(cluster, namespace, "x", exclude=(first["job"],))
    finish_job(cluster, namespace, second["job"], None, succeed=False)
    third = running_job(cluster, namespace, "x", exclude=(first["job"], second["job"]))

    def names() -> list[str]:
        return sorted(j.metadata.name for j in cluster.batch.list_namespaced_job(namespace).items)

    wait_for(lambda: names() == sorted([second["job"], third["job"]]), 30, "only the latest two Jobs left")


def test_reservation_at_prefill_completion_sets_the_engine_flags(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    """`disaggregation.decodeAllocation: prefill_complete` puts the policy and NIXL on both roles."""
    create(cluster, namespace, resource("x", disaggregation={"decodeAllocation": "prefill_complete"}))
    create(cluster, namespace, resource("y"))
    wait_children(cluster, namespace)
    wait_for(lambda: cluster.apps.read_namespaced_deployment("y-decode", namespace), 60, "y's engines")
    for role in ("prefill", "decode"):
        args = (
            cluster.apps.read_namespaced_deployment(f"x-{role}", namespace)
            .spec.template.spec.containers[0]
            .args
        )
        assert args[args.index("--disaggregation-transfer-backend") + 1] == "nixl"
        assert args[args.index("--disaggregation-decode-allocation-policy") + 1] == "prefill_complete"
        plain = (
            cluster.apps.read_namespaced_deployment(f"y-{role}", namespace)
            .spec.template.spec.containers[0]
            .args
        )
        assert "--disaggregation-decode-allocation-policy" not in plain
        assert "--disaggregation-transfer-backend" not in plain


def test_the_gateway_reads_only_its_profile_configmap(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    """The gateway's Role lets it get, list and watch its profile ConfigMap by name and nothing else."""
    create(cluster, namespace, resource("x"))
    wait_children(cluster, namespace)
    user = f"system:serviceaccount:{namespace}:x-gateway"

    def allowed(verb: str, name: str = "") -> bool:
        attributes = {"verb": verb, "resource": "configmaps", "namespace": namespace}
        if name:
            attributes["name"] = name
        review = client.AuthorizationV1Api(cluster.api).create_subject_access_review(
            {"spec": {"user": user, "resourceAttributes": attributes}}
        )
        return review.status.allowed

    assert allowed("get", "x-profile") and allowed("watch", "x-profile") and allowed("list", "x-profile")
    assert not allowed("list") and not allowed("watch") and not allowed("get", "someone-elses")


def test_a_policy_edit_rolls_only_the_children_it_concerns(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    """φ is read by decode's lender alone: editing it rolls decode and the gateway, never prefill; editing
    another policy value rolls the gateway only."""
    create(cluster, namespace, resource("x"))
    wait_children(cluster, namespace)

    def generations() -> dict[str, int]:
        return {
            role: cluster.apps.read_namespaced_deployment(f"x-{role}", namespace).metadata.generation
            for role in ("prefill", "decode", "router", "gateway")
        }

    before = generations()
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "x", {"spec": {"gateway": {"policy": {"margin": 0.8}}}}
    )
    wait_for(lambda: generations()["gateway"] > before["gateway"], 30, "the gateway to roll")
    after_margin = generations()
    assert {k: v for k, v in after_margin.items() if k != "gateway"} == {
        k: v for k, v in before.items() if k != "gateway"
    }
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "x", {"spec": {"gateway": {"policy": {"lendCap": 0.3}}}}
    )
    wait_for(lambda: generations()["decode"] > after_margin["decode"], 30, "decode to roll")
    wait_for(lambda: generations()["gateway"] > after_margin["gateway"], 30, "the gateway to roll")
    final = generations()
    assert (final["prefill"], final["router"]) == (before["prefill"], before["router"])


def test_emulated_engines_run_behind_the_router_service(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    """`emulator.enabled`: one `basin emulate` Deployment in place of prefill, decode and router, behind
    the `<name>-router` Service, with the preset and time scale from the spec; readiness follows it; and
    switching the mode off brings the engines back and removes the emulator."""
    create(
        cluster,
        namespace,
        resource("x", decode={"replicas": 3}, emulator={"enabled": True, "timeScale": 10}),
    )
    emulated = {
        "Deployment": ["x-emulator", "x-gateway"],
        "StatefulSet": ["x-redis"],
        "Service": ["x-gateway", "x-redis", "x-router"],
        "ServiceAccount": ["x-gateway", "x-profiler"],
        "Role": ["x-gateway", "x-profiler"],
    }
    wait_for(
        lambda: all(children(cluster, namespace, "x")[k] == v for k, v in emulated.items()),
        60,
        "the emulated children",
    )
    pod = cluster.apps.read_namespaced_deployment("x-emulator", namespace).spec.template.spec
    args = pod.containers[0].args
    assert pod.containers[0].command == ["basin"] and args[0] == "emulate"
    assert args[args.index("--deployment") + 1] == "h200-1p3d"
    assert args[args.index("--time-scale") + 1] == "10"
    service = cluster.core.read_namespaced_service("x-router", namespace).spec
    assert service.selector["app.kubernetes.io/component"] == "emulator"
    assert {p.target_port for p in service.ports} == {8000}
    for component in ("emulator", "gateway", "redis"):
        set_pods_ready(cluster, namespace, "x", component, 1)
    obj = wait_condition(cluster, namespace, "x", "Ready", "False", "NotProfiled")
    assert all(
        next(c for c in obj["status"]["conditions"] if c["type"] == kind)["status"] == "True"
        for kind in ("PrefillReady", "DecodeReady", "RouterReady", "GatewayReady")
    )
    assert (obj["status"]["prefillReplicas"], obj["status"]["decodeReplicas"]) == (1, 3)

    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "x", {"spec": {"emulator": {"enabled": False}}}
    )
    wait_for(
        lambda: (
            children(cluster, namespace, "x")["Deployment"]
            == ["x-decode", "x-gateway", "x-prefill", "x-router"]
        ),
        60,
        "the engines back and the emulator gone",
    )
    assert (
        cluster.core.read_namespaced_service("x-router", namespace).spec.selector[
            "app.kubernetes.io/component"
        ]
        == "router"
    )


def test_a_namespaced_install_runs_under_a_role(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    """operator/deploy/role.yaml: an operator with `--namespace NS`, bound to that Role in NS only (no
    ClusterRole), creates the children and writes status. The cluster-wide operator is stopped meanwhile
    so the two do not share the object."""
    role = yaml.safe_load((REPO / "operator" / "deploy" / "role.yaml").read_text())
    cluster.core.create_namespaced_service_account(namespace, {"metadata": {"name": "basin-operator"}})
    cluster.rbac.create_namespaced_role(namespace, role)
    cluster.rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "basin-operator"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "basin-operator"},
            "subjects": [{"kind": "ServiceAccount", "name": "basin-operator", "namespace": namespace}],
        },
    )
    token = service_account_token(cluster.core, "basin-operator", namespace)
    kubeconfig = tmp_path / "namespaced.kubeconfig"
    write_token_kubeconfig(yaml.safe_load(Path(cluster.kubeconfig).read_text()), token, kubeconfig)
    namespaced = OperatorProcess(kubeconfig, tmp_path, extra_args=["--namespace", namespace])
    operator_process.stop()
    try:
        namespaced.start()
        create(cluster, namespace, resource("x"))
        wait_children(cluster, namespace)
        running_job(cluster, namespace, "x")
        wait_condition(cluster, namespace, "x", "PrefillReady", "False", "ReplicasNotReady")
    finally:
        namespaced.stop()
        operator_process.start()
    assert "Traceback" not in namespaced.text(), namespaced.text()[-4000:]
