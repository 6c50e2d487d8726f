"""The operator against a real kube-apiserver and controller-manager: children, validation, status, profiling
after scale events, drift, restarts and garbage collection. The tests play the missing kubelet."""

from __future__ import annotations

import copy
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import Cluster, OperatorProcess, wait_for
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from basin.policy.basin import BasinConfig

pytestmark = pytest.mark.cluster

GROUP, VERSION, PLURAL = "basin.dev", "v1alpha1", "basindeployments"
COMPONENT = "app.kubernetes.io/component"
INSTANCE = "app.kubernetes.io/instance"


def merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = (
            merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


def resource(name: str, **spec: Any) -> dict:
    """A BasinDeployment with test defaults: one gateway replica, short debounce and backoff."""
    base = {
        "model": {"path": "Qwen/Qwen3-0.6B"},
        "gateway": {"replicas": 1},
        "profiling": {"debounceSeconds": 3, "backoffSeconds": 2, "maxBackoffSeconds": 4},
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "BasinDeployment",
        "metadata": {"name": name},
        "spec": merge(base, spec),
    }


def create(cluster: Cluster, namespace: str, body: dict) -> dict:
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)


def get(cluster: Cluster, namespace: str, name: str) -> dict:
    return cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def condition(obj: dict, kind: str) -> dict:
    for item in (obj.get("status") or {}).get("conditions") or []:
        if item["type"] == kind:
            return item
    return {}


def wait_condition(
    cluster: Cluster, namespace: str, name: str, kind: str, status: str, reason: str = ""
) -> dict:
    def check() -> dict | None:
        obj = get(cluster, namespace, name)
        found = condition(obj, kind)
        if found.get("status") == status and (not reason or found.get("reason") == reason):
            return obj
        return None

    return wait_for(check, 60, f"{kind}={status} {reason}".strip())


def pods(cluster: Cluster, namespace: str, selector: str) -> list[client.V1Pod]:
    return cluster.core.list_namespaced_pod(namespace, label_selector=selector).items


def set_pods_ready(
    cluster: Cluster, namespace: str, name: str, component: str, count: int, ready: bool = True
) -> None:
    """Play the kubelet: mark `count` pods of a component Running and Ready (or not ready)."""
    selector = f"{INSTANCE}={name},{COMPONENT}={component}"
    found = wait_for(
        lambda: (lambda items: items if len(items) >= count else None)(pods(cluster, namespace, selector)),
        60,
        f"{count} {component} pods",
    )
    value = "True" if ready else "False"
    for pod in sorted(found, key=lambda p: p.metadata.name)[:count]:
        cluster.core.patch_namespaced_pod_status(
            pod.metadata.name,
            namespace,
            {
                "status": {
                    "phase": "Running",
                    "conditions": [
                        {"type": "Ready", "status": value},
                        {"type": "ContainersReady", "status": value},
                    ],
                }
            },
        )


def make_all_ready(cluster: Cluster, namespace: str, name: str, prefill: int = 1, decode: int = 1) -> None:
    for component, count in (
        ("prefill", prefill),
        ("decode", decode),
        ("router", 1),
        ("gateway", 1),
        ("redis", 1),
    ):
        set_pods_ready(cluster, namespace, name, component, count)


def running_job(cluster: Cluster, namespace: str, name: str, exclude: tuple[str, ...] = ()) -> dict:
    """The status of a profiling run whose Job exists and is not one of `exclude`."""

    def check() -> dict | None:
        profiling = (get(cluster, namespace, name).get("status") or {}).get("profiling") or {}
        job = profiling.get("job")
        if profiling.get("state") == "Running" and job not in exclude:
            cluster.batch.read_namespaced_job(job, namespace)
            return profiling
        return None

    return wait_for(check, 60, "a running profiling Job")


def finish_job(
    cluster: Cluster, namespace: str, job: str, profile: dict | None, succeed: bool = True
) -> None:
    """Play the profiler and the kubelet: write the ConfigMap, then end the Job's pod."""
    if profile is not None:
        cluster.core.patch_namespaced_config_map(
            f"{job.split('-profile-')[0]}-profile", namespace, {"data": {"profile.json": json.dumps(profile)}}
        )
    pod = wait_for(lambda: pods(cluster, namespace, f"job-name={job}"), 60, f"the pod of Job {job}")[0]
    phase = "Succeeded" if succeed else "Failed"
    cluster.core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": {"phase": phase}})


def event_reasons(cluster: Cluster, namespace: str, name: str) -> list[str]:
    events = cluster.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
    return [e.reason for e in events]


def children(cluster: Cluster, namespace: str, name: str) -> dict[str, list[str]]:
    """Names of every owned child by kind, found by the instance label."""
    selector = f"{INSTANCE}={name}"
    listers = {
        "Deployment": cluster.apps.list_namespaced_deployment,
        "StatefulSet": cluster.apps.list_namespaced_stateful_set,
        "Service": cluster.core.list_namespaced_service,
        "ServiceAccount": cluster.core.list_namespaced_service_account,
        "ConfigMap": cluster.core.list_namespaced_config_map,
        "Role": cluster.rbac.list_namespaced_role,
        "RoleBinding": cluster.rbac.list_namespaced_role_binding,
        "Job": cluster.batch.list_namespaced_job,
    }
    return {
        kind: sorted(item.metadata.name for item in lister(namespace, label_selector=selector).items)
        for kind, lister in listers.items()
    }


def profile_for(profiling: dict, kappa: float, lambda_c: float) -> dict:
    """What the profiler writes: the shared schema (basin.profile_schema) with the Job's fingerprint."""
    return {
        "kappa": kappa,
        "lambda_c_per_min": lambda_c,
        "prefill_gpu_tokens": 1_090_000,
        "host_tokens": 0,
        "decode_kv_tokens": 1_660_000,
        "prefill_tokens_per_s": 31_000.0,
        "fingerprint": profiling["fingerprint"],
        "profiled_at": "2026-11-30T10:00:00Z",
    }


EXPECTED = {
    "Deployment": ["x-decode", "x-gateway", "x-prefill", "x-router"],
    "StatefulSet": ["x-redis"],
    "Service": ["x-gateway", "x-redis", "x-router"],
    "ServiceAccount": ["x-gateway", "x-profiler", "x-router"],
    "ConfigMap": ["x-profile"],
    "Role": ["x-gateway", "x-profiler", "x-router"],
    "RoleBinding": ["x-gateway", "x-profiler", "x-router"],
}


def test_apply_creates_every_child_with_spec_and_owner(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    body = resource(
        "x", prefill={"hicache": {"hostRatio": 4, "writePolicy": "write_back"}, "extraArgs": ["--a"]}
    )
    created = create(cluster, namespace, body)
    uid = created["metadata"]["uid"]

    def complete() -> dict | None:
        found = children(cluster, namespace, "x")
        return found if all(found[k] == v for k, v in EXPECTED.items()) and len(found["Job"]) == 1 else None

    found = wait_for(complete, 60, "every child")
    owned = [
        *cluster.apps.list_namespaced_deployment(namespace).items,
        *cluster.apps.list_namespaced_stateful_set(namespace).items,
        *cluster.core.list_namespaced_service(namespace).items,
        *cluster.core.list_namespaced_config_map(namespace, label_selector=f"{INSTANCE}=x").items,
        *cluster.rbac.list_namespaced_role(namespace).items,
        *cluster.rbac.list_namespaced_role_binding(namespace).items,
        *cluster.batch.list_namespaced_job(namespace).items,
    ]
    for child in owned:
        refs = child.metadata.owner_references or []
        assert [(r.kind, r.uid, r.controller) for r in refs] == [("BasinDeployment", uid, True)], (
            child.metadata.name
        )

    prefill = cluster.apps.read_namespaced_deployment("x-prefill", namespace)
    args = prefill.spec.template.spec.containers[0].args
    for flag in (
        "--enable-metrics",
        "--enable-priority-scheduling",
        "--schedule-low-priority-values-first",
        "--enable-hierarchical-cache",
    ):
        assert flag in args
    assert args[args.index("--disaggregation-mode") + 1] == "prefill"
    assert args[args.index("--hicache-ratio") + 1] == "4"
    assert args[args.index("--hicache-write-policy") + 1] == "write_back"
    assert args[-1] == "--a"
    assert prefill.spec.template.spec.containers[0].resources.limits == {"nvidia.com/gpu": "1"}
    assert {e.name: e.value for e in prefill.spec.template.spec.containers[0].env}["SGLANG_PLUGINS"]
    decode_args = (
        cluster.apps.read_namespaced_deployment("x-decode", namespace).spec.template.spec.containers[0].args
    )
    assert decode_args[decode_args.index("--disaggregation-mode") + 1] == "decode"
    assert "--enable-hierarchical-cache" not in decode_args  # decode's host ratio defaults to 0

    router = cluster.apps.read_namespaced_deployment("x-router", namespace).spec.template.spec
    router_args = router.containers[0].args
    assert router_args[router_args.index("--prefill-selector") + 1 :][:3] == [
        f"{INSTANCE}=x",
        f"{COMPONENT}=prefill",
        "basin.dev/role=prefill",
    ]
    assert router.service_account_name == "x-router"
    router_role = cluster.rbac.read_namespaced_role("x-router", namespace)
    assert [(r.resources, r.verbs) for r in router_role.rules] == [(["pods"], ["get", "list", "watch"])]

    gateway = cluster.apps.read_namespaced_deployment("x-gateway", namespace).spec.template.spec
    env = {e.name: e.value for e in gateway.containers[0].env}
    assert gateway.containers[0].command == ["basin", "gateway", "run"]
    assert env["BASIN_REDIS_URL"] == "redis://x-redis:6379/0"
    assert env["BASIN_ROUTER_URL"] == "http://x-router:8000"
    assert env["BASIN_POLICY_MARGIN"] == f"{BasinConfig().margin:g}"
    assert [v.config_map.name for v in gateway.volumes if v.config_map] == ["x-profile"]

    job = cluster.batch.read_namespaced_job(found["Job"][0], namespace)
    job_env = {e.name: e.value for e in job.spec.template.spec.containers[0].env}
    assert job.spec.template.spec.containers[0].command == ["python", "-m", "basin_profiler"]
    assert (
        job_env["BASIN_PREFILL_REPLICAS"] == "1" and job_env["BASIN_GATEWAY_URL"] == "http://x-gateway:8080"
    )

    obj = wait_condition(cluster, namespace, "x", "PrefillReady", "False", "ReplicasNotReady")
    status = obj["status"]
    assert status["firstLimit"] in ("cache-first", "decode-first")
    assert status["observedGeneration"] == obj["metadata"]["generation"]
    assert condition(obj, "Ready")["status"] == "False"
    assert status["profiling"]["trigger"] == "create"
    reasons = event_reasons(cluster, namespace, "x")
    assert "Created" in reasons and "ProfilingStarted" in reasons


def test_invalid_resources_are_rejected_naming_the_field(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    cases = {
        "spec.prefill.replicas": resource("bad", prefill={"replicas": 0}),
        "spec.gpuKind": resource("bad", gpuKind="a100"),
        "spec.gateway.policy.margin": resource("bad", gateway={"policy": {"margin": 1.5}}),
        "spec.model.path": resource("bad", model={"path": ""}),
        "spec.redis.mode": resource("bad", redis={"mode": "sometimes"}),
    }
    for field, body in cases.items():
        with pytest.raises(ApiException) as caught:
            create(cluster, namespace, body)
        assert caught.value.status == 422
        assert field in caught.value.body, caught.value.body

    missing_model = resource("bad")
    del missing_model["spec"]["model"]
    with pytest.raises(ApiException) as caught:
        create(cluster, namespace, missing_model)
    assert "spec.model" in caught.value.body

    # Defaults come from the schema, the controller's from BasinConfig.
    created = create(cluster, namespace, resource("ok"))
    spec = created["spec"]
    defaults = BasinConfig()
    assert spec["gateway"]["policy"]["margin"] == defaults.margin
    assert spec["gateway"]["policy"]["shedAfterSeconds"] == defaults.shed_after_s
    assert spec["gateway"]["policy"]["priorityRate"] == defaults.priority_rate
    assert spec["prefill"]["hicache"]["hostRatio"] == 2.0 and spec["decode"]["hicache"]["hostRatio"] == 0.0
    assert spec["redis"]["mode"] == "managed" and spec["router"]["policy"] == "cache_aware"
    assert "predictor" not in spec["gateway"]

    # What the schema of Kubernetes 1.20 cannot say, the operator reports in status and events.
    create(cluster, namespace, resource("ext", redis={"mode": "external"}))
    obj = wait_condition(cluster, namespace, "ext", "Ready", "False", "InvalidSpec")
    assert "spec.redis.url" in condition(obj, "Ready")["message"]
    assert obj["status"]["phase"] == "Invalid"
    assert "InvalidSpec" in wait_for(
        lambda: event_reasons(cluster, namespace, "ext"), 30, "an InvalidSpec event"
    )
    assert children(cluster, namespace, "ext")["Deployment"] == []


def test_status_progresses_and_scale_reprofiles(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    create(cluster, namespace, resource("x"))
    first = running_job(cluster, namespace, "x")
    set_pods_ready(cluster, namespace, "x", "prefill", 1)
    wait_condition(cluster, namespace, "x", "PrefillReady", "True", "ReplicasReady")
    obj = get(cluster, namespace, "x")
    assert condition(obj, "DecodeReady")["status"] == "False"
    set_pods_ready(cluster, namespace, "x", "decode", 1)
    set_pods_ready(cluster, namespace, "x", "router", 1)
    wait_condition(cluster, namespace, "x", "RouterReady", "True")
    obj = wait_condition(cluster, namespace, "x", "GatewayReady", "False")
    assert condition(obj, "GatewayReady")["message"].startswith("0/1 gateway replicas ready")
    set_pods_ready(cluster, namespace, "x", "gateway", 1)
    obj = wait_condition(cluster, namespace, "x", "GatewayReady", "False", "RedisNotReady")
    set_pods_ready(cluster, namespace, "x", "redis", 1)
    obj = wait_condition(cluster, namespace, "x", "Ready", "False", "NotProfiled")
    assert obj["status"]["phase"] == "Pending"
    assert condition(obj, "Profiled")["reason"] == "Profiling"

    finish_job(cluster, namespace, first["job"], profile_for(first, 1.1, 6.0))
    obj = wait_condition(cluster, namespace, "x", "Ready", "True")
    assert condition(obj, "Profiled")["status"] == "True"
    profile = obj["status"]["profile"]
    assert (profile["kappa"], profile["lambdaCPerMin"], profile["state"]) == (1.1, 6.0, "fresh")
    assert profile["fingerprint"] == first["fingerprint"] and obj["status"]["phase"] == "Ready"

    # Scale prefill 1 -> 2 through the scale subresource: once the new pod is ready and that has held for
    # the debounce, a new Job, the old profile stale meanwhile.
    cluster.custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, namespace, PLURAL, "x", {"spec": {"replicas": 2}}
    )
    set_pods_ready(cluster, namespace, "x", "prefill", 2)
    second = running_job(cluster, namespace, "x", exclude=(first["job"],))
    assert second["prefillReplicas"] == 2 and second["trigger"] == "scale"
    assert second["fingerprint"] != first["fingerprint"]
    obj = wait_condition(cluster, namespace, "x", "Profiled", "False", "Profiling")
    assert obj["status"]["profile"]["state"] == "stale" and obj["status"]["profile"]["kappa"] == 1.1
    assert cluster.apps.read_namespaced_deployment("x-prefill", namespace).spec.replicas == 2
    scale = cluster.custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "x")
    wait_for(
        lambda: (
            cluster.custom.get_namespaced_custom_object_scale(GROUP, VERSION, namespace, PLURAL, "x")[
                "status"
            ].get("replicas")
            == 2
        ),
        30,
        "the scale subresource to report 2 ready prefill replicas",
    )
    assert scale["spec"]["replicas"] == 2

    finish_job(cluster, namespace, second["job"], profile_for(second, 1.4, 11.5))
    obj = wait_condition(cluster, namespace, "x", "Profiled", "True")
    profile = obj["status"]["profile"]
    assert (profile["kappa"], profile["lambdaCPerMin"], profile["state"]) == (1.4, 11.5, "fresh")
    assert profile["fingerprint"] == second["fingerprint"]
    reasons = event_reasons(cluster, namespace, "x")
    assert reasons.count("ProfilingStarted") == 2 and reasons.count("Profiled") == 2

    # Scaling decode through the spec reprofiles too.
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "x", {"spec": {"decode": {"replicas": 3}}}
    )
    set_pods_ready(cluster, namespace, "x", "decode", 3)
    third = running_job(cluster, namespace, "x", exclude=(first["job"], second["job"]))
    assert (third["prefillReplicas"], third["decodeReplicas"]) == (2, 3)

    table = kubectl(cluster, "get", "basindeployments", "-n", namespace, "-o", "wide")
    header = table.splitlines()[0].split()
    assert header == ["NAME", "PREFILL", "DECODE", "KAPPA", "PROFILE", "LIMIT", "PHASE", "AGE"]
    row = table.splitlines()[1].split()
    assert row[:5] == ["x", "2", "3", "1.4", "stale"]

    # Back to a shape measured before: a new Job for it, numbered past the old one, not the old one adopted.
    cluster.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "x", {"spec": {"decode": {"replicas": 1}}}
    )
    fourth = running_job(cluster, namespace, "x", exclude=(first["job"], second["job"], third["job"]))
    assert (fourth["fingerprint"], fourth["attempt"]) == (second["fingerprint"], 2)

    def job_names() -> list[str]:
        return [job.metadata.name for job in cluster.batch.list_namespaced_job(namespace).items]

    wait_for(lambda: third["job"] not in job_names(), 30, "the superseded Job to be deleted")
    assert "ProfilingSuperseded" in event_reasons(cluster, namespace, "x")


def kubectl(cluster: Cluster, *args: str) -> str:
    binary = Path.home() / ".cache" / "basin-k8s" / "bin" / "kubectl"
    result = subprocess.run(
        [str(binary), "--kubeconfig", cluster.kubeconfig, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_failed_profiling_job_sets_profiled_false_and_retries_with_backoff(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    create(cluster, namespace, resource("x"))
    first = running_job(cluster, namespace, "x")
    finish_job(cluster, namespace, first["job"], None, succeed=False)
    obj = wait_condition(cluster, namespace, "x", "Profiled", "False", "ProfilingFailed")
    assert first["job"] in condition(obj, "Profiled")["message"]
    assert "BackoffLimitExceeded" in obj["status"]["profiling"]["message"]
    assert "ProfilingFailed" in event_reasons(cluster, namespace, "x")
    retry = running_job(cluster, namespace, "x", exclude=(first["job"],))
    assert retry["attempt"] == 2 and retry["trigger"] == "retry"
    assert retry["fingerprint"] == first["fingerprint"]

    # A succeeded Job whose ConfigMap holds another deployment's profile is a failure too.
    finish_job(cluster, namespace, retry["job"], {**profile_for(retry, 1.0, 5.0), "fingerprint": "other"})
    obj = wait_condition(cluster, namespace, "x", "Profiled", "False", "ProfilingFailed")
    assert "fingerprint" in obj["status"]["profiling"]["message"]
    third = running_job(cluster, namespace, "x", exclude=(first["job"], retry["job"]))
    assert third["attempt"] == 3

    # A profile without the capacities the gateway needs fails the shared schema, naming the field.
    incomplete = {k: v for k, v in profile_for(third, 1.0, 5.0).items() if k != "decode_kv_tokens"}
    finish_job(cluster, namespace, third["job"], incomplete)
    obj = wait_condition(cluster, namespace, "x", "Profiled", "False", "ProfilingFailed")
    assert "decode_kv_tokens" in obj["status"]["profiling"]["message"]
    fourth = running_job(cluster, namespace, "x", exclude=(first["job"], retry["job"], third["job"]))

    # A failed run's reason, left by the profiler in the ConfigMap's status key, reaches the status.
    cluster.core.patch_namespaced_config_map(
        "x-profile",
        namespace,
        {"data": {"status": json.dumps({"state": "failed", "reason": "target unreachable",
                                        "fingerprint": fourth["fingerprint"]})}},
    )  # fmt: skip
    finish_job(cluster, namespace, fourth["job"], None, succeed=False)

    def reason_shown() -> bool:
        profiling = get(cluster, namespace, "x")["status"]["profiling"]
        return profiling["job"] == fourth["job"] and "target unreachable" in (profiling.get("message") or "")

    wait_for(reason_shown, 60, "the profiler's reason in status.profiling.message")


def test_ready_replicas_that_stay_changed_trigger_a_profile(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    create(cluster, namespace, resource("x", decode={"replicas": 2}))
    make_all_ready(cluster, namespace, "x", decode=2)
    first = running_job(cluster, namespace, "x")
    finish_job(cluster, namespace, first["job"], profile_for(first, 1.0, 8.0))
    wait_condition(cluster, namespace, "x", "Profiled", "True")
    # One decode pod stops being ready and stays so past the 3 s debounce: profile the serving shape.
    set_pods_ready(cluster, namespace, "x", "decode", 1, ready=False)
    changed = time.monotonic()
    second = running_job(cluster, namespace, "x", exclude=(first["job"],))
    assert time.monotonic() - changed >= 2.5
    assert (second["prefillReplicas"], second["decodeReplicas"], second["trigger"]) == (
        1,
        1,
        "ready replicas",
    )


def test_drift_restart_and_garbage_collection(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str
) -> None:
    create(cluster, namespace, resource("x"))
    wait_for(
        lambda: all(children(cluster, namespace, "x")[k] == v for k, v in EXPECTED.items()), 60, "children"
    )
    job = running_job(cluster, namespace, "x")["job"]

    # A deleted child comes back; a hand-edited one is put back.
    old = cluster.apps.read_namespaced_deployment("x-prefill", namespace).metadata.uid
    cluster.apps.delete_namespaced_deployment("x-prefill", namespace)
    # 1.20 answers a Status, which this client cannot read as a Service: skip decoding.
    cluster.core.delete_namespaced_service("x-router", namespace, _preload_content=False)
    wait_for(
        lambda: cluster.apps.read_namespaced_deployment("x-prefill", namespace).metadata.uid != old,
        30,
        "the prefill Deployment to come back",
    )
    wait_for(lambda: cluster.core.read_namespaced_service("x-router", namespace), 30, "the router Service")
    cluster.apps.patch_namespaced_deployment(
        "x-gateway",
        namespace,
        {"spec": {"replicas": 5}, "metadata": {"annotations": {"basin.dev/spec-hash": "edited"}}},
    )
    wait_for(
        lambda: cluster.apps.read_namespaced_deployment("x-gateway", namespace).spec.replicas == 1,
        30,
        "the gateway's replicas put back",
    )
    # A deleted running profiling Job is started again under the same name.
    cluster.batch.delete_namespaced_job(job, namespace, propagation_policy="Background")
    wait_for(
        lambda: cluster.batch.read_namespaced_job(job, namespace).metadata.deletion_timestamp is None,
        60,
        "the profiling Job to come back",
    )

    # A restarted operator resumes without duplicating anything: wait until the new process has resumed this
    # object and run its resync timer a few times, then count again.
    before = children(cluster, namespace, "x")
    operator_process.restart()
    log = operator_process.logs[-1]
    wait_for(
        lambda: any(
            "Resuming is processed: 1 succeeded" in line and f'"namespace": "{namespace}"' in line
            for line in log.read_text().splitlines()
        ),
        60,
        "the new operator to resume this object",
    )
    tick = f"Resync of {namespace}/x succeeded"
    ticks = log.read_text().count(tick)
    wait_for(lambda: log.read_text().count(tick) >= ticks + 3, 60, "three resync passes")
    assert children(cluster, namespace, "x") == before

    # Deleting the resource garbage-collects every child (owner references; no finalizer holds it).
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "x")
    wait_for(
        lambda: all(not names for names in children(cluster, namespace, "x").values()),
        120,
        "the children to be garbage-collected",
        every=1.0,
    )


def test_operator_is_not_cluster_admin(cluster: Cluster, operator_process: OperatorProcess) -> None:
    """The operator's identity may do its job and nothing like reading secrets or granting cluster roles."""
    auth = client.AuthorizationV1Api(
        config.new_client_from_config(config_file=str(operator_process.kubeconfig))
    )

    def allowed(verb: str, resource_name: str, group: str = "", subresource: str = "") -> bool:
        attributes = {"verb": verb, "resource": resource_name, "group": group, "namespace": "default"}
        if subresource:
            attributes["subresource"] = subresource
        return auth.create_self_subject_access_review(
            {"spec": {"resourceAttributes": attributes}}
        ).status.allowed

    assert allowed("create", "deployments", "apps")
    assert allowed("patch", "basindeployments", GROUP, "status")
    assert not allowed("get", "secrets")
    assert not allowed("create", "clusterroles", "rbac.authorization.k8s.io")
    assert not allowed("delete", "namespaces")
    assert not allowed("create", "pods")
    role = yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "operator/deploy/clusterrole.yaml").read_text()
    )
    assert all("*" not in rule["verbs"] and "*" not in rule["resources"] for rule in role["rules"])


def test_liveness_probe_answers(operator_process: OperatorProcess) -> None:
    """`--liveness` serves kopf's probe (a deployment's livenessProbe restarts a deaf operator)."""
    url = f"http://127.0.0.1:{operator_process.liveness_port}/healthz"
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
