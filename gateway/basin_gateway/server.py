"""Running the gateway: `basin gateway run` builds the settings, then calls `serve`."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from aiohttp import web

from basin.errors import BasinError
from basin_gateway.app import Gateway, create_app
from basin_gateway.build import LoadedProfile, preset_profile, read_profile
from basin_gateway.coordinator import Coordinator
from basin_gateway.metrics import GatewayMetrics
from basin_gateway.settings import Settings

log = logging.getLogger("basin.gateway")
HEADER_FIELD_LIMIT = 1 << 20  # aiohttp's own parser limit, far above ours: ours answers 431 in JSON


def load_profile(settings: Settings) -> LoadedProfile | None:
    if settings.profile_path:
        profile = read_profile(settings.profile_path)
        if profile is not None and settings.fingerprint and profile.fingerprint != settings.fingerprint:
            log.warning(
                "profile %s was measured on deployment %r, not this one (%r): not used",
                settings.profile_path,
                profile.fingerprint,
                settings.fingerprint,
            )
            return None
        if profile is None:
            log.warning(
                "profile %s is absent or empty: forwarding everything until it appears", settings.profile_path
            )
        return profile
    if settings.preset:
        return preset_profile(settings.preset)
    return None


def build(settings: Settings) -> Gateway:
    metrics = GatewayMetrics()
    profile = load_profile(settings)
    if settings.redis_url:
        from basin_gateway.shared import RedisCoordinator

        coordinator: Coordinator = RedisCoordinator(settings, metrics, profile)
    else:
        coordinator = Coordinator(settings, metrics, profile)
    return Gateway(settings, coordinator, metrics)


async def serve(settings: Settings, ready: Callable[[int], None]) -> None:
    """Serve until SIGTERM/SIGINT or cancellation; `ready` gets the bound port (useful with port 0)."""
    gateway = build(settings)
    app = create_app(gateway)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        max_line_size=HEADER_FIELD_LIMIT,
        max_field_size=HEADER_FIELD_LIMIT,
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise BasinError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from None
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    if settings.metrics_port is not None and settings.metrics_port != settings.port:
        await web.TCPSite(runner, settings.host, settings.metrics_port).start()
    if not settings.redis_url:
        log.info("no Redis configured: state is in memory, for one replica only")
    ready(bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
