"""The `basin` command as a user runs it: a real subprocess, exit codes and output."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from basin.workload import PUBLISHED

BASIN = str(Path(sys.executable).with_name("basin"))  # the installed console script, as users run it


def basin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASIN, *args], capture_output=True, text=True, timeout=120, check=False)


def test_stats_json_meets_published_targets() -> None:
    result = basin("workload", "stats", "--workload", "terminal-bench", "--seed", "1", "--json")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    for key in (
        "sessions",
        "calls_per_session",
        "median_prompt_tokens",
        "p90_prompt_tokens",
        "repeated_prompt_fraction",
        "median_output_tokens",
        "median_tool_gap_s",
        "median_peak_context_tokens",
    ):
        assert key in stats
    for key, target in PUBLISHED["terminal-bench"].items():
        assert stats[key] == pytest.approx(target, rel=0.10), key


def test_stats_table_shows_paper_column() -> None:
    result = basin("workload", "stats", "--workload", "swe-pro")
    assert result.returncode == 0, result.stderr
    assert "median_peak_context_tokens" in result.stdout
    assert "107,000" in result.stdout


def test_export_then_stats_reads_the_file(tmp_path: Path) -> None:
    out = tmp_path / "tb.jsonl"
    result = basin(
        "workload",
        "export",
        "--workload",
        "terminal-bench",
        "--seed",
        "3",
        "--sessions",
        "25",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    assert len(out.read_text().splitlines()) == 25
    stats = json.loads(basin("workload", "stats", "--workload", str(out), "--json").stdout)
    direct = json.loads(
        basin(
            "workload", "stats", "--workload", "terminal-bench", "--seed", "3", "--sessions", "25", "--json"
        ).stdout
    )
    assert stats["median_prompt_tokens"] == direct["median_prompt_tokens"]
    assert stats["sessions"] == 25


def test_every_subcommand_has_help() -> None:
    for args in (
        [],
        ["workload"],
        ["workload", "stats"],
        ["workload", "export"],
        ["simulate"],
        ["predictor"],
        ["predictor", "train"],
        ["predictor", "evaluate"],
    ):
        result = basin(*args, "--help")
        assert result.returncode == 0 and "Usage:" in result.stdout, args


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["workload", "stats", "--workload", "terminal-bnech"], "choose one of terminal-bench, swe-pro"),
        (["workload", "stats", "--workload", "swe-pro", "--output-scale", "0"], "--output-scale"),
        (["workload", "stats", "--workload", "swe-pro", "--sessions", "0"], "--sessions"),
        (["workload", "stats"], "Missing option '--workload'"),
    ],
)
def test_user_errors_exit_nonzero_without_traceback(args: list[str], message: str) -> None:
    result = basin(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_file_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"session_id": "a", "calls": [{"prompt_tokens": 5, "new_tokens": 5, "output_tokens": 1}]}'
    path.write_text(good + '\n{"session_id": "b", "calls": [{"prompt_tokens": -5}]}\n')
    result = basin("workload", "stats", "--workload", str(path))
    assert result.returncode == 2
    assert f"{path}:2:" in result.stderr
    assert "Traceback" not in result.stderr


def test_unreadable_output_path_is_a_clean_error(tmp_path: Path) -> None:
    result = basin("workload", "export", "--workload", "swe-pro", "--out", str(tmp_path / "no" / "x.jsonl"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


SIM_KEYS = (
    "goodput_sessions_per_h",
    "completed_fraction",
    "shed_fraction",
    "label",
    "hit_rate_pre",
    "hit_rate_late",
    "median_ttft_late_s",
    "windows",
    "events",
    "wall_seconds",
)


def test_simulate_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    result = basin(
        "simulate",
        "--deployment",
        "h100-1p1d",
        "--policy",
        "hicache",
        "--workload",
        "terminal-bench",
        "--base-rate",
        "3.3",
        "--surge-factor",
        "2.0",
        "--surge-start-min",
        "5",
        "--surge-minutes",
        "5",
        "--duration-min",
        "45",
        "--seed",
        "0",
        "--json",
        str(out),
        "--plot",
        str(png),
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    for key in SIM_KEYS:
        assert key in data
    assert len(data["windows"]) == 45 // 2
    assert data["events"] > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "goodput (sessions/h)" in result.stdout


def test_simulate_json_to_stdout_is_pure_json() -> None:
    result = basin("simulate", "--base-rate", "1", "--duration-min", "10", "--json", "-", "--quiet")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["deployment"] == "h100-1p1d"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--deployment", "a100-9p9d"], "choose one of h100-1p1d"),
        (["--policy", "magic"], "choose one of hicache"),
        (["--base-rate", "-1"], "base rate must not be negative"),
        (["--surge-minutes", "30", "--surge-start-min", "100"], "past the end of the run"),
        (["--host-tier", "-2"], "--host-tier"),
        (["--router", "random"], "unknown router policy"),
        (["--allocation-policy", "late"], "unknown allocation policy"),
        (["--warm-sessions", "-3"], "--warm-sessions"),
        (["--json", "/nonexistent/dir/x.json"], "does not exist"),
    ],
)
def test_simulate_rejects_bad_input_cleanly(args: list[str], message: str) -> None:
    base = ["simulate", "--base-rate", "2", "--duration-min", "120", "--quiet"]
    if "--base-rate" in args:
        base = ["simulate", "--duration-min", "120", "--quiet"]
    result = basin(*base, *args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_simulate_replays_a_mooncake_trace_at_its_own_times(mooncake_slice: Path) -> None:
    trace = ("simulate", "--workload", str(mooncake_slice), "--arrivals", "trace")
    result = basin(*trace, "--duration-min", "20", "--json", "-", "--quiet")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["arrivals"] == "trace" and data["warm_sessions"] == 0
    clash = basin(*trace, "--base-rate", "3", "--quiet")
    assert clash.returncode == 2 and "takes its times from the trace" in clash.stderr
    missing = basin("simulate", "--duration-min", "10", "--quiet")
    assert missing.returncode == 2 and "--base-rate" in missing.stderr


def test_simulate_names_the_bad_line_of_a_workload_file(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    good = '{"session_id": "a", "calls": [{"prompt_tokens": 5, "new_tokens": 5, "output_tokens": 1}]}'
    path.write_text(good + "\ngarbage\n")
    result = basin("simulate", "--workload", str(path), "--base-rate", "1", "--quiet")
    assert result.returncode == 2
    assert f"{path}:2:" in result.stderr


def test_predictor_train_and_evaluate(tmp_path: Path) -> None:
    model = tmp_path / "model.json"
    result = basin("predictor", "train", "--workload", "swe-pro", "--out", str(model))
    assert result.returncode == 0, result.stderr
    assert json.loads(model.read_text())["format"] == "basin-peak-predictor"
    result = basin("predictor", "evaluate", "--workload", "swe-pro", "--folds", "10", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["folds"] == 10 and 0 < data["spearman"] <= 1


def test_predictor_bad_input_is_a_clean_error(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.jsonl"
    basin("workload", "export", "--workload", "swe-pro", "--sessions", "2", "--out", str(tiny))
    for args in (
        ["train", "--workload", str(tiny), "--out", str(tmp_path / "m.json")],
        ["evaluate", "--workload", "swe-pro", "--folds", "1"],
        ["train", "--workload", "nope", "--out", str(tmp_path / "m.json")],
    ):
        result = basin("predictor", *args)
        assert result.returncode == 2, args
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith("error:")


def test_analyze_prints_equilibria_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "fluid.png"
    result = basin(
        "analyze",
        "--deployment",
        "h200-1p3d",
        "--host-tier",
        "2",
        "--workload",
        "terminal-bench",
        "--base-rate",
        "8",
        "--json",
        "--plot",
        str(png),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    for key in (
        "first_limit",
        "n_stable",
        "n_unstable",
        "n_peak",
        "d_peak_per_min",
        "d_low_per_min",
        "vulnerable_range_per_min",
    ):
        assert key in data
    assert data["first_limit"] in ("cache", "decode")
    assert png.read_bytes()[:4] == b"\x89PNG"
    text = basin("analyze", "--base-rate", "8", "--backlog", "50")
    assert "unstable equilibrium" in text.stdout and "drain 50 sessions" in text.stdout


def test_analyze_bad_input() -> None:
    for args in (
        ["--base-rate", "-2"],
        ["--base-rate", "2", "--deployment", "tpu"],
        ["--base-rate", "2", "--kappa", "0"],
    ):
        result = basin("analyze", *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, args


def test_profile_simulate_json() -> None:
    result = basin(
        "profile",
        "--simulate",
        "--deployment",
        "h100-1p1d",
        "--ramps",
        "1",
        "--steps",
        "6",
        "--step-minutes",
        "10",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["kappa"] > 0 and data["lambda_c_per_min"] > 0 and len(data["ramps"]) == 1


def test_profile_simulate_prints_only_results_on_stdout() -> None:
    """The progress bar goes to stderr: piped, stdout opens with the profile, not an empty line."""
    result = basin(
        "profile", "--simulate", "--deployment", "h100-1p1d", "--ramps", "1", "--steps", "3",
        "--step-minutes", "10", "--allow-no-cliff",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("h100-1p1d: κ = "), result.stdout[:80]


def test_profile_simulate_steps_settle_by_default() -> None:
    """Without --step-minutes a simulated ramp steps for three session lifetimes (issue 15), as the
    evaluation suites profile: the command and `profile_simulated`'s default agree."""
    from basin.profile import profile_simulated

    result = basin(
        "profile", "--simulate", "--deployment", "h100-1p1d", "--ramps", "1", "--steps", "3", "--json"
    )
    assert result.returncode == 0, result.stderr
    settled = profile_simulated("h100-1p1d", ramps=1, steps=3)
    assert json.loads(result.stdout)["lambda_c_per_min"] == pytest.approx(settled.lambda_c_per_min)
    twelve = profile_simulated("h100-1p1d", ramps=1, steps=3, step_minutes=12, require_cliff=False)
    assert settled.lambda_c_per_min != pytest.approx(twelve.lambda_c_per_min)


def test_profile_simulate_scales_the_workload() -> None:
    """Tripling outputs triples decode work per session, so λc falls (§7.4 profiles outputs ×3 the same
    way); the workload options reach the ramps, and a ramp that stays on its plateau counts κ = 1 only
    when asked to."""
    common = ("profile", "--simulate", "--deployment", "h200-1p3d", "--ramps", "1", "--steps", "5",
              "--step-minutes", "12", "--shared-prefix", "8192", "--allow-no-cliff", "--json")  # fmt: skip
    rates = {}
    for scale in ("1", "3"):
        result = basin(*common, "--output-scale", scale)
        assert result.returncode == 0, result.stderr
        rates[scale] = json.loads(result.stdout)["lambda_c_per_min"]
    assert rates["3"] < 0.7 * rates["1"], rates
    kept = basin(*common, "--output-scale", "3", "--keep-prompts")
    assert kept.returncode == 0, kept.stderr
    # Prompts that do not resend the extra output keep the sessions' footprints: a higher λc.
    assert rates["3"] < json.loads(kept.stdout)["lambda_c_per_min"] < rates["1"], (rates, kept.stdout)
    # Three steps stop short of the cliff (the top one at 2.1x the cache still hits 0.84).
    short = [a for a in common if a != "--allow-no-cliff"]
    short[short.index("--steps") + 1] = "3"
    strict = basin(*short)
    assert strict.returncode == 2 and "never left the healthy plateau" in strict.stderr
    assert "Traceback" not in strict.stderr


def test_profile_live_refuses_simulated_only_options() -> None:
    target = ("profile", "--target", "http://127.0.0.1:1")
    result = basin(*target, "--output-scale", "3", "--keep-prompts", "--shared-prefix", "8")
    message = "--output-scale, --resend-outputs/--keep-prompts, --shared-prefix: --simulate only"
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_profile_needs_simulate_and_analyze_needs_a_rate() -> None:
    result = basin("profile", "--deployment", "h100-1p1d")
    assert result.returncode == 2 and "--simulate" in result.stderr
    result = basin("analyze", "--deployment", "h100-1p1d")
    assert result.returncode == 2 and "--base-rate is required" in result.stderr


def test_simulate_accepts_basin_and_prediction_modes() -> None:
    for extra in (
        ["--policy", "basin"],
        ["--policy", "basin", "--prediction", "noisy:0.5"],
        ["--policy", "basin-arrival", "--kappa", "1.2", "--lambda-c", "5"],
    ):
        result = basin(
            "simulate", "--base-rate", "2", "--duration-min", "20", "--json", "-", "--quiet", *extra
        )
        assert result.returncode == 0, (extra, result.stderr)
        assert json.loads(result.stdout)["policy"] == extra[1]
    bad = basin("simulate", "--base-rate", "2", "--policy", "basin", "--prediction", "psychic", "--quiet")
    assert bad.returncode == 2 and "choose predictor, oracle or noisy:SIGMA" in bad.stderr


def test_evaluate_rejects_unknown_suites() -> None:
    result = basin("evaluate", "everything")
    assert result.returncode == 2 and "ablation" in result.stderr and "Traceback" not in result.stderr


def test_export_writes_a_shared_prefix_and_refuses_one_over_trace_blocks(tmp_path: Path) -> None:
    out = tmp_path / "tb.jsonl"
    args = ("workload", "export", "--workload", "terminal-bench", "--sessions", "5", "--out", str(out))
    result = basin(*args, "--shared-prefix", "4000")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["shared_prefix_tokens"] for r in records] == [
        min(4000, r["calls"][0]["prompt_tokens"]) for r in records
    ]
    trace = str(Path(__file__).parents[1] / "data" / "mooncake_conversation_slice.jsonl")
    refused = basin("workload", "export", "--workload", trace, "--shared-prefix", "100", "--out", str(out))
    assert refused.returncode == 2 and "blocks" in refused.stderr and "Traceback" not in refused.stderr
    assert basin(*args, "--shared-prefix", "-1").returncode == 2
