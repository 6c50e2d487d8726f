"""docs/operator.md documents every field of the BasinDeployment spec: each leaf of the CRD schema generated
from the pydantic models has a row in the `spec` table (a field added to the models without its row fails
here)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from basin_operator.crd import openapi_schema
from basin_operator.spec import BasinDeploymentSpec

DOC = Path(__file__).resolve().parents[2] / "docs" / "operator.md"
OPAQUE = {"resources"}  # requests/limits maps, documented as one field


def leaves(node: dict[str, Any], path: str = "") -> list[str]:
    properties = node.get("properties")
    if not properties or path.rsplit(".", 1)[-1] in OPAQUE:
        return [path]
    return [leaf for name, child in properties.items() for leaf in leaves(child, f"{path}.{name}".strip("."))]


def spec_rows() -> list[str]:
    text = DOC.read_text()
    section = text.split("### `spec`", 1)[1].split("\n### ", 1)[0]
    return [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]


def documented(path: str, rows: list[str]) -> bool:
    """`a.b.c` in a row, or a row naming the parent `a.b.…` and the field as `c`, `.c` (`a.b.x`, `.c`)."""
    parent, _, name = path.rpartition(".")
    for row in rows:
        if f"`{path}`" in row:
            return True
        names = set(re.findall(r"`\.?([A-Za-z]+)`", row))
        if parent and f"`{parent}." in row and name in names:
            return True
    return False


def test_every_spec_field_has_a_row_in_the_operator_docs() -> None:
    rows = spec_rows()
    fields = leaves(openapi_schema(BasinDeploymentSpec))
    assert len(fields) > 40  # the walk found the spec's fields
    assert [f for f in fields if not documented(f, rows)] == []


def test_the_check_notices_a_missing_row() -> None:
    rows = [r for r in spec_rows() if "gateway.addressing" not in r]
    assert not documented("gateway.addressing", rows)
