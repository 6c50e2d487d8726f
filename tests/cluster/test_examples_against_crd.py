"""examples/ against the CRD in a real apiserver: a server-side dry run creates each (schema, defaults,
enums and ranges checked by Kubernetes itself) and what it returns parses with the operator's models."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from harness import REPO, Cluster

from basin_operator.handlers import spec_problems

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("name", ["minimal", "full", "emulated"])
def test_example_is_valid_against_the_crd(cluster: Cluster, crd: dict, namespace: str, name: str) -> None:
    body = yaml.safe_load((Path(REPO) / "examples" / f"{name}.yaml").read_text())
    created = cluster.custom.create_namespaced_custom_object(
        "basin.dev", "v1alpha1", namespace, "basindeployments", body, dry_run="All"
    )

    # Nothing was pruned: every field the example sets came back (the apiserver drops unknown fields).
    def subset(small: object, big: object) -> bool:
        if isinstance(small, dict):
            return isinstance(big, dict) and all(k in big and subset(v, big[k]) for k, v in small.items())
        return small == big or str(small) == str(big)

    assert subset(body["spec"], created["spec"])
    spec, problems = spec_problems(created["metadata"]["name"], created["spec"])
    assert spec is not None and problems == []
