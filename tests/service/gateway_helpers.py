"""Starting the gateway, Redis and stub upstreams as real processes and servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import requests
from aiohttp import web

# The servers start the way `basin up` starts them (gateway/basin_gateway/local.py); re-exported here.
from basin_gateway.local import BASIN as BASIN
from basin_gateway.local import Server as Process
from basin_gateway.local import free_port as free_port
from basin_gateway.local import redis_server_path
from basin_gateway.local import replay_command as replay_command
from basin_gateway.local import start_emulator as start_emulator
from basin_gateway.local import start_gateway as start_gateway
from basin_gateway.local import start_redis as _start_redis

# A profile whose tiny κ makes BASIN's admission engage under a light replay (B0 = m·κ·x_k·C ≈ 34K tokens).
TINY_KAPPA_PROFILE = {
    "kappa": 0.02,
    "lambda_c_per_min": 1.0,
    "prefill_gpu_tokens": 1_000_000,
    "host_tokens": 0,
    "decode_kv_tokens": 2_000_000,
    "prefill_tokens_per_s": 50_000.0,
    "fingerprint": "test",
}


def start_redis(tmp: Path, port: int | None = None) -> Process:
    """A throwaway redis-server; the service tests need a real one, so its absence is an error."""
    if redis_server_path() is None:
        raise RuntimeError(
            "redis-server is not on PATH: the gateway's service tests need a real Redis "
            "(Debian: apt-get install redis-server)"
        )
    return _start_redis(tmp, port)


def start_replicas(upstream: str, *args: str, count: int = 2) -> list[Process]:
    """`count` gateway replicas with the same arguments (one Redis among them); the first holds the
    leader's lease before the others start, so which replica leads is known. On a failure, those started
    are stopped."""
    replicas: list[Process] = []
    try:
        for _ in range(count):
            replicas.append(start_gateway(upstream, *args))
            if len(replicas) == 1:
                wait_for(
                    lambda: metric(replicas[0].url, "basin_gateway_leader") == 1, "the first replica's lease"
                )
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas


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
