"""`basin trap-map` (paper §4, Fig. 7): how often a surge traps HiCache alone, counted over seeds."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from basin.evaluate import trapmap

BASIN = str(Path(sys.executable).with_name("basin"))
GRID = ("--seeds", "2,3", "--surges", "1,2", "--duration-min", "60")


def basin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASIN, *args], capture_output=True, text=True, timeout=300, check=False)


def test_each_cell_counts_the_runs_simulate_labels_trapped(tmp_path: Path) -> None:
    out, figure = tmp_path / "map.json", tmp_path / "map.png"
    result = basin("trap-map", *GRID, "--jobs", "2", "--json", str(out), "--plot", str(figure), "--quiet")
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    runs = [(o["surge_factor"], o["seed"]) for o in data["outcomes"]]
    assert runs == [(1.0, 2), (1.0, 3), (2.0, 2), (2.0, 3)]  # grid order, whatever finished first
    for outcome in data["outcomes"]:
        surge = "10" if outcome["surge_factor"] != 1 else "0"  # the control has no surge window at all
        alone = basin(
            "simulate", "--base-rate", "3.3", "--seed", str(outcome["seed"]), "--duration-min", "60",
            "--surge-factor", str(outcome["surge_factor"]), "--surge-minutes", surge,
            "--json", "-", "--quiet",
        )  # fmt: skip
        assert alone.returncode == 0, alone.stderr
        single = json.loads(alone.stdout)
        assert outcome["label"] == single["label"]
        assert outcome["goodput_sessions_per_h"] == pytest.approx(single["goodput_sessions_per_h"])
        assert outcome["l_late_s"] == pytest.approx(single["l_late_s"])
    for line in result.stdout.splitlines():
        assert "Traceback" not in line
    assert "95 % CI" in result.stdout
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_worker_processes_do_not_change_the_outcomes() -> None:
    spec = trapmap.MapSpec("h100-1p1d", (3.3,), (1.0, 2.0), (2, 3), duration_min=60)
    serial, parallel = trapmap.run_map(spec, jobs=1), trapmap.run_map(spec, jobs=2)
    assert serial == parallel
    cell = trapmap.cells(serial)[1]
    assert cell.surge_factor == 2.0
    assert len(cell.trapped) == sum(o.label == "trapped" for o in serial if o.surge_factor == 2.0)
    slow = [o.seed for o in serial if o.surge_factor == 2.0 and o.l_late_s > 10]
    assert [o.seed for o in cell.persistently_slow] == slow


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--surges", "0.5"), "surge factors must be at least 1"),
        (("--base-rates", "3,x"), "--base-rates takes a comma list of numbers"),
        (("--seeds", "4-2"), "--seeds range"),
        (("--duration-min", "40"), "35 minutes past the surge's end"),
        (("--deployment", "h300-1p1d"), "unknown deployment"),
        (("--workload", "no-such-workload"), "unknown workload"),
    ],
)
def test_bad_input_is_refused_before_any_run(args: tuple[str, ...], message: str) -> None:
    result = basin("trap-map", *args, "--quiet")
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_state_slots_cut_reuse_in_simulate() -> None:
    def hit(*extra: str) -> float:
        result = basin(
            "simulate", "--base-rate", "3.3", "--duration-min", "30", "--json", "-", "--quiet", *extra
        )
        assert result.returncode == 0, result.stderr
        data = json.loads(result.stdout)
        assert data["state_slots"] == (int(extra[1]) if extra else None)
        return float(data["hit_rate_pre"])

    # 40 snapshots for ~45 active sessions: a returning session often finds its prompt's pages cached
    # but its recurrent state gone, and must recompute (paper §2).
    assert hit("--state-slots", "40") < hit() - 0.05


def test_offered_demand_is_the_arrivals_on_an_engine_that_never_binds(tmp_path: Path) -> None:
    from basin.policy import make_policy
    from basin.sim import Simulation, SimulationConfig
    from basin.workload import RateSchedule, load_workload

    spec = trapmap.MapSpec("h100-1p1d", (3.3,), (1.0, 3.0), (2, 3), duration_min=60, offered=True)
    out = tmp_path / "offered.json"
    result = basin(
        "trap-map", "--seeds", "2,3", "--surges", "1,3", "--duration-min", "60", "--offered",
        "--json", str(out), "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    outcomes = [trapmap.Outcome(**o) for o in json.loads(out.read_text())["outcomes"]]
    control = {o.seed: o for o in outcomes if o.surge_factor == 1.0}
    surge = {o.seed: o for o in outcomes if o.surge_factor == 3.0}
    for seed in (2, 3):
        assert surge[seed].label == "trapped"  # the engine copes badly with a +200 % surge…
        # …which adds ~66 sessions in 10 minutes to the ~45 of the base load: the demand shows it.
        assert surge[seed].offered_peak_sessions > control[seed].offered_peak_sessions + 20
        assert surge[seed].offered_peak_working_set > control[seed].offered_peak_working_set + 0.5
        assert 1.0 < control[seed].offered_peak_working_set < 3.0  # the calibrated base load nears 2x C
    # The never-binding engine keeps the prefixes of the very arrivals that trap the real one.
    deployment = spec.deployment_model()
    schedule = RateSchedule(3.3, 60, surge_factor=3.0, surge_start_min=15, surge_minutes=10)
    pool = load_workload("terminal-bench", seed=3)
    config = SimulationConfig(trapmap.never_binding(deployment), schedule, seed=3)
    summary = Simulation(config, make_policy("hicache"), pool).run().summary
    assert summary.label == "healthy"
    assert summary.hit_rate_late > 0.9
    plain = trapmap.run_map(dataclasses.replace(spec, offered=False, seeds=(3,), surge_factors=(1.0,)))
    assert plain[0].offered_peak_sessions is None and plain[0].offered_peak_working_set is None
    # The table is followed by the cut that separates the two trapped surges from the healthy controls.
    cut = trapmap.trap_threshold(outcomes, "offered_peak_working_set")
    assert cut is not None and (cut.trapped_above, cut.trapped, cut.others_above, cut.others) == (2, 2, 0, 2)
    top_control = max(o.offered_peak_working_set for o in control.values())
    assert top_control < cut.value < min(o.offered_peak_working_set for o in surge.values())
    assert f"peak W/C {cut.value:.2f}: above it 2 of 2 trapped runs and 0 of 2 others" in result.stdout


def test_the_trap_threshold_is_the_cut_that_best_tells_trapped_runs_from_the_rest() -> None:
    def runs(*offered: tuple[float, str]) -> list[trapmap.Outcome]:
        return [
            trapmap.Outcome(3.3, 2.0, seed, label, 0.9, 0.3, 60, 40, 90, demand, int(demand * 30))
            for seed, (demand, label) in enumerate(offered)
        ]

    # One trapped run in nine: a cut that calls everything healthy gets 8 of 9 right, but Youden's J
    # (share of trapped above less share of others above) puts the cut under the trapped run.
    rare = runs(*[(1.5 + 0.05 * i, "healthy") for i in range(7)], (2.0, "recovering"), (2.2, "trapped"))
    cut = trapmap.trap_threshold(rare, "offered_peak_working_set")
    assert cut == trapmap.Threshold("offered_peak_working_set", pytest.approx(2.1), 1, 1, 0, 8)
    # Overlapping demand: cutting at 1.5 leaves a trapped run below (J = 2/3), cutting at 1.1 a healthy
    # run above (J = 1 - 1/2): the first is better.
    mixed = runs((1.0, "healthy"), (1.2, "trapped"), (1.4, "healthy"), (1.6, "trapped"), (1.8, "trapped"))
    cut = trapmap.trap_threshold(mixed, "offered_peak_working_set")
    assert cut == trapmap.Threshold("offered_peak_working_set", pytest.approx(1.5), 2, 3, 0, 2)
    # On a tie between cuts (J = 1/2 at 1.1 and at 1.5) the lowest wins.
    tie = trapmap.trap_threshold(mixed[:4], "offered_peak_working_set")
    assert tie is not None and tie.value == pytest.approx(1.1)
    # Sessions are cut the same way, midway between the runs (60 and 66 sessions).
    assert trapmap.trap_threshold(rare, "offered_peak_sessions").value == pytest.approx(63)
    # No cut without both kinds of run, without offered demand, or when every run offers the same.
    untrapped = runs((1.0, "healthy"), (2.0, "overloaded"))
    bare = [dataclasses.replace(o, offered_peak_working_set=None) for o in mixed]
    level = runs((2.0, "healthy"), (2.0, "trapped"))
    for outcomes in (untrapped, bare, level):
        assert trapmap.trap_threshold(outcomes, "offered_peak_working_set") is None


def test_a_cell_bounds_the_chance_of_a_trap_by_its_seed_count() -> None:
    def cell(trapped: int, runs: int) -> trapmap.Cell:
        outcomes = tuple(
            trapmap.Outcome(3.3, 2.0, seed, "trapped" if seed < trapped else "healthy", 0.9, 0.3, 60, 40, 90)
            for seed in range(runs)
        )
        return trapmap.Cell(3.3, 2.0, outcomes)

    # Exact binomial (Clopper–Pearson) bounds: 4 of 12 fits a trap chance from 10 % to 65 %, and no trap
    # in 12 seeds still allows one in four; 96 seeds narrow 18 trapped to 12-28 %.
    assert cell(4, 12).trapped_share_interval == pytest.approx((0.099, 0.651), abs=0.001)
    assert cell(0, 12).trapped_share_interval == pytest.approx((0.0, 0.265), abs=0.001)
    assert cell(12, 12).trapped_share_interval == pytest.approx((0.735, 1.0), abs=0.001)
    assert cell(18, 96).trapped_share_interval == pytest.approx((0.115, 0.280), abs=0.001)
