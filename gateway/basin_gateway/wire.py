"""Pure helpers on request and answer bodies: session ids, what a first call shows, the upstream rewrite,
token counts from an answer. No I/O here (unit-tested in tests/unit/test_gateway_wire.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson

# The engine extension's keys (engine_ext/basin_engine_ext/config.py): the gateway's mark on a call.
SESSION_KEY = "basin_session"
LEND_KEY = "basin_lend"
PRIORITY_SCALE = 10  # a policy key in seconds becomes an integer priority in tenths of a second
INT32 = (-(2**31), 2**31 - 1)  # sglang-router types `priority` as i32
ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")


class BadInput(Exception):
    """The request cannot be handled as sent (400, with this message)."""


@dataclass(frozen=True)
class CallShape:
    """What the gateway reads from a call: the task text (first user message or `text`) and a prompt
    length estimate (ids counted exactly; text as whitespace words, as `basin.tokens` does)."""

    task: str
    prompt_tokens: int
    stream: bool


FAST_PATH_BYTES = 16 * 1024  # bodies above this have their token-id list set aside, not parsed


@dataclass
class Body:
    """A parsed request body. A long flat token-id list (`input_ids`, or `prompt` for /v1/completions)
    is kept as its raw JSON bytes and counted, not parsed: on a 40K-token prompt that saves the
    gateway most of its per-request CPU (the engine parses and checks the ids itself)."""

    fields: dict[str, Any]
    ids_key: str | None = None
    ids_raw: bytes = b""
    ids_count: int = 0

    def encode(self) -> bytes:
        out = orjson.dumps(self.fields)
        if self.ids_key is None:
            return out
        head = b'{"' + self.ids_key.encode() + b'":' + self.ids_raw
        return head + (b"}" if out == b"{}" else b"," + out[1:])


def _split_ids(raw: bytes, key: str) -> tuple[bytes, bytes, int] | None:
    """(the body with the id list emptied, the list's raw bytes, its length), or None to parse it all."""
    start = raw.find(b'"' + key.encode() + b'"')
    if start < 0:
        return None
    open_at = raw.find(b"[", start)
    if open_at < 0 or raw[start + len(key) + 2 : open_at].strip() not in (b":",):
        return None
    close_at = raw.find(b"]", open_at)
    if close_at < 0:
        return None
    ids = raw[open_at : close_at + 1]
    if b"[" in ids[1:] or b'"' in ids or b"{" in ids:
        return None  # nested (a batch) or not numbers: the full parse decides
    inner = ids[1:-1].strip()
    count = inner.count(b",") + 1 if inner else 0
    return raw[:open_at] + b"[]" + raw[close_at + 1 :], ids, count


def parse_body(raw: bytes, route: str = "") -> Body:
    key = {"/generate": "input_ids", "/v1/completions": "prompt"}.get(route)
    if key is not None and len(raw) > FAST_PATH_BYTES:
        split = _split_ids(raw, key)
        if split is not None:
            skeleton, ids, count = split
            try:
                fields = orjson.loads(skeleton)
            except orjson.JSONDecodeError as exc:
                raise BadInput(f"invalid JSON body: {exc}") from None
            if isinstance(fields, dict) and fields.get(key) == []:
                del fields[key]
                return Body(fields, key, ids, count)
    try:
        fields = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadInput(f"invalid JSON body: {exc}") from None
    if not isinstance(fields, dict):
        raise BadInput("the request body must be a JSON object")
    return Body(fields)


def _words(text: str) -> int:
    return len(text.split())


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise BadInput("message content parts must be objects")
            if part.get("type") == "text":
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise BadInput("a text part's text must be a string")
                parts.append(text)
        return " ".join(parts)
    raise BadInput("message content must be a string or a list of parts")


def call_shape(route: str, parsed: Body | Mapping[str, Any]) -> CallShape:
    """Validate what the gateway relies on and measure the call; the engine validates the rest."""
    body = parsed.fields if isinstance(parsed, Body) else parsed
    set_aside = parsed.ids_count if isinstance(parsed, Body) and parsed.ids_key else None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadInput("stream must be true or false")
    if route == "/generate":
        text, ids = body.get("text"), [] if set_aside is not None else body.get("input_ids")
        if (text is None) == (ids is None):
            raise BadInput("give exactly one of text and input_ids")
        params = body.get("sampling_params")
        if params is not None and not isinstance(params, dict):
            raise BadInput("sampling_params must be an object")
        if params is not None and not isinstance(params.get("custom_params", {}), dict | None):
            raise BadInput("sampling_params.custom_params must be an object")
        if text is not None:
            if not isinstance(text, str):
                raise BadInput("text must be a string (the gateway takes one request, not a batch)")
            return CallShape(text, _words(text), stream)
        if not isinstance(ids, list) or (ids and isinstance(ids[0], list)):
            raise BadInput("input_ids must be a list of token ids (one request, not a batch)")
        return CallShape("", set_aside if set_aside is not None else len(ids), stream)
    if not isinstance(body.get("custom_params", {}), dict | None):
        raise BadInput("custom_params must be an object")
    if route == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadInput("messages must be a non-empty list")
        task, tokens = None, 0
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise BadInput("every message must be an object with a role")
            text = _content_text(message.get("content"))
            tokens += 1 + _words(text)
            if task is None and message["role"] == "user":
                task = text
        return CallShape(task or "", tokens, stream)
    if set_aside is not None:
        return CallShape("", set_aside, stream)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return CallShape(prompt, _words(prompt), stream)
    if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
        return CallShape("", len(prompt), stream)
    raise BadInput("prompt must be a string or a list of token ids (one request, not a batch)")


def session_of(headers: Mapping[str, str], header: str, body: Mapping[str, Any]) -> str | None:
    """The session id: the configured header, else the body's `session_id`, else OpenAI's `user`."""
    value = headers.get(header)
    if value:
        return value
    for field in ("session_id", "user"):
        candidate = body.get(field)
        if candidate is None:
            continue
        if not isinstance(candidate, str) or not candidate:
            raise BadInput(f"{field} must be a non-empty string")
        return candidate
    return None


def wire_priority(key: float) -> int:
    """A policy key (seconds; lower first) as SGLang's integer priority, clamped to the router's i32."""
    return max(INT32[0], min(INT32[1], round(key * PRIORITY_SCALE)))


def rewrite(
    route: str,
    parsed: Body,
    session: str,
    rid: str,
    priority: float | None,
    lend: bool,
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """The upstream body: the client's, plus `rid`, the policy's priority, the engine extension's mark and
    `extra` top-level fields (the PD bootstrap fields when the gateway addresses the engines directly).

    /generate carries `custom_params` inside `sampling_params`; the OpenAI routes at the top level
    (SGLang 0.5.23's ChatCompletionRequest/CompletionRequest copy it into the sampling parameters)."""
    body = parsed.fields
    body["rid"] = rid
    if priority is not None:
        body["priority"] = wire_priority(priority)
    if route == "/generate":
        params = body.get("sampling_params")
        if params is None:
            params = body["sampling_params"] = {}
        holder = params
    else:
        holder = body
    custom = dict(holder.get("custom_params") or {})
    custom[SESSION_KEY] = session
    if lend:
        custom[LEND_KEY] = True
    else:
        custom.pop(LEND_KEY, None)
    holder["custom_params"] = custom
    body.update(extra or {})
    return parsed.encode()


class Tokens(NamedTuple):
    """What an answer says of its tokens; `cached` (the prompt's prefix-cache hit) only where the engine
    reports it (SGLang's meta_info, or usage.prompt_tokens_details with --enable-cache-report)."""

    prompt: int
    completion: int
    cached: int | None = None


def _count(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _tokens_of(chunk: Mapping[str, Any]) -> Tokens | None:
    meta = chunk.get("meta_info")
    if isinstance(meta, dict) and "completion_tokens" in meta:
        return Tokens(
            int(meta.get("prompt_tokens") or 0),
            int(meta.get("completion_tokens") or 0),
            _count(meta.get("cached_tokens")),
        )
    usage = chunk.get("usage")
    if isinstance(usage, dict) and "completion_tokens" in usage:
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else None
        return Tokens(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0), cached)
    return None


def answer_tokens(body: Any) -> Tokens | None:
    """(prompt, completion, cached) tokens from a non-streamed answer, when it says."""
    if isinstance(body, dict):
        return _tokens_of(body)
    if isinstance(body, list) and body and isinstance(body[0], dict):
        return _tokens_of(body[0])
    return None


def stream_tokens(tail: Iterable[bytes]) -> tuple[Tokens | None, bool]:
    """From the last bytes of an SSE stream: the tokens when a chunk says, and whether the stream ended
    with `data: [DONE]`."""
    lines = b"".join(tail).split(b"\n")
    done = False
    found = None
    for line in reversed(lines):
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if isinstance(chunk, dict):
            found = _tokens_of(chunk)
            if found is not None:
                break
    return found, done
