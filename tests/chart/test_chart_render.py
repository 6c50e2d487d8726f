"""The helm chart offline: `helm lint --strict`, every rendered manifest valid for Kubernetes 1.20 and 1.37
(kubernetes-validate's strict schemas), RBAC and CRD identical to the repository's, the operator pod's
security and liveness, dashboards and alert rules carried verbatim, and monitoring objects only where the
Prometheus Operator's API exists. Sample dashboards and rule files go into a throwaway copy of the chart."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from charttools import (
    CHART,
    CURRENT,
    MONITORING_API,
    OLDEST,
    REPO,
    by_kind,
    copy_chart,
    helm,
    one,
    render,
    validate,
)

from basin_monitoring.alerts import heading_anchors

MONITORING_KINDS = {"PrometheusRule", "ServiceMonitor", "PodMonitor"}
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "Namespace"}

# A Grafana dashboard and a Prometheus rule file with their own template syntax, which helm must not touch.
SAMPLE_DASHBOARD = {
    "title": "Sample",
    "uid": "basin-sample",
    "templating": {"list": [{"name": "namespace", "query": "label_values(basin_gateway_info, namespace)"}]},
    "panels": [
        {
            "title": "Hit rate {{instance}}",
            "targets": [{"expr": 'sum(rate(x{namespace="$namespace"}[5m]))', "legendFormat": "{{pod}}"}],
        }
    ],
}
SAMPLE_RULES = """\
groups:
  - name: basin-sample
    rules:
      - alert: BasinSampleAlert
        expr: basin_sample > 1
        for: 5m
        labels: {severity: warning}
        annotations:
          summary: "{{ $labels.namespace }}/{{ $labels.instance }} at {{ $value | humanize }}"
          runbook_url: https://example.invalid/runbook#sample
  - name: basin-sample-records
    rules:
      - record: basin:sample:rate5m
        expr: rate(basin_sample_total[5m])
"""

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": {"rbac.namespaced": True, "operator.watchNamespaces": ["team-a", "team-b"]},
    "watching-some-cluster-wide": {"operator.watchNamespaces": ["team-a"], "operator.logJson": False},
    "existing-account": {"serviceAccount.create": False, "serviceAccount.name": "ops"},
}


@pytest.fixture(scope="module")
def sample_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chart = copy_chart(tmp_path_factory.mktemp("chart"))
    for folder in ("dashboards", "alerts"):  # only the samples: the project's own files are tested below
        shutil.rmtree(chart / "files" / folder, ignore_errors=True)
        (chart / "files" / folder).mkdir(parents=True)
    (chart / "files" / "dashboards" / "Sample_Overview.json").write_text(
        json.dumps(SAMPLE_DASHBOARD, indent=2)
    )
    (chart / "files" / "alerts" / "sample.yaml").write_text(SAMPLE_RULES)
    return chart


def test_lint_strict_passes(sample_chart: Path) -> None:
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), "--set", "rbac.namespaced=true")
    helm("lint", "--strict", str(sample_chart))  # lint has no --api-versions: monitors are checked below


@pytest.mark.parametrize("kube_version", [OLDEST, CURRENT])
@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_manifest_is_valid_for_kubernetes(sample_chart: Path, name: str, kube_version: str) -> None:
    """Strict schemas: an unknown or misspelled field, a wrong type or a kind the version lacks fails."""
    docs = render(
        sample_chart, values=VALUE_SETS[name], kube_version=kube_version, api_versions=(MONITORING_API,)
    )
    checked = 0
    for doc in docs:
        if doc["kind"] in MONITORING_KINDS:
            continue  # custom resources: no Kubernetes schema (their shape is tested below)
        validate(doc, kube_version)
        checked += 1
    assert checked >= 4 and one(docs, "Deployment")


@pytest.mark.parametrize("kube_version", [OLDEST, CURRENT])
def test_the_validator_rejects_what_the_version_lacks(kube_version: str) -> None:
    """The offline check can fail: a misspelled field fails on both versions, a Pod field added after 1.20
    (`spec.os`, 1.23) fails on 1.20 only."""
    deployment = one(render(), "Deployment")
    typo = json.loads(json.dumps(deployment))
    typo["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate(typo, kube_version)
    newer = json.loads(json.dumps(deployment))
    newer["spec"]["template"]["spec"]["os"] = {"name": "linux"}
    if kube_version == OLDEST:
        with pytest.raises(jsonschema.ValidationError):
            validate(newer, kube_version)
    else:
        validate(newer, kube_version)


def test_kubernetes_older_than_1_20_is_refused() -> None:
    result = helm("template", "basin", str(CHART), "--kube-version", "1.19.9", check=False)
    assert result.returncode != 0 and "kubeVersion" in result.stderr


def test_the_crd_is_the_repository_s() -> None:
    """helm installs crds/ once and never upgrades it; the copy must be the generated CRD (`make crds`)."""
    assert (CHART / "crds" / "basindeployment.yaml").read_bytes() == (
        REPO / "crds" / "basindeployment.yaml"
    ).read_bytes()
    assert [p.name for p in (CHART / "crds").iterdir()] == ["basindeployment.yaml"]


def test_the_cluster_role_is_the_repository_s() -> None:
    expected = yaml.safe_load((REPO / "operator" / "deploy" / "clusterrole.yaml").read_text())["rules"]
    docs = render()
    role = one(docs, "ClusterRole")
    assert role["rules"] == expected
    binding = one(docs, "ClusterRoleBinding")
    account = one(docs, "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "basin-system"}
    ]
    assert not by_kind(docs, "Role") and not by_kind(docs, "RoleBinding")


def test_a_namespaced_install_has_roles_only() -> None:
    """`rbac.namespaced`: operator/deploy/role.yaml's rules per watched namespace, nothing cluster-scoped,
    and the operator told to watch exactly those namespaces."""
    expected = yaml.safe_load((REPO / "operator" / "deploy" / "role.yaml").read_text())["rules"]
    for watched, values in (
        (["basin-system"], {"rbac.namespaced": True}),
        (["team-a", "team-b"], {"rbac.namespaced": True, "operator.watchNamespaces": ["team-a", "team-b"]}),
    ):
        docs = render(values=values)
        assert not [doc["kind"] for doc in docs if doc["kind"] in CLUSTER_SCOPED]
        roles, bindings = by_kind(docs, "Role"), by_kind(docs, "RoleBinding")
        assert sorted(r["metadata"]["namespace"] for r in roles) == watched
        assert all(r["rules"] == expected for r in roles)
        assert sorted(b["metadata"]["namespace"] for b in bindings) == watched
        assert all(
            b["subjects"]
            == [{"kind": "ServiceAccount", "name": "basin-operator", "namespace": "basin-system"}]
            for b in bindings
        )
        args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        assert [args[i + 1] for i, a in enumerate(args) if a == "--namespace"] == watched


def test_the_operator_pod_is_locked_down_and_probed() -> None:
    deployment = one(render(), "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 10001
    assert pod["serviceAccountName"] == "basin-operator"
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"]
    assert security.get("privileged") is not True
    assert container["command"] == ["python", "-m", "basin_operator"]
    # The probe hits the port and path kopf serves with --liveness.
    liveness = container["args"][container["args"].index("--liveness") + 1]
    assert liveness == "http://0.0.0.0:8080/healthz"
    probe = container["livenessProbe"]["httpGet"]
    port = next(p for p in container["ports"] if p["name"] == probe["port"])
    assert (probe["path"], port["containerPort"]) == ("/healthz", 8080)
    assert "--namespace" not in container["args"]  # cluster-wide by default
    # A read-only root: /tmp (MPLCONFIGDIR, Python's temporary files) is a writable emptyDir.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert container["image"] == "ghcr.io/basin-project/basin:0.1.0"


def test_the_chart_version_follows_basin_s() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = (REPO / "pyproject.toml").read_text()
    assert f'version = "{chart["appVersion"]}"' in project and chart["version"] == chart["appVersion"]


def test_values_are_checked_against_the_schema() -> None:
    for bad in (
        ["--set", "image.pullPolicy=Sometimes"],
        ["--set", "operatr.verbose=true"],
        ["--set", "operator.resyncSeconds=0"],
        ["--set", "operator.watchNamespaces[0]=Not_A_Name"],
    ):
        result = helm("template", "basin", str(CHART), *bad, check=False)
        assert result.returncode != 0 and "schema" in result.stderr.lower(), (bad, result.stderr)


def test_dashboards_are_configmaps_for_grafana_s_sidecar(sample_chart: Path) -> None:
    """Each files/dashboards/*.json is one labelled ConfigMap holding the file unchanged (Grafana's own
    {{...}} and $variables included)."""
    docs = render(sample_chart)
    (configmap,) = by_kind(docs, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["name"] == "basin-dashboard-sample-overview"
    text = (sample_chart / "files" / "dashboards" / "Sample_Overview.json").read_text()
    assert configmap["data"] == {"Sample_Overview.json": text}
    custom = render(
        sample_chart,
        values={
            "dashboards.label": "my_dash",
            "dashboards.labelValue": "yes",
            "dashboards.namespace": "monitoring",
            "dashboards.annotations": {"grafana_folder": "Basin"},
        },
    )
    (configmap,) = by_kind(custom, "ConfigMap")
    assert configmap["metadata"]["labels"]["my_dash"] == "yes"
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "Basin"}
    assert not by_kind(render(sample_chart, values={"dashboards.enabled": False}), "ConfigMap")


def test_the_chart_s_own_dashboards_all_render() -> None:
    """Whatever files/dashboards holds: one ConfigMap per file, each valid JSON."""
    files = sorted((CHART / "files" / "dashboards").glob("*.json"))
    configmaps = by_kind(render(), "ConfigMap")
    assert len(configmaps) == len(files)
    for configmap in configmaps:
        ((key, text),) = configmap["data"].items()
        assert json.loads(text) == json.loads((CHART / "files" / "dashboards" / key).read_text())


def test_alert_rules_become_a_prometheus_rule_only_where_the_api_exists(sample_chart: Path) -> None:
    without = render(sample_chart)
    assert not [doc for doc in without if doc["kind"] in MONITORING_KINDS]
    docs = render(
        sample_chart, api_versions=(MONITORING_API,), values={"monitoring.labels": {"release": "kps"}}
    )
    rule = one(docs, "PrometheusRule")
    assert rule["apiVersion"] == MONITORING_API
    expected = yaml.safe_load(SAMPLE_RULES)["groups"]
    # Templates reach Prometheus as written; only the runbook page becomes the chart's, the anchor kept.
    expected[0]["rules"][0]["annotations"]["runbook_url"] = f"{_default_runbook()}#sample"
    assert rule["spec"]["groups"] == expected
    assert rule["metadata"]["labels"]["release"] == "kps"
    verbatim = render(
        sample_chart, api_versions=(MONITORING_API,), values={"monitoring.prometheusRule.runbookBaseUrl": ""}
    )
    assert one(verbatim, "PrometheusRule")["spec"]["groups"] == yaml.safe_load(SAMPLE_RULES)["groups"]
    off = render(
        sample_chart, api_versions=(MONITORING_API,), values={"monitoring.prometheusRule.enabled": False}
    )
    assert not by_kind(off, "PrometheusRule")


def test_the_chart_s_own_alert_files_are_all_carried() -> None:
    files = sorted((CHART / "files" / "alerts").glob("*.yaml"))
    groups = [g for f in files for g in yaml.safe_load(f.read_text())["groups"]]
    rules = by_kind(render(api_versions=(MONITORING_API,)), "PrometheusRule")
    assert (rules[0]["spec"]["groups"] if rules else []) == groups


def _default_runbook() -> str:
    return yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]["prometheusRule"][
        "runbookBaseUrl"
    ]


def _alert_urls(docs: list[dict[str, Any]]) -> dict[str, str]:
    groups = one(docs, "PrometheusRule")["spec"]["groups"]
    return {r["alert"]: r["annotations"]["runbook_url"] for g in groups for r in g["rules"] if "alert" in r}


def test_every_alert_links_to_a_runbook_section_under_a_configurable_page() -> None:
    """By default the runbook on GitHub; `monitoring.prometheusRule.runbookBaseUrl` moves every link to
    another page, keeping each alert's section anchor (one that docs/runbook.md has)."""
    anchors = heading_anchors((REPO / "docs" / "runbook.md").read_text())
    default = _alert_urls(render(api_versions=(MONITORING_API,)))
    assert len(default) >= 8
    assert _default_runbook() == "https://github.com/basin-project/basin/blob/main/docs/runbook.md"
    for alert, url in default.items():
        page, _, anchor = url.partition("#")
        assert page == _default_runbook() and anchor in anchors, (alert, url)
    mirror = "https://wiki.example.com/ops/basin-runbook"
    moved = _alert_urls(
        render(api_versions=(MONITORING_API,), values={"monitoring.prometheusRule.runbookBaseUrl": mirror})
    )
    assert moved == {alert: url.replace(_default_runbook(), mirror) for alert, url in default.items()}
    result = helm(
        "template",
        "basin",
        str(CHART),
        "--set",
        "monitoring.prometheusRule.runbookBaseUrl=docs/x.md#y",
        check=False,
    )
    assert result.returncode != 0 and "schema" in result.stderr.lower()


def test_monitors_scrape_gateway_router_and_engines_where_the_api_exists() -> None:
    """They select the labels and ports the operator's children carry (basin_operator.builders)."""
    assert not [doc for doc in render() if doc["kind"] in MONITORING_KINDS]
    docs = render(api_versions=(MONITORING_API,))
    services = {doc["metadata"]["name"]: doc for doc in by_kind(docs, "ServiceMonitor")}
    assert set(services) == {"basin-gateway", "basin-router"}
    gateway, router = services["basin-gateway"]["spec"], services["basin-router"]["spec"]
    assert gateway["selector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert gateway["endpoints"][0]["port"] == "http" and router["endpoints"][0]["port"] == "metrics"
    assert router["selector"]["matchLabels"]["app.kubernetes.io/managed-by"] == "basin-operator"
    engines = one(docs, "PodMonitor")["spec"]
    assert engines["selector"]["matchExpressions"][0]["values"] == ["prefill", "decode"]
    assert engines["podMetricsEndpoints"][0]["port"] == "http"
    assert engines["namespaceSelector"] == {"any": True}
    off = render(
        api_versions=(MONITORING_API,),
        values={"monitoring.gateway.enabled": False, "monitoring.engines.enabled": False},
    )
    monitors = [doc for doc in off if doc["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert [doc["metadata"]["name"] for doc in monitors] == ["basin-router"]


def test_monitors_match_the_children_the_operator_builds() -> None:
    """The ports and labels the monitors name are the ones basin_operator.builders gives the children."""
    from basin_operator import builders
    from basin_operator.spec import BasinDeploymentSpec

    spec = BasinDeploymentSpec.model_validate({"model": {"path": "m"}})
    by = {(c["kind"], c["metadata"]["name"]): c for c in builders.build_children("x", "ns", spec)}
    for name, port in (("x-gateway", "http"), ("x-router", "metrics")):
        service = by[("Service", name)]
        assert service["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "basin-operator"
        assert port in {p["name"] for p in service["spec"]["ports"]}
    for role in ("prefill", "decode"):
        pod = by[("Deployment", f"x-{role}")]["spec"]["template"]
        assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == role
        assert "http" in {p["name"] for p in pod["spec"]["containers"][0]["ports"]}


def _leaves(values: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        out += _leaves(value, f"{path}.") if isinstance(value, dict) and value else [path]
    return out


def test_the_values_table_in_docs_install_is_complete_and_current() -> None:
    """Every value is documented (itself or a parent map), and every documented value exists."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    table = [
        line
        for line in (REPO / "docs" / "install.md").read_text().split("## Values", 1)[1].splitlines()
        if line.startswith("| `")
    ]
    documented = {name for line in table for name in re.findall(r"`([A-Za-z][\w.]*)`", line.split(" | ")[0])}
    for leaf in _leaves(values):
        parts = leaf.split(".")
        assert any(".".join(parts[:n]) in documented for n in range(1, len(parts) + 1)), leaf
    for name in documented:
        node: Any = values
        for part in name.split("."):
            assert isinstance(node, dict) and part in node, (
                f"docs/install.md names {name}, not in values.yaml"
            )
            node = node[part]
