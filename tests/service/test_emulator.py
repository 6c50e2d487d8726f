"""`basin emulate` as a client sees it: SGLang's routes, content-based prefix reuse, priorities, metrics,
aborts and SGLang-style errors, over real HTTP against the real process."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from basin import tokens

pytestmark = pytest.mark.service


def post(url: str, body: Any, **kwargs: Any) -> requests.Response:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(url, data=data, timeout=60, **kwargs)


def generate(url: str, ids: list[int], max_new_tokens: int = 4, **extra: Any) -> dict[str, Any]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens}, **extra}
    response = post(f"{url}/generate", body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
def emulator(emulator_factory):  # type: ignore[no-untyped-def]
    return emulator_factory("--deployment", "h100-1p1d", "--time-scale", "50", "--context-length", "200000")


def test_server_info_and_log_say_it_is_an_emulator(emulator) -> None:  # type: ignore[no-untyped-def]
    info = requests.get(f"{emulator.url}/get_server_info", timeout=10).json()
    assert info["emulator"] is True and "no GPU" in info["note"]
    assert info["deployment"] == "h100-1p1d" and info["page_size"] == 64
    assert info["prefill_cache_tokens"] > 0 and info["decode_kv_tokens"] > 0
    assert requests.get(f"{emulator.url}/health", timeout=10).status_code == 200


def test_prefix_reuse_comes_from_the_tokens_sent(emulator) -> None:  # type: ignore[no-untyped-def]
    history = tokens.output_ids(1, 5_000)
    first = generate(emulator.url, history, max_new_tokens=8)
    assert first["meta_info"]["cached_tokens"] == 0
    assert len(first["output_ids"]) == 8 and first["meta_info"]["completion_tokens"] == 8
    # A returning call resends its history plus the output and new text: the history's full pages hit.
    returning = history + first["output_ids"] + tokens.output_ids(2, 700)
    second = generate(emulator.url, returning)
    assert second["meta_info"]["cached_tokens"] == (len(history) // 64) * 64
    # Same length, different first token: nothing in common, nothing cached.
    other = [history[0] + 1, *history[1:]]
    assert generate(emulator.url, other)["meta_info"]["cached_tokens"] == 0
    # Text prompts tokenize deterministically: one word, one token.
    text = " ".join(f"word{i}" for i in range(300))
    body = {"text": text, "sampling_params": {"max_new_tokens": 2}}
    assert post(f"{emulator.url}/generate", body).json()["meta_info"]["prompt_tokens"] == 300
    again = post(f"{emulator.url}/generate", body).json()
    assert again["meta_info"]["cached_tokens"] == 256
    # Outputs are deterministic filler of the requested length.
    assert generate(emulator.url, returning)["output_ids"] == second["output_ids"]


def test_flush_cache_drops_the_prefix(emulator) -> None:  # type: ignore[no-untyped-def]
    ids = tokens.output_ids(3, 2_000)
    generate(emulator.url, ids)
    assert generate(emulator.url, ids)["meta_info"]["cached_tokens"] > 0
    assert post(f"{emulator.url}/flush_cache", b"").status_code == 200
    assert generate(emulator.url, ids)["meta_info"]["cached_tokens"] == 0


def test_openai_routes_stream_and_report_usage(emulator) -> None:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": " ".join(f"w{200 + i}" for i in range(500))}]
    plain = post(f"{emulator.url}/v1/chat/completions", {"messages": messages, "max_tokens": 5}).json()
    assert plain["object"] == "chat.completion"
    assert plain["usage"]["prompt_tokens"] == 501  # the role word and the content
    assert plain["usage"]["completion_tokens"] == 5
    assert len(plain["choices"][0]["message"]["content"].split()) == 5
    body = {"messages": messages, "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    with post(f"{emulator.url}/v1/chat/completions", body, stream=True) as response:
        events = [line[6:] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    words = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]).split()
    assert len(words) == 6
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens_details"]["cached_tokens"] == 448
    completion = post(f"{emulator.url}/v1/completions", {"prompt": [300] * 100, "max_tokens": 3}).json()
    assert completion["object"] == "text_completion" and completion["usage"]["prompt_tokens"] == 100
    assert requests.get(f"{emulator.url}/v1/models", timeout=10).json()["data"][0]["id"] == "basin-emulated"


def test_native_stream_grows_the_text(emulator) -> None:  # type: ignore[no-untyped-def]
    body = {"input_ids": tokens.output_ids(4, 300), "sampling_params": {"max_new_tokens": 40}, "stream": True}
    with post(f"{emulator.url}/generate", body, stream=True) as response:
        events = [line[6:] for line in response.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[-1] == 40
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert chunks[-1]["text"] == tokens.decode(chunks[-1]["output_ids"])


async def _first_token_times(url: str, bodies: list[dict[str, Any]], gap_s: float) -> list[float]:
    """Send streaming requests `gap_s` apart; the wall time each one's first token arrived."""
    started = time.monotonic()

    async def one(http: aiohttp.ClientSession, body: dict[str, Any], delay: float) -> float:
        await asyncio.sleep(delay)
        async with http.post(f"{url}/generate", json={**body, "stream": True}) as response:
            async for line in response.content:
                if line.startswith(b"data: {"):
                    return time.monotonic() - started
        raise AssertionError("no token")

    async with aiohttp.ClientSession() as http:
        return await asyncio.gather(*(one(http, b, k * gap_s) for k, b in enumerate(bodies)))


def test_lower_priority_values_are_served_first(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", "2")

    def body(seed: int, priority: int | None) -> dict[str, Any]:
        return {"input_ids": tokens.output_ids(seed, 30_000), "sampling_params": {"max_new_tokens": 1}} | (
            {"priority": priority} if priority is not None else {}
        )

    # The first request occupies prefill; the next two queue behind it and leave in priority order,
    # not in arrival order.
    blocker, sent_second_priority_5, sent_third_priority_0 = asyncio.run(
        _first_token_times(emulator.url, [body(10, None), body(11, 5), body(12, 0)], gap_s=0.05)
    )
    assert blocker < sent_third_priority_0 < sent_second_priority_5


def test_abort_and_disconnect_free_the_request(emulator) -> None:  # type: ignore[no-untyped-def]
    url = emulator.url
    body = {
        "input_ids": tokens.output_ids(5, 1_000),
        "sampling_params": {"max_new_tokens": 100_000},
        "stream": True,
        "rid": "long-one",
    }
    with post(f"{url}/generate", body, stream=True) as response:
        lines = response.iter_lines(decode_unicode=True)
        next(line for line in lines if line.startswith("data: {"))
        assert post(f"{url}/abort_request", {"rid": "long-one"}).json() == {"aborted": ["long-one"]}
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert json.loads(events[-2])["meta_info"]["finish_reason"]["type"] == "abort"

    def running() -> int:
        loads = requests.get(f"{url}/v1/loads", timeout=10).json()["loads"]
        return sum(r["num_running_reqs"] for r in loads if r["engine_type"] == "decode")

    assert running() == 0
    assert post(f"{url}/abort_request", {"rid": "long-one"}).json() == {"aborted": []}  # gone already
    # A client that goes away mid-stream aborts its request too.
    response = post(f"{url}/generate", {**body, "rid": "vanishing"}, stream=True)
    lines = response.iter_lines()  # kept: dropping a half-read iterator closes the connection
    next(line for line in lines if line.startswith(b"data: {"))
    assert running() == 1
    response.close()
    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running() == 0


EXPECTED_METRICS = {
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:cache_hit_rate",
    "sglang:prefill_effective_tokens",
    "sglang:cached_tokens",
    "sglang:prompt_tokens",
    "sglang:generation_tokens",
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
    "sglang:num_prefill_bootstrap_queue_reqs",
    "sglang:kv_available_tokens",
    "sglang:max_total_num_tokens",
}


SCHEDULER_SERIES = {
    "sglang:max_total_num_tokens",
    "sglang:cache_hit_rate",
    "sglang:prefill_effective_tokens_total",
    "sglang:kv_transfer_latency_ms_count",
    "sglang:kv_transfer_latency_ms_sum",
    "sglang:num_retracted_requests_total",
    "sglang:num_prefill_inflight_queue_reqs",
}


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = requests.get(f"{url}/metrics", timeout=10).text
    families = list(text_string_to_metric_families(text))
    assert {f.name for f in families} >= EXPECTED_METRICS
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_metrics_parse_and_count_the_work(emulator) -> None:  # type: ignore[no-untyped-def]
    ids = tokens.output_ids(6, 3_200)
    generate(emulator.url, ids, max_new_tokens=7)
    generate(emulator.url, ids, max_new_tokens=7)
    samples = _samples(emulator.url)
    # SGLang's tokenizer labels (requests, tokens, latencies) and its scheduler's (queues, KV, retractions).
    labels = {"model_name": "basin-emulated", "priority": "", "tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}
    scheduler = {**labels, "moe_ep_rank": "0"}

    def value(name: str, **extra: str) -> float:
        base = scheduler if name in SCHEDULER_SERIES else labels
        return samples[(name, tuple(sorted({**base, **extra}.items())))]

    assert value("sglang:prompt_tokens_total", engine_type="prefill", is_streaming="false") == 6_400
    assert value("sglang:prompt_tokens_total", engine_type="prefill", is_streaming="true") == 0
    # 3,200 tokens are 50 full pages: the repeat hits all of them and computes nothing new.
    assert value("sglang:cached_tokens_total", engine_type="prefill", cache_source="device") == 3_200
    assert value("sglang:prefill_effective_tokens_total", engine_type="prefill", mode="input") == 3_200
    assert value("sglang:prefill_effective_tokens_total", engine_type="prefill", mode="device_hit") == 3_200
    assert value("sglang:generation_tokens_total", engine_type="decode", is_streaming="false") == 14
    assert value("sglang:num_requests_total", engine_type="decode", is_streaming="false") == 2
    assert value("sglang:max_total_num_tokens", engine_type="decode") > 0
    assert 0 < value("sglang:cache_hit_rate", engine_type="prefill") < 1
    # Two answered requests: two first tokens, two end-to-end latencies, one KV transfer each, no retraction.
    assert value("sglang:time_to_first_token_seconds_count", engine_type="decode", is_streaming="false") == 2
    assert value("sglang:e2e_request_latency_seconds_count", engine_type="decode", is_streaming="false") == 2
    assert value("sglang:inter_token_latency_seconds_count", engine_type="decode") == 2
    assert value("sglang:kv_transfer_latency_ms_count", engine_type="prefill") == 2
    assert value("sglang:kv_transfer_latency_ms_sum", engine_type="prefill") > 0
    assert value("sglang:num_retracted_requests_total", engine_type="decode") == 0
    assert value("sglang:num_prefill_inflight_queue_reqs", engine_type="prefill") == 0


BAD_REQUESTS = [
    ("/generate", b"{not json", "invalid JSON"),
    ("/generate", b"[1, 2]", "JSON object"),
    ("/generate", {"sampling_params": {"max_new_tokens": 3}}, "exactly one of text and input_ids"),
    ("/generate", {"text": "a b", "input_ids": [1, 2]}, "exactly one of text and input_ids"),
    ("/generate", {"text": ["a", "b"]}, "batches are not supported"),
    ("/generate", {"input_ids": [1, -2]}, "negative token id"),
    ("/generate", {"input_ids": [1, "x"]}, "list of token ids"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -1}}, "at least 0"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "many"}}, "must be an integer"),
    (
        "/generate",
        {"input_ids": [1] * 150, "sampling_params": {"max_new_tokens": 100}},
        "maximum context length",
    ),
    ("/generate", {"input_ids": [1, 2], "priority": "high"}, "priority must be a number"),
    ("/generate", {"input_ids": []}, "prompt is empty"),
    ("/v1/completions", {"max_tokens": 3}, "prompt is required"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -5}, "at least 0"),
    ("/v1/chat/completions", {"messages": []}, "non-empty list"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "role"),
    ("/abort_request", {}, "rid"),
]


@pytest.mark.parametrize(("route", "body", "message"), BAD_REQUESTS)
def test_bad_input_gets_400_with_a_json_error(small_emulator, route, body, message) -> None:  # type: ignore[no-untyped-def]
    response = post(f"{small_emulator.url}{route}", body)
    assert response.status_code == 400
    error = response.json()
    assert error["code"] == 400 and message in error["message"], error


def test_unknown_route_is_404_json(small_emulator) -> None:  # type: ignore[no-untyped-def]
    response = requests.get(f"{small_emulator.url}/no/such/route", timeout=10)
    assert response.status_code == 404 and response.json()["code"] == 404


def test_lending_keeps_marked_prompts_on_decode(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    emulator = emulator_factory("--deployment", "h200-1p1d", "--time-scale", "50", "--lending")

    def lent() -> float:
        return sum(
            v for (name, labels), v in _samples(emulator.url).items() if name == "sglang:basin_lent_tokens"
        )

    generate(emulator.url, tokens.output_ids(20, 4_000))  # unmarked: nothing lent
    assert lent() == 0
    mark = {"basin_lend": True, "basin_session": "s1"}  # the engine extension's mark
    body = {
        "input_ids": tokens.output_ids(21, 4_000),
        "sampling_params": {"max_new_tokens": 4, "custom_params": mark},
    }
    response = post(f"{emulator.url}/generate", body)
    assert response.status_code == 200
    assert lent() == 62 * 64  # the prompt's full pages; the partial last page is not kept


def test_a_port_in_use_is_a_one_line_error(emulator) -> None:  # type: ignore[no-untyped-def]
    basin = str(Path(sys.executable).with_name("basin"))
    result = subprocess.run(
        [basin, "emulate", "--port", str(emulator.port)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "address already in use" in result.stderr and "Traceback" not in result.stderr


def test_sigterm_finishes_the_calls_in_flight_then_exits(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    """A Pod replaced by a rollout gets SIGTERM (as PID 1, which ignores it without a handler): the emulator
    stops accepting, answers the call it is streaming in full, and exits."""
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", "1")
    ids, sampling = tokens.output_ids(4, 300), {"max_new_tokens": 150}
    body = {"input_ids": ids, "sampling_params": sampling, "stream": True}
    with post(f"{emulator.url}/generate", body, stream=True) as response:
        lines = response.iter_lines(decode_unicode=True)
        first = next(line for line in lines if line.startswith("data: {"))
        emulator.process.send_signal(signal.SIGTERM)  # ~150 decode steps (over a second) still to go
        time.sleep(0.3)
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{emulator.url}/health", timeout=5)  # no longer accepting
        events = [first, *(line for line in lines if line.startswith("data: "))]
    assert events[-1] == "data: [DONE]"
    assert len(json.loads(events[-2][6:])["output_ids"]) == 150
    assert emulator.process.wait(timeout=30) == 0
    assert "finishing the calls in flight" in emulator.text()
