"""Evaluation suites: rows per scenario and system, ratios to BASIN, JSON without NaN."""

import dataclasses
import json

import pytest

from basin.evaluate import suites
from basin.evaluate.suites import Scenario, System, run_suite


@pytest.fixture
def tiny_suite(monkeypatch: pytest.MonkeyPatch) -> str:
    scenario = Scenario("1P1D light", "h100-1p1d", 0.0, 1.5, 2.0, 5.0, surge_start_min=5.0, duration_min=40.0)
    systems = (
        System("BASIN", "basin"),
        System("without priority order", "basin", (("ordering", False),)),
        System("HiCache alone", "hicache"),
    )
    monkeypatch.setitem(suites.SUITES, "tiny", ((scenario,), systems))
    return "tiny"


def test_suite_rows_and_ratios(tiny_suite: str) -> None:
    progress: list[int] = []
    rows = run_suite(tiny_suite, seed=0, progress=progress.append)
    assert progress == [1, 2, 3]
    assert [r.system for r in rows] == ["BASIN", "without priority order", "HiCache alone"]
    assert rows[0].relative_to_basin == 1.0
    for row in rows:
        assert row.goodput_sessions_per_h > 0
        assert row.relative_to_basin == pytest.approx(
            row.goodput_sessions_per_h / rows[0].goodput_sessions_per_h
        )
        json.dumps(row.to_dict(), allow_nan=False)


def test_ablation_suite_covers_the_papers_variants() -> None:
    scenarios, systems = suites.SUITES["ablation"]
    names = {s.name for s in systems}
    expected = {
        "BASIN",
        "without priority order",
        "without admission",
        "without lending",
        "lending only",
        "arrival-time controller",
        "Continuum",
        "ThunderAgent",
        "CONCUR",
        "Crossflow",
        "HiCache alone",
    }
    assert names == expected
    assert any(s.host_tier == 0 for s in scenarios) and any(s.host_tier > 0 for s in scenarios)
    assert any(
        s.surge_minutes >= 60 and s.host_tier > 0 for s in scenarios
    )  # §7.9's hour of sustained overload


def test_sensitivity_suite_sets_each_parameter_of_fig_24a_lower_and_higher() -> None:
    """Fig. 24a's caption: Δ, m, the three α, φ, T_s and r each set below and above the §6.6 default, one at
    a time, on the ablation scenarios, and so is every other numeric setting of BasinConfig (a new one
    joins the study, or this fails); every variant is a valid BasinConfig."""
    from basin.policy import BasinConfig

    scenarios, systems = suites.SUITES["sensitivity"]
    assert scenarios == suites.SUITES["ablation"][0]
    assert systems[0] == System("BASIN", "basin")
    default = BasinConfig()
    sides: dict[str, set[str]] = {}
    for system in systems[1:]:
        assert system.name.startswith("BASIN ") and system.policy == "basin"
        ((field, value),) = system.config_changes
        BasinConfig(**{field: value})  # raises on a value out of range
        base = getattr(default, field)
        assert value != base, system.name
        if isinstance(value, float):
            sides.setdefault(field, set()).add("lower" if value < base else "higher")
    numeric = [f.name for f in dataclasses.fields(BasinConfig) if f.type in ("float", float)]
    assert len(numeric) >= 18  # §6.6's parameters (Δ with its fast interval) and ours
    for field in numeric:
        assert sides[field] == {"lower", "higher"}, field
    ranges = {v for s in systems[1:] for f, v in s.config_changes if f == "budget_range"}
    assert ranges == {(0.25, 4.0), (0.5, 2.0)}  # the paper's wide one; the narrow one policies.md rejects


def test_sensitivity_spread_pools_seeds_per_pair_and_leaves_baselines_out() -> None:
    from basin.evaluate.suites import Row, headline, sensitivity_spread

    def row(scenario: str, system: str, ratio: float) -> Row:
        return Row(scenario, system, 900 * ratio, 1, 0, 1, 1, "healthy", ratio)

    rows = [
        row("a", "BASIN", 1.0),
        row("a", "BASIN Δ 15 s", 1.02),
        row("a", "BASIN Δ 15 s", 1.06),  # a second seed: the pair's mean is 1.04, outside 3 %
        row("a", "BASIN r 100", 0.99),
        row("b", "BASIN Δ 15 s", 0.80),
        row("b", "BASIN r 100", 1.01),
        row("b", "Continuum", 0.5),  # not a variant
    ]
    spread = sensitivity_spread(rows)
    assert spread is not None
    assert spread.pairs == 4
    assert spread.within == 0.5  # 0.99 and 1.01
    assert spread.median_change == pytest.approx(0.025)  # changes 0.01, 0.01, 0.04, 0.20
    assert (spread.low, spread.high) == (pytest.approx(0.80), pytest.approx(1.04))
    assert "4 variant–scenario pairs: 50 % within 3 %" in spread.text()
    assert sensitivity_spread([row("a", "BASIN", 1.0), row("a", "Continuum", 0.5)]) is None
    # Variants never count as the strongest baseline: here there is none.
    assert all(not head["strongest_baseline"] for head in headline([r for r in rows if r.scenario == "a"]))


def test_headline_ratios_pick_the_strongest_baseline() -> None:
    from basin.evaluate.suites import Row, headline

    rows = [
        Row("s", "BASIN", 900, 1, 0, 1, 1, "healthy"),
        Row("s", "Continuum", 600, 1, 0, 1, 1, "healthy"),
        Row("s", "without lending", 950, 1, 0, 1, 1, "healthy"),  # a variant, not a baseline
        Row("s", "HiCache alone", 300, 1, 0, 1, 1, "trapped"),
    ]
    (head,) = headline(rows)
    assert head["strongest_baseline"] == "Continuum"
    assert head["vs_strongest"] == 1.5 and head["vs_hicache"] == 3.0


def test_main_suite_has_six_scenarios_and_seven_systems() -> None:
    scenarios, systems = suites.SUITES["main"]
    assert len(scenarios) == 6 and len(systems) == 7
    assert {s.policy for s in systems} == {
        "basin",
        "continuum",
        "thunderagent",
        "concur",
        "crossflow",
        "composition",
        "hicache",
    }
    assert all(s.base_rate is None and s.base_fraction == 0.5 for s in scenarios)


def test_sweep_steady_and_post_surge_suites_follow_the_paper() -> None:
    sweep, _ = suites.SUITES["surge-sweep"]
    default = [s for s in sweep if s.tool_time_scale == 1.0]  # the tools x3 panel is tested below
    assert [s.surge_factor for s in default] == [3.0, 4.0, 5.0, 6.0]
    assert all(s.surge_minutes == 20 and s.base_fraction == 0.55 for s in default)
    steady, _ = suites.SUITES["steady"]
    assert all(s.surge_minutes == 0 for s in steady)
    assert [s.base_fraction for s in steady if s.tool_time_scale == 1.0] == [0.6, 0.8, 1.0, 1.2]
    post, _ = suites.SUITES["post-surge"]
    assert [s.post_surge_fraction for s in post] == [0.1, 0.3, 0.5]
    assert all(s.host_tier == 0 and s.surge_factor == 4.0 and s.surge_minutes == 10 for s in post)


def test_post_surge_rate_reaches_the_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    class Spy:
        def __init__(self, config, policy, pool):
            seen["schedule"] = config.schedule

        def run(self):
            raise StopIteration

    monkeypatch.setattr("basin.sim.Simulation", Spy)
    monkeypatch.setattr(suites, "profile_for", lambda scenario, seed, shared_prefix: (1.0, 10.0))
    scenario = suites.Scenario("x", "h100-1p1d", 0.0, None, 4.0, 10.0, post_surge_fraction=0.3)
    with pytest.raises(StopIteration):
        suites.run_scenario(scenario, suites.System("HiCache alone", "hicache"), 0)
    assert seen["schedule"].base_rate == 5.0 and seen["schedule"].post_surge_rate == 3.0


def test_late_suite_switches_systems_on_at_minute_45() -> None:
    (scenario,), systems = suites.SUITES["late"]
    assert scenario.activate_min == 45.0 and scenario.surge_factor == 5.0
    assert len(systems) == 7


def test_tools_x3_scenarios_run_two_and_a_half_hours_and_have_their_panels() -> None:
    """§7.1: runs with tool time x3 last 2.5 h; Fig. 16/17 have tools x3 panels (the surge sweep from
    0.66 of λc, and steady load)."""
    for name in ("main", "surge-sweep", "steady"):
        scenarios, _ = suites.SUITES[name]
        tools = [s for s in scenarios if s.tool_time_scale > 1]
        assert tools and all(s.duration_min == 150.0 for s in tools)
        assert all(s.duration_min == 120.0 for s in scenarios if s.tool_time_scale == 1)
    sweep, _ = suites.SUITES["surge-sweep"]
    panel = [s for s in sweep if s.tool_time_scale == 3.0]
    assert sorted(s.surge_factor for s in panel) == [3.0, 4.0, 5.0, 6.0]
    assert all(s.base_fraction == 0.66 and s.surge_minutes == 20.0 for s in panel)
    steady, _ = suites.SUITES["steady"]
    assert len([s for s in steady if s.tool_time_scale == 3.0]) == 4


def test_a_shared_prefix_reaches_the_profile_and_every_session(monkeypatch: pytest.MonkeyPatch) -> None:
    """`basin report --shared-prefix`: the runs and the profile ramps that set their base rate both see it."""
    seen: dict = {}

    class Spy:
        def __init__(self, config, policy, pool):
            seen["shared"] = {s.shared_prefix_tokens for s in pool}
            seen["all_or_whole_first"] = all(
                s.shared_prefix_tokens in (4096, s.first_prompt_tokens) for s in pool
            )

        def run(self):
            raise StopIteration

    def profile(scenario, seed, shared_prefix):
        seen["profiled_with"] = shared_prefix
        return (1.0, 10.0)

    monkeypatch.setattr("basin.sim.Simulation", Spy)
    monkeypatch.setattr(suites, "profile_for", profile)
    scenario = suites.Scenario("x", "h100-1p1d", 0.0, None, 2.0, 10.0)
    with pytest.raises(StopIteration):
        suites.run_scenario(scenario, suites.System("HiCache alone", "hicache"), 0, shared_prefix=4096)
    assert seen["profiled_with"] == 4096
    assert seen["all_or_whole_first"] and 4096 in seen["shared"]
    with pytest.raises(StopIteration):
        suites.run_scenario(scenario, suites.System("HiCache alone", "hicache"), 0)
    # Without the option the workload keeps its own prefix (Terminal-Bench's 8K; all of a short first prompt).
    assert seen["profiled_with"] is None and max(seen["shared"]) == 8192


def test_evaluate_sensitivity_prints_the_spread_and_no_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    """`basin evaluate sensitivity` on a reduced scenario: the variants' spread after the table, and no
    "strongest baseline" line, since every system is BASIN."""
    from click.testing import CliRunner

    from basin.cli import cli

    scenario = Scenario("1P1D light", "h100-1p1d", 0.0, 1.5, 2.0, 5.0, surge_start_min=5.0, duration_min=40.0)
    systems = (System("BASIN", "basin"), System("BASIN r 100", "basin", (("priority_rate", 100.0),)))
    monkeypatch.setitem(suites.SUITES, "sensitivity", ((scenario,), systems))
    monkeypatch.setattr(suites, "profile_for", lambda *args: (1.0, 3.3))  # no ramps: a fixed-rate scenario
    result = CliRunner().invoke(cli, ["evaluate", "sensitivity"])
    assert result.exit_code == 0, result.output
    assert "1 variant–scenario pairs:" in result.output and "(paper §7.9: 204 pairs" in result.output
    assert "strongest baseline" not in result.output
