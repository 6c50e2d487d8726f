"""The profiler's preflight against a target that is not up yet: by hand it fails at once, before any load;
the Job (which the operator starts together with the gateway) waits for the target within a bound."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from basin_profiler import ramp
from basin_profiler.ramp import ProfileFailure, preflight


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def serve_later(port: int, delay_s: float) -> web.AppRunner:
    await asyncio.sleep(delay_s)
    app = web.Application()
    app.router.add_get("/health", lambda _: web.Response())
    app.router.add_get("/get_server_info", lambda _: web.json_response({"time_scale": 20}))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def test_a_target_that_comes_up_within_the_wait_is_profiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ramp, "PREFLIGHT_RETRY_S", 0.2)
    port = free_port()
    said: list[str] = []

    async def scenario() -> dict:
        server = asyncio.create_task(serve_later(port, 1.0))
        try:
            return await preflight(f"http://127.0.0.1:{port}", wait_s=30, echo=said.append)
        finally:
            await (await server).cleanup()

    assert asyncio.run(scenario()) == {"time_scale": 20}
    assert said and all("waiting for the target" in line and "unreachable" in line for line in said)


def test_without_a_wait_or_past_it_an_unreachable_target_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ramp, "PREFLIGHT_RETRY_S", 0.2)
    target = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ProfileFailure, match="is unreachable"):
        asyncio.run(preflight(target))
    said: list[str] = []
    with pytest.raises(ProfileFailure, match="is unreachable"):
        asyncio.run(preflight(target, wait_s=1.0, echo=said.append))
    assert 2 <= len(said) <= 6  # asked again every retry interval until the wait ran out


def test_a_gateway_whose_upstream_is_not_ready_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway is alive (/health) before its upstream answers through the Service; a ramp started then
    fails on its first calls, so its /ready (503 until the upstream is healthy) is waited for too."""
    monkeypatch.setattr(ramp, "PREFLIGHT_RETRY_S", 0.2)
    asked = {"ready": 0}

    async def ready(_: web.Request) -> web.Response:
        asked["ready"] += 1
        return web.Response(status=503 if asked["ready"] < 3 else 200, text="upstream-unavailable")

    async def scenario(wait_s: float) -> dict:
        app = web.Application()
        app.router.add_get("/health", lambda _: web.Response())
        app.router.add_get("/ready", ready)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            return await preflight(f"http://127.0.0.1:{port}", wait_s=wait_s, echo=said.append)
        finally:
            await runner.cleanup()

    said: list[str] = []
    with pytest.raises(ProfileFailure, match="is not ready: GET /ready answered 503 upstream-unavailable"):
        asyncio.run(scenario(0))
    assert asyncio.run(scenario(30)) == {} and asked["ready"] == 3
    assert said and all("not ready" in line for line in said)
