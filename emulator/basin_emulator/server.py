"""The HTTP face of the emulator: SGLang's native and OpenAI-compatible routes on an aiohttp app.

A client sees one SGLang PD deployment behind its router. Bad input gets SGLang's answers (400 with a
JSON error body; unknown routes 404), requests honor `priority` (lower values first, as SGLang with
`--enable-priority-scheduling --schedule-low-priority-values-first`), and a client that disconnects
aborts its request so the model frees its memory, as SGLang does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from basin import __version__, tokens
from basin.looplag import LoopLagProbe
from basin.sim.deployments import PAGE_TOKENS, Deployment
from basin_emulator.engine import LiveCall, LiveEngine
from basin_emulator.metrics import EngineCollector

log = logging.getLogger("basin.emulator")

SESSION_HEADER = "X-Session-ID"
STREAM_TICK_S = 0.05  # wall seconds between streamed chunks (the last one goes out at once)
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default for /generate
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_BODY_BYTES = 64 * 1024 * 1024  # aiohttp's client_max_size, enforced here since bodies are read by chunk
# Bodies above this are parsed and tokenized in a worker thread: a 20 MB prompt takes seconds to split
# into words, and on the event loop that would stall every other client's stream for as long.
LARGE_BODY_BYTES = 256 * 1024
READ_TIMEOUT_ENV = "BASIN_EMULATE_READ_TIMEOUT_S"
DEFAULT_READ_TIMEOUT_S = 30.0
HEALTH_TIMEOUT_S = 20.0  # wall seconds /health_generate waits for its one-token generation


@dataclass(frozen=True)
class EmulatorSettings:
    deployment: Deployment
    time_scale: float = 1.0
    lending: bool = False
    model_name: str = "basin-emulated"
    context_length: int = 262_144
    # A client that sends no body bytes for this long gets 408 and its connection closed (a stalled
    # upload must not hold a handler, and its memory, forever). The environment variable sets it for
    # `basin emulate` (tests use a short one).
    read_timeout_s: float = field(
        default_factory=lambda: float(os.environ.get(READ_TIMEOUT_ENV, DEFAULT_READ_TIMEOUT_S))
    )


ENGINE_KEY = web.AppKey("engine", LiveEngine)
SETTINGS_KEY = web.AppKey("settings", EmulatorSettings)
REGISTRY_KEY = web.AppKey("registry", CollectorRegistry)
LOOP_LAG_KEY = web.AppKey("loop_lag", LoopLagProbe)


class BadRequest(Exception):
    """Input SGLang would reject with 400."""


class ReadTimeout(Exception):
    """The client stopped sending its body: answered 408 and the connection closed."""


@dataclass(frozen=True)
class Job:
    """A parsed generation request, whatever route it came from."""

    prompt_ids: list[int]
    max_new_tokens: int
    stream: bool
    rid: str
    priority: float | None
    session_id: str | None
    lend: bool


# ---------------------------------------------------------------------------- parsing
async def _read(request: web.Request) -> bytes:
    """The whole body, read chunk by chunk with a read timeout: `ReadTimeout` when the client sends
    nothing for `read_timeout_s` (aiohttp's own `read()` waits forever for a stalled upload)."""
    timeout = request.app[SETTINGS_KEY].read_timeout_s
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            chunk = await asyncio.wait_for(request.content.readany(), timeout)
        except TimeoutError:
            raise ReadTimeout(f"no body bytes for {timeout:g} s; {size} bytes read") from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_BODY_BYTES, actual_size=size)
        chunks.append(chunk)


def _loads(data: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as error:
        raise BadRequest(f"invalid JSON body: {error}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


async def _body(request: web.Request) -> dict[str, Any]:
    return _loads(await _read(request))


def _int(value: Any, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise BadRequest(f"{name} must be at least {minimum}, got {value}")
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    # Checked at C speed: prompts run to 100K+ ids and the check sits on every request's path.
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise BadRequest(f"{name} must be a list of token ids (one request; batches are not supported)")
    if value and min(value) < 0:
        raise BadRequest(f"{name} holds a negative token id")
    return value


def _priority(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"priority must be a number, got {value!r}")
    return float(value)


def _job(request: web.Request, body: dict[str, Any], prompt_ids: list[int], max_new_tokens: int) -> Job:
    settings: EmulatorSettings = request.app[SETTINGS_KEY]
    if not prompt_ids:
        raise BadRequest("the prompt is empty")
    total = len(prompt_ids) + max_new_tokens
    if total > settings.context_length:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {settings.context_length}"
            f" tokens. You requested a total of {total} tokens: {len(prompt_ids)} tokens from the input"
            f" messages and {max_new_tokens} tokens for the completion."
        )
    rid = body.get("rid") or f"emu-{uuid.uuid4().hex}"
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string")
    if rid in request.app[ENGINE_KEY].calls:
        raise BadRequest(f"a request with rid {rid!r} is already running")
    # The gateway's mark, as the engine extension reads it (docs/engine-ext.md): `basin_lend` and
    # `basin_session` in `custom_params` (under `sampling_params` for /generate, top level for OpenAI).
    params = body.get("sampling_params")
    custom = (params if isinstance(params, dict) else body).get("custom_params") or {}
    if not isinstance(custom, dict):
        raise BadRequest("custom_params must be an object")
    session = custom.get("basin_session") or body.get("session_id") or request.headers.get(SESSION_HEADER)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false")
    return Job(
        prompt_ids=prompt_ids,
        max_new_tokens=max_new_tokens,
        stream=stream,
        rid=rid,
        priority=_priority(body.get("priority")),
        session_id=str(session) if session is not None else None,
        lend=custom.get("basin_lend") is True,
    )


def _generate_job(request: web.Request, body: dict[str, Any]) -> Job:
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise BadRequest("give exactly one of text and input_ids")
    if text is not None and not isinstance(text, str):
        raise BadRequest("text must be a string (one request; batches are not supported)")
    prompt = tokens.encode(text) if text is not None else _token_ids(input_ids, "input_ids")
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    max_new = _int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), "max_new_tokens")
    return _job(request, body, prompt, max_new)


def _max_tokens(body: dict[str, Any]) -> int:
    value = body.get("max_completion_tokens", body.get("max_tokens", DEFAULT_MAX_TOKENS))
    return _int(value, "max_tokens")


def _completion_job(request: web.Request, body: dict[str, Any]) -> Job:
    prompt = body.get("prompt")
    if prompt is None:
        raise BadRequest("prompt is required")
    ids = tokens.encode(prompt) if isinstance(prompt, str) else _token_ids(prompt, "prompt")
    return _job(request, body, ids, _max_tokens(body))


def chat_prompt_ids(messages: Any) -> list[int]:
    """The emulator's chat template: each message is its role word followed by its content."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    ids: list[int] = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest("every message needs a role")
        content = message.get("content", "")
        if isinstance(content, list):
            parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            content = " ".join(parts)
        if not isinstance(content, str):
            raise BadRequest("message content must be a string or a list of text parts")
        ids.extend(tokens.encode(message["role"]))
        ids.extend(tokens.encode(content))
    return ids


def _chat_job(request: web.Request, body: dict[str, Any]) -> Job:
    return _job(request, body, chat_prompt_ids(body.get("messages")), _max_tokens(body))


# ---------------------------------------------------------------------------- running a job
async def _wait(event: asyncio.Event, timeout: float | None) -> None:
    """Wait for `event`, at most `timeout` seconds."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


async def _token_stream(engine: LiveEngine, call: LiveCall) -> AsyncIterator[list[int]]:
    """Output ids as the model generates them, in chunks; ends when the request finishes."""
    await call.first_token.wait()
    sent = 0
    while True:
        finished = call.done.is_set()
        count = len(call.output_ids) if finished and not call.aborted else engine.generated(call)
        count = max(count, 1 if call.output_ids and not call.aborted else 0)
        if count > sent:
            yield call.output_ids[sent:count]
            sent = count
        if finished:
            return
        await _wait(call.done, STREAM_TICK_S)


def _finish_reason(call: LiveCall) -> str:
    return "abort" if call.aborted else "length"


Respond = Callable[[LiveCall], Awaitable[web.StreamResponse]]


async def _serve_job(
    request: web.Request, parse: Callable[[dict[str, Any]], tuple[Job, Respond]]
) -> web.StreamResponse:
    """Read a generation request, parse it, run it on the model and answer.

    The model holds its clock (at most `MAX_HOLD_S`) only while a read body is parsed on the loop, so the
    emulator's own parsing does not count as engine latency; it never waits for an upload in progress
    (a stalled client would hold every other request back). Large bodies are parsed in a worker thread,
    without a hold: their tokenizing would otherwise block the loop, and a held clock, for seconds.
    """
    engine = request.app[ENGINE_KEY]
    data = await _read(request)
    arrival: int | None = None
    if len(data) > LARGE_BODY_BYTES:
        job, respond = await asyncio.to_thread(lambda: parse(_loads(data)))
    else:
        arrival = engine.hold()
    try:
        if arrival is not None:
            job, respond = parse(_loads(data))
        call = engine.submit(
            job.rid,
            job.prompt_ids,
            job.max_new_tokens,
            job.session_id,
            job.priority,
            job.lend,
            arrival,
            streaming=job.stream,
        )
    finally:
        if arrival is not None:
            engine.release(arrival)
    try:
        return await respond(call)
    except asyncio.CancelledError:
        engine.abort(call.rid)  # the client went away: free what the request holds
        raise
    except ConnectionResetError:
        engine.abort(call.rid)
        return web.Response(status=499)  # nobody reads it; keeps a vanished client out of the error log
    finally:
        engine.finish(call)


async def _sse(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    return response


async def _send(response: web.StreamResponse, payload: dict[str, Any] | str) -> None:
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    await response.write(b"data: " + data + b"\n\n")


def _meta(engine: LiveEngine, call: LiveCall, completion_tokens: int, final: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": call.rid,
        "prompt_tokens": len(call.prompt_ids),
        "completion_tokens": completion_tokens,
        "cached_tokens": call.cached_tokens,
        "finish_reason": None,
    }
    if final:
        if call.aborted:
            meta["finish_reason"] = {"type": "abort", "message": "aborted"}
        else:
            meta["finish_reason"] = {"type": "length", "length": completion_tokens}
        meta["e2e_latency"] = engine.env.now - call.submitted_model_s
    return meta


def _native(
    engine: LiveEngine, call: LiveCall, out: list[int], final: bool, text: str | None = None
) -> dict[str, Any]:
    """One /generate answer (or stream chunk): SGLang streams the whole text so far in every chunk."""
    text = tokens.decode(out) if text is None else text
    return {"text": text, "output_ids": out, "meta_info": _meta(engine, call, len(out), final)}


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang's native `POST /generate`."""
    engine = request.app[ENGINE_KEY]

    def parse(body: dict[str, Any]) -> tuple[Job, Respond]:
        job = _generate_job(request, body)

        async def respond(call: LiveCall) -> web.StreamResponse:
            if not job.stream:
                await call.done.wait()
                return web.json_response(_native(engine, call, [] if call.aborted else call.output_ids, True))
            response = await _sse(request)
            sent: list[int] = []
            text = ""  # grown chunk by chunk: re-spelling the whole output each time is quadratic
            async for chunk in _token_stream(engine, call):
                sent.extend(chunk)
                text = f"{text} {tokens.decode(chunk)}" if text else tokens.decode(chunk)
                await _send(response, _native(engine, call, sent, final=False, text=text))
            await _send(response, _native(engine, call, sent, final=True, text=text))
            await _send(response, "[DONE]")
            await response.write_eof()
            return response

        return job, respond

    return await _serve_job(request, parse)


def _usage(call: LiveCall, completion_tokens: int) -> dict[str, Any]:
    prompt = len(call.prompt_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": call.cached_tokens},
    }


def _openai(chat: bool) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """`POST /v1/chat/completions` (chat) or `POST /v1/completions`, with SSE streaming and usage."""
    kind = "chat.completion" if chat else "text_completion"
    chunk_kind = f"{kind}.chunk" if chat else kind

    def choice(text: str, reason: str | None, delta: bool, first: bool = False) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if not delta:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        content = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": 0, "delta": content, "finish_reason": reason}

    async def handler(request: web.Request) -> web.StreamResponse:
        engine = request.app[ENGINE_KEY]
        model = request.app[SETTINGS_KEY].model_name
        created = int(time.time())

        def parse(body: dict[str, Any]) -> tuple[Job, Respond]:
            job = _chat_job(request, body) if chat else _completion_job(request, body)
            options = body.get("stream_options") or {}
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))

            async def respond(call: LiveCall) -> web.StreamResponse:
                head = {"id": call.rid, "created": created, "model": model}
                if not job.stream:
                    await call.done.wait()
                    out = [] if call.aborted else call.output_ids
                    answer = choice(tokens.decode(out), _finish_reason(call), False)
                    return web.json_response(
                        {**head, "object": kind, "choices": [answer], "usage": _usage(call, len(out))}
                    )
                response = await _sse(request)
                count = 0
                async for chunk in _token_stream(engine, call):
                    text = tokens.decode(chunk) if count == 0 else " " + tokens.decode(chunk)
                    delta = choice(text, None, True, first=count == 0)
                    count += len(chunk)
                    await _send(response, {**head, "object": chunk_kind, "choices": [delta]})
                final = choice("", _finish_reason(call), True)
                await _send(response, {**head, "object": chunk_kind, "choices": [final]})
                if include_usage:
                    usage = _usage(call, count)
                    await _send(response, {**head, "object": chunk_kind, "choices": [], "usage": usage})
                await _send(response, "[DONE]")
                await response.write_eof()
                return response

            return job, respond

        return await _serve_job(request, parse)

    return handler


# ---------------------------------------------------------------------------- control and telemetry
async def health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def health_generate(request: web.Request) -> web.Response:
    """SGLang's `GET /health_generate` (what its own probes call): 200 once a one-token generation
    went through the model, 503 when it does not finish within `HEALTH_TIMEOUT_S` wall seconds."""
    engine = request.app[ENGINE_KEY]
    rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
    call = engine.submit(rid, [0], 1, None, None, False)
    try:
        await asyncio.wait_for(call.done.wait(), HEALTH_TIMEOUT_S)
    except TimeoutError:
        engine.abort(rid)
        return web.Response(status=503, text="the model did not generate within the health timeout\n")
    finally:
        engine.finish(call)
    return web.Response(status=200)


async def server_info(request: web.Request) -> web.Response:
    settings: EmulatorSettings = request.app[SETTINGS_KEY]
    deployment = settings.deployment
    return web.json_response(
        {
            "emulator": True,
            "note": "basin emulate: an SGLang-compatible emulator driven by Basin's calibrated engine model;"
            " no GPU and no model run here.",
            "version": f"basin-emulator {__version__}",
            "model_path": settings.model_name,
            "served_model_name": settings.model_name,
            "deployment": deployment.name,
            "gpu": deployment.gpu.name,
            "disaggregation_mode": "prefill-decode behind a router",
            "prefill_instances": deployment.prefill_instances,
            "decode_instances": deployment.decode_instances,
            "page_size": PAGE_TOKENS,
            "context_length": settings.context_length,
            "prefill_cache_tokens": deployment.gpu.prefill_cache_tokens,
            "host_cache_tokens": int(deployment.gpu.prefill_cache_tokens * deployment.host_tier),
            "decode_kv_tokens": deployment.gpu.decode_kv_tokens,
            "hicache_write_policy": "write_through" if deployment.write_through else "write_back",
            "disaggregation_decode_allocation_policy": deployment.allocation,
            "router_policy": deployment.router,
            "enable_priority_scheduling": True,
            "schedule_low_priority_values_first": True,
            "lending": settings.lending,
            "time_scale": settings.time_scale,
            # The emulator's own CPU work delays every answer by about this much (wall seconds, last
            # ten minutes); at time scale S that is S times more in model time.
            "loop_lag_mean_s": request.app[LOOP_LAG_KEY].mean(),
            "loop_lag_p90_s": request.app[LOOP_LAG_KEY].quantile(0.9),
        }
    )


async def models(request: web.Request) -> web.Response:
    name = request.app[SETTINGS_KEY].model_name
    return web.json_response(
        {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "basin"}]}
    )


async def loads(request: web.Request) -> web.Response:
    """SGLang's `GET /v1/loads`: one load record per engine instance (prefill and decode)."""
    engine = request.app[ENGINE_KEY]
    return web.json_response(
        {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "version": f"basin-emulator {__version__}",
            "loads": engine.snapshot(),
        }
    )


async def flush_cache(request: web.Request) -> web.Response:
    pages = request.app[ENGINE_KEY].flush_cache()
    return web.Response(text=f"Cache flushed: {pages * PAGE_TOKENS} tokens dropped.\n")


async def abort_request(request: web.Request) -> web.Response:
    body = await _body(request)
    rid = body.get("rid")
    engine = request.app[ENGINE_KEY]
    if body.get("abort_all"):
        aborted = [r for r in list(engine.calls) if engine.abort(r)]
        return web.json_response({"aborted": aborted})
    if not isinstance(rid, str):
        raise BadRequest("rid (a string) or abort_all is required")
    return web.json_response({"aborted": [rid] if engine.abort(rid) else []})


async def metrics(request: web.Request) -> web.Response:
    registry: CollectorRegistry = request.app[REGISTRY_KEY]
    body = generate_latest(registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---------------------------------------------------------------------------- the app
def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(
        {"object": "error", "message": message, "type": kind, "param": None, "code": status}, status=status
    )


@web.middleware
async def errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> Any:
    """SGLang-style JSON error bodies for bad input and unknown routes."""
    try:
        return await handler(request)
    except BadRequest as error:
        return _error(400, str(error), "BadRequestError")
    except ReadTimeout as error:
        response = _error(408, str(error), "RequestTimeoutError")
        response.force_close()  # the rest of the body may never come: do not linger reading it
        return response
    except web.HTTPException as error:
        if error.status >= 400:
            return _error(error.status, error.reason, type(error).__name__)
        raise


def create_app(settings: EmulatorSettings) -> web.Application:
    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
    engine = LiveEngine(settings.deployment, settings.time_scale, settings.lending)
    app[SETTINGS_KEY] = settings
    app[ENGINE_KEY] = engine
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine, settings.model_name))
    app[REGISTRY_KEY] = registry
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", _openai(chat=False))
    app.router.add_post("/v1/chat/completions", _openai(chat=True))
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_server_info", server_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/metrics", metrics)

    app[LOOP_LAG_KEY] = LoopLagProbe()

    async def clock(app: web.Application) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(engine.run_clock()), asyncio.create_task(app[LOOP_LAG_KEY].run())]
        yield
        for task in tasks:
            task.cancel()

    app.cleanup_ctx.append(clock)
    return app


async def serve(settings: EmulatorSettings, host: str, port: int, ready: Callable[[int], None]) -> None:
    """Run the emulator until SIGTERM/SIGINT or cancellation; `ready` gets the bound port (useful with port
    0). On SIGTERM it stops accepting and finishes the calls in flight (up to a minute) before it exits, as
    SGLang's server does: a Pod replaced by a rollout (a scaled emulated deployment) loses no call. In a
    container the process is PID 1, which ignores a SIGTERM it has no handler for."""
    runner = web.AppRunner(create_app(settings), handler_cancellation=True, access_log=None)
    await runner.setup()
    # SGLang's server (uvicorn) listens with a backlog of 2048; aiohttp's 128 drops the connections of a
    # burst (a gateway opening hundreds at once) while the event loop is busy, and they time out.
    site = web.TCPSite(runner, host, port, backlog=2048)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    ready(bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        log.info("stopping: finishing the calls in flight")
    finally:
        await runner.cleanup()
