"""The emulator as a Pod others depend on: a client stalling mid-upload or sending a 20 MB body must not
slow anyone else, and SGLang's `/health_generate` probe answers.

The slow-down is measured against the same requests without the misbehaving client, on the same machine
in the same run, so the comparison holds on a busy machine: before the fix a stalled upload held the
model's clock back by 50-100 ms per event for every request, and a 20 MB body blocked the event loop for
the seconds its tokenizing took.
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import time

import aiohttp
import pytest
import requests

from basin import tokens

pytestmark = pytest.mark.service

TIME_SCALE = 50.0
HOLD_S = 0.05  # basin_emulator.engine.MAX_HOLD_S: what a held clock adds to every model event


def small(url: str, seed: int) -> tuple[float, float]:
    """One small /generate: (wall seconds it took, the model's own e2e latency in model seconds)."""
    body = {"input_ids": tokens.output_ids(seed, 200), "sampling_params": {"max_new_tokens": 4}}
    started = time.monotonic()
    response = requests.post(f"{url}/generate", json=body, timeout=60)
    wall = time.monotonic() - started
    assert response.status_code == 200, response.text
    return wall, response.json()["meta_info"]["e2e_latency"]


def overhead(url: str, seeds: range) -> float:
    """Median wall time a small request takes beyond what the model charged it, in wall seconds."""
    return statistics.median(wall - model / TIME_SCALE for wall, model in (small(url, s) for s in seeds))


def test_a_stalled_upload_neither_slows_others_nor_lives_forever(emulator_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("BASIN_EMULATE_READ_TIMEOUT_S", "6")
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", f"{TIME_SCALE:g}")
    small(emulator.url, 0)  # warm up
    baseline = overhead(emulator.url, range(1, 13))

    # A client announces 100 kB, sends 10 bytes and stalls.
    stalled = socket.create_connection(("127.0.0.1", emulator.port), timeout=30)
    stalled.sendall(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n" + b'{"input_ids'
    )
    started = time.monotonic()
    during = overhead(emulator.url, range(13, 25))
    assert time.monotonic() - started < 6, "the stall outlived the measurement; lengthen the read timeout"
    assert during < baseline + HOLD_S / 2, (
        f"others took {1000 * during:.1f} ms beyond the model during the stall,"
        f" {1000 * baseline:.1f} ms before"
    )

    # The stalled client is answered 408 after the read timeout and its connection closed.
    answer = b""
    while chunk := stalled.recv(65536):
        answer += chunk
    stalled.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"RequestTimeoutError" in answer


async def _during_huge(url: str, huge: bytes) -> tuple[int, float, list[float]]:
    """Send `huge` to /generate and small requests back to back until it is answered: its status, its
    duration and the wall time of every small request that ran meanwhile."""
    latencies: list[float] = []
    done = asyncio.Event()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def big() -> tuple[int, float]:
            started = time.monotonic()
            headers = {"Content-Type": "application/json"}
            async with http.post(f"{url}/generate", data=huge, headers=headers) as response:
                await response.read()
                status = response.status
            done.set()
            return status, time.monotonic() - started

        async def smalls() -> None:
            seed = 100
            while not done.is_set():
                body = {"input_ids": tokens.output_ids(seed, 200), "sampling_params": {"max_new_tokens": 4}}
                started = time.monotonic()
                async with http.post(f"{url}/generate", json=body) as response:
                    assert response.status == 200, await response.text()
                    await response.read()
                if not done.is_set():
                    latencies.append(time.monotonic() - started)
                seed += 1

        (status, duration), _ = await asyncio.gather(big(), smalls())
    return status, duration, latencies


def test_a_huge_body_does_not_block_other_clients(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    emulator = emulator_factory(
        "--deployment", "h100-1p1d", "--time-scale", f"{TIME_SCALE:g}", "--context-length", "200000"
    )
    small(emulator.url, 0)
    # 21 MB of words the tokenizer has not seen: seconds of tokenizing, then 400 (beyond the context).
    text = " ".join(f"q{i}" for i in range(2_500_000))
    huge = b'{"text": "' + text.encode() + b'", "sampling_params": {"max_new_tokens": 1}}'
    status, duration, latencies = asyncio.run(_during_huge(emulator.url, huge))
    assert status == 400
    assert len(latencies) >= 3, f"only {len(latencies)} small requests ran in the {duration:.1f} s"
    # Before the fix one small request waited out the whole tokenizing (most of `duration`).
    assert max(latencies) < duration / 4, (
        f"a small request took {max(latencies):.2f} s while the huge one took {duration:.2f} s"
    )


def test_health_generate_runs_a_generation(emulator_factory) -> None:  # type: ignore[no-untyped-def]
    emulator = emulator_factory("--deployment", "h100-1p1d", "--time-scale", f"{TIME_SCALE:g}")
    response = requests.get(f"{emulator.url}/health_generate", timeout=60)
    assert response.status_code == 200
    generated = 0.0  # summed over the decode label sets (SGLang's labels split it, e.g. by is_streaming)
    for line in requests.get(f"{emulator.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("sglang:generation_tokens_total{") and 'engine_type="decode"' in line:
            generated += float(line.rsplit(" ", 1)[1])
    assert generated >= 1  # it went through the model, not a canned answer
