"""Chart-test tools: the helm binary and Kubernetes' JSON schemas that `make tools` (helm/get-tools.sh)
caches, rendering the chart, and validating manifests offline for Kubernetes 1.20 and a current version."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "basin"
TOOLS = Path(
    os.environ.get("BASIN_TOOLS")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "basin"
)
HELM = TOOLS / "bin" / "helm"
SCHEMAS_1_20 = TOOLS / "k8s-schemas" / "v1.20.0-local-strict"
OLDEST, CURRENT = "1.20.0", "1.37.0"
MONITORING_API = "monitoring.coreos.com/v1"


def helm_binary() -> str:
    """The cached helm; a missing one fails (never skips): `make test` fetches it through `make tools`."""
    if not HELM.is_file():
        pytest.fail(f"{HELM} is missing: run `make tools` (helm/get-tools.sh) first")
    return str(HELM)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120, check=False)
    if check and result.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
    return result


def render(
    chart: Path = CHART,
    *,
    values: dict[str, Any] | None = None,
    kube_version: str = CURRENT,
    api_versions: tuple[str, ...] = (),
    namespace: str = "basin-system",
    release: str = "basin",
) -> list[dict[str, Any]]:
    """`helm template` with `values` (set as a JSON string each) and the cluster capabilities given."""
    args = ["template", release, str(chart), "--namespace", namespace, "--kube-version", kube_version]
    for key, value in (values or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    for api in api_versions:
        args += ["--api-versions", api]
    return [doc for doc in yaml.safe_load_all(helm(*args).stdout) if doc]


def copy_chart(target: Path) -> Path:
    """A throwaway copy of the chart, for tests that add sample dashboards or alert files."""
    copy = target / "basin"
    shutil.copytree(CHART, copy)
    return copy


@functools.cache
def _definitions_1_20() -> dict[str, Any]:
    if not (SCHEMAS_1_20 / "_definitions.json").is_file():
        pytest.fail(f"{SCHEMAS_1_20} is missing: run `make tools` (helm/get-tools.sh) first")
    return json.loads((SCHEMAS_1_20 / "_definitions.json").read_text())["definitions"]


def _validate_1_20(doc: dict[str, Any]) -> None:
    """kubernetes-validate's strict 1.20 schemas (from its 1.24.1 release; 1.37 ships 1.25+ only): each kind's
    file is a `$ref` into `_definitions.json`, so the schema is that reference resolved in the definitions."""
    group, _, version = doc["apiVersion"].rpartition("/")
    name = f"{doc['kind'].lower()}-{group.split('.')[0] + '-' if group else ''}{version}.json"
    path = SCHEMAS_1_20 / name
    if not path.is_file():
        raise kubernetes_validate.SchemaNotFoundError(
            version="1.20", kind=doc["kind"], api_version=doc["apiVersion"]
        )
    reference = json.loads(path.read_text())["$ref"].split("#", 1)[1]
    schema = {"definitions": _definitions_1_20(), "$ref": f"#{reference}"}
    jsonschema.Draft7Validator(schema).validate(doc)


def validate(doc: dict[str, Any], kube_version: str) -> None:
    """Validate one manifest strictly (unknown fields fail) against Kubernetes `kube_version`'s schemas."""
    if kube_version.startswith("1.20"):
        _validate_1_20(doc)
    else:
        kubernetes_validate.validate(doc, kube_version, strict=True)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]
