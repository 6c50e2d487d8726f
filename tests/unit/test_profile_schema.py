"""The shared profile document: what it accepts, what it refuses (one line naming each field), and that a
simulated profile converts to it and back; plus the live ramp's pure parts (samples, settle, plan)."""

from __future__ import annotations

import json
import math

import pytest

from basin.errors import BasinError
from basin.evaluate import RunRecords
from basin.evaluate.records import CallRecord, Sample, SessionRecord
from basin.profile_schema import from_simulated, parse_profile

VALID = {
    "kappa": 1.1,
    "lambda_c_per_min": 4.9,
    "prefill_gpu_tokens": 1_090_000,
    "host_tokens": 0,
    "decode_kv_tokens": 1_660_000,
    "prefill_tokens_per_s": 31_000.0,
    "fingerprint": "abc",
    "profiled_at": "2026-12-01T10:00:00Z",
}


def test_a_complete_profile_round_trips_and_gives_the_policy_its_profile() -> None:
    document = parse_profile(json.dumps({**VALID, "future_field": 1}))
    again = parse_profile(document.to_json())
    assert again == document
    assert json.loads(document.to_json())["profiled_at"] == "2026-12-01T10:00:00Z"
    policy = document.deployment_profile()
    assert (policy.kappa, policy.decode_kv_tokens, policy.prefill_tokens_per_s) == (1.1, 1_660_000, 31_000.0)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"decode_kv_tokens": None}, "decode_kv_tokens"),
        ({"kappa": 0}, "kappa"),
        ({"lambda_c_per_min": -1}, "lambda_c_per_min"),
        ({"prefill_tokens_per_s": None}, "prefill_tokens_per_s"),
        ({"profiled_at": "2026-12-01T10:00:00"}, "profiled_at"),
        ({"ramps": [[{"hit_rate": 1.5}]]}, "ramps.0.0.hit_rate"),
    ],
)
def test_bad_profiles_are_one_line_naming_the_field(change: dict, named: str) -> None:
    body = {k: v for k, v in {**VALID, **change}.items() if v is not None}
    with pytest.raises(BasinError) as error:
        parse_profile(json.dumps(body), "cm/profile.json")
    message = str(error.value)
    assert message.startswith("cm/profile.json: ") and named in message and "\n" not in message


def test_not_json_is_said_so() -> None:
    with pytest.raises(BasinError, match=r"profile\.json: not JSON"):
        parse_profile("{kappa: 1")


def test_a_simulated_profile_converts_with_nan_hit_rates_as_none() -> None:
    from basin.profile import Profile, RampSample

    profile = Profile(1.2, [1.2], 5.0, 1_090_000, 0, 1_660_000, "h100-1p1d",
                      [[RampSample(0.5, math.nan, 1.0), RampSample(1.0, 0.9, 2.0)]])  # fmt: skip
    document = from_simulated(profile, 31_000.0, 1, 1, "h100", "terminal-bench", 12.0)
    assert document.source == "simulated" and document.ramps[0][0].hit_rate is None
    assert parse_profile(document.to_json()).kappa == 1.2


def _records() -> RunRecords:
    """Two minutes of a replay: 10 active sessions, then 20; two calls, one session done."""
    records = RunRecords(duration_s=240, cache_tokens=1000)
    records.samples = [
        Sample(t, 10 if t < 120 else 20, 0, 500 if t < 120 else 1500) for t in range(0, 240, 10)
    ]
    first = CallRecord("a", 0, 100, 10, 130.0)
    first.prefill_start_s, first.cached_tokens = 130.0, 90
    second = CallRecord("b", 0, 300, 10, 200.0)
    second.prefill_start_s, second.cached_tokens = 200.0, 30
    records.calls = [first, second]
    done = SessionRecord("a", 0.0, 100.0)
    done.done_s = 150.0
    records.sessions = [done]
    return records


def test_window_sample_mirrors_the_simulators_step_sample() -> None:
    from basin_profiler.ramp import window_sample

    x, hit, departures, active = window_sample(_records(), 120, 240)
    assert x == pytest.approx(1.5) and hit == pytest.approx(120 / 400)
    assert departures == pytest.approx(0.5) and active == 20


def test_settled_compares_the_last_two_windows() -> None:
    from basin_profiler.ramp import past_cliff, settled

    records = _records()
    assert settled(records, 240, 60, 0.1)[0]  # 20 -> 20
    ok, before, after = settled(records, 180, 60, 0.1)  # 10 -> 20
    assert not ok and (before, after) == (10, 20)
    assert settled(records, 180, 60, 1.0)[0]
    assert past_cliff(0.4, plateau=0.94) and not past_cliff(0.8, plateau=0.94)
    assert not past_cliff(math.nan, plateau=0.94)


def test_the_plan_fits_the_budget_or_refuses_before_any_load() -> None:
    from basin.sim import get_deployment
    from basin.workload import load_workload
    from basin_profiler.ramp import RampSettings, plan

    def settings(**changes: object) -> RampSettings:
        base = dict(target="http://x", deployment=get_deployment("h100-1p1d"),
                    pool_factory=lambda seed: load_workload("terminal-bench", seed=seed, sessions=40),
                    ramps=4, steps=8, step_minutes=12.0, budget_minutes=240.0)  # fmt: skip
        return RampSettings(**{**base, **changes})  # type: ignore[arg-type]

    fitted = plan(settings())  # 4 x 96 min > 240: two ramps fit
    assert fitted.ramps == 2 and "running 2" in fitted.note
    assert fitted.rates[0] == pytest.approx(0.2 * fitted.rates[-1]) and fitted.rates[-1] == pytest.approx(
        2 * fitted.peak_per_min
    )
    with pytest.raises(BasinError, match="over the budget"):
        plan(settings(budget_minutes=30.0))
    assert plan(settings(time_scale=10.0)).ramps == 4
    settle = plan(settings(step_minutes=None, time_scale=10.0))
    assert settle.min_step_min < settle.timeout_step_min and settle.min_wall_minutes < settle.max_wall_minutes


def test_the_deployment_comes_from_options_then_the_server_then_the_preset() -> None:
    from basin_profiler.ramp import deployment_from

    info = {"gpu": "h200", "prefill_instances": 1, "decode_instances": 3, "prefill_cache_tokens": 2_000_000,
            "host_cache_tokens": 4_000_000}  # fmt: skip
    served = deployment_from(info)
    assert (served.name, served.prefill_instances, served.decode_instances, served.host_tier) == (
        "h200-1p3d", 1, 3, 2.0
    )  # fmt: skip
    # The shape measured names the profile (it used to keep the 1P1D base's name).
    assert deployment_from(info, decode=2, host_ratio=0.0).decode_instances == 2
    assert deployment_from(info, decode=2, host_ratio=0.0).name == "h200-1p2d"
    assert deployment_from({"gpu": "h100", "prefill_instances": 2, "decode_instances": 6}).name == "h100-2p6d"
    assert deployment_from({}).name == "h200-1p3d"
    assert deployment_from({}, gpu="h100").gpu.name == "h100"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "BASIN_NAMESPACE is not set"),
        ({"BASIN_NAMESPACE": "n", "BASIN_PROFILE_CONFIGMAP": "c"}, "BASIN_GATEWAY_URL is not set"),
        ({"BASIN_PROFILE_RAMPS": "four"}, "BASIN_PROFILE_RAMPS='four' is not a valid int"),
        ({"BASIN_GPU_KIND": "a100"}, "BASIN_GPU_KIND must be h100 or h200"),
        ({"BASIN_PROFILE_STEP_SECONDS": "-1"}, "BASIN_PROFILE_STEP_SECONDS must not be negative"),
        ({"BASIN_PROFILE_WAIT_SECONDS": "-5"}, "BASIN_PROFILE_WAIT_SECONDS must not be negative"),
    ],
)
def test_the_job_refuses_bad_environment_in_one_line(
    env: dict, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """No cluster here: the failure cannot be written, which the Job says too, and it exits 2."""
    from basin_profiler.job import main

    base = {"BASIN_NAMESPACE": "n", "BASIN_PROFILE_CONFIGMAP": "c", "BASIN_GATEWAY_URL": "http://127.0.0.1:9",
            "KUBECONFIG": "/nonexistent/kubeconfig"}  # fmt: skip
    full = env if (not env or "BASIN_NAMESPACE" in env) else {**base, **env}
    assert main(full) == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err
