"""`basin profile --target` against real emulator processes: κ and λc agree with `basin profile --simulate`
for the same preset and step settings, and every failure mode exits non-zero with its reason and writes no
profile (unreachable target, failing requests, a ramp that never reaches the cliff, no settle, Ctrl-C)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from basin.profile_schema import parse_profile

pytestmark = pytest.mark.service

BASIN = str(Path(sys.executable).with_name("basin"))


def run_basin(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASIN, *args], capture_output=True, text=True, timeout=timeout, check=False)


# Few steps at a high time scale keep each live ramp to a few wall minutes; --simulate runs the same steps.
# h100-1p1d: six 15-minute steps, a little over a session's ~12.6-minute unloaded lifetime. λc is the
# departure peak, and on the recalibrated engine it falls in the step past the cliff, where the collapse is
# under way; with five 10-minute steps that step's count is a knife edge: moving the shared prefix by 1 %
# (8,192 to 8,150 or 8,300 tokens, same seed) moves the simulated λc from 4.2 to 5.1 (κ 1.13 throughout),
# and the live run measured 5.1 against 4.2. With six 15-minute steps the same perturbations (8,000-8,400
# tokens) keep it at 4.8-5.2 on seeds 0, 1 and 2. h200-1p3d: its population builds 3x larger before the
# cliff, and 10-minute steps end before it crosses (the simulated ramp alone never leaves the plateau, up
# to 2.25x the cache), so three 20-minute steps from 0.4x to 2x the fluid peak: the middle one near the
# peak, the last past the cliff.
STEPS = {"h100-1p1d": (1, 6, 15), "h200-1p3d": (1, 3, 20)}  # ramps, steps per ramp, model minutes per step
# λc, the departure peak at the cliff's edge, moves with the emulator's own delay: past a mean event-loop
# lag of 0.1 model seconds (5 ms of wall time at x20, half the unloaded median TTFT) a λc out of tolerance
# is reported as an expected failure naming the lag, not a pass; κ is asserted whatever the lag.
LAG_LIMIT_S = 0.1


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(STEPS))
def test_live_profile_of_the_emulator_agrees_with_the_simulated_one(  # type: ignore[no-untyped-def]
    emulator_factory, tmp_path: Path, preset: str
) -> None:
    """Issue 16: κ and λc within ±20 % of `basin profile --simulate` for the same preset and steps. The live
    ramp starts warm as the simulator does (same seed, same arrivals), so the two differ only by what the
    emulator and the client add: HTTP and event-loop time, x20 in model time. Measured on the 2-core
    reference machine, h100-1p1d with one ramp of five 10-minute steps (before the recalibration): live κ
    1.20 / λc 6.60 against 1.20 / 6.60 (emulator 0.04 model s late); after it, 1.14 / 5.10 against 1.13 /
    4.20, the knife edge above; six 15-minute steps: 1.18 / 5.20 against 1.17 / 5.00 (0.03 model s late,
    4.6 wall minutes); with two ramps (older calibration) κ 0.99-1.25 but λc 3.5-3.8 against 1.18 / 4.90
    when the machine was shared at loads of 4-13 (the emulator 0.25-0.44 model s late): λc, the departure
    peak at the cliff's edge, is the figure most sensitive to the client's and emulator's own delay, which
    tips the live engine toward the trap early. One ramp each keeps the pair at about 8 wall minutes; the
    simulator runs the same single ramp, so they still compare like with like. h200-1p3d on a quiet
    machine: live κ 1.02 / λc 15.00 (x20, 3 wall minutes, emulator 0.10 model s late) and 1.03 / 15.30
    (x10) against 1.02 / 15.15; shared (0.23 model s late): 1.02 / 12.60. With the fixed 10 ms PD transfer
    (issue 15): live 1.02 / 14.10 against 1.02 / 15.60 (0.15 model s late)."""
    ramps, per_ramp, minutes = STEPS[preset]
    steps = ("--ramps", str(ramps), "--steps", str(per_ramp), "--step-minutes", str(minutes))
    emulator = emulator_factory("--deployment", preset, "--time-scale", "20")
    out, plot = tmp_path / "profile.json", tmp_path / "profile.png"
    live = run_basin("profile", "--target", emulator.url, "--api", "sglang", "--quiet", "--out", str(out),
                     "--plot", str(plot), *steps)  # fmt: skip
    assert live.returncode == 0, live.stderr
    assert f"{preset}: κ = " in live.stderr  # the summary names the shape measured
    profile = parse_profile(out.read_text())
    assert plot.stat().st_size > 10_000
    simulated = run_basin("profile", "--simulate", "--deployment", preset, "--json", *steps)
    assert simulated.returncode == 0, simulated.stderr
    model = json.loads(simulated.stdout)
    with urllib.request.urlopen(f"{emulator.url}/get_server_info", timeout=10) as answer:
        lag = json.loads(answer.read())["loop_lag_mean_s"] * 20  # model seconds
    # Near the cliff a few hundred ms of software time per event (a busy machine) tips the live engine
    # into the trap early: the report says how late the emulator ran.
    report = (
        f"live κ {profile.kappa:.3f} λc {profile.lambda_c_per_min:.2f};"
        f" simulated κ {model['kappa']:.3f} λc {model['lambda_c_per_min']:.2f};"
        f" emulator loop lag {lag:.2f} model s"
    )
    print(report)
    assert profile.kappa == pytest.approx(model["kappa"], rel=0.20), report
    assert (profile.prefill_gpu_tokens, profile.host_tokens, profile.decode_kv_tokens) == (
        model["prefill_gpu_tokens"], model["host_tokens"], model["decode_kv_tokens"]
    )  # fmt: skip
    assert profile.deployment == model["deployment"] == preset
    assert len(profile.ramps) == ramps and all(len(r) == per_ramp for r in profile.ramps)
    assert profile.step_minutes == minutes and profile.source == "live"
    in_tolerance = profile.lambda_c_per_min == pytest.approx(model["lambda_c_per_min"], rel=0.20)
    if not in_tolerance and lag > LAG_LIMIT_S:
        pytest.xfail(f"λc out of ±20 % on a machine that measured itself: {report}")
    assert in_tolerance, report


def _no_profile(result: subprocess.CompletedProcess[str], out: Path, reason: str, code: int = 1) -> None:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    assert "profile failed: " in result.stderr and reason in result.stderr, result.stderr
    assert not out.exists()


def test_an_unreachable_target_fails_before_any_load(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "p.json"
    result = run_basin("profile", "--target", f"http://127.0.0.1:{port}", "--out", str(out), "--quiet")
    _no_profile(result, out, "unreachable")


def test_failing_requests_fail_the_profile(small_emulator, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Every prompt is longer than the emulator's 200-token context: every call answers 400."""
    out = tmp_path / "p.json"
    result = run_basin("profile", "--target", small_emulator.url, "--api", "sglang", "--time-scale", "120",
                       "--deployment", "h100-1p1d", "--ramps", "1", "--steps", "3", "--step-minutes", "2",
                       "--out", str(out), "--quiet")  # fmt: skip
    _no_profile(result, out, "HTTP 400")


def test_a_ramp_that_never_reaches_the_cliff_is_reported_not_fitted(  # type: ignore[no-untyped-def]
    emulator_factory, tmp_path: Path
) -> None:
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", "60")
    out = tmp_path / "p.json"
    result = run_basin("profile", "--target", emulator.url, "--api", "sglang", "--top-rate", "0.3",
                       "--ramps", "1", "--steps", "3", "--step-minutes", "6", "--out", str(out),
                       "--quiet")  # fmt: skip
    _no_profile(result, out, "never left the healthy plateau")


@pytest.mark.slow
def test_a_step_that_never_settles_fails_the_profile(emulator_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """With a zero tolerance no population counts as settled: the first step (on the plateau) times out."""
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", "60")
    out = tmp_path / "p.json"
    result = run_basin("profile", "--target", emulator.url, "--api", "sglang", "--settle",
                       "--settle-tolerance", "0", "--ramps", "1", "--steps", "3", "--out", str(out),
                       "--quiet")  # fmt: skip
    _no_profile(result, out, "did not settle within")


def wait_until_loaded(url: str, timeout: float = 60) -> None:
    """Poll the emulator's metrics to a deadline until it has prefilled a prompt (the ramp is running)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
            text = answer.read().decode()
        if any(line.startswith("sglang:num_requests_total") or line.startswith("sglang:prompt_tokens_total")
               for line in text.splitlines() if not line.rstrip().endswith(" 0.0")):  # fmt: skip
            return
        time.sleep(0.2)
    pytest.fail("the ramp sent nothing")


def test_ctrl_c_stops_the_ramp_and_writes_no_profile(emulator_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", "20")
    out = tmp_path / "p.json"
    process = subprocess.Popen(
        [BASIN, "profile", "--target", emulator.url, "--api", "sglang", "--ramps", "1", "--steps", "3",
         "--step-minutes", "10", "--out", str(out), "--quiet"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert process.stderr is not None
    first = process.stderr.readline()
    assert first.startswith("profiling "), first
    wait_until_loaded(emulator.url)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    _no_profile(subprocess.CompletedProcess([], process.returncode, "", err), out, "interrupted", code=130)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "ftp://x"], "--target must be an http(s) URL"),
        (["--simulate", "--target", "http://127.0.0.1:1"], "either --simulate or --target"),
        (["--target", "http://127.0.0.1:1", "--settle", "--step-minutes", "5"], "exclude each other"),
        (["--target", "http://127.0.0.1:1", "--configmap", "nonamespace"], "NAMESPACE/NAME"),
        (["--target", "http://127.0.0.1:1", "--out", "/nonexistent/p.json"], "does not exist"),
    ],
)
def test_bad_options_are_one_line_errors(args: list[str], message: str) -> None:
    result = run_basin("profile", *args, timeout=60)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
