"""`basin plan`: the fluid model's surge verdicts, the ranking and the command as users run it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from basin.errors import BasinError
from basin.fluid import FluidModel, FluidParameters, analyze
from basin.plan import (
    Basis,
    PopulationBalance,
    Surge,
    deployment_for,
    headroom_now,
    judge,
    plan,
    recommendation,
    running_deployment,
    splits,
)
from basin.profile_schema import ProfileDocument
from basin.workload import load_workload

BASIN = str(Path(sys.executable).with_name("basin"))  # the checkout under test, never a `basin` on PATH


@cache
def pool():  # type: ignore[no-untyped-def]
    return load_workload("terminal-bench", seed=0)


def test_splits_cover_every_prefill_decode_division() -> None:
    assert splits(4) == [(1, 3), (2, 2), (3, 1)]
    with pytest.raises(BasinError, match="at least 2 GPUs"):
        splits(1)


@pytest.mark.parametrize("text", ["5", "x:20", "0.5:10", "2:0", "2:3:4"])
def test_a_malformed_surge_is_refused(text: str) -> None:
    with pytest.raises(BasinError):
        Surge.parse(text)


def test_the_papers_single_engine_recovers_from_a_third_more_and_a_doubling_is_at_its_edge() -> None:
    """§3 in the model: H100 1P1D GPU-only at 3.3 sessions/min, ten-minute surges. The paper's engine is
    trapped by the doubling; ours sits at that edge: the model's largest recoverable surge is 2.26x (the
    doubling's peak population, 58, short of the unstable point, 67), and the simulator traps 4 of 12
    seeds (tests/simulation/test_cache_trap.py)."""
    deployment = deployment_for("h100", 1, 1, 0.0)
    third, double, larger = (judge(deployment, pool(), 3.3, Surge(f, 10)) for f in (1.33, 2.0, 2.5))
    assert third.recovers and third.drain_minutes is not None
    assert not larger.recovers and larger.surge_peak_population > larger.n_unstable
    assert double.n_unstable is not None and double.surge_peak_population > 0.85 * double.n_unstable
    assert 1.33 < third.max_recoverable_factor < 2.5


def test_the_largest_recoverable_surge_is_the_boundary_of_the_verdict() -> None:
    deployment = deployment_for("h200", 1, 3, 2.0)
    candidate = judge(deployment, pool(), 8.0, Surge(5, 20))
    largest = candidate.max_recoverable_factor
    assert 1.0 < largest < 5.0
    assert judge(deployment, pool(), 8.0, Surge(largest - 0.05, 20)).recovers
    assert not judge(deployment, pool(), 8.0, Surge(largest + 0.05, 20)).recovers


def test_a_surge_above_the_departure_peak_grows_the_population_and_it_drains_after() -> None:
    deployment = deployment_for("h200", 2, 2, 10.0)
    model = FluidModel(FluidParameters.from_workload(deployment, pool()))
    analysis = analyze(model, 8.0)
    balance = PopulationBalance(model)
    assert analysis.n_stable is not None
    end = balance.through_surge(analysis.n_stable, 8.0, Surge(5, 20))
    assert end > analysis.n_stable + 100  # 40 sessions/min against a peak near 29
    drain = balance.drain_minutes(end, analysis.n_stable, 8.0)
    assert drain is not None and 0 < drain < 60


def test_more_cache_recovers_from_more() -> None:
    """Host tiers move the cliff (paper Fig. 2a): on a cache-first split the recoverable surge grows."""
    ranked = plan(4, "h200", pool(), 8.0, Surge(5, 20), [0.0, 2.0, 10.0])
    by_tier = {c.host_tier: c for c in ranked if (c.prefill, c.decode) == (1, 3)}
    factors = [by_tier[t].max_recoverable_factor for t in (0.0, 2.0, 10.0)]
    assert factors == sorted(factors) and factors[0] < factors[-1]
    assert [c.max_recoverable_factor for c in ranked] == sorted(
        (c.max_recoverable_factor for c in ranked), reverse=True
    )
    advice = recommendation(ranked, Surge(5, 20))
    best = ranked[0]
    assert advice.startswith(f"{best.prefill}P{best.decode}D with")


def test_a_base_rate_no_split_sustains_is_said_plainly() -> None:
    ranked = plan(2, "h100", pool(), 30.0, Surge(2, 10), [0.0])
    assert all(c.max_recoverable_factor == 0 and not c.recovers for c in ranked)
    assert recommendation(ranked, Surge(2, 10)).startswith("none of these splits sustains the base rate")


def test_plan_command_prints_json_and_a_plot(tmp_path: Path) -> None:
    out = tmp_path / "plan.png"
    result = subprocess.run(
        [BASIN, "plan", "--gpus", "4", "--base-rate", "8", "--surge", "5:20", "--host-tiers", "0,2",
         "--json", "--plot", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert len(payload["candidates"]) == 6 and payload["capacities"] == "presets"
    assert payload["recommendation"]
    assert out.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "1", "--base-rate", "8"], "at least 2 GPUs"),
        (["--gpus", "4", "--base-rate", "8", "--surge", "5"], "FACTOR:MINUTES"),
        (["--gpus", "4", "--base-rate", "8", "--host-tiers", "2,x"], "--host-tiers"),
        (["--gpus", "4", "--base-rate", "-1"], "--base-rate"),
        (["--gpus", "4", "--base-rate", "8", "--plot", "/nonexistent/x.png"], "does not exist"),
    ],
)
def test_bad_plan_options_are_one_line_errors(args: list[str], message: str) -> None:
    result = subprocess.run([BASIN, "plan", *args], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def profile_of(preset: str, **changes: object) -> ProfileDocument:
    """The profile a perfect measurement of preset `preset` would give (aggregate capacities, the fluid
    model's prefill rate on the Terminal-Bench pool), with `changes` applied."""
    from basin.sim import get_deployment

    deployment = get_deployment(preset)
    fields: dict[str, object] = {
        "kappa": 1.0,
        "lambda_c_per_min": 20.0,
        "prefill_gpu_tokens": deployment.prefill_cache_tokens,
        "host_tokens": deployment.host_cache_tokens,
        "decode_kv_tokens": deployment.decode_kv_tokens,
        "prefill_tokens_per_s": FluidParameters.from_workload(deployment, pool()).prefill_tokens_per_s,
        "prefill_replicas": deployment.prefill_instances,
        "decode_replicas": deployment.decode_instances,
        "gpu": deployment.gpu.name,
        "deployment": preset,
        "profiled_at": "2026-12-01T10:00:00Z",
        "workload": "terminal-bench",
    }
    return ProfileDocument.model_validate({**fields, **changes})


def largest(candidates: list, split: tuple[int, int], tier: float) -> float:
    (match,) = [c for c in candidates if (c.prefill, c.decode, c.host_tier) == (*split, tier)]
    return match.max_recoverable_factor


def test_a_profile_that_measures_the_preset_plans_as_the_preset_does() -> None:
    """Aggregates are divided back to one instance: a 1P3D and a 2P6D measurement of the same GPU
    give the preset's per-instance capacities and prefill rate, hence the preset's verdicts."""
    surge = Surge(5, 20)
    expected = plan(4, "h200", pool(), 8.0, surge, [0.0, 2.0])
    for preset in ("h200-1p3d", "h200-2p6d"):
        basis = Basis.from_profile(profile_of(preset), "h200", pool())
        assert basis.source == "profile" and basis.gpu.decode_kv_tokens == 3_320_000
        got = plan(4, basis.gpu, pool(), 8.0, surge, [0.0, 2.0], basis.kappa)
        assert [(c.name, c.host_tier, c.recovers) for c in got] == [
            (c.name, c.host_tier, c.recovers) for c in expected
        ]
        for g, e in zip(got, expected, strict=True):
            assert g.max_recoverable_factor == pytest.approx(e.max_recoverable_factor, abs=0.02)


def test_a_profiles_kappa_capacities_and_prefill_rate_move_the_verdict() -> None:
    """1P3D with a 2x host tier at 8/min is cache-first: a profiled larger κ moves the cliff out, a
    smaller measured cache or a slower measured prefill brings it in."""
    surge = Surge(5, 20)

    def factor(**changes: object) -> float:
        basis = Basis.from_profile(profile_of("h200-1p3d", **changes), "h200", pool())
        return largest(plan(4, basis.gpu, pool(), 8.0, surge, [2.0], basis.kappa), (1, 3), 2.0)

    rate = profile_of("h200-1p3d").prefill_tokens_per_s
    measured = factor()
    assert factor(kappa=1.5) > measured + 0.5
    assert factor(prefill_gpu_tokens=1_090_000) < measured - 0.5
    assert factor(prefill_tokens_per_s=rate * 0.6) < measured - 0.2


def write_profile(tmp_path: Path, doc: ProfileDocument | str) -> str:
    path = tmp_path / "profile.json"
    path.write_text(doc if isinstance(doc, str) else doc.to_json())
    return str(path)


def test_plan_command_says_where_kappa_and_capacities_come_from(tmp_path: Path) -> None:
    path = write_profile(tmp_path, profile_of("h200-1p3d", kappa=1.37, prefill_gpu_tokens=1_500_000))
    common = [BASIN, "plan", "--gpus", "4", "--base-rate", "8", "--host-tiers", "2"]
    run = lambda *extra: subprocess.run(  # noqa: E731
        [*common, *extra], capture_output=True, text=True, timeout=120, check=False
    )
    measured = run("--profile", path, "--json")
    assert measured.returncode == 0, measured.stderr
    payload = json.loads(measured.stdout)
    assert payload["capacities"] == "profile" and payload["kappa"] == 1.37
    assert payload["gpu"] == "h200" and payload["workload"] == "terminal-bench"  # taken from the profile
    assert payload["per_instance"]["prefill_cache_tokens"] == 1_500_000
    assert payload["profile"]["deployment"] == "h200-1p3d" and payload["profile"]["path"] == path
    presets = json.loads(run("--json").stdout)
    assert presets["capacities"] == "presets" and presets["kappa"] == 1.0 and "profile" not in presets
    assert payload["candidates"] != presets["candidates"]
    table = run("--profile", path)
    assert table.returncode == 0, table.stderr
    assert "κ = 1.37 and capacities from profile" in " ".join(table.stdout.split())
    assert "preset calibration" in run().stdout


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("{not json", [], "profile.json: not JSON"),
        ('{"kappa": 1.2}', [], "lambda_c_per_min: Field required"),
        (profile_of.__name__, ["--gpu", "h100"], "was measured on h200, not h100: pass --gpu h200"),
        (profile_of.__name__, ["--workload", "swe-bench-pro"], "measured with workload 'terminal-bench'"),
        (profile_of.__name__, ["--kappa", "1.2"], "--kappa and --profile both set κ"),
    ],
)
def test_a_bad_or_mismatched_profile_is_a_one_line_error(
    tmp_path: Path, content: str, extra: list[str], message: str
) -> None:
    text = profile_of("h200-1p3d").to_json() if content == profile_of.__name__ else content
    path = write_profile(tmp_path, text)
    result = subprocess.run(
        [BASIN, "plan", "--gpus", "4", "--base-rate", "8", "--profile", path, *extra],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_missing_profile_file_is_a_usage_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [BASIN, "plan", "--gpus", "4", "--base-rate", "8", "--profile", str(tmp_path / "none.json")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_headroom_now_from_the_stable_population_is_the_plans_largest_surge() -> None:
    """The gateway's figures and `basin plan` are one computation: from N_s at the base rate."""
    deployment = deployment_for("h200", 1, 3, 2.0)
    candidate = judge(deployment, pool(), 8.0, Surge(5, 20))
    model = FluidModel(FluidParameters.from_workload(deployment, pool()))
    assert candidate.n_stable is not None
    now = headroom_now(model, 8.0, candidate.n_stable, 20)
    assert now.recoverable_surge_factor == candidate.max_recoverable_factor
    assert now.cliff_population == candidate.n_unstable
    assert now.rate_headroom_per_min == pytest.approx(candidate.departure_peak_per_min - 8.0)


def test_headroom_shrinks_as_sessions_pile_up_and_arrivals_rise() -> None:
    model = FluidModel(FluidParameters.from_workload(deployment_for("h200", 1, 3, 2.0), pool()))
    calm = headroom_now(model, 8.0, 100, 10)
    assert 100 < calm.cliff_population < math.inf
    crowded = headroom_now(model, 8.0, calm.cliff_population - 20, 10)
    assert 0 < crowded.cliff_headroom_sessions < calm.cliff_headroom_sessions
    assert crowded.recoverable_surge_factor < calm.recoverable_surge_factor  # type: ignore[operator]
    past = headroom_now(model, 8.0, calm.cliff_population + 20, 10)
    assert past.cliff_headroom_sessions < 0 and past.recoverable_surge_factor == 0
    busier = headroom_now(model, 12.0, 100, 10)
    assert busier.rate_headroom_per_min < calm.rate_headroom_per_min
    assert busier.recoverable_surge_factor < calm.recoverable_surge_factor  # type: ignore[operator]
    overloaded = headroom_now(model, calm.departure_peak_per_min + 1, 100, 10)
    assert overloaded.rate_headroom_per_min < 0 and overloaded.recoverable_surge_factor == 0
    assert overloaded.cliff_headroom_sessions == -100  # every population grows: already past
    quiet = headroom_now(model, 1.0, 5, 10)  # below the low-reuse rate: any crowd drains
    assert quiet.cliff_headroom_sessions == math.inf
    assert headroom_now(model, 0.0, 0, 10).recoverable_surge_factor is None  # no arrivals to scale


def test_a_gateway_profile_of_the_preset_builds_the_presets_model() -> None:
    from basin.sim import get_deployment
    from basin.sim.policies import default_profile

    preset = get_deployment("h200-1p3d")
    profile = default_profile(preset, pool())
    running = running_deployment(profile, pool(), "h200", 1, 3)
    assert running.host_tier == preset.host_tier
    got, want = (FluidParameters.from_workload(d, pool()) for d in (running, preset))
    assert got.cache_tokens == want.cache_tokens and got.decode_requests_fit == want.decode_requests_fit
    assert got.prefill_tokens_per_s == pytest.approx(want.prefill_tokens_per_s)
