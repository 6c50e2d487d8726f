"""The CRD is generated from the pydantic models, and the checked-in YAML is exactly that output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kopf")  # the `operator` extra

from basin.policy.basin import BasinConfig
from basin_operator.crd import build_crd, render_crd

REPO = Path(__file__).resolve().parents[2]


def test_checked_in_crd_matches_the_generator() -> None:
    text = (REPO / "crds" / "basindeployment.yaml").read_text()
    assert text == render_crd(), (
        "crds/basindeployment.yaml is stale: run `basin operator crd --out crds/basindeployment.yaml`"
    )


def test_cli_prints_the_same_crd() -> None:
    basin = str(Path(sys.executable).with_name("basin"))
    result = subprocess.run(
        [basin, "operator", "crd"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == render_crd()


def _nodes(node: dict, path: str = ""):
    """Every schema node: properties, items and additionalProperties, recursively."""
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _nodes(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _nodes(node[key], f"{path}[{key}]")


def test_schema_is_structural() -> None:
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, node in _nodes(schema):
        assert not {"$ref", "anyOf", "oneOf", "allOf", "title", "$defs", "const"} & set(node), path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if node.get("type") == "object" and "properties" in node:
            assert "additionalProperties" not in node, path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_defaults_validation_and_subresources() -> None:
    version = build_crd()["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    policy = spec["gateway"]["properties"]["policy"]
    assert policy["default"] == {}
    defaults = BasinConfig()
    values = {name: node["default"] for name, node in policy["properties"].items()}
    assert values == {
        "controlIntervalSeconds": defaults.interval_s,
        "fastControlIntervalSeconds": defaults.fast_interval_s,
        "margin": defaults.margin,
        "alphaLend": defaults.alpha_lend,
        "alphaOrder": defaults.alpha_order,
        "alphaRelease": defaults.alpha_release,
        "lendCap": defaults.lend_cap,
        "shedAfterSeconds": defaults.shed_after_s,
        "priorityRate": defaults.priority_rate,
    }
    assert policy["properties"]["margin"]["maximum"] == 1
    assert spec["prefill"]["properties"]["replicas"]["minimum"] == 1
    assert spec["decode"]["properties"]["hicache"]["properties"]["hostRatio"]["default"] == 0.0
    assert spec["prefill"]["properties"]["hicache"]["properties"]["hostRatio"]["default"] == 2.0
    assert spec["redis"]["properties"]["mode"]["enum"] == ["managed", "external"]
    assert "default" not in spec["gateway"]["properties"]["predictor"]  # optional objects stay absent
    assert "model" in version["schema"]["openAPIV3Schema"]["properties"]["spec"]["required"]
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.prefill.replicas",
        "statusReplicasPath": ".status.prefillReplicas",
        "labelSelectorPath": ".status.prefillSelector",
    }
    assert version["subresources"]["status"] == {}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Prefill", "Decode", "Kappa", "Profile", "Limit", "Phase", "Age"]
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["items"]["required"] == ["type", "status", "reason", "message", "lastTransitionTime"]
    json.dumps(build_crd())  # plain data only
