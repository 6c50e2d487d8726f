"""Requests per second the engine emulator sustains on one core with short prompts.

So we know it is never the bottleneck in gateway benchmarks. The emulator runs pinned to one core at a
huge time scale (model time is negligible: the HTTP and bookkeeping cost is what is measured); a client
process on another core keeps `--concurrency` streaming requests in flight. Baseline in the same run:
a bare aiohttp server on the same core that streams the same number of SSE chunks without any engine
model, the floor for any Python HTTP server here. Also reports the per-request overhead for one long
prompt (30K tokens), which sets how far a replay's TTFT sits above the model's at a given time scale.

Run: python benchmarks/emulator.py [--seconds 10] [--concurrency 32] [--prompt-tokens 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from basin import tokens

ROOT = Path(__file__).resolve().parents[1]

BARE_SERVER = """
import asyncio, json, sys
from aiohttp import web

async def generate(request):
    body = await request.json()
    n = body["sampling_params"]["max_new_tokens"]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(2):  # a first chunk and a final one, as the emulator sends at this time scale
        await response.write(("data: " + json.dumps({"text": " w1" * n}) + "\\n\\n").encode())
    await response.write(b"data: [DONE]\\n\\n")
    return response

app = web.Application(client_max_size=1 << 26)
app.router.add_post("/generate", generate)
app.router.add_get("/health", lambda r: web.Response())
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], port: int) -> subprocess.Popen[bytes]:
    core = ["taskset", "-c", "0"] if os.cpu_count() and os.cpu_count() > 1 else []  # type: ignore[operator]
    process = subprocess.Popen([*core, *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit(f"server on port {port} did not start: {command}")


async def one(http: aiohttp.ClientSession, url: str, prompt: list[int], output: int) -> float:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": output}, "stream": True}
    begin = time.perf_counter()
    first = None
    async with http.post(url, json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if first is None and line.startswith(b"data:"):
                first = time.perf_counter()
    return (first or time.perf_counter()) - begin


async def load(port: int, seconds: float, concurrency: int, prompt_tokens: int, output: int) -> float:
    """Completed requests per second with `concurrency` clients looping for `seconds`."""
    url = f"http://127.0.0.1:{port}/generate"
    done = 0
    stop = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal done
        prompt = tokens.output_ids(k, prompt_tokens)
        while time.perf_counter() < stop:
            await one(http, url, prompt, output)
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as http:
        begin = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        return done / (time.perf_counter() - begin)


async def long_prompt_overhead(port: int, prompt_tokens: int) -> float:
    """Wall seconds to the first token of a long prompt, median of five (model time ~0 at this scale)."""
    url = f"http://127.0.0.1:{port}/generate"
    times = []
    async with aiohttp.ClientSession() as http:
        for k in range(5):
            times.append(await one(http, url, tokens.output_ids(1000 + k, prompt_tokens), 1))
    return sorted(times)[2]


def measure(command: list[str], port: int, args: argparse.Namespace) -> tuple[float, float]:
    process = start(command, port)
    try:
        rate = asyncio.run(load(port, args.seconds, args.concurrency, args.prompt_tokens, args.output_tokens))
        overhead = asyncio.run(long_prompt_overhead(port, 30_000))
        return rate, overhead
    finally:
        process.terminate()
        process.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--output-tokens", type=int, default=16)
    args = parser.parse_args()
    basin = str(Path(sys.executable).with_name("basin"))
    port = free_port()
    emulator = [basin, "emulate", "--deployment", "h200-1p3d", "--port", str(port), "--time-scale", "100000"]
    emu_rate, emu_overhead = measure(emulator, port, args)
    port = free_port()
    bare_rate, bare_overhead = measure([sys.executable, "-c", BARE_SERVER, str(port)], port, args)
    shape = f"{args.prompt_tokens} tokens in, {args.output_tokens} out, {args.concurrency} in flight"
    print(f"short prompts ({shape}):")
    print(f"  emulator on one core:       {emu_rate:8.0f} requests/s")
    print(f"  bare aiohttp SSE (baseline): {bare_rate:8.0f} requests/s   ratio {emu_rate / bare_rate:.2f}")
    print("first token of a 30K-token prompt, wall time (model time ~0):")
    print(f"  emulator: {1e3 * emu_overhead:6.1f} ms   bare aiohttp: {1e3 * bare_overhead:6.1f} ms")
    print("  (at --time-scale S a replay's TTFT reads about S x this above the model's)")


if __name__ == "__main__":
    main()
