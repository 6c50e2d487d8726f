"""The gateway addressing a prefill and a decode engine directly (`--prefill URL PORT --decode URL`), as
a real process in front of two recording engines: both halves get the same body with the bootstrap
fields, decode's answer is the call's, and a half that fails does not leave the other waiting."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import requests
from aiohttp import web
from gateway_helpers import Process, Stub, free_port, metric, start_gateway, wait_for

pytestmark = pytest.mark.service

ANSWER = {"text": "done", "meta_info": {"prompt_tokens": 5, "completion_tokens": 2}}


class Engine:
    """An engine that records every POST and answers /generate with `status` (healthy unless told)."""

    def __init__(self, status: int = 200, healthy: bool = True) -> None:
        self.status = status
        self.healthy = healthy
        self.calls: list[tuple[str, dict]] = []
        self.stub = Stub(self.handle).serve()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            return web.json_response({}, status=200 if self.healthy else 503)
        body = await request.json()
        self.calls.append((request.path, body))
        if request.path == "/abort_request":
            return web.json_response({})
        await asyncio.sleep(0.05)
        if self.status != 200:
            return web.json_response({"object": "error", "message": "boom"}, status=self.status)
        return web.json_response(ANSWER)

    def generations(self) -> list[dict]:
        return [body for path, body in self.calls if path == "/generate"]

    def aborts(self) -> list[str]:
        return [body["rid"] for path, body in self.calls if path == "/abort_request"]


def gateway_for(prefill: str, decode: str, bootstrap: int = 8998) -> Process:
    return start_gateway(
        "http://127.0.0.1:9",
        "--policy",
        "passthrough",
        "--prefill",
        prefill,
        str(bootstrap),
        "--decode",
        decode,
    )


@pytest.fixture
def pair() -> Iterator[tuple[Engine, Engine, Process]]:
    prefill, decode = Engine(), Engine()
    gateway = gateway_for(prefill.stub.url, decode.stub.url)
    yield prefill, decode, gateway
    gateway.stop()
    assert "Traceback" not in gateway.text()


def call(gateway: Process, session: str) -> requests.Response:
    body = {"text": "fix the bug", "sampling_params": {"max_new_tokens": 2}}
    return requests.post(f"{gateway.url}/generate", json=body, headers={"X-Session-ID": session}, timeout=30)


def test_both_halves_get_the_same_body_with_the_bootstrap_fields(
    pair: tuple[Engine, Engine, Process],
) -> None:
    prefill, decode, gateway = pair
    assert "calls go directly: prefill" in gateway.text()
    assert requests.get(f"{gateway.url}/ready", timeout=10).status_code == 200
    for _ in range(2):
        answer = call(gateway, "s1")
        assert answer.status_code == 200 and answer.json() == ANSWER
    wait_for(lambda: len(prefill.generations()) == 2, "prefill's halves")
    for sent_to_prefill, sent_to_decode in zip(prefill.generations(), decode.generations(), strict=True):
        assert sent_to_prefill == sent_to_decode
        assert sent_to_decode["bootstrap_host"] == "127.0.0.1" and sent_to_decode["bootstrap_port"] == 8998
        assert sent_to_decode["rid"].startswith("basin-")
        assert sent_to_decode["sampling_params"]["custom_params"] == {"basin_session": "s1"}
    rooms = {body["bootstrap_room"] for body in decode.generations()}
    assert len(rooms) == 2  # each call pairs its own halves


def test_a_failed_prefill_half_aborts_the_decode_half() -> None:
    prefill, decode = Engine(status=500), Engine()
    gateway = gateway_for(prefill.stub.url, decode.stub.url)
    try:
        assert call(gateway, "s2").status_code == 200  # decode's answer (on SGLang: its abort)
        rid = decode.generations()[0]["rid"]
        wait_for(lambda: decode.aborts() == [rid], "the abort on decode")
        assert metric(gateway.url, "basin_gateway_upstream_errors_total", 'kind="prefill-status-500"') == 1
    finally:
        gateway.stop()


def test_an_unreachable_decode_fails_the_call_and_aborts_the_prefill_half() -> None:
    prefill = Engine()
    gateway = gateway_for(prefill.stub.url, f"http://127.0.0.1:{free_port()}")
    try:
        answer = call(gateway, "s3")
        assert answer.status_code == 502 and answer.headers["X-Basin-Reason"] == "upstream-unavailable"
        wait_for(lambda: len(prefill.aborts()) == 1, "the abort on prefill")
        assert prefill.aborts() == [prefill.generations()[0]["rid"]]
        assert requests.get(f"{gateway.url}/ready", timeout=10).status_code == 503  # decode is down
    finally:
        gateway.stop()


def test_one_half_without_the_other_is_refused_at_start() -> None:
    with pytest.raises(Exception, match="both --prefill and --decode"):
        start_gateway("http://127.0.0.1:9", "--prefill", "http://127.0.0.1:30000", "8998")
