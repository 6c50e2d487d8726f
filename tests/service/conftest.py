"""Real server processes on 127.0.0.1: the `basin emulate` command as users start it."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

BASIN = str(Path(sys.executable).with_name("basin"))


class Emulator:
    def __init__(self, process: subprocess.Popen[str], port: int) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_emulator(*args: str) -> Emulator:
    """Start `basin emulate --port 0 …` and wait for the line that names its port."""
    process = subprocess.Popen(
        [BASIN, "emulate", "--port", "0", *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    assert process.stderr is not None
    deadline = time.monotonic() + 30
    log: list[str] = []
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        log.append(line)
        match = re.search(r"at http://127\.0\.0\.1:(\d+)", line)
        if match:
            # Keep reading its log so a chatty emulator never blocks on a full pipe.
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return Emulator(process, int(match.group(1)))
        if not line and process.poll() is not None:
            break
    process.kill()
    raise RuntimeError("the emulator did not start: " + "".join(log))


@pytest.fixture
def emulator_factory() -> Iterator[Callable[..., Emulator]]:
    started: list[Emulator] = []

    def start(*args: str) -> Emulator:
        emulator = start_emulator(*args)
        started.append(emulator)
        return emulator

    yield start
    for emulator in started:
        emulator.stop()


@pytest.fixture(scope="module")
def small_emulator() -> Iterator[Emulator]:
    """One emulator with a 200-token context, shared by a module's bad-input matrix."""
    emulator = start_emulator("--context-length", "200")
    yield emulator
    emulator.stop()
