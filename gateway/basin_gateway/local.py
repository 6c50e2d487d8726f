"""`basin up`: the local stack on one machine — the emulator, the gateway (sharing state through a
throwaway `redis-server` when one is installed, else in memory), and a short surge replay through it,
with a live table of what the gateway decides."""

from __future__ import annotations

import json
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


@dataclass(frozen=True)
class Stack:
    deployment: str = "h200-1p3d"
    time_scale: float = 20.0
    policy: str = "basin"
    redis: bool = True
    replay: tuple[str, ...] = (
        "--base-rate",
        "8",
        "--surge-factor",
        "5",
        "--surge-start-min",
        "3",
        "--surge-minutes",
        "12",
        "--duration-min",
        "30",
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _drain(stream: object, log: list[str]) -> None:
    log.extend(iter(stream.readline, ""))  # type: ignore[attr-defined]


def _start(args: list[str], pattern: str, what: str, log: list[str]) -> tuple[subprocess.Popen[str], int]:
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert process.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        log.append(line)
        match = re.search(pattern, line)
        if match:
            threading.Thread(target=_drain, args=(process.stdout, log), daemon=True).start()
            return process, int(match.group(1) or 0)
        if not line and process.poll() is not None:
            break
    process.kill()
    raise BasinError(f"{what} did not start: {''.join(log[-5:])}")


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
    started: list[subprocess.Popen[str]] = []
    logs: dict[str, list[str]] = {"emulator": [], "gateway": [], "redis": []}
    tmp = tempfile.mkdtemp(prefix="basin-up-")
    try:
        scale = f"{stack.time_scale:g}"
        emulator, emulator_port = _start(
            [BASIN, "emulate", "--deployment", stack.deployment, "--time-scale", scale, "--port", "0"],
            r"at http://127\.0\.0\.1:(\d+)",
            "the emulator",
            logs["emulator"],
        )
        started.append(emulator)
        extra: list[str] = []
        mode = "in memory (no redis-server installed)"
        redis_server = shutil.which("redis-server") if stack.redis else None
        if redis_server:
            port = _free_port()
            redis, _ = _start(
                [
                    redis_server,
                    "--port",
                    str(port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    tmp,
                ],
                r"(?i)ready to accept connections()",
                "redis-server",
                logs["redis"],
            )
            started.append(redis)
            extra = ["--redis", f"redis://127.0.0.1:{port}/0"]
            mode = f"Redis at 127.0.0.1:{port}"
        elif not stack.redis:
            mode = "in memory"
        gateway, gateway_port = _start(
            [
                BASIN,
                "gateway",
                "run",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--upstream",
                f"http://127.0.0.1:{emulator_port}",
                "--deployment",
                stack.deployment,
                "--time-scale",
                scale,
                "--policy",
                stack.policy,
                *extra,
            ],
            r"serving at http://127\.0\.0\.1:(\d+)",
            "the gateway",
            logs["gateway"],
        )
        started.append(gateway)
        url = f"http://127.0.0.1:{gateway_port}"
        console.print(f"emulator http://127.0.0.1:{emulator_port}, gateway {url} ({mode}); replaying a surge")
        out = Path(tmp) / "replay.json"
        replay = subprocess.Popen(
            [
                BASIN,
                "replay",
                "--target",
                url,
                "--api",
                "sglang",
                "--time-scale",
                scale,
                "--quiet",
                "--json",
                str(out),
                *stack.replay,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        started.append(replay)
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
        for process in reversed(started):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
        shutil.rmtree(tmp, ignore_errors=True)
