"""`basin replay` against real servers: the emulator (agreement with `basin simulate`), a gateway-like
server that parks and sheds, an emulator that dies mid-run, and Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

pytestmark = pytest.mark.service

BASIN = str(Path(sys.executable).with_name("basin"))


def run_basin(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASIN, *args], capture_output=True, text=True, timeout=timeout, check=False)


MOONCAKE = str(Path(__file__).parents[1] / "data" / "mooncake_conversation_slice.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("workload", "rate", "scale", "compare_ttft"),
    [
        # Mooncake's conversations leave real uncached prefill: a median TTFT of 0.12 model seconds. The
        # replay's reads 1.64x that at x5, 1.90x at x10 and 2.10x at x20 (seed 1, one machine): the
        # client's and server's software time grows with the scale, so x5 keeps it from deciding the test.
        (MOONCAKE, "6", "5", True),
        # Terminal-Bench-like sessions hit ~92 %: the median TTFT, ~0.05 model seconds, is 2.5 ms of wall
        # time at x20, below what a Python client and server on a shared 2-core machine resolve, so
        # this run checks reuse and completions (at x40, to keep it short).
        ("terminal-bench", "3.3", "40", False),
    ],
)
def test_replay_on_the_emulator_agrees_with_the_simulator(  # type: ignore[no-untyped-def]
    emulator_factory, tmp_path: Path, workload: str, rate: str, scale: str, compare_ttft: bool
) -> None:
    """The same scenario and seed, cold start: replayed in real time over HTTP, then simulated.

    Tolerances (issue 6): hit rate ±0.05, completed sessions ±10 %, median TTFT within 2×. A replay's
    TTFT also holds `scale` times the client's and server's software time per request (1–3 ms here,
    see benchmarks/emulator.py), which is why TTFT has the widest tolerance.
    """
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", scale)
    scenario = ["--workload", workload, "--base-rate", rate, "--duration-min", "20", "--seed", "1"]
    out = tmp_path / "replay.json"
    replay = run_basin(
        "replay", "--target", emulator.url, "--time-scale", scale, "--api", "sglang", "--quiet",
        "--warm-sessions", "0", "--json", str(out), *scenario,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    live = json.loads(out.read_text())
    simulated = run_basin("simulate", "--deployment", "h100-1p1d", "--warm-sessions", "0", "--quiet",
                          "--json", "-", *scenario)  # fmt: skip
    assert simulated.returncode == 0, simulated.stderr
    model = json.loads(simulated.stdout)
    assert live["connection_errors"] == live["failed_requests"] == 0
    assert live["measured_sessions"] == model["measured_sessions"] > 20  # the same arrivals
    assert abs(live["hit_rate_pre"] - model["hit_rate_pre"]) <= 0.05
    live_done = live["completed_fraction"] * live["measured_sessions"]
    model_done = model["completed_fraction"] * model["measured_sessions"]
    assert abs(live_done - model_done) <= 0.1 * model_done
    if compare_ttft:
        ratio = live["median_ttft_late_s"] / model["median_ttft_late_s"]
        assert 0.5 <= ratio <= 2.0, (live["median_ttft_late_s"], model["median_ttft_late_s"])


def test_openai_replay_reuses_prefixes_through_the_chat_route(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    emulator = emulator_factory("--deployment", "h200-1p1d", "--time-scale", "60")
    result = run_basin(
        "replay", "--target", emulator.url, "--time-scale", "60", "--api", "openai", "--quiet",
        "--base-rate", "3", "--duration-min", "6", "--seed", "2", "--json", "-",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["answered"] > 50 and payload["connection_errors"] == 0
    assert payload["reference_gpu"] == "h200"  # read from the emulator's /get_server_info
    assert payload["hit_rate_pre"] > 0.6  # returning calls resend their history and hit


def test_replay_starts_warm_as_the_simulator_does(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    """Without --warm-sessions a replay begins with the simulator's steady population (rate x unloaded
    lifetime on the emulator's GPU), each warm session priming the cache with its previous prompt: a
    surge minutes into the run meets the load it meets in `basin simulate`, not an empty engine."""
    emulator = emulator_factory("--deployment", "h200-1p1d", "--time-scale", "60")
    scenario = ["--base-rate", "3", "--duration-min", "3", "--seed", "2"]
    result = run_basin(
        "replay", "--target", emulator.url, "--api", "sglang", "--quiet", "--json", "-", *scenario
    )
    assert result.returncode == 0, result.stderr
    live = json.loads(result.stdout)
    simulated = run_basin("simulate", "--deployment", "h200-1p1d", "--quiet", "--json", "-", *scenario)
    assert simulated.returncode == 0, simulated.stderr
    model = json.loads(simulated.stdout)
    assert live["warm_sessions"] == model["warm_sessions"] > 5
    # the primes are answered and cached: warm sessions' next calls hit from the first minute
    assert live["connection_errors"] == 0 and live["hit_rate_pre"] > 0.6
    cold = run_basin("replay", "--target", emulator.url, "--api", "sglang", "--quiet", "--json", "-",
                     "--warm-sessions", "0", *scenario)  # fmt: skip
    assert cold.returncode == 0, cold.stderr
    assert json.loads(cold.stdout)["warm_sessions"] == 0
    assert json.loads(cold.stdout)["requests"] < live["requests"]


def test_negative_warm_sessions_is_refused() -> None:
    result = run_basin(
        "replay", "--target", "http://127.0.0.1:9", "--base-rate", "1", "--warm-sessions", "-1"
    )
    assert result.returncode == 2 and "--warm-sessions must not be negative" in result.stderr


class GatewayStub:
    """A gateway-like server: it parks every session's first call once (429), serves it, then sheds
    the session at its next call (503), recording the headers it saw. With `serve_all` it answers every
    call at once; with `hang` it never answers."""

    def __init__(self, serve_all: bool = False, hang: bool = False) -> None:
        self.serve_all = serve_all
        self.hang = hang
        self.seen: list[dict[str, str]] = []
        self.attempts: dict[str, int] = {}
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        session = request.headers["X-Session-ID"]
        self.seen.append(dict(request.headers))
        attempt = self.attempts[session] = self.attempts.get(session, 0) + 1
        if self.hang:
            await asyncio.Event().wait()
        if not self.serve_all and attempt == 1:
            return web.Response(status=429, headers={"Retry-After": "0.01"})
        if not self.serve_all and attempt > 2:
            return web.Response(status=503, headers={"X-Basin-Outcome": "shed"})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        words = " ".join(["w500"] * body["max_tokens"])
        chunk = {"choices": [{"index": 0, "delta": {"content": words}, "finish_reason": None}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}}
        for event in (chunk, usage):
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    def serve(self) -> None:
        async def main() -> None:
            app = web.Application(client_max_size=1 << 26)
            app.router.add_post("/v1/chat/completions", self.handle)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._loop = asyncio.get_running_loop()
            self._ready.set()
            await asyncio.Event().wait()

        threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
        self._ready.wait(10)


def replay_stub(stub: GatewayStub, *scenario: str) -> dict[str, Any]:
    """`basin replay --json -` of a cold scenario against the stub; the run must end with exit 0."""
    result = run_basin(
        "replay", "--target", f"http://127.0.0.1:{stub.port}", "--quiet", "--warm-sessions", "0",
        "--json", "-", *scenario,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return dict(json.loads(result.stdout))


@pytest.fixture
def gateway() -> Iterator[GatewayStub]:
    stub = GatewayStub()
    stub.serve()
    yield stub


def test_429_parks_and_503_sheds(gateway: GatewayStub) -> None:
    """Cold sessions only: each one's first call is parked once, served, and its second call shed."""
    # Exit 0: parking and shedding are answers, not errors.
    payload = replay_stub(
        gateway, "--time-scale", "200", "--base-rate", "3", "--duration-min", "30", "--seed", "3"
    )
    sessions = len(gateway.attempts)
    assert sessions > 10
    assert payload["parked_answers"] == sessions  # every session was parked once, then retried
    assert payload["shed_fraction"] > 0.9  # measured sessions all reached their second call
    assert payload["completed_fraction"] == 0
    assert all(h["X-Session-ID"] for h in gateway.seen)
    assert not any("X-Session-Final" in h for h in gateway.seen)  # no session reached its last call


def test_every_call_names_its_session_and_the_last_is_marked_final() -> None:
    stub = GatewayStub(serve_all=True)
    stub.serve()
    payload = replay_stub(
        stub, "--time-scale", "500", "--base-rate", "4", "--duration-min", "120", "--seed", "4"
    )
    calls: dict[str, list[bool]] = {}
    for headers in stub.seen:
        calls.setdefault(headers["X-Session-ID"], []).append(headers.get("X-Session-Final") == "1")
    finished = [marks for marks in calls.values() if any(marks)]
    assert len(finished) >= 10
    assert all(marks[-1] and not any(marks[:-1]) for marks in finished)  # only the last call is final
    assert payload["parked_answers"] == payload["connection_errors"] == payload["failed_requests"] == 0


def test_requests_still_out_when_the_run_ends_are_counted_as_cut_off() -> None:
    """A server that never answers: every request the client sent is still out at the end, unread, and
    the client says so instead of counting it as an answer or an error."""
    stub = GatewayStub(hang=True)
    stub.serve()
    payload = replay_stub(
        stub, "--time-scale", "60", "--base-rate", "6", "--duration-min", "5", "--seed", "0"
    )
    assert len(stub.seen) >= 10
    assert payload["requests"] == payload["cut_off"] == len(stub.seen)
    assert payload["answered"] == payload["parked_answers"] == payload["connection_errors"] == 0


def test_replay_survives_the_emulator_dying(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", "20")
    replay = subprocess.Popen(
        [BASIN, "replay", "--target", emulator.url, "--time-scale", "20", "--base-rate", "6",
         "--duration-min", "120", "--max-errors", "5", "--api", "sglang"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(4)
    emulator.process.kill()
    stdout, stderr = replay.communicate(timeout=60)
    assert replay.returncode == 1, stderr
    assert "Traceback" not in stderr + stdout
    assert "stopped early: 5 errors" in stderr and "error: " in stderr
    assert "goodput (sessions/h)" in stdout  # the partial summary still prints


def test_ctrl_c_stops_with_a_partial_summary(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", "20")
    replay = subprocess.Popen(
        [BASIN, "replay", "--target", emulator.url, "--time-scale", "20", "--base-rate", "3",
         "--duration-min", "120", "--warm-sessions", "0", "--quiet", "--json", "-"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    time.sleep(4)
    replay.send_signal(signal.SIGINT)
    stdout, stderr = replay.communicate(timeout=60)
    assert replay.returncode == 130, stderr
    payload: dict[str, Any] = json.loads(stdout)
    assert payload["stopped_early"].startswith("interrupted")
    assert 0 < payload["model_seconds"] < 120 * 60 and payload["answered"] > 0
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "localhost:30000", "--base-rate", "1"], "must be an http(s) URL"),
        (["--target", "http://127.0.0.1:9", "--base-rate", "1", "--time-scale", "0"], "--time-scale"),
        (["--target", "http://127.0.0.1:9", "--base-rate", "1", "--workload", "nope.jsonl"], "nope.jsonl"),
    ],
)
def test_bad_options_are_one_line_errors(args: list[str], message: str) -> None:
    result = run_basin("replay", *args, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_replay_takes_the_servers_time_scale_and_warns_on_another(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", "20")
    scenario = ["--target", emulator.url, "--base-rate", "3", "--api", "sglang", "--quiet", "--json", "-"]
    taken = run_basin("replay", *scenario, "--duration-min", "2")
    assert taken.returncode == 0, taken.stderr
    assert json.loads(taken.stdout)["time_scale"] == 20
    assert "differs from the server's" not in taken.stderr
    other = run_basin("replay", *scenario, "--duration-min", "0.2", "--time-scale", "1")
    assert other.returncode == 0, other.stderr
    assert "warning: --time-scale 1 differs from the server's 20" in other.stderr


def test_a_busy_client_sees_its_own_lag(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    """A client whose loop is blocked 40 % of the time dates answers late, and its figures say so."""
    from basin.sim.deployments import GPUS
    from basin.workload import RateSchedule, load_workload
    from basin_profiler.replay import Replay, ReplayConfig

    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", "10")
    config = ReplayConfig(
        target=emulator.url,
        schedule=RateSchedule(base_rate=3, duration_min=1.5),
        reference_gpu=GPUS["h100"],
        api="sglang",
        time_scale=10,
    )

    async def hog() -> None:  # CPU work the loop cannot interleave, like tokenizing huge prompts
        while True:
            time.sleep(0.08)
            await asyncio.sleep(0.12)

    async def run_busy() -> Any:
        hogging = asyncio.create_task(hog())
        try:
            return await Replay(config, load_workload("terminal-bench", 0)).run()
        finally:
            hogging.cancel()

    busy = asyncio.run(run_busy())
    assert busy.client.lag_p90_model_s >= 0.4  # 40 ms of wall lag at x10
    assert busy.client.dominates(0.2)
    assert not busy.client.dominates(100.0)
    assert busy.client.to_dict()["client_loop_lag_p90_model_s"] == busy.client.lag_p90_model_s


def test_the_emulator_reports_its_own_loop_lag(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    import requests

    emulator = emulator_factory("--deployment", "h100-1p1d")
    time.sleep(0.5)  # a few probes
    info = requests.get(f"{emulator.url}/get_server_info", timeout=5).json()
    assert 0 <= info["loop_lag_mean_s"] <= info["loop_lag_p90_s"] < 1


def test_a_shared_prefix_is_reused_across_sessions_live_as_in_the_simulator(  # type: ignore[no-untyped-def]
    emulator_factory, tmp_path: Path
) -> None:
    """Single-call sessions whose prompts open with the workload's 2,048-token shared prefix: each one's
    only reuse is that prefix, which the replay sends as the same ids and the emulator caches by content,
    as the simulator gives it the same pages."""
    call = {"prompt_tokens": 3000, "new_tokens": 3000, "output_tokens": 4}
    sessions = tmp_path / "shared.jsonl"
    sessions.write_text(
        "".join(
            json.dumps({"session_id": f"s-{i}", "workload": "agent", "shared_prefix_tokens": 2048,
                        "calls": [call]}) + "\n"
            for i in range(20)
        )
    )  # fmt: skip
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", "20")
    scenario = ["--workload", str(sessions), "--base-rate", "20", "--duration-min", "3", "--seed", "1",
                "--warm-sessions", "0", "--quiet", "--json"]  # fmt: skip
    out = tmp_path / "replay.json"
    replay = run_basin("replay", "--target", emulator.url, "--time-scale", "20", "--api", "sglang",
                       *scenario, str(out))  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    live = json.loads(out.read_text())
    simulated = run_basin("simulate", "--deployment", "h100-1p1d", *scenario, "-")
    assert simulated.returncode == 0, simulated.stderr
    model = json.loads(simulated.stdout)
    assert live["measured_sessions"] == model["measured_sessions"] > 15
    assert model["hit_rate_pre"] > 0.6  # 2048 of 3000 tokens, all but the first call
    assert abs(live["hit_rate_pre"] - model["hit_rate_pre"]) <= 0.02
