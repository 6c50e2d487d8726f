"""Pure `build_*` functions: a BasinDeployment spec in, child manifests out (plain dicts, no API calls).

The handlers adopt these (owner reference) and server-side apply them on every pass (`kube.ensure`); the
`basin.dev/spec-hash` annotation is a digest of the built child. Every child carries the instance labels,
so deleting the BasinDeployment garbage-collects them and the router discovers engines by label.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from basin_operator import constants as c
from basin_operator.spec import BasinDeploymentSpec, Resources, RoleSpec

Manifest = dict[str, Any]


def digest(value: Any, length: int = 16) -> str:
    """A short stable hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:length]


def labels(name: str, component: str) -> dict[str, str]:
    """The labels every child of `name` carries; (instance, component) selects one component's pods."""
    return {
        c.LABEL_INSTANCE: name,
        c.LABEL_COMPONENT: component,
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        c.LABEL_PART_OF: "basin",
    }


def selector(name: str, component: str) -> dict[str, str]:
    return {c.LABEL_INSTANCE: name, c.LABEL_COMPONENT: component}


def selector_string(name: str, component: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(name, component).items())


def _meta(name: str, namespace: str, component: str, child: str | None = None) -> Manifest:
    return {
        "name": child or c.child_name(name, component),
        "namespace": namespace,
        "labels": labels(name, component),
    }


def _resources(resources: Resources, gpus: int = 0) -> Manifest:
    """Container resources; the GPU count goes into limits (an extended resource's request follows it).
    Quantities are strings: server-side apply of 1.20 rejects a bare number where a quantity goes."""
    out: Manifest = {}
    if resources.requests:
        out["requests"] = {k: str(v) for k, v in resources.requests.items()}
    limits = {k: str(v) for k, v in resources.limits.items()}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    if limits:
        out["limits"] = limits
    return out


def _pod_placement(role: RoleSpec) -> Manifest:
    out: Manifest = {}
    if role.node_selector:
        out["nodeSelector"] = dict(role.node_selector)
    if role.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in role.tolerations]
    return out


def engine_args(spec: BasinDeploymentSpec, mode: str) -> list[str]:
    """`sglang.launch_server` arguments of one PD role: PD mode, metrics, low-values-first priority
    scheduling (BASIN's session keys), HiCache when a host tier is configured, then the user's extras."""
    role: RoleSpec = spec.prefill if mode == "prefill" else spec.decode
    args = [
        "--model-path", spec.model.path,
        "--served-model-name", spec.model.served_name or spec.model.path,
        "--host", "0.0.0.0",
        "--port", str(c.ENGINE_PORT),
        "--tp-size", str(role.gpus_per_replica),
        "--disaggregation-mode", mode,
        "--enable-metrics",
        "--enable-priority-scheduling",
        "--schedule-low-priority-values-first",
    ]  # fmt: skip
    if mode == "prefill":
        args += ["--disaggregation-bootstrap-port", str(c.BOOTSTRAP_PORT)]
    # Reservation at prefill completion (docs/engine-ext.md): the policy on both roles, over NIXL.
    backend = spec.disaggregation.backend()
    if backend is not None:
        args += ["--disaggregation-transfer-backend", backend]
    if spec.disaggregation.decode_allocation != "early":
        args += ["--disaggregation-decode-allocation-policy", spec.disaggregation.decode_allocation]
    if role.hicache.host_ratio > 0:
        args += [
            "--enable-hierarchical-cache",
            "--hicache-ratio", f"{role.hicache.host_ratio:g}",
            "--hicache-write-policy", role.hicache.write_policy,
        ]  # fmt: skip
    return args + list(role.extra_args)


def build_engine_deployment(name: str, namespace: str, spec: BasinDeploymentSpec, mode: str) -> Manifest:
    """A prefill or decode Deployment of SGLang engines with the Basin engine extension enabled."""
    role: RoleSpec = spec.prefill if mode == "prefill" else spec.decode
    pod_labels = {**labels(name, mode), c.LABEL_ROLE: mode}
    ports = [{"name": "http", "containerPort": c.ENGINE_PORT, "protocol": "TCP"}]
    annotations = {}
    if mode == "prefill":
        ports.append({"name": "bootstrap", "containerPort": c.BOOTSTRAP_PORT, "protocol": "TCP"})
        annotations[c.BOOTSTRAP_PORT_ANNOTATION] = str(c.BOOTSTRAP_PORT)
    else:
        ports.append({"name": "units", "containerPort": c.UNIT_PORT, "protocol": "TCP"})
    # The engine extension (docs/engine-ext.md): decode serves lent units on UNIT_PORT, prefill fetches
    # them there; both roles must agree on the port. φ caps the decode memory lent: only decode's lender
    # reads it, so it sits in decode's pod template alone and a change of φ rolls decode, not prefill.
    env = [
        {"name": c.ENGINE_PLUGIN_ENV, "value": c.ENGINE_PLUGIN},
        {"name": "BASIN_ENGINE_UNIT_PORT", "value": str(c.UNIT_PORT)},
    ]
    if mode == "decode":
        env.append({"name": "BASIN_ENGINE_LEND_CAP", "value": str(spec.gateway.policy.lend_cap)})
    container = {
        "name": "engine",
        "image": spec.images.engine,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": engine_args(spec, mode),
        "env": env,
        "ports": ports,
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": c.ENGINE_PORT},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "resources": _resources(role.resources, role.gpus_per_replica),
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, mode),
        "spec": {
            "replicas": role.replicas,
            "selector": {"matchLabels": selector(name, mode)},
            "template": {
                "metadata": {"labels": pod_labels, "annotations": annotations},
                "spec": {
                    "automountServiceAccountToken": False,
                    "containers": [container],
                    "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
                    **_pod_placement(role),
                },
            },
        },
    }


def build_service_account(name: str, namespace: str, component: str) -> Manifest:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(name, namespace, component)}


def build_role(name: str, namespace: str, component: str) -> Manifest:
    """Least privilege per component: the router watches pods, the gateway reads pods and the profile
    ConfigMap, the profiler writes only the profile ConfigMap (and Events saying why a run failed)."""
    profile = c.child_name(name, "profile")
    rules = {
        "router": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        "gateway": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [profile],
                # list and watch with the field selector metadata.name=<profile> are authorized against
                # resourceNames, so the gateway can watch its profile without reading other ConfigMaps
                "verbs": ["get", "list", "watch"],
            },
        ],
        "profiler": [
            {
                "apiGroups": [""],
                "resources": ["configmaps"],
                "resourceNames": [profile],
                "verbs": ["get", "update", "patch"],
            },
            # a failed run also says why in an Event on the BasinDeployment (create cannot be limited by name)
            {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        ],
    }[component]
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _meta(name, namespace, component),
        "rules": rules,
    }


def build_role_binding(name: str, namespace: str, component: str) -> Manifest:
    child = c.child_name(name, component)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(name, namespace, component),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": child},
        "subjects": [{"kind": "ServiceAccount", "name": child, "namespace": namespace}],
    }


def build_router_deployment(name: str, namespace: str, spec: BasinDeploymentSpec) -> Manifest:
    """SGLang's PD router with Kubernetes service discovery: scaling engines needs no router rewrite."""

    def pairs(component: str) -> list[str]:
        return [f"{k}={v}" for k, v in {**selector(name, component), c.LABEL_ROLE: component}.items()]

    args = [
        "--pd-disaggregation",
        "--service-discovery",
        "--service-discovery-namespace", namespace,
        "--service-discovery-port", str(c.ENGINE_PORT),
        "--prefill-selector", *pairs("prefill"),
        "--decode-selector", *pairs("decode"),
        "--policy", spec.router.policy,
        "--host", "0.0.0.0",
        "--port", str(c.ROUTER_PORT),
        "--prometheus-host", "0.0.0.0",
        "--prometheus-port", str(c.ROUTER_METRICS_PORT),
    ]  # fmt: skip
    container = {
        "name": "router",
        "image": spec.router.image or spec.images.engine,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["python3", "-m", "sglang_router.launch_router"],
        "args": args,
        "ports": [
            {"name": "http", "containerPort": c.ROUTER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": c.ROUTER_METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": {"httpGet": {"path": "/health", "port": c.ROUTER_PORT}, "periodSeconds": 10},
        "resources": _resources(spec.router.resources),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, "router"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector(name, "router")},
            "template": {
                "metadata": {"labels": labels(name, "router")},
                "spec": {"serviceAccountName": c.child_name(name, "router"), "containers": [container]},
            },
        },
    }


def build_service(
    name: str,
    namespace: str,
    component: str,
    ports: dict[str, int],
    headless: bool = False,
    target: str | None = None,
    target_port: int | None = None,
) -> Manifest:
    """A Service named for `component`, selecting the pods of `target` (default: the same component) on
    `target_port` (default: each port's own number)."""
    spec: Manifest = {
        "selector": selector(name, target or component),
        "ports": [
            {"name": port, "port": number, "targetPort": target_port or number, "protocol": "TCP"}
            for port, number in ports.items()
        ],
    }
    if headless:
        spec["clusterIP"] = "None"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, component),
        "spec": spec,
    }


def engine_component(spec: BasinDeploymentSpec, role: str) -> str:
    """The component whose pods serve `role` (prefill, decode, router): the emulator's in emulated mode."""
    return "emulator" if spec.emulator.enabled else role


# A Pod being deleted keeps serving while its address leaves the Service's endpoints (kube-proxy and the
# router learn it a moment later): without this wait the server closes its socket at once and calls sent
# in that moment are refused. SIGTERM follows, then the server finishes what it has in flight.
DRAIN_BEFORE_STOP = {"preStop": {"exec": {"command": ["sleep", str(c.DRAIN_SECONDS)]}}}


def emulator_args(spec: BasinDeploymentSpec) -> list[str]:
    """`basin emulate` arguments: the preset, host tier, allocation policy and time scale from the spec,
    serving on the router's port so the router Service needs no other target."""
    args = [
        "emulate",
        "--deployment", spec.emulator_preset(),
        "--host-tier", f"{spec.prefill.hicache.host_ratio:g}",
        "--allocation-policy", spec.disaggregation.decode_allocation,
        "--time-scale", f"{spec.emulator.time_scale:g}",
        "--model-name", spec.model.served_name or spec.model.path,
        "--host", "0.0.0.0",
        "--port", str(c.ROUTER_PORT),
        "--lending",
    ]  # fmt: skip
    if spec.router.policy == "cache_aware":
        args += ["--router", "cache_aware"]
    return args


def build_emulator_deployment(name: str, namespace: str, spec: BasinDeploymentSpec) -> Manifest:
    """The emulated-engine mode's one pod: `basin emulate` in the Basin image, standing in for the
    prefill and decode engines and the router (one process: its engine model holds every instance)."""
    container = {
        "name": "emulator",
        "image": spec.images.basin,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["basin"],
        "args": emulator_args(spec),
        "ports": [{"name": "http", "containerPort": c.ROUTER_PORT, "protocol": "TCP"}],
        # A loaded emulator's event loop may answer late; a 1 s probe would take it out of its Service.
        "readinessProbe": {
            "httpGet": {"path": "/health", "port": c.ROUTER_PORT},
            "periodSeconds": 5,
            "timeoutSeconds": 10,
        },
        "lifecycle": DRAIN_BEFORE_STOP,
        "livenessProbe": {
            "httpGet": {"path": "/health_generate", "port": c.ROUTER_PORT},
            "periodSeconds": 30,
            "timeoutSeconds": 25,
            "failureThreshold": 3,
        },
        "resources": _resources(spec.emulator.resources),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, "emulator"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": selector(name, "emulator")},
            "template": {
                "metadata": {"labels": labels(name, "emulator")},
                "spec": {"automountServiceAccountToken": False, "containers": [container]},
            },
        },
    }


def redis_url(name: str, spec: BasinDeploymentSpec) -> str:
    if spec.redis.mode == "external":
        return spec.redis.url or ""
    return f"redis://{c.child_name(name, 'redis')}:{c.REDIS_PORT}/0"


def gateway_env(name: str, spec: BasinDeploymentSpec) -> list[Manifest]:
    """The gateway's configuration: everything `basin gateway run` reads (docs/operator.md lists it)."""
    policy = spec.gateway.policy
    values = {
        "BASIN_GATEWAY_PORT": str(c.GATEWAY_PORT),
        "BASIN_ROUTER_URL": f"http://{c.child_name(name, 'router')}:{c.ROUTER_PORT}",
        "BASIN_REDIS_URL": redis_url(name, spec),
        "BASIN_SESSION_HEADER": spec.gateway.session_header,
        "BASIN_PROFILE_PATH": f"{c.PROFILE_MOUNT}/{c.PROFILE_KEY}",
        "BASIN_PROFILE_CONFIGMAP": c.child_name(name, "profile"),
        "BASIN_PREFILL_SELECTOR": selector_string(name, engine_component(spec, "prefill")),
        "BASIN_DECODE_SELECTOR": selector_string(name, engine_component(spec, "decode")),
        "BASIN_ENGINE_PORT": str(c.ROUTER_PORT if spec.emulator.enabled else c.ENGINE_PORT),
        "BASIN_POLICY_INTERVAL_S": f"{policy.control_interval_seconds:g}",
        "BASIN_POLICY_FAST_INTERVAL_S": f"{policy.fast_control_interval_seconds:g}",
        "BASIN_POLICY_MARGIN": f"{policy.margin:g}",
        "BASIN_POLICY_ALPHA_LEND": f"{policy.alpha_lend:g}",
        "BASIN_POLICY_ALPHA_ORDER": f"{policy.alpha_order:g}",
        "BASIN_POLICY_ALPHA_RELEASE": f"{policy.alpha_release:g}",
        "BASIN_POLICY_LEND_CAP": f"{policy.lend_cap:g}",
        "BASIN_POLICY_SHED_AFTER_S": f"{policy.shed_after_seconds:g}",
        "BASIN_POLICY_PRIORITY_RATE": f"{policy.priority_rate:g}",
    }
    if spec.emulator.enabled:
        # One emulator pod answers for both roles; its /metrics labels each series with engine_type.
        values["BASIN_ENGINES_EMULATED"] = "1"
        # The gateway's clock in model seconds must run at the emulator's pace (docs/gateway.md): its
        # control interval, parking and idle timeouts are model seconds.
        values["BASIN_TIME_SCALE"] = f"{spec.emulator.time_scale:g}"
    elif spec.gateway.addressing == "direct":
        values["BASIN_DIRECT_ENGINES"] = "1"
        values["BASIN_BOOTSTRAP_PORT"] = str(c.BOOTSTRAP_PORT)
    if spec.gateway.predictor is not None:
        values["BASIN_PREDICTOR_PATH"] = f"{c.PREDICTOR_MOUNT}/{spec.gateway.predictor.key}"
    env: list[Manifest] = [{"name": k, "value": v} for k, v in values.items()]
    env.append({"name": "BASIN_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}})
    env.append(admin_token_env(name))
    secret = spec.redis.password_secret
    if spec.redis.mode == "external" and secret is not None:
        env.append(
            {
                "name": "BASIN_REDIS_PASSWORD",
                "valueFrom": {"secretKeyRef": {"name": secret.name, "key": secret.key}},
            }
        )
    return env


def build_gateway_deployment(name: str, namespace: str, spec: BasinDeploymentSpec) -> Manifest:
    """The session gateway: Redis URL, the profile ConfigMap mounted (it reloads on change), predictor."""
    mounts = [{"name": "profile", "mountPath": c.PROFILE_MOUNT, "readOnly": True}]
    volumes: list[Manifest] = [
        {"name": "profile", "configMap": {"name": c.child_name(name, "profile"), "optional": True}}
    ]
    if spec.gateway.predictor is not None:
        mounts.append({"name": "predictor", "mountPath": c.PREDICTOR_MOUNT, "readOnly": True})
        volumes.append({"name": "predictor", "configMap": {"name": spec.gateway.predictor.config_map}})
    container = {
        "name": "gateway",
        "image": spec.images.basin,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["basin", "gateway", "run"],
        "env": gateway_env(name, spec),
        "ports": [{"name": "http", "containerPort": c.GATEWAY_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": c.GATEWAY_PORT}, "periodSeconds": 5},
        "lifecycle": DRAIN_BEFORE_STOP,
        "resources": _resources(spec.gateway.resources),
        "volumeMounts": mounts,
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(name, namespace, "gateway"),
        "spec": {
            "replicas": spec.gateway.replicas,
            "selector": {"matchLabels": selector(name, "gateway")},
            "template": {
                "metadata": {"labels": labels(name, "gateway")},
                "spec": {
                    "serviceAccountName": c.child_name(name, "gateway"),
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def build_redis_statefulset(name: str, namespace: str, spec: BasinDeploymentSpec) -> Manifest:
    """A single managed Redis without persistence: gateway state is soft (sessions re-register)."""
    container = {
        "name": "redis",
        "image": spec.images.redis,
        "imagePullPolicy": spec.images.pull_policy,
        "args": ["--save", "", "--appendonly", "no"],
        "ports": [{"name": "redis", "containerPort": c.REDIS_PORT, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": c.REDIS_PORT}, "periodSeconds": 5},
        "resources": _resources(spec.redis.resources),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(name, namespace, "redis"),
        "spec": {
            "replicas": 1,
            "serviceName": c.child_name(name, "redis"),
            "selector": {"matchLabels": selector(name, "redis")},
            "template": {
                "metadata": {"labels": labels(name, "redis")},
                "spec": {"automountServiceAccountToken": False, "containers": [container]},
            },
        },
    }


def build_profile_configmap(name: str, namespace: str) -> Manifest:
    """The profile ConfigMap, created empty; only the profiling Job writes its data."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(name, namespace, "profile"),
        "data": {},
    }


def profile_fingerprint(spec: BasinDeploymentSpec, prefill: int, decode: int) -> str:
    """What a profile is valid for (DESIGN: replicas, GPU kind, router policy), plus what changes capacity."""
    return digest(
        {
            "gpu": spec.gpu_kind,
            "model": spec.model.path,
            "prefill": [prefill, spec.prefill.gpus_per_replica, spec.prefill.hicache.host_ratio],
            "decode": [decode, spec.decode.gpus_per_replica, spec.decode.hicache.host_ratio],
            "router": spec.router.policy,
        },
        length=10,
    )


def profile_deadline_seconds(spec: BasinDeploymentSpec) -> int:
    """How long a profiling Job may run: `profiling.deadlineSeconds`, else twice its planned ramps plus
    ten minutes for start-up (images, warm-up)."""
    profiling = spec.profiling
    if profiling.deadline_seconds is not None:
        return profiling.deadline_seconds
    return 2 * profiling.ramps * profiling.steps * profiling.step_seconds + 600


def profile_job_name(name: str, fingerprint: str, attempt: int) -> str:
    """Deterministic, so a restarted operator finds the Job it started instead of starting another."""
    return f"{c.child_name(name, 'profile')}-{fingerprint}-{attempt}"


def build_admin_secret(name: str, namespace: str) -> Manifest:
    """The shared secret the gateway and the profiling Job both read: with it the profiler's ramp calls
    bypass the gateway's controls (`X-Basin-Bypass`), and an admin may end sessions. Created once with a
    fresh random token and never rewritten (the operator creates it, it does not apply it)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": c.child_name(name, "gateway-admin"),
            "namespace": namespace,
            "labels": labels(name, "gateway"),
        },
        "type": "Opaque",
        "stringData": {c.ADMIN_TOKEN_KEY: secrets.token_urlsafe(32)},
    }


def admin_token_env(name: str) -> Manifest:
    ref = {"name": c.child_name(name, "gateway-admin"), "key": c.ADMIN_TOKEN_KEY}
    return {"name": "BASIN_ADMIN_TOKEN", "valueFrom": {"secretKeyRef": ref}}


def build_profile_job(
    name: str,
    namespace: str,
    spec: BasinDeploymentSpec,
    fingerprint: str,
    prefill: int,
    decode: int,
    attempt: int,
) -> Manifest:
    """One profiling run: `python -m basin_profiler` ramps load through the gateway, fits κ and λc and
    writes them with the fingerprint into the profile ConfigMap. The operator retries (backoffLimit 0)."""
    profiling = spec.profiling
    values = {
        "BASIN_DEPLOYMENT": name,
        "BASIN_GATEWAY_URL": f"http://{c.child_name(name, 'gateway')}:{c.GATEWAY_PORT}",
        "BASIN_SESSION_HEADER": spec.gateway.session_header,
        "BASIN_PROFILE_CONFIGMAP": c.child_name(name, "profile"),
        "BASIN_PROFILE_KEY": c.PROFILE_KEY,
        "BASIN_PROFILE_FINGERPRINT": fingerprint,
        "BASIN_PROFILE_WORKLOAD": profiling.workload,
        "BASIN_PROFILE_RAMPS": str(profiling.ramps),
        "BASIN_PROFILE_STEPS": str(profiling.steps),
        "BASIN_PROFILE_STEP_SECONDS": str(profiling.step_seconds),
        "BASIN_PROFILE_TOP_RATE": f"{profiling.top_rate:g}",
        "BASIN_PREFILL_REPLICAS": str(prefill),
        "BASIN_DECODE_REPLICAS": str(decode),
        "BASIN_GPU_KIND": spec.gpu_kind,
        # the ramp's rates come from the fluid model of this shape, which the host tier changes
        "BASIN_HOST_RATIO": str(spec.prefill.hicache.host_ratio),
    }
    env: list[Manifest] = [{"name": k, "value": v} for k, v in values.items()]
    env.append({"name": "BASIN_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}})
    env.append(admin_token_env(name))
    job_labels = {**labels(name, "profiler"), c.LABEL_FINGERPRINT: fingerprint}
    container = {
        "name": "profiler",
        "image": spec.images.basin,
        "imagePullPolicy": spec.images.pull_policy,
        "command": ["python", "-m", "basin_profiler"],
        "env": env,
        "resources": _resources(profiling.resources),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": profile_job_name(name, fingerprint, attempt),
            "namespace": namespace,
            "labels": job_labels,
        },
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": profile_deadline_seconds(spec),
            # Honoured where the API has it (beta from Kubernetes 1.21); the operator also deletes
            # superseded finished Jobs itself (`handlers._clean_up_jobs`).
            "ttlSecondsAfterFinished": c.JOB_TTL_SECONDS,
            "template": {
                "metadata": {"labels": job_labels},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": c.child_name(name, "profiler"),
                    "containers": [container],
                },
            },
        },
    }


def obsolete_children(name: str, spec: BasinDeploymentSpec) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of children the other engine mode has and this one must not: switching the
    emulator on or off removes them."""
    if spec.emulator.enabled:
        deployments = [c.child_name(name, role) for role in ("prefill", "decode", "router")]
        router = c.child_name(name, "router")
        rbac = "rbac.authorization.k8s.io/v1"
        return [("apps/v1", "Deployment", d) for d in deployments] + [
            ("v1", "ServiceAccount", router),
            (rbac, "Role", router),
            (rbac, "RoleBinding", router),
        ]
    return [("apps/v1", "Deployment", c.child_name(name, "emulator"))]


def build_children(name: str, namespace: str, spec: BasinDeploymentSpec) -> list[Manifest]:
    """Every long-lived child, in creation order (identities and state before the pods that use them)."""
    children: list[Manifest] = []
    emulated = spec.emulator.enabled
    for component in ("gateway", "profiler") if emulated else ("router", "gateway", "profiler"):
        children += [
            build_service_account(name, namespace, component),
            build_role(name, namespace, component),
            build_role_binding(name, namespace, component),
        ]
    children.append(build_profile_configmap(name, namespace))
    if spec.redis.mode == "managed":
        children += [
            build_service(name, namespace, "redis", {"redis": c.REDIS_PORT}, headless=True),
            build_redis_statefulset(name, namespace, spec),
        ]
    router_ports = {"http": c.ROUTER_PORT, "metrics": c.ROUTER_METRICS_PORT}
    if emulated:
        # The same Service the gateway calls, onto the emulator (whose metrics share its HTTP port).
        children += [
            build_emulator_deployment(name, namespace, spec),
            build_service(
                name, namespace, "router", router_ports, target="emulator", target_port=c.ROUTER_PORT
            ),
        ]
    else:
        children += [
            build_engine_deployment(name, namespace, spec, "prefill"),
            build_engine_deployment(name, namespace, spec, "decode"),
            build_router_deployment(name, namespace, spec),
            build_service(name, namespace, "router", router_ports),
        ]
    children += [
        build_gateway_deployment(name, namespace, spec),
        build_service(name, namespace, "gateway", {"http": c.GATEWAY_PORT}),
    ]
    for child in children:
        child["metadata"].setdefault("annotations", {})[c.ANNOTATION_SPEC_HASH] = digest(child)
    return children
