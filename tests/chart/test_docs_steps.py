"""The cluster steps of docs/install.md and docs/quickstart.md name real things, though no kind, Docker or GPU
cluster runs here: every `helm install` (with its `--set` values, the prose's too) renders with the real
helm and the chart's values.schema.json; every `kubectl` step names a file, Deployment, Service, CRD or
short name that exists under the names the docs' release and examples give; `make` targets exist; the image
archive `kind load` reads is the one `make images` writes, tagged as the chart expects. Every command line of
those docs' code blocks must be one of the kinds checked here, so a new step needs its check."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml
from charttools import CHART, REPO, by_kind, helm, render

DOCS = [REPO / "docs" / "install.md", REPO / "docs" / "quickstart.md"]
FENCE = re.compile(r"^\s*```")


def block_commands(doc: Path) -> list[str]:
    """Shell lines of the doc's fenced blocks, comments dropped, backslash continuations joined."""
    out: list[str] = []
    inside, joining = False, False
    for raw in doc.read_text().splitlines():
        if FENCE.match(raw):
            inside, joining = not inside, False
            continue
        if not inside:
            continue
        line = re.sub(r"(^|\s)#\s.*$", "", raw).strip()
        if not line:
            continue
        if joining:
            out[-1] += " " + line.rstrip("\\").strip()
        else:
            out.append(line.rstrip("\\").strip())
        joining = line.endswith("\\")
    return out


def inline_sets(doc: Path) -> list[str]:
    """`--set key=value` spans of the prose."""
    return re.findall(r"`(--set [^`]+)`", doc.read_text())


def helm_values(args: list[str]) -> list[tuple[str, str]]:
    return [(args[i], args[i + 1]) for i, a in enumerate(args[:-1]) if a in ("--set", "--set-string")]


def schema_has(schema: dict[str, Any], key: str) -> bool:
    """The dotted values key exists in values.schema.json (any key of a free-form map)."""
    node = schema
    for part in key.split("."):
        part = re.sub(r"\[\d+\]$", "", part)
        properties = node.get("properties", {})
        if part not in properties:
            return (
                isinstance(node.get("additionalProperties"), dict) or node.get("additionalProperties") is True
            )
        node = properties[part]
    return True


def commands() -> list[tuple[str, str]]:
    return [(doc.name, line) for doc in DOCS for line in block_commands(doc)]


def test_the_docs_have_cluster_steps() -> None:
    kinds = {line.split()[0] for _, line in commands()}
    assert {"helm", "kubectl", "kind", "make"} <= kinds


def _install(args: list[str]) -> tuple[str, str, str]:
    """release, chart and namespace of `helm install RELEASE CHART --namespace NS …`."""
    positional = [
        a for i, a in enumerate(args[2:], 2) if not a.startswith("-") and not args[i - 1].startswith("--")
    ]
    namespace = args[args.index("--namespace") + 1] if "--namespace" in args else "default"
    return positional[0], positional[1], namespace


def test_every_step_names_what_exists() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    crd = yaml.safe_load((CHART / "crds" / "basindeployment.yaml").read_text())
    installs: list[tuple[str, str]] = []
    rendered: dict[tuple[str, str], list[dict[str, Any]]] = {}
    kind_clusters: set[str] = set()
    unchecked = []
    for doc, line in commands():
        args = shlex.split(line)
        tool, verb = args[0], args[1] if len(args) > 1 else ""
        where = f"{doc}: {line}"
        if tool == "make":
            assert set(args[1:]) <= targets, where
        elif tool == "helm" and verb == "install":
            release, chart, namespace = _install(args)
            assert (REPO / chart / "Chart.yaml").is_file(), where
            for key, _ in [kv.split("=", 1) for _, kv in helm_values(args)]:
                assert schema_has(schema, key), f"{where}: {key} is not a chart value"
            sets = [x for pair in helm_values(args) for x in pair]
            result = helm(
                "template", release, str(REPO / chart), "--namespace", namespace, *sets, check=False
            )
            assert result.returncode == 0, f"{where}: {result.stderr}"
            rendered[(release, namespace)] = [d for d in yaml.safe_load_all(result.stdout) if d]
            installs.append((release, namespace))
        elif tool == "helm" and verb == "uninstall":
            assert (args[2], args[args.index("--namespace") + 1]) in installs, where
        elif tool == "kubectl" and verb == "apply":
            path = REPO / args[args.index("-f") + 1]
            assert path.is_file(), where
            assert yaml.safe_load(path.read_text())["kind"] == crd["spec"]["names"]["kind"], where
        elif tool == "kubectl" and "rollout" in args:
            namespace = args[args.index("-n") + 1]
            kind_name = args[-1].split("/")
            assert kind_name[0] == "deployment", where
            docs = [d for (_, ns), ds in rendered.items() if ns == namespace for d in ds]
            names = [d["metadata"]["name"] for d in by_kind(docs, "Deployment")]
            assert kind_name[1] in names, f"{where}: the chart's Deployments are {names}"
        elif (
            tool == "kubectl" and verb in ("get", "delete") and args[2] in crd["spec"]["names"]["shortNames"]
        ):
            pass  # `kubectl get bd`, `kubectl delete bd --all`: the CRD's short name
        elif tool == "kubectl" and verb == "delete" and args[2] == "crd":
            assert args[3] == crd["metadata"]["name"], where
        elif tool == "kind" and verb == "create":
            kind_clusters.add(args[args.index("--name") + 1])
        elif tool == "kind" and verb == "load":
            assert args[2] == "image-archive" and args[args.index("--name") + 1] in kind_clusters, where
            _check_image_archive(args[3])
        else:
            unchecked.append(where)
    assert installs
    assert unchecked == [], "steps no check covers: add one"


def _check_image_archive(path: str) -> None:
    """`make images` writes this archive, tagged with the image name and version the chart runs by default."""
    from basin import __version__
    from basin_operator.constants import BASIN_IMAGE

    build = (REPO / "images" / "build.sh").read_text()
    assert (
        path == "images/out/basin.tar"
        and '"$OUT/basin.tar' in build
        and 'BASIN_TAG="$BASIN_IMAGE:$VERSION"' in build
    )
    assert "images/build.sh" in (REPO / "Makefile").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert values["image"]["repository"] == BASIN_IMAGE and chart["appVersion"] == __version__


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_prose_s_helm_values_exist_and_render(doc: Path) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    for span in inline_sets(doc):
        args = shlex.split(span)
        for _, kv in helm_values(args):
            assert schema_has(schema, kv.split("=", 1)[0]), span
        result = helm("template", "basin", str(CHART), *args, check=False)
        assert result.returncode == 0, f"{span}: {result.stderr}"


def test_the_port_forward_names_the_example_s_gateway_service() -> None:
    """`kubectl port-forward svc/demo-gateway 8080`: the gateway Service of examples/emulated.yaml."""
    from basin_operator import builders
    from basin_operator.spec import BasinDeploymentSpec

    text = (REPO / "docs" / "install.md").read_text()
    (service, port), *_ = re.findall(r"kubectl port-forward svc/([\w-]+) (\d+)", text)
    example = yaml.safe_load((REPO / "examples" / "emulated.yaml").read_text())
    spec = BasinDeploymentSpec.model_validate(example["spec"])
    children = builders.build_children(example["metadata"]["name"], "default", spec)
    services = {c["metadata"]["name"]: c for c in children if c["kind"] == "Service"}
    assert service in services
    assert int(port) in {p["port"] for p in services[service]["spec"]["ports"]}


def test_the_checks_notice_stale_steps() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema_has(schema, "monitoring.labels.release") and schema_has(schema, "rbac.namespaced")
    assert not schema_has(schema, "monitoring.lables.release") and not schema_has(schema, "rbac.namespace")
    assert helm("template", "basin", str(CHART), "--set", "operator.resync=5", check=False).returncode != 0
    assert by_kind(render(), "Deployment")[0]["metadata"]["name"] == "basin-operator"
