"""examples/ and operator/deploy/: the minimal, full and emulated BasinDeployments parse with the spec
models and pass the operator's cross-field checks, the full one sets every spec field the CRD has (so it
stays full as fields are added), and the namespaced Role grants what the ClusterRole does.
tests/cluster/test_examples_against_crd.py has the apiserver validate the examples against the CRD."""

from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf")  # the `operator` extra

from basin_operator.crd import build_crd
from basin_operator.handlers import spec_problems

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Fields the full example leaves out because they exclude what it shows (external Redis, a router image
# other than the engine's, an explicit backend where prefill_complete picks NIXL).
NOT_IN_FULL = {"redis.url", "redis.passwordSecret", "router.image", "disaggregation.transferBackend"}


def leaves(schema: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for name, node in (schema.get("properties") or {}).items():
        path = f"{prefix}{name}"
        out |= leaves(node, f"{path}.") if node.get("properties") else {path}
    return out


def present(value: Any, prefix: str = "") -> set[str]:
    out = set()
    for name, item in value.items():
        path = f"{prefix}{name}"
        out.add(path)
        if isinstance(item, dict):
            out |= present(item, f"{path}.")
    return out


@pytest.mark.parametrize("name", ["minimal", "full", "emulated"])
def test_examples_parse_and_pass_the_checks(name: str) -> None:
    body = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    assert body["apiVersion"] == "basin.dev/v1alpha1" and body["kind"] == "BasinDeployment"
    spec, problems = spec_problems(body["metadata"]["name"], body["spec"])
    assert spec is not None and problems == []


def test_the_full_example_sets_every_field() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    full = yaml.safe_load((EXAMPLES / "full.yaml").read_text())["spec"]
    missing = {
        path
        for path in leaves(schema) - present(full)
        if not any(path == left or path.startswith(f"{left}.") for left in NOT_IN_FULL)
    }
    assert not missing, f"examples/full.yaml lacks {sorted(missing)}"


def test_the_namespaced_role_grants_what_the_cluster_role_does() -> None:
    deploy = Path(__file__).resolve().parents[2] / "operator" / "deploy"
    role = yaml.safe_load((deploy / "role.yaml").read_text())
    cluster_role = yaml.safe_load((deploy / "clusterrole.yaml").read_text())
    assert role["kind"] == "Role" and cluster_role["kind"] == "ClusterRole"
    assert role["rules"] == cluster_role["rules"]
