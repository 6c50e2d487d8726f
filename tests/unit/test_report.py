"""The seed report: mean/range/state counts and margins from per-seed rows, the paper column placed (— where
the paper gives nothing), `--from-json` re-rendering the same Markdown, bad input as one-line errors, and
one small real run through the same code path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from basin.errors import BasinError
from basin.evaluate import paper, report, suites
from basin.evaluate.suites import Scenario, System

BASIN = str(Path(sys.executable).with_name("basin"))


def _row(seed: int, system: str, goodput: float, label: str, scenario: str = "1P3D x5 surge") -> dict:
    return {
        "suite": "main",
        "seed": seed,
        "scenario": scenario,
        "system": system,
        "goodput_sessions_per_h": goodput,
        "completed_fraction": 0.9,
        "shed_fraction": 0.0,
        "median_slowdown": 1.5,
        "p90_first_call_wait_s": None,
        "label": label,
        "relative_to_basin": None,
    }


@pytest.fixture
def data() -> dict:
    rows = []
    for seed, (basin, continuum, thunder, hicache, label) in enumerate(
        [(800, 400, 300, 200, "healthy"), (900, 600, 300, 150, "healthy"), (700, 700, 350, 100, "recovering")]
    ):
        rows += [
            _row(seed, "BASIN", basin, label),
            _row(seed, "Continuum", continuum, "healthy"),
            _row(seed, "ThunderAgent", thunder, "recovering"),
            _row(seed, "HiCache alone", hicache, "trapped"),
        ]
    return {
        "schema": report.SCHEMA,
        "commit": "abc",
        "generated": "now",
        "suites": ["main"],
        "seeds": [0, 1, 2],
        "rows": rows,
    }


def _line(text: str, *cells: str) -> str:
    return next(line for line in text.splitlines() if all(f"| {c} |" in line for c in cells))


def test_render_cells_states_margins_and_paper(data: dict) -> None:
    text = report.render(data)
    assert "Seeds 0–2 (3)" in text and "`abc`" in text
    basin = _line(text, "1P3D x5 surge", "BASIN")
    assert "| 800 [700–900] |" in basin
    assert "healthy 2/3, recovering 1/3" in basin
    assert basin.endswith("| — |")  # the paper gives BASIN's 1P3D goodput only relatively
    continuum = _line(text, "1P3D x5 surge", "Continuum")
    assert "| 567 [400–700] |" in continuum and "healthy 3/3" in continuum
    # The paper's BASIN 1.64× Continuum, then ours in the same direction: 2.00, 1.50, 1.00.
    assert "BASIN 1.64× · ours 1.50 [1.00–2.00] (Fig. 14, §7.3)" in continuum
    assert "trapped 3/3" in _line(text, "1P3D x5 surge", "HiCache alone")
    assert "3.13–4.17" in _line(text, "1P3D x5 surge", "HiCache alone")
    assert _line(text, "1P3D x5 surge", "ThunderAgent").endswith("| — |")
    margin = _line(text, "1P3D x5 surge", "1.50 [1.00–2.00]×")
    assert "Continuum 3/3" in margin and "BASIN 1.64×" in margin
    assert "Paper: Fig. 14" in text


def test_render_gives_the_sensitivity_spread_and_no_margin(data: dict) -> None:
    """The sensitivity suite's variants are BASIN's, so there is no baseline to lead: the report gives the
    spread of the variants around BASIN (pooled over seeds per pair) beside §7.9's, and no margin table."""
    rows = []
    for seed, (fast, slow) in enumerate([(1.02, 0.90), (1.06, 0.94)]):
        rows += [
            {**_row(seed, "BASIN", 900, "healthy"), "suite": "sensitivity", "relative_to_basin": 1.0},
            {**_row(seed, "BASIN Δ 15 s", 900 * fast, "healthy"), "suite": "sensitivity"},
            {**_row(seed, "BASIN Δ 60 s", 900 * slow, "healthy"), "suite": "sensitivity"},
        ]
        rows[-2]["relative_to_basin"], rows[-1]["relative_to_basin"] = fast, slow
    text = report.render({**data, "suites": ["sensitivity"], "seeds": [0, 1], "rows": rows})
    assert "| BASIN Δ 15 s | 936 [918–954] |" in text
    assert "Spread: 2 variant–scenario pairs: 0 % within 3 %" in text  # means 1.04 and 0.92
    assert "median change 6.0 %, ratios 0.92–1.04" in text
    assert "BASIN over the strongest baseline" not in text
    assert "Paper: Fig. 24a" in text


def test_from_json_round_trip(data: dict, tmp_path: Path) -> None:
    source = tmp_path / "rows.json"
    source.write_text(json.dumps(data))
    out, again = tmp_path / "report.md", tmp_path / "again.json"
    result = subprocess.run(
        [BASIN, "report", "--from-json", str(source), "--out", str(out), "--json", str(again)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert out.read_text() == report.render(data)
    assert json.loads(again.read_text()) == data


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seeds", "4-0"], "--seeds range '4-0'"),
        (["--seeds", "x"], "--seeds takes"),
        (["--suites", "main,nope"], "unknown suite nope"),
        (["--jobs", "0"], "--jobs"),
        (["--suites", "main", "--scenario", "1P3D x9 surge"], "no scenario '1P3D x9 surge' in suite main"),
        (["--suites", "headline", "--system", "CONCUR"], "no system 'CONCUR' in suite headline"),
        (
            ["--suites", "headline,late", "--scenario", "1P3D x5 surge", "--system", "Crossflow"],
            "nothing to run",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [BASIN, "report", *args, "--out", str(tmp_path / "r.md")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert message in result.stderr
    if args[0] != "--jobs":  # click's own usage errors print a usage line too
        assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["--shared-prefix", "0"],
        ["--scenario", "1P3D x5 surge"],
        ["--system", "BASIN", "--system", "Continuum"],
    ],
)
def test_a_partial_report_needs_its_own_out(args: list[str], tmp_path: Path) -> None:
    """Without --out a one-cell (or shared-prefix) report would overwrite the project's docs/evaluation.md."""
    (tmp_path / "docs").mkdir()
    result = subprocess.run(
        [BASIN, "report", "--suites", "headline", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "is not the project's; name its --out" in result.stderr
    assert not (tmp_path / "docs" / "evaluation.md").exists()


def test_bad_from_json(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    result = subprocess.run(
        [BASIN, "report", "--from-json", str(bad), "--out", str(tmp_path / "r.md")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_parse_seeds() -> None:
    assert report.parse_seeds("0-4") == [0, 1, 2, 3, 4]
    assert report.parse_seeds("3") == [3]
    assert report.parse_seeds("0,2-3,2") == [0, 2, 3]
    with pytest.raises(BasinError):
        report.parse_seeds("1-")


def test_paper_cells_name_real_suite_cells() -> None:
    """A paper figure keyed to a scenario or system the suite lacks would never be shown."""
    for suite, scenario, system in paper.CELLS:
        scenarios, systems = suites.SUITES[suite]
        assert scenario in {s.name for s in scenarios}, (suite, scenario)
        assert system in {s.name for s in systems}, (suite, system)
    for suite, scenario in paper.MARGINS:
        assert scenario in {s.name for s in suites.SUITES[suite][0]}, (suite, scenario)
    assert set(paper.NOTES) <= set(suites.SUITES)


def test_small_real_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two seeds of a reduced scenario through run_report and render, as `basin report` runs them."""
    scenario = Scenario("1P1D light", "h100-1p1d", 0.0, 1.5, 2.0, 5.0, surge_start_min=5.0, duration_min=40.0)
    systems = (System("BASIN", "basin"), System("HiCache alone", "hicache"))
    monkeypatch.setitem(suites.SUITES, "tiny", ((scenario,), systems))
    advanced: list[int] = []
    rows = report.run_report(["tiny"], [0, 1], jobs=1, advance=advanced.append)
    assert report.run_count(["tiny"], [0, 1]) == 4 == sum(advanced) == len(rows)
    order = [(r["seed"], r["system"]) for r in rows]
    assert order == [(0, "BASIN"), (0, "HiCache alone"), (1, "BASIN"), (1, "HiCache alone")]
    text = report.render(report.payload(rows, ["tiny"], [0, 1]))
    assert "## tiny" in text
    for system in ("BASIN", "HiCache alone"):
        line = _line(text, "1P1D light", system)
        assert "/2" in line and line.endswith("| — |")
    json.dumps(rows, allow_nan=False)


def _fake_rows(
    scenario: Scenario, systems: tuple[System, ...], seed: int, shared_prefix: int | None = None
) -> list[suites.Row]:
    """Instant rows in place of simulations, so the process pool and the CLI's run path are tested fast;
    a shared prefix adds its thousands of tokens to the goodput, so a test sees that it arrived."""
    extra = (shared_prefix or 0) / 1000
    return [
        suites.Row(scenario.name, s.name, 100.0 * (seed + 1) / (i + 1) + extra, 1.0, 0.0, 1.0, 0.0, "healthy")
        for i, s in enumerate(systems)
    ]


def test_worker_processes_keep_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "scenario_rows", _fake_rows)  # forked workers inherit the patch
    one = report.run_report(["main", "headline"], [0, 1], jobs=1)
    assert report.run_report(["main", "headline"], [0, 1], jobs=2) == one
    assert len(one) == report.run_count(["main", "headline"], [0, 1])


def test_cli_run_writes_report_and_json(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from basin.cli import cli

    monkeypatch.setattr(report, "scenario_rows", _fake_rows)
    out, rows = tmp_path / "report.md", tmp_path / "rows.json"
    args = ["report", "--seeds", "0-1", "--suites", "headline", "--jobs", "1", "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--json", str(rows)])
    assert result.exit_code == 0, result.output
    data = json.loads(rows.read_text())
    assert data["seeds"] == [0, 1] and data["suites"] == ["headline"] and len(data["rows"]) == 6
    text = out.read_text()
    assert out.read_text() == report.render(data)
    assert "| 150 [100–200] | healthy 2/2 |" in _line(text, "1P3D x5 surge", "BASIN")
    assert "Not in this report: main" in text


def test_cli_shared_prefix_reaches_every_run_and_is_named_in_the_report(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from click.testing import CliRunner

    from basin.cli import cli

    monkeypatch.setattr(report, "scenario_rows", _fake_rows)  # forked workers inherit the patch
    out, rows = tmp_path / "report.md", tmp_path / "rows.json"
    args = ["report", "--seeds", "0-1", "--suites", "headline", "--jobs", "2", "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--shared-prefix", "8192", "--json", str(rows)])
    assert result.exit_code == 0, result.output
    data = json.loads(rows.read_text())
    assert data["shared_prefix"] == 8192
    (scenario,), systems = suites.SUITES["headline"]
    expected = [_fake_rows(scenario, systems, seed, 8192) for seed in (0, 1)]
    assert [r["goodput_sessions_per_h"] for r in data["rows"]] == [
        row.goodput_sessions_per_h for rows_of_seed in expected for row in rows_of_seed
    ]
    text = out.read_text()
    assert text == report.render(data)
    assert "same 8,192-token prefix" in text and "--shared-prefix 8192 --out FILE" in text
    plain = report.render({**data, "shared_prefix": None})
    assert "prefix" not in plain.split("Goodput is")[0] and "--out docs/evaluation.md" in plain


@pytest.mark.parametrize("value", [-1, "8K", True, 1.5])
def test_from_json_rejects_a_bad_shared_prefix(value: object, tmp_path: Path, data: dict) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({**data, "shared_prefix": value}))
    with pytest.raises(BasinError, match="shared_prefix must be a token count"):
        report.check_payload(json.loads(path.read_text()))


def test_cli_scenario_and_system_limit_the_runs_and_the_report_names_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One cell over many seeds (how docs/simulator.md measures HiCache alone's chance of a trap): only the
    named scenario and system run, the report says so, and without BASIN it shows no margin table."""
    from click.testing import CliRunner

    from basin.cli import cli

    calls: list[tuple[str, tuple[str, ...], int]] = []

    def fake(scenario: Scenario, systems: tuple[System, ...], seed: int, shared_prefix: int | None = None):
        calls.append((scenario.name, tuple(s.name for s in systems), seed))
        return _fake_rows(scenario, systems, seed, shared_prefix)

    monkeypatch.setattr(report, "scenario_rows", fake)
    out, rows = tmp_path / "report.md", tmp_path / "rows.json"
    cell = ["--scenario", "1P1D x5 surge, tools x3", "--system", "HiCache alone"]
    args = ["report", "--seeds", "0-2", "--suites", "main", *cell, "--jobs", "1", "--out", str(out)]
    result = CliRunner().invoke(cli, [*args, "--json", str(rows)])
    assert result.exit_code == 0, result.output
    assert calls == [("1P1D x5 surge, tools x3", ("HiCache alone",), seed) for seed in (0, 1, 2)]
    data = json.loads(rows.read_text())
    assert data["only_scenarios"] == ["1P1D x5 surge, tools x3"] and data["only_systems"] == ["HiCache alone"]
    assert report.run_count(["main"], [0, 1, 2], data["only_scenarios"], data["only_systems"]) == 3
    text = out.read_text()
    assert text == report.render(data)
    assert "Only the scenario '1P1D x5 surge, tools x3' (`--scenario`)." in text
    assert "--scenario '1P1D x5 surge, tools x3' --system 'HiCache alone' --out FILE" in text
    assert "| 200 [100–300] | healthy 3/3 |" in _line(text, "1P1D x5 surge, tools x3", "HiCache alone")
    assert "BASIN over the strongest" not in text
    both = report.run_report(["main"], [0], scenarios=["1P3D x5 surge"], systems=["BASIN", "Continuum"])
    assert [(r["scenario"], r["system"]) for r in both] == [
        ("1P3D x5 surge", "BASIN"),
        ("1P3D x5 surge", "Continuum"),
    ]
    one_seed = report.render(report.payload(both, ["main"], [0]))
    assert "Seeds 0 (1)" in one_seed and "--seeds 0 " in one_seed
    assert "2.00×" in _line(
        report.render(report.payload(both, ["main"], [0])), "1P3D x5 surge", "Continuum 1/1"
    )


def test_shared_prefix_with_from_json_is_one_line_exit_2(tmp_path: Path, data: dict) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(data))
    run = subprocess.run(
        [BASIN, "report", "--from-json", str(path), "--shared-prefix", "8192", "--out", "-"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "--shared-prefix, --scenario and --system apply to runs" in run.stderr


@pytest.mark.parametrize(
    "markdown, rows",
    [
        ("evaluation.md", "evaluation-seeds.json"),
        ("evaluation-shared-prefix.md", "evaluation-shared-prefix.json"),
    ],
)
def test_committed_reports_are_their_rows_rendered(markdown: str, rows: str) -> None:
    """docs/ keeps each report's per-seed rows beside its Markdown: the figures quoted in the docs can be
    traced to runs, and a change to the renderer shows up here rather than as a stale page."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    data = report.check_payload(json.loads((docs / rows).read_text()))
    assert (docs / markdown).read_text() == report.render(data)


def test_the_report_names_the_commit_of_its_own_checkout_from_any_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from a folder outside the checkout (the docs' advice for long runs), the report still names the
    commit it measured, not `unknown`."""
    checkout = Path(report.__file__).resolve().parent
    head = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"], cwd=checkout, capture_output=True, text=True
    )
    assert head.returncode == 0, head.stderr
    monkeypatch.chdir(tmp_path)
    assert report.commit().removesuffix("+dirty") == head.stdout.strip()
