"""The BasinDeployment reference (docs/reference/basindeployment.md) is generated from the pydantic models:
the committed file is exactly the generator's output, it has a row for every field of the CRD schema (found
here by a walk of its own, so a generator that skipped a field fails), every field has a description worth
reading, and the field paths the other docs name exist (with their enum values)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kopf")  # the `operator` extra

from basin.policy.basin import BasinConfig
from basin_operator.crd import build_crd
from basin_operator.reference import render_reference

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference" / "basindeployment.md"
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]


def schema(part: str) -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][part]


def fields(node: dict[str, Any], path: str = "") -> dict[str, dict[str, Any]]:
    """Every field below `node` by its path (`a.b`, list items' fields as `a[].b`)."""
    out: dict[str, dict[str, Any]] = {}
    for name, child in node.get("properties", {}).items():
        out[path + name] = child
        out |= fields(child, f"{path}{name}.")
        if isinstance(child.get("items"), dict):
            out |= fields(child["items"], f"{path}{name}[].")
    return out


def reference_rows(text: str, section: str) -> dict[str, list[str]]:
    """The reference's table rows under `## \\`section\\`` by field path: their cells."""
    body = text.split(f"\n## `{section}`\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in body.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[cells[0].strip("`")] = cells
    return rows


def test_the_committed_reference_is_the_generator_s_output() -> None:
    assert REFERENCE.read_text() == render_reference(), (
        "docs/reference/basindeployment.md is stale: run `make crds` (basin operator docs)"
    )


def test_the_cli_prints_the_same_reference(tmp_path: Path) -> None:
    basin = str(Path(sys.executable).with_name("basin"))
    result = subprocess.run(
        [basin, "operator", "docs"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == render_reference()
    out = tmp_path / "ref.md"
    result = subprocess.run(
        [basin, "operator", "docs", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and out.read_text() == render_reference()


@pytest.mark.parametrize("section", ["spec", "status"])
def test_every_field_has_a_row(section: str) -> None:
    expected = fields(schema(section))
    rows = reference_rows(REFERENCE.read_text(), section)
    assert len(expected) > (60 if section == "spec" else 30)  # the walk found the fields
    assert sorted(set(expected) - set(rows)) == []
    assert sorted(set(rows) - set(expected)) == []


def test_the_row_check_notices_a_missing_row() -> None:
    text = REFERENCE.read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("| `gateway.addressing` |"))
    rows = reference_rows(text.replace(line + "\n", ""), "spec")
    assert set(fields(schema("spec"))) - set(rows) == {"gateway.addressing"}


def test_rows_carry_the_schema_s_defaults_ranges_and_enums() -> None:
    rows = reference_rows(REFERENCE.read_text(), "spec")
    defaults = BasinConfig()
    assert rows["model.path"][1:4] == ["string", "required", "non-empty"]
    assert rows["gateway.policy.margin"][1:4] == ["number", f"`{defaults.margin}`", "> 0; ≤ 1"]
    assert rows["gateway.policy.shedAfterSeconds"][2] == f"`{float(defaults.shed_after_s)}`"
    assert rows["prefill.replicas"][3] == "≥ 1" and rows["profiling.steps"][3] == "≥ 3"
    assert rows["decode.hicache.hostRatio"][2] == "`0.0`" and rows["prefill.hicache.hostRatio"][2] == "`2.0`"
    assert rows["redis.mode"][3] == "`managed`, `external`"
    assert rows["prefill.tolerations[].effect"][3] == "`NoSchedule`, `PreferNoSchedule`, `NoExecute`"
    assert rows["prefill.resources.requests"][1] == "map of string to quantity (integer or string)"
    assert rows["gateway.predictor"][2] == "—"  # optional objects stay unset
    assert rows["gateway.predictor.configMap"][2] == "required"


@pytest.mark.parametrize("section", ["spec", "status"])
def test_every_field_has_a_description_worth_reading(section: str) -> None:
    """At least three words: a description is the reference's only prose for its field."""
    thin = {
        path: node.get("description", "")
        for path, node in fields(schema(section)).items()
        if len(node.get("description", "").split()) < 3
    }
    assert thin == {}


# `path` or `path: value` in backticks, rooted at a spec field (or `spec.`/`status.`): field names are
# camelCase, so `prefill.PrefillFetcher` (a Python class) does not match.
TOP = "|".join(schema("spec")["properties"])
NAMED = re.compile(rf"`((?:spec\.|status\.)?(?:{TOP})(?:\.[a-z][A-Za-z]*)+)(?::\s*([^`\s]+))?[^`]*`")


def named_fields(text: str) -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(2)) for m in NAMED.finditer(text)]


def unknown_fields(text: str) -> list[str]:
    spec, status = fields(schema("spec")), fields(schema("status"))
    bad = []
    for path, value in named_fields(text):
        known = status if path.startswith("status.") else spec
        node = known.get(path.removeprefix("spec.").removeprefix("status."))
        if node is None:
            bad.append(path)
        elif value is not None:
            allowed = node.get("enum") or (["true", "false"] if node.get("type") == "boolean" else None)
            if allowed is not None and value not in allowed:
                bad.append(f"{path}: {value}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_fields_the_docs_name_exist(doc: Path) -> None:
    assert unknown_fields(doc.read_text()) == []


def test_the_docs_name_fields_at_all_and_the_check_notices_a_wrong_one() -> None:
    text = (REPO / "docs" / "operator.md").read_text()
    assert len(named_fields(text)) >= 8
    assert unknown_fields(
        "`profiling.stepSecs` and `redis.mode: clustered` and `gateway.addressing: direct`"
    ) == [
        "profiling.stepSecs",
        "redis.mode: clustered",
    ]


def test_operator_md_links_the_reference_and_keeps_no_hand_table() -> None:
    text = (REPO / "docs" / "operator.md").read_text()
    assert "](reference/basindeployment.md)" in text
    assert "| `gateway.policy.margin`" not in text  # the spec table lives in the generated reference only
