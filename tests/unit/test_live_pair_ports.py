"""The live pair's port-clash retry (engine_ext/live/pair.py), on real processes: a server whose port was
taken between picking and binding exits, and the launch is retried on a fresh port; any other failure is
raised at once. CI once lost the whole live suite to one such clash (the router's port, picked before the
engines' minutes-long start, was taken by one of their own ephemeral ports)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engine_ext" / "live"))
from pair import HOST, Process, free_port, retry_on_port_clash, start, wait_healthy


def http_server_launcher(tmp_path: Path, ports: list[int], launched: list[Process]):  # type: ignore[no-untyped-def]
    """A launch in the pair's shape: pick a port (from `ports` first, then a free one), start a real
    server on it, wait for it to answer."""

    def launch() -> list[Process]:
        port = ports.pop(0) if ports else free_port()
        argv = [sys.executable, "-m", "http.server", str(port), "--bind", HOST]
        server = start(f"http-{len(launched)}", argv, {}, tmp_path)
        launched.append(server)
        wait_healthy([(server, f"http://{HOST}:{port}/")], 30.0)
        return [server]

    return launch


def test_a_launch_whose_port_was_taken_is_retried_on_a_fresh_port(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        launched: list[Process] = []
        try:
            retry_on_port_clash(http_server_launcher(tmp_path, [taken.getsockname()[1]], launched))
            assert len(launched) == 2
            assert not launched[0].alive() and "Address already in use" in launched[0].log()
            assert launched[1].alive()
        finally:
            for server in launched:
                server.stop()


def test_a_port_taken_on_every_attempt_fails_with_the_servers_log(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        launched: list[Process] = []
        with pytest.raises(RuntimeError, match="Address already in use"):
            launch = http_server_launcher(tmp_path, [taken.getsockname()[1]] * 3, launched)
            retry_on_port_clash(launch, attempts=3)
        assert len(launched) == 3


def test_other_failures_are_not_retried(tmp_path: Path) -> None:
    calls = []

    def launch() -> list[Process]:
        calls.append(1)
        server = start("crash", [sys.executable, "-c", "raise SystemExit('model not found')"], {}, tmp_path)
        wait_healthy([(server, f"http://{HOST}:{free_port()}/")], 30.0)
        return [server]

    with pytest.raises(RuntimeError, match="model not found"):
        retry_on_port_clash(launch)
    assert len(calls) == 1


def test_a_clash_far_above_the_log_s_tail_is_still_recognised(tmp_path: Path) -> None:
    """SGLang logs the bind error, then pages of tracebacks from its warm-up thread (seen in a live run)."""
    script = "print('ERROR: [Errno 98] address already in use'); print('x' * 20000); raise SystemExit(3)"
    attempts: list[Process] = []

    def launch() -> list[Process]:
        argv = [sys.executable, "-c", script] if not attempts else [sys.executable, "-m", "http.server", "0"]
        server = start(f"noisy-{len(attempts)}", argv, {}, tmp_path)
        attempts.append(server)
        if len(attempts) == 1:
            wait_healthy([(server, f"http://{HOST}:{free_port()}/")], 30.0)
        return [server]

    try:
        retry_on_port_clash(launch)
        assert len(attempts) == 2
    finally:
        for server in attempts:
            server.stop()
