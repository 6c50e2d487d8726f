"""Where a call goes: through the SGLang router (`--upstream`), or straight to a prefill and a decode
engine (`--prefill URL BOOTSTRAP_PORT` and `--decode URL`), the way sglang-router's PD mode sends it.

Why address the engines directly: through sglang-router 0.3.2, `custom_params` (lending) reaches the
engines only on `/v1/completions`; `/generate` drops it, chat drops `rid`, `priority` and `custom_params`,
and the router has no `/abort_request` (docs/gateway.md, "Through sglang-router"). Sent directly, every
field of the call's body reaches both engines. Like the router, the gateway posts the same body to both
at once with `bootstrap_host`/`bootstrap_port` (the prefill engine's bootstrap server) and a random
63-bit `bootstrap_room` that pairs the two; decode's answer is the call's. A session keeps its prefill
and decode engines (a stable hash of its id), so its growing prefix is found where it was cached.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from basin.errors import BasinError
from basin_gateway.telemetry import PodEngines, TelemetryError

if TYPE_CHECKING:
    from basin_gateway.settings import Settings

log = logging.getLogger("basin.gateway")


@dataclass(frozen=True)
class PrefillEngine:
    url: str
    bootstrap_port: int

    @property
    def bootstrap_host(self) -> str:
        host = urlsplit(self.url).hostname
        assert host is not None  # checked by `parse_prefill`
        return host


@dataclass(frozen=True)
class Target:
    """One call's destination: `url` answers it; with `prefill`, the same body (plus the bootstrap
    fields) also goes to that prefill engine."""

    url: str
    prefill: PrefillEngine | None = None


def _http_url(url: str, what: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BasinError(f"{what} must be an http(s) URL with a host, got {url!r}")
    return url.rstrip("/")


def parse_prefill(url: str, bootstrap_port: int | str) -> PrefillEngine:
    try:
        port = int(bootstrap_port)
    except ValueError:
        raise BasinError(
            f"--prefill {url}: the bootstrap port must be a number, got {bootstrap_port!r}"
        ) from None
    if not 0 < port < 65536:
        raise BasinError(f"--prefill {url}: the bootstrap port must be between 1 and 65535, got {port}")
    return PrefillEngine(_http_url(url, "--prefill"), port)


def parse_decode(url: str) -> str:
    return _http_url(url, "--decode")


def parse_prefill_list(value: str) -> tuple[PrefillEngine, ...]:
    """`BASIN_PREFILL_ENGINES`: comma-separated `URL BOOTSTRAP_PORT` pairs."""
    engines = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        fields = item.split()
        if len(fields) != 2:
            raise BasinError(f"BASIN_PREFILL_ENGINES: expected 'URL BOOTSTRAP_PORT', got {item!r}")
        engines.append(parse_prefill(*fields))
    return tuple(engines)


def _index(session: str, count: int) -> int:
    """A session's engine among `count`: stable across calls, replicas and restarts."""
    digest = hashlib.blake2b(session.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


class Upstreams:
    """The router, or the prefill and decode engines (a static list, or the Ready engine pods the gateway
    finds by the operator's selectors: `update` replaces them); which one answers a session's calls."""

    def __init__(
        self, router: str, prefill: tuple[PrefillEngine, ...], decode: tuple[str, ...], direct: bool = False
    ) -> None:
        self.router = router.rstrip("/")
        self.prefill = prefill
        self.decode = decode
        self.direct = direct or bool(decode)

    @classmethod
    def of(cls, settings: Settings) -> Upstreams:
        return cls(settings.upstream, settings.prefill, settings.decode, settings.direct)

    def update(self, prefill: tuple[PrefillEngine, ...], decode: tuple[str, ...]) -> bool:
        """New engine lists (from the pods); whether they changed."""
        changed = (prefill, decode) != (self.prefill, self.decode)
        self.prefill, self.decode = prefill, decode
        return changed

    def pick(self, session: str) -> Target | None:
        """The session's target; None while direct addressing knows no prefill or no decode engine."""
        if not self.direct:
            return Target(self.router)
        if not self.prefill or not self.decode:
            return None
        return Target(
            self.decode[_index(session, len(self.decode))],
            self.prefill[_index(session, len(self.prefill))],
        )

    def engines(self) -> tuple[str, ...]:
        """Every server a call may reach: their health is the gateway's readiness, and an abandoned call
        is aborted on each (an unknown rid is a no-op for SGLang)."""
        if not self.direct:
            return (self.router,)
        return (*(p.url for p in self.prefill), *self.decode)

    def describe(self) -> str:
        if not self.direct:
            return f"through the router {self.router}"
        if not self.decode and not self.prefill:
            return "directly to the engine pods found by the operator's selectors"
        prefill = ", ".join(f"{p.url} (bootstrap {p.bootstrap_port})" for p in self.prefill)
        return f"directly: prefill {prefill}; decode {', '.join(self.decode)}"


def bootstrap_fields(prefill: PrefillEngine) -> dict[str, str | int]:
    """The fields that pair a call's prefill and decode halves (sglang-router's PD mode sends the same)."""
    return {
        "bootstrap_host": prefill.bootstrap_host,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": random.getrandbits(63),
    }


class EnginePods:
    """Keeps `upstreams` on the Ready engine pods the operator's selectors find (prefill pods serve their
    bootstrap on `bootstrap_port`), re-listed every `refresh_s` wall seconds. A failed listing keeps the
    last lists, and says so in the log."""

    def __init__(
        self,
        upstreams: Upstreams,
        prefill: PodEngines,
        decode: PodEngines,
        bootstrap_port: int,
        refresh_s: float = 10.0,
    ) -> None:
        self.upstreams = upstreams
        self.prefill = prefill
        self.decode = decode
        self.bootstrap_port = bootstrap_port
        self.refresh_s = refresh_s

    async def refresh(self) -> None:
        prefill, decode = await asyncio.gather(self.prefill.urls(), self.decode.urls())
        engines = tuple(PrefillEngine(url, self.bootstrap_port) for url in prefill)
        if self.upstreams.update(engines, decode):
            log.info("calls go %s", self.upstreams.describe())

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except TelemetryError as exc:
                log.warning("engine pods: %s; calls keep going %s", exc, self.upstreams.describe())
            await asyncio.sleep(self.refresh_s)
