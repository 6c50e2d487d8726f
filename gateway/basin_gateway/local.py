"""`basin up`: the local stack on one machine — the emulator, the gateway (sharing state through a
throwaway `redis-server` when one is installed, else in memory), and a short surge replay through it,
with a live table of what the gateway decides."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from basin.errors import BasinError

BASIN = str(Path(sys.executable).with_name("basin"))


def surge_replay(duration_min: float = 30.0) -> tuple[str, ...]:
    """`basin replay`'s arguments for the local stack's surge: x5 from minute 3 to 15 at 9 sessions/min,
    about half h200-1p3d's critical rate (the same scenario `basin up` shows and the gateway's surge test
    measures)."""
    return (
        *("--base-rate", "9", "--surge-factor", "5", "--surge-start-min", "3", "--surge-minutes", "12"),
        *("--duration-min", f"{duration_min:g}"),
    )


@dataclass(frozen=True)
class Stack:
    deployment: str = "h200-1p3d"
    time_scale: float = 20.0
    policy: str = "basin"
    redis: bool = True
    replay: tuple[str, ...] = surge_replay()


class Server:
    """A started server process whose output is kept (read on a thread so it never blocks on a full
    pipe), with the port it announced."""

    def __init__(self, process: subprocess.Popen[str], port: int, log: list[str]) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log

    def text(self) -> str:
        return "".join(self.log)

    def stop(self, kill: bool = False) -> None:
        if self.process.poll() is None:
            self.process.kill() if kill else self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _drain(stream: object, log: list[str]) -> None:
    log.extend(iter(stream.readline, ""))  # type: ignore[attr-defined]


def start_server(
    args: list[str], pattern: str, what: str, timeout: float = 60, env: dict[str, str] | None = None
) -> Server:
    """Start `args` and wait for the output line matching `pattern` (its group 1 is the port, if any)."""
    full_env = {**os.environ, **env} if env else None
    process = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env
    )
    assert process.stdout is not None
    log: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:  # end of output: the process is exiting
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            break
        log.append(line)
        match = re.search(pattern, line)
        if match:
            threading.Thread(target=_drain, args=(process.stdout, log), daemon=True).start()
            return Server(process, int(match.group(1) or 0), log)
    process.kill()
    raise BasinError(f"{what} did not start: {''.join(log)[-4000:]}")


def start_emulator(*args: str) -> Server:
    """`basin emulate --port 0 …`, waiting for the line that names its port."""
    return start_server(
        [BASIN, "emulate", "--port", "0", *args], r"at http://127\.0\.0\.1:(\d+)", "the emulator"
    )


def start_gateway(upstream: str, *args: str, env: dict[str, str] | None = None) -> Server:
    """`basin gateway run --port 0 …`, waiting for the line that names its port."""
    command = [BASIN, "gateway", "run", "--host", "127.0.0.1", "--port", "0", "--upstream", upstream, *args]
    return start_server(command, r"serving at http://127\.0\.0\.1:(\d+)", "the gateway", env=env)


def replay_command(target: str, time_scale: str, out: Path, *scenario: str) -> list[str]:
    """`basin replay` of `scenario` against `target` in SGLang's wire format, its result as JSON in `out`."""
    command = [BASIN, "replay", "--target", target, "--api", "sglang", "--time-scale", time_scale]
    return [*command, "--quiet", "--json", str(out), *scenario]


def redis_server_path() -> str | None:
    return shutil.which("redis-server")


def start_redis(directory: str | Path, port: int | None = None) -> Server:
    """A throwaway redis-server without persistence (gateway state is soft, as in a managed Redis)."""
    server_path = redis_server_path()
    if server_path is None:
        raise BasinError("redis-server is not on PATH (Debian: apt-get install redis-server)")
    port = port or free_port()
    args = [server_path, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = start_server(
        [*args, "--dir", str(directory)], r"(?i)ready to accept connections()", "redis-server"
    )
    server.port = port
    server.url = f"redis://127.0.0.1:{port}/0"
    return server


def _metrics(url: str) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("basin_gateway_") and "{" not in line:
            name, _, value = line.rpartition(" ")
            values[name.removeprefix("basin_gateway_")] = float(value)
        elif line.startswith("basin_gateway_sessions_ended{"):
            outcome = re.search(r'outcome="(\w+)"', line)
            if outcome:
                key = f"ended_{outcome.group(1)}"
                values[key] = values.get(key, 0.0) + float(line.rpartition(" ")[2])
    return values


def _table(values: dict[str, float], stack: Stack, elapsed: float, mode: str) -> Table:
    def show(name: str, scale: float = 1.0, digits: int = 0) -> str:
        value = values.get(name)
        if value is None or value != value:
            return "n/a"
        if value in (float("inf"), float("-inf")):
            return "∞"
        return f"{value / scale:,.{digits}f}"

    table = Table(
        title=f"basin up: {stack.deployment} emulated, ×{stack.time_scale:g}, {stack.policy}, {mode}"
    )
    table.add_column("what")
    table.add_column("now", justify="right")
    rows = [
        ("model minutes", f"{elapsed * stack.time_scale / 60:.1f}"),
        ("sessions active / parked", f"{show('sessions_active')} / {show('sessions_parked')}"),
        ("working set (M tokens)", show("working_set_tokens", 1e6, 2)),
        ("budget B / B0 (M tokens)", f"{show('budget_tokens', 1e6, 2)} / {show('b0_tokens', 1e6, 2)}"),
        (
            "admission / ordering / lending",
            " / ".join(show(n) for n in ("admission_active", "ordering_active", "lending_active")),
        ),
        ("hit rate (last reading)", show("telemetry_hit_rate", 1.0, 2)),
        ("prefill backlog (K tokens)", show("telemetry_prefill_backlog_tokens", 1e3, 0)),
        ("429 answers", show("parked_answers_total")),
        (
            "completed / shed / rejected",
            " / ".join(show(f"ended_{n}") for n in ("completed", "shed", "rejected")),
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def run_stack(stack: Stack, console: Console) -> int:
    """Start everything, replay the surge with a live table, print the replay's summary; 0 on success."""
    started: list[Server] = []
    tmp = tempfile.mkdtemp(prefix="basin-up-")
    try:
        scale = f"{stack.time_scale:g}"
        emulator = start_emulator("--deployment", stack.deployment, "--time-scale", scale)
        started.append(emulator)
        extra: list[str] = []
        mode = "in memory (no redis-server installed)" if stack.redis else "in memory"
        if stack.redis and redis_server_path():
            redis = start_redis(tmp)
            started.append(redis)
            extra = ["--redis", redis.url]
            mode = f"Redis at 127.0.0.1:{redis.port}"
        gateway = start_gateway(
            emulator.url,
            "--deployment",
            stack.deployment,
            "--time-scale",
            scale,
            "--policy",
            stack.policy,
            *extra,
        )
        started.append(gateway)
        url = gateway.url
        console.print(f"emulator {emulator.url}, gateway {url} ({mode}); replaying a surge")
        out = Path(tmp) / "replay.json"
        replay = subprocess.Popen(
            replay_command(url, scale, out, *stack.replay),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(Server(replay, 0, []))
        begin = time.monotonic()
        with Live(_table({}, stack, 0.0, mode), console=console, refresh_per_second=2) as live:
            while replay.poll() is None:
                time.sleep(1.0)
                live.update(_table(_metrics(url), stack, time.monotonic() - begin, mode))
        if replay.returncode != 0 or not out.exists():
            console.print(replay.stdout.read() if replay.stdout else "")
            return 1
        result = json.loads(out.read_text())
        summary = Table(title="the replay, as the client saw it")
        summary.add_column("metric")
        summary.add_column("value", justify="right")
        for key in (
            "goodput_sessions_per_h",
            "completed_fraction",
            "shed_fraction",
            "hit_rate_pre",
            "hit_rate_late",
            "median_ttft_late_s",
            "requests",
            "parked_answers",
            "label",
        ):
            value = result.get(key)
            summary.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
        console.print(summary)
        return 0
    except KeyboardInterrupt:
        console.print("stopped")
        return 130
    finally:
        for server in reversed(started):
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
