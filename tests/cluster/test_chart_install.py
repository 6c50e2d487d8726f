"""`helm install` of helm/basin into the real test cluster: the chart's ServiceAccount, ClusterRole (or Roles)
and Deployment are created, an operator running under that ServiceAccount's token reconciles examples/'s
BasinDeployments (so the chart's RBAC is what is tested), and `helm uninstall` completes without waiting on
any BasinDeployment, which can still be deleted afterwards with no operator running. The operator runs as a
process beside the cluster (the test cluster has no node for its Pod), standing in for the chart's Pod."""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import yaml
from harness import (
    CLUSTER_ROLE,
    REPO,
    Cluster,
    OperatorProcess,
    service_account_token,
    wait_for,
    write_token_kubeconfig,
)
from kubernetes.client.exceptions import ApiException
from test_operator import GROUP, PLURAL, VERSION, children, get

pytestmark = pytest.mark.cluster

CHART = REPO / "helm" / "basin"
TOOLS = Path(
    os.environ.get("BASIN_TOOLS")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "basin"
)
HELM = TOOLS / "bin" / "helm"


def helm(cluster: Cluster, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """helm against the test cluster as its administrator; fails the test on a non-zero exit."""
    if not HELM.is_file():
        pytest.fail(f"{HELM} is missing: run `make tools` (helm/get-tools.sh) first")
    result = subprocess.run(
        [str(HELM), "--kubeconfig", cluster.kubeconfig, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def example(name: str) -> dict:
    return yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())


def gone(check: object) -> bool:
    try:
        check()  # type: ignore[operator]
    except ApiException as error:
        if error.status == 404:
            return True
        raise
    return False


def chart_operator(
    cluster: Cluster, account: str, namespace: str, folder: Path, args: list[str]
) -> OperatorProcess:
    """`basin operator run` with the token of the chart's ServiceAccount: only the chart's RBAC applies."""
    token = service_account_token(cluster.core, account, namespace)
    kubeconfig = folder / "chart-operator.kubeconfig"
    write_token_kubeconfig(yaml.safe_load(Path(cluster.kubeconfig).read_text()), token, kubeconfig)
    return OperatorProcess(kubeconfig, folder, extra_args=args)


def test_helm_install_runs_the_operator_under_the_chart_s_rbac_and_uninstall_never_hangs(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    release = f"b-{uuid.uuid4().hex[:6]}"
    full = f"{release}-basin-operator"
    helm(
        cluster, "install", release, str(CHART), "--namespace", namespace, "--set", "operator.resyncSeconds=1"
    )

    # What the chart made, as the cluster holds it.
    role = cluster.rbac.read_cluster_role(full)
    expected = yaml.safe_load(CLUSTER_ROLE.read_text())["rules"]
    assert [cluster.api.sanitize_for_serialization(rule) for rule in role.rules] == expected
    binding = cluster.rbac.read_cluster_role_binding(full)
    assert (binding.subjects[0].name, binding.subjects[0].namespace) == (full, namespace)
    cluster.core.read_namespaced_service_account(full, namespace)
    deployment = cluster.apps.read_namespaced_deployment(full, namespace)
    assert deployment.spec.strategy.type == "Recreate" and deployment.spec.replicas == 1
    container = deployment.spec.template.spec.containers[0]
    assert container.security_context.read_only_root_filesystem is True

    operator = chart_operator(cluster, full, namespace, tmp_path, [])
    operator_process.stop()  # the session's operator would reconcile the same objects under the repo's role
    try:
        operator.start()
        # examples/emulated.yaml (the kind / no-GPU path) and examples/minimal.yaml (GPU engines).
        for name in ("emulated", "minimal"):
            cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, example(name))
        wait_for(
            lambda: (
                children(cluster, namespace, "demo")["Deployment"] == ["demo-emulator", "demo-gateway"]
                and children(cluster, namespace, "demo")["Role"] == ["demo-gateway", "demo-profiler"]
                and children(cluster, namespace, "demo")["StatefulSet"] == ["demo-redis"]
            ),
            90,
            "the emulated example's children",
        )
        wait_for(
            lambda: (
                children(cluster, namespace, "qwen")["Deployment"]
                == ["qwen-decode", "qwen-gateway", "qwen-prefill", "qwen-router"]
            ),
            90,
            "the minimal example's children",
        )
        # Status is written (the status subresource's rule) and events posted (the events rule).
        wait_for(lambda: (get(cluster, namespace, "demo").get("status") or {}).get("phase"), 60, "a status")
        events = cluster.core.list_namespaced_event(
            namespace, field_selector="involvedObject.name=demo"
        ).items
        assert any(e.reason == "Created" for e in events)

        # The documented order: delete BasinDeployments while the operator still runs. A finalizer an older
        # operator left is removed by this one, so even that deletion completes.
        cluster.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "qwen", {"metadata": {"finalizers": ["basin.dev/finalizer"]}}
        )
        wait_for(
            lambda: not get(cluster, namespace, "qwen")["metadata"].get("finalizers"),
            60,
            "the operator to drop the leftover finalizer",
        )
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "qwen")
        wait_for(lambda: gone(lambda: get(cluster, namespace, "qwen")), 60, "qwen to be deleted")
    finally:
        operator.stop()  # the chart's Pod ends when helm deletes its Deployment
        operator_process.start()
    text = operator.text()
    assert "Traceback" not in text and "Forbidden" not in text and " 403" not in text, text[-6000:]

    # An upgrade replaces the operator's pod template in place (still Recreate, still one replica).
    helm(
        cluster,
        "upgrade",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "--reuse-values",
        "--set",
        "operator.verbose=true",
    )
    upgraded = cluster.apps.read_namespaced_deployment(full, namespace)
    assert "--verbose" in upgraded.spec.template.spec.containers[0].args
    assert upgraded.metadata.generation > deployment.metadata.generation
    assert upgraded.spec.strategy.type == "Recreate"

    # Uninstalling with a BasinDeployment still present completes promptly: nothing waits on it.
    started = time.monotonic()
    helm(cluster, "uninstall", release, "--namespace", namespace, "--timeout", "60s", timeout=120)
    assert time.monotonic() - started < 60
    assert gone(lambda: cluster.rbac.read_cluster_role(full))
    assert gone(lambda: cluster.rbac.read_cluster_role_binding(full))
    assert gone(lambda: cluster.core.read_namespaced_service_account(full, namespace))
    wait_for(
        lambda: gone(lambda: cluster.apps.read_namespaced_deployment(full, namespace)),
        30,
        "the Deployment gone",
    )
    # helm keeps the CRD (crds/ is install-only), so the resource stays until deleted; deleting it needs
    # no operator (the operator adds no finalizer) and so never hangs.
    assert get(cluster, namespace, "demo")
    operator_process.stop()  # nothing may remove a finalizer for it: the deletion must complete on its own
    try:
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "demo")
        wait_for(
            lambda: gone(lambda: get(cluster, namespace, "demo")),
            30,
            "demo to be deleted without an operator",
        )
    finally:
        operator_process.start()


def test_a_namespaced_helm_install_runs_the_operator_under_its_role(
    cluster: Cluster, operator_process: OperatorProcess, namespace: str, tmp_path: Path
) -> None:
    """`rbac.namespaced=true`: no cluster-scoped RBAC, a Role in the release's namespace, the operator told
    to watch only it (the Deployment's own `--namespace`); that suffices for examples/minimal.yaml."""
    release = f"b-{uuid.uuid4().hex[:6]}"
    full = f"{release}-basin-operator"
    helm(cluster, "install", release, str(CHART), "--namespace", namespace, "--set", "rbac.namespaced=true")
    assert gone(lambda: cluster.rbac.read_cluster_role(full))
    assert gone(lambda: cluster.rbac.read_cluster_role_binding(full))
    role = cluster.rbac.read_namespaced_role(full, namespace)
    expected = yaml.safe_load((REPO / "operator" / "deploy" / "role.yaml").read_text())["rules"]
    assert [cluster.api.sanitize_for_serialization(rule) for rule in role.rules] == expected
    args = cluster.apps.read_namespaced_deployment(full, namespace).spec.template.spec.containers[0].args
    assert args[args.index("--namespace") + 1] == namespace

    operator = chart_operator(cluster, full, namespace, tmp_path, ["--namespace", namespace])
    operator_process.stop()
    try:
        operator.start()
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, example("minimal"))
        wait_for(
            lambda: (
                children(cluster, namespace, "qwen")["Role"]
                == ["qwen-gateway", "qwen-profiler", "qwen-router"]
                and len(children(cluster, namespace, "qwen")["Deployment"]) == 4
            ),
            90,
            "the minimal example's children",
        )
        wait_for(lambda: (get(cluster, namespace, "qwen").get("status") or {}).get("phase"), 60, "a status")
    finally:
        operator.stop()
        operator_process.start()
    text = operator.text()
    assert "Traceback" not in text and "Forbidden" not in text, text[-6000:]
    helm(cluster, "uninstall", release, "--namespace", namespace, "--timeout", "60s", timeout=120)
    assert gone(lambda: cluster.rbac.read_namespaced_role(full, namespace))
