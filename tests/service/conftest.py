"""Real server processes on 127.0.0.1: the `basin emulate` command as users start it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from basin_gateway.local import Server, start_emulator

Emulator = Server  # started as `basin up` starts it: gateway/basin_gateway/local.py


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
