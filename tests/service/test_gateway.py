"""The gateway as a real process in front of the emulator (or a stub that misbehaves): the client contract,
the bad-input matrix, and that every way a call ends releases its session."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import pytest
import requests
from aiohttp import web
from gateway_helpers import BASIN, Process, Stub, free_port, metric, start_emulator, start_gateway, wait_for

pytestmark = pytest.mark.service
ADMIN = {"X-Basin-Admin-Token": "s3cret"}


@pytest.fixture(scope="module")
def emulator() -> Iterator[Process]:
    emulator = start_emulator("--deployment", "h200-1p1d", "--time-scale", "20")
    yield emulator
    emulator.stop()


@pytest.fixture(scope="module")
def gateway(emulator: Process) -> Iterator[Process]:
    process = start_gateway(
        emulator.url,
        "--deployment",
        "h200-1p1d",
        "--time-scale",
        "20",
        "--admin-token",
        "s3cret",
        "--max-body-bytes",
        "100000",
        "--max-header-bytes",
        "8000",
        "--body-timeout",
        "1",
    )
    yield process
    process.stop()
    assert "Traceback" not in process.text()


def post(url: str, route: str, body: object, **headers: str) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{url}{route}", data=data, headers=headers, timeout=30)


def assert_error(response: requests.Response, status: int, reason: str) -> None:
    """A non-2xx answer from the gateway: JSON with the reason in a header and in the body."""
    assert response.status_code == status, response.text
    assert response.headers["X-Basin-Reason"] == reason
    body = response.json()
    assert body["reason"] == reason and body["code"] == status and body["message"]


def test_calls_pass_through_with_the_session_and_release_on_the_final_call(gateway: Process) -> None:
    first = post(
        gateway.url,
        "/generate",
        {"text": "fix the build", "sampling_params": {"max_new_tokens": 4}},
        **{"X-Session-ID": "s1"},
    )
    assert first.status_code == 200 and first.json()["meta_info"]["completion_tokens"] == 4
    assert metric(gateway.url, "basin_gateway_sessions_active") >= 1
    chat = {
        "messages": [{"role": "user", "content": "fix the build"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    streamed = post(
        gateway.url, "/v1/chat/completions", chat, **{"X-Session-ID": "s1", "X-Session-Final": "1"}
    )
    lines = [line for line in streamed.text.splitlines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and '"usage"' in lines[-2]
    ended = 'basin_gateway_sessions_ended{outcome="completed",reason="final-call"}'
    assert metric(gateway.url, ended.split("{")[0], ended.split("{")[1][:-1]) >= 1
    # Without an id a call is a session of its own, ended by its answer; OpenAI's `user` names one too.
    assert post(gateway.url, "/v1/completions", {"prompt": "hello", "max_tokens": 2}).status_code == 200
    assert (
        post(gateway.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "user": "u1"}).status_code
        == 200
    )
    assert requests.delete(f"{gateway.url}/v1/sessions/u1", headers=ADMIN, timeout=10).json()["ended"] is True


@pytest.mark.parametrize(
    ("route", "body", "reason"),
    [
        ("/generate", b"{not json", "bad-request"),
        ("/generate", b"[1, 2]", "bad-request"),
        ("/generate", {"text": 5}, "bad-request"),
        ("/generate", {"input_ids": "1 2 3"}, "bad-request"),
        ("/generate", {"text": "a", "stream": "yes"}, "bad-request"),
        ("/v1/chat/completions", {"messages": "hi"}, "bad-request"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "session_id": 7},
            "bad-request",
        ),
        ("/v1/completions", {"prompt": {"a": 1}}, "bad-request"),
    ],
)
def test_malformed_and_mistyped_bodies_get_400(
    gateway: Process, route: str, body: object, reason: str
) -> None:
    headers = {} if isinstance(body, dict) and "session_id" in body else {"X-Session-ID": "bad"}
    assert_error(post(gateway.url, route, body, **headers), 400, reason)


def test_the_engine_s_own_400_passes_through_and_releases_the_session(gateway: Process) -> None:
    before = metric(gateway.url, "basin_gateway_sessions_active")
    answer = post(gateway.url, "/generate", {"input_ids": [1, -2]}, **{"X-Session-ID": "neg"})
    assert answer.status_code == 400 and answer.headers["X-Basin-Reason"] == "upstream-rejected"
    assert answer.json()["type"] == "BadRequestError"  # SGLang's (the emulator's) body, unchanged
    assert metric(gateway.url, "basin_gateway_sessions_active") == before


def test_limits_on_bodies_and_headers(gateway: Process) -> None:
    assert_error(post(gateway.url, "/generate", {"input_ids": [1] * 60_000}), 413, "body-too-large")
    assert_error(
        post(gateway.url, "/generate", {"text": "a"}, **{"X-Big": "x" * 9000}), 431, "headers-too-large"
    )
    assert_error(requests.get(f"{gateway.url}/nowhere", timeout=10), 404, "not-found")


def test_a_stalled_upload_times_out_alone(gateway: Process) -> None:
    """One client stops mid-body; another is served meanwhile; the staller gets 408 in JSON."""
    with socket.create_connection(("127.0.0.1", gateway.port)) as stalled:
        stalled.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"text": "wait'
        )
        served = post(gateway.url, "/generate", {"text": "quick", "sampling_params": {"max_new_tokens": 1}})
        assert served.status_code == 200
        stalled.settimeout(30)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = stalled.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"X-Basin-Reason: body-timeout" in head
    assert json.loads(body)["reason"] == "body-timeout"


def test_deleting_sessions_needs_the_admin_token_and_a_known_session(gateway: Process) -> None:
    assert_error(requests.delete(f"{gateway.url}/v1/sessions/nobody", timeout=10), 403, "forbidden")
    assert_error(
        requests.delete(f"{gateway.url}/v1/sessions/nobody", headers=ADMIN, timeout=10),
        404,
        "unknown-session",
    )
    assert (
        post(
            gateway.url,
            "/generate",
            {"text": "x", "sampling_params": {"max_new_tokens": 1}},
            **{"X-Session-ID": "del"},
        ).status_code
        == 200
    )
    assert requests.delete(f"{gateway.url}/v1/sessions/del", headers=ADMIN, timeout=10).status_code == 200
    assert_error(
        requests.delete(f"{gateway.url}/v1/sessions/del", headers=ADMIN, timeout=10), 404, "unknown-session"
    )


def test_a_client_that_leaves_mid_stream_aborts_the_engine_request(
    gateway: Process, emulator: Process
) -> None:
    body = {"text": "long answer", "sampling_params": {"max_new_tokens": 20_000}, "stream": True}
    with requests.post(
        f"{gateway.url}/generate", json=body, headers={"X-Session-ID": "gone"}, stream=True, timeout=30
    ) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first chunk arrived; now hang up
    wait_for(lambda: metric(gateway.url, "basin_gateway_upstream_aborts_total") >= 1, "the upstream abort")
    ended = ("basin_gateway_sessions_ended", 'outcome="ended",reason="client-disconnect"')
    wait_for(lambda: metric(gateway.url, *ended) >= 1, "the session's release")
    engine = requests.get(f"{emulator.url}/metrics", timeout=10).text
    aborted = sum(
        float(line.rsplit(" ", 1)[1])
        for line in engine.splitlines()
        if line.startswith("sglang:num_aborted_requests_total")
    )
    assert aborted >= 1


def test_health_readiness_and_metrics(gateway: Process) -> None:
    assert requests.get(f"{gateway.url}/health", timeout=10).json()["status"] == "ok"
    ready = requests.get(f"{gateway.url}/ready", timeout=10).json()
    assert ready["status"] == "ready" and ready["mode"] == "memory" and ready["policy"] == "basin"
    text = requests.get(f"{gateway.url}/metrics", timeout=10).text
    for name in (
        "sessions_active",
        "sessions_parked",
        "working_set_tokens",
        "b0_tokens",
        "budget_tokens",
        "cliff_tokens",
        "admission_active",
        "ordering_active",
        "lending_active",
        "telemetry_hit_rate",
        "telemetry_prefill_backlog_tokens",
        "telemetry_decode_waiting_requests",
        "telemetry_stale",
        "first_call_wait_seconds_bucket",
        "request_duration_seconds_bucket",
        "ttft_seconds_bucket",
        "leader",
        "profile_info",
    ):
        assert f"basin_gateway_{name}" in text, name
    wait_for(lambda: metric(gateway.url, "basin_gateway_telemetry_stale") == 0, "fresh telemetry")


# ---------------------------------------------------------------------------- a failing upstream
def test_upstream_down_is_a_502_and_the_session_is_released() -> None:
    gateway = start_gateway(f"http://127.0.0.1:{free_port()}", "--policy", "passthrough")
    try:
        answer = post(gateway.url, "/generate", {"text": "x"}, **{"X-Session-ID": "s"})
        assert_error(answer, 502, "upstream-unavailable")
        assert metric(gateway.url, "basin_gateway_sessions_active") == 0
        assert metric(gateway.url, "basin_gateway_upstream_errors_total", 'kind="unavailable"') == 1
        assert_error(requests.get(f"{gateway.url}/ready", timeout=10), 503, "upstream-unavailable")
        wait_for(lambda: metric(gateway.url, "basin_gateway_telemetry_stale") == 1, "stale telemetry")
        assert "telemetry unavailable" in gateway.text()  # said in the log, never a crash
    finally:
        gateway.stop()
    assert "Traceback" not in gateway.text()


async def _garbage(request: web.Request) -> web.StreamResponse:
    if request.path == "/v1/completions":
        return web.Response(text="<html>surprise</html>", content_type="application/json")
    if request.path == "/v1/chat/completions":
        return web.Response(status=500, text="internal kaboom")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"text": "partial", "meta_info": {"completion_tokens": 1}}\n\n')
    assert request.transport is not None
    request.transport.close()  # the engine dies mid-stream
    return response


@pytest.fixture(scope="module")
def broken_gateway() -> Iterator[Process]:
    stub = Stub(_garbage).serve()
    gateway = start_gateway(stub.url, "--policy", "passthrough")
    yield gateway
    gateway.stop()
    assert "Traceback" not in gateway.text()


def test_garbage_and_errors_from_the_upstream_become_502(broken_gateway: Process) -> None:
    url = broken_gateway.url
    assert_error(
        post(url, "/v1/completions", {"prompt": "x"}, **{"X-Session-ID": "g1"}), 502, "upstream-garbage"
    )
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert_error(post(url, "/v1/chat/completions", chat, **{"X-Session-ID": "g2"}), 502, "upstream-status")
    assert metric(url, "basin_gateway_sessions_active") == 0


def test_a_stream_that_breaks_off_is_broken_for_the_client_too(broken_gateway: Process) -> None:
    """The client sees the partial answer, an error event, then a broken connection: never a clean end."""
    received = b""
    with (
        pytest.raises(requests.exceptions.ChunkedEncodingError),
        requests.post(
            f"{broken_gateway.url}/generate",
            json={"text": "x", "stream": True},
            headers={"X-Session-ID": "g3"},
            stream=True,
            timeout=30,
        ) as response,
    ):
        for chunk in response.iter_content(None):
            received += chunk
    assert b"partial" in received and b'"upstream-broken"' in received and b"[DONE]" not in received
    wait_for(lambda: metric(broken_gateway.url, "basin_gateway_sessions_active") == 0, "the release")
    assert metric(broken_gateway.url, "basin_gateway_upstream_errors_total", 'kind="broken-stream"') == 1


def test_a_connection_the_upstream_resets_as_the_call_goes_out_is_retried_once() -> None:
    """A Pod shutting down closes its idle keep-alive connections; a call sent on one at that moment is sent
    again on a new connection (counted), once: an upstream that keeps resetting is a 502."""
    calls = {"/generate": 0, "/v1/completions": 0}

    async def resets(request: web.Request) -> web.StreamResponse:
        calls[request.path] += 1
        if request.path == "/v1/completions" or calls[request.path] % 2 == 1:
            assert request.transport is not None
            request.transport.abort()  # closed with no answer, as a stopping server closes an idle one
            return web.Response()
        return web.json_response({"text": "ok", "meta_info": {"prompt_tokens": 1, "completion_tokens": 1}})

    stub = Stub(resets).serve()
    gateway = start_gateway(stub.url, "--policy", "passthrough")
    try:
        answer = post(gateway.url, "/generate", {"text": "x"}, **{"X-Session-ID": "r1"})
        assert answer.status_code == 200 and answer.json()["text"] == "ok", answer.text
        assert calls["/generate"] == 2
        assert metric(gateway.url, "basin_gateway_upstream_retries_total") == 1
        failed = post(gateway.url, "/v1/completions", {"prompt": "x"}, **{"X-Session-ID": "r2"})
        assert_error(failed, 502, "upstream-unavailable")
        assert calls["/v1/completions"] == 2  # once more, not again and again
    finally:
        gateway.stop()
    assert "Traceback" not in gateway.text()


def test_the_retry_opens_its_own_connection_when_every_pooled_one_is_stale() -> None:
    """An upstream Pod replaced under load (the router during a scale) leaves the gateway's pool holding
    several connections to the stopped server; the retry must not draw another of them. Here the stub
    serves three calls at once (three pooled connections), then "restarts": a call arriving on any
    connection it had before is cut with no answer, as the stopped server's are."""
    import concurrent.futures
    import threading

    seen: set[int] = set()
    restarted = threading.Event()
    all_in = threading.Barrier(3)

    async def serve(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        connection = id(request.transport)
        if restarted.is_set() and connection in seen:
            request.transport.abort()
            return web.Response()
        seen.add(connection)
        if not restarted.is_set() and request.path == "/generate":
            await asyncio.get_running_loop().run_in_executor(None, all_in.wait, 10)
        return web.json_response({"text": "ok", "meta_info": {"prompt_tokens": 1, "completion_tokens": 1}})

    stub = Stub(serve).serve()
    gateway = start_gateway(stub.url, "--policy", "passthrough")
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            warm = list(
                pool.map(
                    lambda i: post(gateway.url, "/generate", {"text": "x"}, **{"X-Session-ID": f"w{i}"}),
                    range(3),
                )
            )
        assert [r.status_code for r in warm] == [200, 200, 200]
        assert len(seen) >= 3  # three keep-alive connections (at least) now sit in the gateway's pool
        restarted.set()
        answer = post(gateway.url, "/generate", {"text": "x"}, **{"X-Session-ID": "after"})
        assert answer.status_code == 200 and answer.json()["text"] == "ok", answer.text
        assert metric(gateway.url, "basin_gateway_upstream_retries_total") == 1
    finally:
        gateway.stop()
    assert "Traceback" not in gateway.text()


def test_policies_needing_engine_features_are_refused_at_start() -> None:
    import subprocess

    result = subprocess.run(
        [BASIN, "gateway", "run", "--policy", "continuum", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "cannot run live" in result.stderr and "TTL" in result.stderr


def test_own_api_keys_and_a_separate_metrics_port(emulator: Process, tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text("key-one\nkey-two\n")
    metrics_port = free_port()
    gateway = start_gateway(
        emulator.url,
        "--policy",
        "passthrough",
        "--metrics-port",
        str(metrics_port),
        env={"BASIN_API_KEYS_FILE": str(keys)},
    )
    try:
        body = {"text": "x", "sampling_params": {"max_new_tokens": 1}}
        assert_error(requests.post(f"{gateway.url}/generate", json=body, timeout=30), 401, "unauthorized")
        wrong = {"Authorization": "Bearer nope"}
        assert_error(
            requests.post(f"{gateway.url}/generate", json=body, headers=wrong, timeout=30),
            401,
            "unauthorized",
        )
        ok = requests.post(
            f"{gateway.url}/generate", json=body, headers={"Authorization": "Bearer key-two"}, timeout=30
        )
        assert ok.status_code == 200  # and the header went on to SGLang, which may check its own --api-key
        assert requests.get(f"http://127.0.0.1:{metrics_port}/health", timeout=10).status_code == 200
        assert metric(f"http://127.0.0.1:{metrics_port}", "basin_gateway_sessions_active") == 0
    finally:
        gateway.stop()


def test_what_reaches_the_engine() -> None:
    """The client's Authorization and body go on; the gateway adds rid, its marks and the session."""
    seen: list[tuple[dict[str, str], dict]] = []

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append((dict(request.headers), await request.json()))
        return web.json_response({"text": "ok", "meta_info": {"prompt_tokens": 3, "completion_tokens": 1}})

    stub = Stub(record).serve()
    gateway = start_gateway(stub.url, "--policy", "passthrough")
    try:
        body = {"text": "fix it", "sampling_params": {"max_new_tokens": 1, "custom_params": {"mine": 1}}}
        answer = requests.post(
            f"{gateway.url}/generate",
            json=body,
            timeout=30,
            headers={"Authorization": "Bearer engine-key", "X-Session-ID": "s9"},
        )
        assert answer.status_code == 200 and answer.json()["text"] == "ok"
    finally:
        gateway.stop()
    headers, forwarded = seen[0]
    assert headers["Authorization"] == "Bearer engine-key" and headers["X-Session-ID"] == "s9"
    assert forwarded["text"] == "fix it" and forwarded["rid"].startswith("basin-")
    assert forwarded["sampling_params"]["custom_params"] == {"mine": 1, "basin_session": "s9"}
    assert "priority" not in forwarded  # HiCache alone: arrival order
