"""Every calibrated constant has a row in docs/simulator.md's table of sources (published, fitted or
assumed), so a new constant cannot arrive without saying where it comes from."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from basin.sim.deployments import Deployment, GpuCalibration
from basin.workload.synthetic import SyntheticProfile

DOC = Path(__file__).resolve().parents[2] / "docs" / "simulator.md"
# Fields that are not calibrated numbers: names, shapes and switches each preset or option sets.
NOT_CONSTANTS = {
    "name", "gpu", "prefill_instances", "decode_instances", "write_through", "allocation", "router",
    "decode_prefill", "prefix", "vocabulary",
}  # fmt: skip


def _source_rows() -> dict[str, str]:
    """First cell's backticked names -> the row's source cell, from the section's tables."""
    section = DOC.read_text().split("## Constants and their sources", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or set(cells[0]) <= {"-"}:
            continue
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            rows[name] = cells[-1]
    return rows


def test_every_calibrated_constant_states_its_source() -> None:
    rows = _source_rows()
    fields = {
        f.name
        for cls in (GpuCalibration, Deployment, SyntheticProfile)
        for f in dataclasses.fields(cls)
        if f.name not in NOT_CONSTANTS
    }
    assert fields - rows.keys() == set(), "constants without a row in docs/simulator.md"
    assert rows.keys() <= fields, "rows naming no constant"
    for name in fields:
        source = rows[name]
        assert re.search(r"\b(published|fitted|assumed|SGLang)", source), f"{name}: no source kind: {source}"
