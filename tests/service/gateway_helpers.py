"""Starting the gateway, Redis and stub upstreams as real processes and servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import requests
from aiohttp import web

BASIN = str(Path(sys.executable).with_name("basin"))  # the venv's own script, never one on PATH


class Process:
    """A started server process whose log is kept (read on a thread so it never blocks on a full pipe)."""

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


def _drain(stream: object, log: list[str]) -> None:
    log.extend(iter(stream.readline, ""))  # type: ignore[attr-defined]


def _start(
    args: list[str], pattern: str, what: str, timeout: float = 60, env: dict[str, str] | None = None
) -> Process:
    full_env = {**os.environ, **env} if env else None
    process = subprocess.Popen(
        args, stderr=subprocess.STDOUT, stdout=subprocess.PIPE, text=True, env=full_env
    )
    assert process.stdout is not None
    log: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        log.append(line)
        match = re.search(pattern, line)
        if match:
            threading.Thread(target=_drain, args=(process.stdout, log), daemon=True).start()
            return Process(process, int(match.group(1) or 0), log)
        if not line and process.poll() is not None:
            break
    process.kill()
    raise RuntimeError(f"{what} did not start: " + "".join(log))


def start_emulator(*args: str) -> Process:
    """`basin emulate --port 0 …` (the conftest's fixture starts one per test; these live per module)."""
    return _start([BASIN, "emulate", "--port", "0", *args], r"at http://127\.0\.0\.1:(\d+)", "the emulator")


def start_gateway(upstream: str, *args: str, env: dict[str, str] | None = None) -> Process:
    """`basin gateway run --port 0 …`, waiting for the line that names its port."""
    command = [BASIN, "gateway", "run", "--host", "127.0.0.1", "--port", "0", "--upstream", upstream, *args]
    return _start(command, r"serving at http://127\.0\.0\.1:(\d+)", "the gateway", env=env)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def redis_server_path() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError(
            "redis-server is not on PATH: the gateway's service tests need a real Redis "
            "(Debian: apt-get install redis-server)"
        )
    return path


def start_redis(tmp: Path, port: int | None = None) -> Process:
    """A throwaway redis-server without persistence (gateway state is soft, as in the managed Redis)."""
    port = port or free_port()
    args = [
        redis_server_path(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(tmp),
    ]
    process = _start(args, r"(?:Ready to accept connections|ready to accept connections)()", "redis-server")
    process.port = port
    process.url = f"redis://127.0.0.1:{port}/0"
    return process


def metrics(url: str) -> dict[str, float]:
    """Every unlabelled sample of a gateway's /metrics, in one scrape."""
    values = {}
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def metric(url: str, name: str, labels: str = "") -> float:
    """One sample of a gateway's /metrics (NaN when absent)."""
    text = requests.get(f"{url}/metrics", timeout=10).text
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == wanted:
            return float(value)
    return float("nan")


def wait_for(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Poll to a deadline (never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Stub:
    """An upstream that misbehaves on purpose, served from a thread."""

    def __init__(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.handler = handler
        self.port = 0
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def serve(self) -> Stub:
        async def main() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self.handler)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self._ready.set()
            await asyncio.Event().wait()

        threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
        self._ready.wait(10)
        return self


class RoundRobin:
    """A TCP balancer: each new client connection goes to the next backend (as a Service spreads them)."""

    def __init__(self, ports: list[int]) -> None:
        self.ports = ports
        self.port = 0
        self.next = 0
        self._ready = threading.Event()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = self.ports[self.next % len(self.ports)]
        self.next += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    def serve(self) -> RoundRobin:
        async def main() -> None:
            server = await asyncio.start_server(self._client, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            await server.serve_forever()

        threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
        self._ready.wait(10)
        return self
