"""The chart's dashboards and alert rules: generated from `basin_monitoring` and committed in sync, valid
for `promtool`, every alert linked to a runbook section that exists, every engine series they read
exported by the emulator (so the live test below can evaluate them)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from basin_monitoring import alerts, dashboards
from basin_monitoring.__main__ import generated, main

ROOT = Path(__file__).resolve().parents[2]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        raise RuntimeError("promtool is not on PATH (Debian: apt-get install prometheus)")
    return path


def test_committed_files_are_what_the_generator_writes() -> None:
    assert main(["--check"]) == 0, "run: python -m basin_monitoring"
    assert {p.name for p in generated()} == {
        "basin-overview.json",
        "basin-engines.json",
        "basin-profiling.json",
        "basin.yaml",
    }


@pytest.mark.parametrize("scale", [1, 20])
def test_promtool_accepts_the_rules(tmp_path: Path, scale: float) -> None:
    """The committed rules, and the time-scaled copy the live test loads."""
    path = tmp_path / "basin.yaml"
    path.write_text(alerts.render(scale))
    result = subprocess.run([promtool(), "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_links_to_its_runbook_section() -> None:
    """Absolute links into the published runbook, each to a section docs/runbook.md has (the committed
    rule file is the generator's output, checked above)."""
    anchors = alerts.heading_anchors((ROOT / "docs" / "runbook.md").read_text())
    assert alerts.RUNBOOK_URL.startswith("https://") and alerts.RUNBOOK_URL.endswith("/docs/runbook.md")
    committed = yaml.safe_load((ROOT / "helm" / "basin" / "files" / "alerts" / "basin.yaml").read_text())
    rules = [r for g in committed["groups"] for r in g["rules"] if "alert" in r]
    assert len(rules) >= 8
    for rule in rules:
        url = rule["annotations"]["runbook_url"]
        page, _, anchor = url.partition("#")
        assert page == alerts.RUNBOOK_URL and anchor in anchors, (rule["alert"], url)
        assert rule["labels"]["severity"] in ("warning", "critical")
    assert len({r["annotations"]["runbook_url"] for r in rules}) >= 7  # sections, not one page for all


def test_the_runbook_page_is_a_parameter() -> None:
    rules = yaml.safe_load(alerts.render(runbook_url="https://docs.example.com/runbook"))["groups"][1]
    urls = [r["annotations"]["runbook_url"] for r in rules["rules"]]
    assert urls and all(u.startswith("https://docs.example.com/runbook#") for u in urls)


def test_the_anchor_check_notices_a_missing_section() -> None:
    runbook = (ROOT / "docs" / "runbook.md").read_text()
    assert "cache-trap" in alerts.heading_anchors(runbook)
    assert "cache-trap" not in alerts.heading_anchors(
        runbook.replace("## Cache trap\n", "## Cache trapped\n")
    )


def test_every_engine_series_read_is_one_the_emulator_exports() -> None:
    """Names only (the live test evaluates the queries); a misspelled `sglang:` name fails here at once."""
    from test_emulator_sglang_names import emulator_metrics

    exported = set()
    for family, (kind, _) in emulator_metrics().items():
        suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}.get(kind, [""])
        exported |= {family + s for s in suffixes}
    texts = [alerts.render()] + [dashboards.render(n) for n in dashboards.DASHBOARDS]
    used = {name for text in texts for name in re.findall(r"sglang:[a-z0-9_]+", text)}
    assert used and used <= exported, sorted(used - exported)
