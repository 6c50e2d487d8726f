"""The gateway's HTTP face: SGLang's generation routes in front of the upstream router (or of the prefill
and decode engines themselves, basin_gateway/upstream.py), plus its own.

Every call goes through the brain (or, with Redis, the leader's brain) before it is forwarded; answers
stream back unbuffered. Every non-2xx answer the gateway makes is JSON with an `X-Basin-Reason` header;
429 means parked (retry after `Retry-After` seconds), 503 with `X-Basin-Outcome` means the session ended
(docs/gateway.md lists every status and reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from basin_gateway.brain import FORWARD, PARK, REJECT, SHED, Verdict
from basin_gateway.coordinator import Coordinator
from basin_gateway.metrics import GatewayMetrics
from basin_gateway.settings import Settings
from basin_gateway.telemetry import PodEngines
from basin_gateway.upstream import EnginePods, PrefillEngine, Target, Upstreams, bootstrap_fields
from basin_gateway.wire import (
    ROUTES,
    BadInput,
    Tokens,
    answer_tokens,
    call_shape,
    parse_body,
    rewrite,
    session_of,
    stream_tokens,
)

log = logging.getLogger("basin.gateway")

REASON_HEADER = "X-Basin-Reason"
OUTCOME_HEADER = "X-Basin-Outcome"
FINAL_HEADER = "X-Session-Final"
ADMIN_HEADER = "X-Basin-Admin-Token"
BYPASS_HEADER = "X-Basin-Bypass"
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "TE",
        "Trailers",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
        "Content-Encoding",
        "Accept-Encoding",
    )
)
STREAM_TAIL_BYTES = 1 << 20  # the end of a stream kept to read its token counts
GATEWAY_KEY = web.AppKey("gateway", object)


def error(status: int, reason: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """The gateway's error answer: JSON in SGLang's/OpenAI's error shape plus the reason."""
    body = {"object": "error", "message": message, "type": reason, "code": status, "reason": reason}
    return web.Response(
        body=orjson.dumps(body),
        status=status,
        content_type="application/json",
        headers={REASON_HEADER: reason, **(headers or {})},
    )


def forward_headers(headers: Any, session_header: str, session: str) -> dict[str, str]:
    """The client's headers minus hop-by-hop ones (Authorization passes through), plus the session id."""
    out = {
        k: v
        for k, v in headers.items()
        if k.lower() not in HOP_BY_HOP and not k.lower().startswith("x-basin")
    }
    out[session_header] = session
    out["Content-Type"] = "application/json"
    return out


def format_retry_after(seconds: float) -> str:
    """Whole seconds when at least one (HTTP's delta-seconds), else a decimal (time-scaled runs)."""
    if seconds >= 1:
        return str(math.ceil(seconds))
    return f"{max(seconds, 0.01):.3f}"


class Gateway:
    """What the handlers share: settings, the coordinator (brain, locally or through Redis), the
    upstream client, metrics."""

    def __init__(self, settings: Settings, coordinator: Coordinator, metrics: GatewayMetrics) -> None:
        self.settings = settings
        self.coordinator = coordinator
        self.metrics = metrics
        self.http: aiohttp.ClientSession | None = None
        # Unpooled: every request on a new connection, closed after it. Retries go here, so a retry cannot
        # draw another pooled connection to the same stopped server.
        self.fresh_http: aiohttp.ClientSession | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.upstreams = Upstreams.of(settings)
        self.timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=settings.upstream_connect_timeout_s,
            sock_read=settings.upstream_read_timeout_s,
        )
        self.ready_checked = 0.0
        self.upstream_ok = False
        self.held = 0  # parked calls held open now (--hold-parked)
        metrics.add_state(lambda: [("held_calls", "Parked calls held open now.", {}, float(self.held))])

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def abort_upstream(self, rid: str, servers: tuple[str, ...] | None = None) -> None:
        """SGLang's `/abort_request` for a call whose client left (the engines free what they hold), on
        every server it may have reached (default: all)."""
        assert self.http is not None
        self.metrics.aborts.inc()
        for server in servers or self.upstreams.engines():
            try:
                async with self.http.post(
                    f"{server}/abort_request", json={"rid": rid}, timeout=aiohttp.ClientTimeout(total=5)
                ) as response:
                    await response.read()
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("could not abort %s at %s: %s", rid, server, exc)

    async def prefill_half(
        self, prefill: PrefillEngine, decode: str, route: str, data: bytes, headers: dict[str, str], rid: str
    ) -> None:
        """The prefill engine's half of a directly addressed call. Its answer is read and dropped (decode's
        is the call's, as with sglang-router); when it fails, decode's half is aborted, so that decode
        does not wait for KV that never comes."""
        assert self.http is not None
        try:
            async with self.http.post(
                f"{prefill.url}{route}", data=data, headers=headers, timeout=self.timeout
            ) as response:
                await response.read()
                if response.status == 200:
                    return
                kind, detail = f"prefill-status-{response.status}", f"answered {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            kind, detail = "prefill-unavailable", f"{type(exc).__name__} {exc}"
        self.metrics.upstream_errors.labels(kind).inc()
        log.warning("prefill %s %s for %s; aborting it on decode", prefill.url, detail, rid)
        await self.abort_upstream(rid, (decode,))


# ---------------------------------------------------------------------------- middleware
@web.middleware
async def guard(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> Any:
    """Header limit (431), JSON for every error aiohttp or a handler raises, never a traceback."""
    gateway: Gateway = request.app[GATEWAY_KEY]  # type: ignore[assignment]
    size = sum(len(k) + len(v) + 4 for k, v in request.raw_headers)
    if size > gateway.settings.max_header_bytes:
        return error(
            431,
            "headers-too-large",
            f"request headers of {size} bytes exceed the gateway's limit of"
            f" {gateway.settings.max_header_bytes}",
        )
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        reason = {404: "not-found", 405: "method-not-allowed", 413: "body-too-large"}.get(
            exc.status, "http-error"
        )
        return error(exc.status, reason, exc.reason or exc.text or reason)
    except asyncio.CancelledError:
        raise
    except ConnectionResetError:
        return web.Response(status=499)  # the client left mid-request: nobody reads this
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return error(500, "internal", "the gateway failed on this request; see its log")


# ---------------------------------------------------------------------------- the proxy
async def _read_body(request: web.Request, settings: Settings) -> bytes | web.Response:
    if request.content_length is not None and request.content_length > settings.max_body_bytes:
        return error(
            413,
            "body-too-large",
            f"the body of {request.content_length} bytes exceeds the limit of {settings.max_body_bytes}",
            {"Connection": "close"},
        )
    try:
        return await asyncio.wait_for(request.read(), settings.body_timeout_s)
    except TimeoutError:
        return error(
            408,
            "body-timeout",
            f"the request body did not arrive within {settings.body_timeout_s:g} s",
            {"Connection": "close"},
        )
    except web.HTTPRequestEntityTooLarge:
        return error(
            413,
            "body-too-large",
            f"the body exceeds the limit of {settings.max_body_bytes} bytes",
            {"Connection": "close"},
        )


def _authorized(request: web.Request, settings: Settings) -> bool:
    if not settings.api_keys:
        return True
    auth = request.headers.get("Authorization", "")
    key = auth.removeprefix("Bearer ").strip()
    return any(hmac.compare_digest(key.encode(), k.encode()) for k in settings.api_keys)


def _is_admin(request: web.Request, settings: Settings) -> bool:
    token = request.headers.get(ADMIN_HEADER, "")
    return bool(settings.admin_token) and hmac.compare_digest(
        token.encode(), (settings.admin_token or "").encode()
    )


async def proxy(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app[GATEWAY_KEY]  # type: ignore[assignment]
    settings, metrics, coordinator = gateway.settings, gateway.metrics, gateway.coordinator
    route = request.path
    if not _authorized(request, settings):
        return error(401, "unauthorized", "a valid API key is required (Authorization: Bearer KEY)")
    raw = await _read_body(request, settings)
    if isinstance(raw, web.Response):
        return raw
    try:
        body = parse_body(raw, route)
        shape = call_shape(route, body)
        session = session_of(request.headers, settings.session_header, body.fields)
    except BadInput as exc:
        return error(400, "bad-request", str(exc))
    rid = body.fields.get("rid")
    if rid is not None and not isinstance(rid, str):
        return error(400, "bad-request", "rid must be a string")
    rid = rid or f"basin-{uuid.uuid4().hex}"
    one_call = session is None
    sid = session or f"one-call-{rid}"
    final = one_call or request.headers.get(FINAL_HEADER, "").strip() in ("1", "true")
    bypass = request.headers.get(BYPASS_HEADER) == "1"
    if bypass and not _is_admin(request, settings):
        return error(403, "forbidden", f"{BYPASS_HEADER} needs the admin token in {ADMIN_HEADER}")
    target = gateway.upstreams.pick(sid)
    if target is None:
        return error(
            503,
            "no-engines",
            f"no Ready prefill and decode engine is known yet: calls go {gateway.upstreams.describe()}",
        )
    if bypass:
        verdict = Verdict(FORWARD)
    else:
        verdict = await coordinator.call(sid, shape.task, shape.prompt_tokens)
        if verdict.action == PARK and settings.hold_parked_s > 0:
            verdict = await _hold(request, gateway, sid, shape.task, shape.prompt_tokens, verdict)
    if verdict.action != FORWARD:
        return _refusal(gateway, route, verdict)
    if verdict.waited is not None:
        metrics.first_call_wait.observe(verdict.waited)
    directives = verdict.directives
    upstream_body = rewrite(
        route,
        body,
        sid,
        rid,
        directives.priority if directives else None,
        bool(directives and directives.lend),
        bootstrap_fields(target.prefill) if target.prefill else None,
    )
    del body, raw
    return await _forward(
        request,
        gateway,
        route,
        target,
        sid,
        rid,
        verdict,
        shape.prompt_tokens,
        upstream_body,
        final and not bypass,
        bypass,
    )


async def _hold(
    request: web.Request, gateway: Gateway, sid: str, task: str, prompt_tokens: int, verdict: Verdict
) -> Verdict:
    """A parked call held open (`--hold-parked`) for clients that cannot retry: asked again just after
    each control step (when the leader may admit it) until it is forwarded or ended, or until the next
    step would fall past the hold; then the 429 it would have had at once. Past `--max-held` calls held at
    once, the 429 comes at once. A client that leaves while held ends its session, as one that leaves
    mid-answer does."""
    settings, coordinator, metrics = gateway.settings, gateway.coordinator, gateway.metrics
    if gateway.held >= settings.max_held:
        return verdict
    deadline = time.monotonic() + settings.hold_parked_s
    gateway.held += 1
    try:
        while verdict.action == PARK:
            wait = coordinator.retry_after_s()
            if time.monotonic() + wait > deadline:
                break
            await asyncio.sleep(wait)
            if request.transport is None or request.transport.is_closing():
                coordinator.end(sid, False, "ended", "client-disconnect")
                break
            verdict = await coordinator.call(sid, task, prompt_tokens)
            if verdict.action == PARK:
                metrics.hold_rechecks.inc()
    except asyncio.CancelledError:
        coordinator.end(sid, False, "ended", "client-disconnect")
        raise
    finally:
        gateway.held -= 1
    return verdict


def _refusal(gateway: Gateway, route: str, verdict: Verdict) -> web.Response:
    metrics = gateway.metrics
    if verdict.action == PARK:
        metrics.parked_answers.inc()
        metrics.requests.labels(route, "429").inc()
        coordinator = gateway.coordinator
        retry = format_retry_after(coordinator.retry_after_s() + coordinator.backoff_s(verdict.attempts))
        return error(
            429,
            verdict.reason,
            "the session is parked: retry the same call after Retry-After seconds",
            {"Retry-After": retry},
        )
    outcome = "shed" if verdict.action == SHED else "rejected"
    assert verdict.action in (SHED, REJECT)
    metrics.requests.labels(route, "503").inc()
    return error(
        503,
        verdict.reason,
        f"the session was {outcome} by the gateway ({verdict.reason})",
        {OUTCOME_HEADER: outcome},
    )


async def _post_upstream(
    gateway: Gateway, url: str, data: bytes, headers: dict[str, str], may_retry: bool
) -> aiohttp.ClientResponse:
    """POST upstream; a pooled keep-alive connection the upstream closed as the call went out (a Pod
    shutting down closes its idle connections) is retried once on a new connection: no answer was read, and
    the server that reset it had stopped serving. The retry opens its own connection: the pool may hold
    more connections to the same stopped server. Not with a prefill half, which is paired with this call."""
    assert gateway.http is not None and gateway.fresh_http is not None
    try:
        return await gateway.http.post(url, data=data, headers=headers, timeout=gateway.timeout)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        if not may_retry or isinstance(exc, aiohttp.ClientConnectorError):
            raise
        gateway.metrics.upstream_retries.inc()
        return await gateway.fresh_http.post(url, data=data, headers=headers, timeout=gateway.timeout)


async def _forward(
    request: web.Request,
    gateway: Gateway,
    route: str,
    target: Target,
    sid: str,
    rid: str,
    verdict: Verdict,
    prompt_tokens: int,
    data: bytes,
    final: bool,
    bypass: bool,
) -> web.StreamResponse:
    """Send the call upstream (with its prefill half, when the engines are addressed directly) and pass
    its answer back; settle the session whatever happens."""
    assert gateway.http is not None
    metrics, coordinator, settings = gateway.metrics, gateway.coordinator, gateway.settings
    started = time.perf_counter()
    headers = forward_headers(request.headers, settings.session_header, sid)
    settled = False

    def fail(kind: str) -> None:
        nonlocal settled
        metrics.upstream_errors.labels(kind).inc()
        if not bypass and not settled:
            coordinator.end(sid, False, "failed", kind)
        settled = True
        if target.prefill is not None:  # its prefill half must not wait for a decode that failed
            gateway.spawn(gateway.abort_upstream(rid, (target.prefill.url,)))

    def done(tokens: Tokens | None, fallback_output: int) -> None:
        nonlocal settled
        if bypass or settled:
            return
        settled = True
        prompt, output, cached = tokens if tokens is not None else (prompt_tokens, fallback_output, None)
        prompt = prompt or prompt_tokens
        coordinator.call_done(sid, verdict.index, prompt, prompt + output, cached)
        if final:
            coordinator.end(sid, True, "completed", "final-call")

    def left() -> None:
        nonlocal settled
        if settled:
            return
        settled = True
        if not bypass:
            coordinator.end(sid, False, "ended", "client-disconnect")
        gateway.spawn(gateway.abort_upstream(rid))

    if target.prefill is not None:
        gateway.spawn(gateway.prefill_half(target.prefill, target.url, route, data, headers, rid))
    try:
        url, direct = f"{target.url}{route}", target.prefill is not None
        upstream = await _post_upstream(gateway, url, data, headers, may_retry=not direct)
    except asyncio.CancelledError:
        left()
        raise
    except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as exc:
        fail("unavailable")
        return error(502, "upstream-unavailable", f"the upstream {target.url} is unreachable: {exc}")
    except TimeoutError:
        fail("timeout")
        return error(504, "upstream-timeout", "the upstream did not answer in time")
    except aiohttp.ClientError as exc:
        fail("connection")
        return error(502, "upstream-error", f"the upstream failed: {type(exc).__name__} {exc}")
    try:
        if upstream.status != 200:
            return await _upstream_refused(gateway, route, upstream, fail)
        if upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
            return await _stream(request, gateway, route, rid, upstream, started, fail, done, left)
        try:
            payload = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            fail("broken-answer")
            return error(502, "upstream-broken", f"the upstream's answer broke off: {type(exc).__name__}")
        try:
            parsed = orjson.loads(payload)
        except orjson.JSONDecodeError:
            fail("garbage")
            return error(502, "upstream-garbage", "the upstream answered 200 with a body that is not JSON")
        done(answer_tokens(parsed), 0)
        metrics.duration.labels(route).observe(time.perf_counter() - started)
        metrics.requests.labels(route, "200").inc()
        return web.Response(body=payload, status=200, content_type="application/json")
    except asyncio.CancelledError:
        left()
        raise
    finally:
        upstream.release()


async def _upstream_refused(
    gateway: Gateway, route: str, upstream: aiohttp.ClientResponse, fail: Callable[[str], None]
) -> web.Response:
    """A non-200 upstream answer: its own JSON error passes through for 4xx; 5xx and garbage become 502."""
    status = upstream.status
    try:
        payload = await upstream.read()
        parsed = orjson.loads(payload)
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        parsed = None
    gateway.metrics.requests.labels(route, str(status if 400 <= status < 500 else 502)).inc()
    if 400 <= status < 500 and isinstance(parsed, dict):
        fail(f"status-{status}")
        return web.Response(
            body=payload,
            status=status,
            content_type="application/json",
            headers={REASON_HEADER: "upstream-rejected"},
        )
    fail(f"status-{status}")
    message = parsed.get("message") if isinstance(parsed, dict) else None
    return error(
        502, "upstream-status", f"the upstream answered {status}" + (f": {message}" if message else "")
    )


async def _stream(
    request: web.Request,
    gateway: Gateway,
    route: str,
    rid: str,
    upstream: aiohttp.ClientResponse,
    started: float,
    fail: Callable[[str], None],
    done: Callable[[tuple[int, int] | None, int], None],
    left: Callable[[], None],
) -> web.StreamResponse:
    """Pass an SSE stream through chunk by chunk; keep its tail for the token counts."""
    metrics = gateway.metrics
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": upstream.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )
    await response.prepare(request)
    tail: deque[bytes] = deque()
    kept = 0
    events = 0
    first = True
    chunks = upstream.content.iter_any().__aiter__()
    broken: str | None = None
    while True:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            break
        except (aiohttp.ClientError, TimeoutError) as exc:
            broken = f"{type(exc).__name__}"
            break
        if first:
            metrics.ttft.labels(route).observe(time.perf_counter() - started)
            first = False
        events += chunk.count(b"data:")
        tail.append(chunk)
        kept += len(chunk)
        while kept - len(tail[0]) >= STREAM_TAIL_BYTES:
            kept -= len(tail.popleft())
        try:
            await response.write(chunk)
        except (ConnectionResetError, aiohttp.ClientConnectionError):
            left()
            return response
    tokens, finished = stream_tokens(tail)
    if broken is None and finished:
        done(tokens, max(events - 2, 0))
        metrics.duration.labels(route).observe(time.perf_counter() - started)
        metrics.requests.labels(route, "200").inc()
        with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionError):
            await response.write_eof()
        return response
    # The upstream broke off mid-stream: say so in the stream, then break the client's connection so
    # no client mistakes a truncated answer for a whole one.
    fail("broken-stream")
    metrics.requests.labels(route, "502").inc()
    message = {
        "object": "error",
        "type": "upstream-broken",
        "reason": "upstream-broken",
        "code": 502,
        "message": f"the upstream stream broke off ({broken or 'closed before [DONE]'})",
    }
    with contextlib.suppress(ConnectionResetError, aiohttp.ClientConnectionError):
        await response.write(b"data: " + orjson.dumps({"error": message}) + b"\n\n")
    if request.transport is not None:
        request.transport.close()
    return response


# ---------------------------------------------------------------------------- the gateway's own routes
async def delete_session(request: web.Request) -> web.Response:
    gateway: Gateway = request.app[GATEWAY_KEY]  # type: ignore[assignment]
    if not _is_admin(request, gateway.settings):
        return error(403, "forbidden", f"ending a session needs the admin token in {ADMIN_HEADER}")
    sid = request.match_info["sid"]
    if not await gateway.coordinator.delete(sid):
        return error(404, "unknown-session", f"no session {sid!r} is known to the gateway")
    return web.json_response({"session": sid, "ended": True})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _healthy(gateway: Gateway, server: str) -> bool:
    assert gateway.http is not None
    try:
        async with gateway.http.get(f"{server}/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def ready(request: web.Request) -> web.Response:
    """Ready when the upstream (every engine, when addressed directly) answers its /health (checked at
    most once a second)."""
    gateway: Gateway = request.app[GATEWAY_KEY]  # type: ignore[assignment]
    if time.monotonic() - gateway.ready_checked > 1.0:
        gateway.ready_checked = time.monotonic()
        servers = gateway.upstreams.engines()
        healthy = await asyncio.gather(*(_healthy(gateway, s) for s in servers))
        gateway.upstream_ok = gateway.upstreams.pick("") is not None and all(healthy)
    state = {"upstream": gateway.upstream_ok, **gateway.coordinator.describe()}
    if not gateway.upstream_ok:
        return error(503, "upstream-unavailable", f"the upstream is not healthy: {state}")
    return web.json_response({"status": "ready", **state})


async def metrics_route(request: web.Request) -> web.Response:
    gateway: Gateway = request.app[GATEWAY_KEY]  # type: ignore[assignment]
    return web.Response(
        body=generate_latest(gateway.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


async def passthrough_get(request: web.Request) -> web.StreamResponse:
    """Read-only upstream routes clients use (`/v1/models`, `/get_server_info`), passed through."""
    gateway: Gateway = request.app[GATEWAY_KEY]  # type: ignore[assignment]
    assert gateway.http is not None
    target = gateway.upstreams.pick("")
    if target is None:
        return error(
            503,
            "no-engines",
            f"no Ready prefill and decode engine is known yet: calls go {gateway.upstreams.describe()}",
        )
    try:
        async with gateway.http.get(
            f"{target.url}{request.path}",
            timeout=aiohttp.ClientTimeout(total=10),
            headers=forward_headers(request.headers, "X-Basin-None", ""),
        ) as r:
            payload = await r.read()
            return web.Response(body=payload, status=r.status, content_type=r.content_type)
    except (aiohttp.ClientError, TimeoutError) as exc:
        return error(502, "upstream-unavailable", f"the upstream is unreachable: {type(exc).__name__}")


def create_app(gateway: Gateway) -> web.Application:
    settings = gateway.settings
    app = web.Application(middlewares=[guard], client_max_size=settings.max_body_bytes)
    app[GATEWAY_KEY] = gateway
    for route in ROUTES:
        app.router.add_post(route, proxy)
    app.router.add_delete("/v1/sessions/{sid}", delete_session)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics_route)
    app.router.add_get("/v1/models", passthrough_get)
    app.router.add_get("/get_server_info", passthrough_get)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60)
        gateway.http = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        fresh = aiohttp.TCPConnector(limit=0, ttl_dns_cache=60, force_close=True)
        gateway.fresh_http = aiohttp.ClientSession(connector=fresh, auto_decompress=False)
        await gateway.coordinator.start(gateway.http)
        if gateway.upstreams.direct and not settings.decode:  # the engine pods, by the operator's selectors
            pods = EnginePods(
                gateway.upstreams,
                *(
                    PodEngines(
                        settings.namespace or "default",
                        (selector,),
                        settings.engine_port,
                        settings.kubeconfig,
                    )
                    for selector in (settings.prefill_selector, settings.decode_selector)
                ),
                settings.bootstrap_port,
            )
            gateway.spawn(pods.run())
        yield
        await gateway.coordinator.stop()
        for task in list(gateway.tasks):
            task.cancel()
        await asyncio.gather(*gateway.tasks, return_exceptions=True)
        await gateway.http.close()
        await gateway.fresh_http.close()

    app.cleanup_ctx.append(lifecycle)
    return app
