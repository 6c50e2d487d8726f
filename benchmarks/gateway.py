"""What the session gateway adds to a call: latency (p50, p99) and requests/s at 200 connections.

Upstream: a bare aiohttp SSE server that answers at once (so only HTTP and the gateway's work is
measured). Baseline in the same run: the client calling that upstream directly. Then the same load
through `basin gateway run --policy basin` (a) in memory, (b) with Redis as the leader replica, (c) with
Redis on a follower replica, whose every call crosses Redis to the leader. Agent-like traffic: each client
runs sessions of ten calls (`X-Session-ID`, the last `X-Session-Final: 1`), prompts of `--prompt-tokens`
token ids through `/generate`, streamed. The gateway is pinned to one core (taskset), the rest share
the other.

Run: python benchmarks/gateway.py [--seconds 10] [--requests 2000] [--prompt-tokens 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

BASIN = str(Path(sys.executable).with_name("basin"))
CALLS_PER_SESSION = 10

UPSTREAM = """
import json, sys
from aiohttp import web

async def generate(request):
    await request.read()
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    chunk = {"text": "w1 w2", "meta_info": {"prompt_tokens": 10, "completion_tokens": 2}}
    await response.write(("data: " + json.dumps(chunk) + "\\n\\n").encode())
    await response.write(b"data: [DONE]\\n\\n")
    return response

async def metrics(request):
    return web.Response(text="sglang:prompt_tokens_total 0\\n")

app = web.Application(client_max_size=1 << 26)
app.router.add_post("/generate", generate)
app.router.add_get("/metrics", metrics)
app.router.add_get("/health", lambda r: web.Response())
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            if process.poll() is not None:
                raise SystemExit(f"a server exited: {process.args}") from None
            time.sleep(0.1)
    raise SystemExit(f"port {port} never opened: {process.args}")


def start(command: list[str], port: int, core: str | None = None) -> subprocess.Popen[bytes]:
    pin = (
        ["taskset", "-c", core]
        if core is not None and shutil.which("taskset") and (os.cpu_count() or 1) > 1
        else []
    )
    process = subprocess.Popen([*pin, *command], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, process)
    return process


def gateway(upstream: int, extra: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    command = [
        BASIN,
        "gateway",
        "run",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--upstream",
        f"http://127.0.0.1:{upstream}",
        "--policy",
        "basin",
        "--deployment",
        "h200-1p3d",
        *extra,
    ]
    return start(command, port, core="0"), port


class Client:
    def __init__(self, url: str, prompt_tokens: int) -> None:
        self.url = f"{url}/generate"
        self.body = (
            b'{"input_ids": ['
            + ",".join(str(i % 30000) for i in range(prompt_tokens)).encode()
            + b'], "sampling_params": {"max_new_tokens": 2}, "stream": true}'
        )
        self.sessions = itertools.count()

    async def session(self, http: aiohttp.ClientSession, latencies: list[float] | None, stop: float) -> int:
        sid = f"bench-{next(self.sessions)}-{os.getpid()}"
        done = 0
        for call in range(CALLS_PER_SESSION):
            if time.perf_counter() > stop:
                break
            headers = {"X-Session-ID": sid, "Content-Type": "application/json"}
            if call == CALLS_PER_SESSION - 1:
                headers["X-Session-Final"] = "1"
            begin = time.perf_counter()
            async with http.post(self.url, data=self.body, headers=headers) as response:
                if response.status != 200:
                    raise SystemExit(f"{response.status}: {await response.text()}")
                await response.read()
            if latencies is not None:
                latencies.append(time.perf_counter() - begin)
            done += 1
        return done

    async def latency(self, requests: int) -> np.ndarray:
        """One call at a time: the wall time of each, sent to completion."""
        latencies: list[float] = []
        async with aiohttp.ClientSession() as http:
            while len(latencies) < requests:
                await self.session(http, latencies, float("inf"))
        return np.array(latencies[:requests])

    async def throughput(self, connections: int, seconds: float) -> float:
        stop = time.perf_counter() + seconds
        total = 0

        async def loop() -> None:
            nonlocal total
            while time.perf_counter() < stop:
                done = await self.session(http, None, stop)  # not `total += await …`: that reads total
                total += done  # before the await, and concurrent loops would overwrite each other

        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections)) as http:
            begin = time.perf_counter()
            await asyncio.gather(*(loop() for _ in range(connections)))
            return total / (time.perf_counter() - begin)


def measure(url: str, args: argparse.Namespace) -> tuple[np.ndarray, float]:
    client = Client(url, args.prompt_tokens)
    asyncio.run(client.latency(200))  # warm-up: connections, the predictor, code paths
    latencies = asyncio.run(client.latency(args.requests))
    rate = asyncio.run(client.throughput(args.connections, args.seconds))
    return latencies, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    args = parser.parse_args()
    started: list[subprocess.Popen[bytes]] = []
    try:
        upstream_port = free_port()
        started.append(start([sys.executable, "-c", UPSTREAM, str(upstream_port)], upstream_port, core="1"))
        rows = [("direct to the upstream (baseline)", *measure(f"http://127.0.0.1:{upstream_port}", args))]
        memory, port = gateway(upstream_port, [])
        started.append(memory)
        rows.append(("gateway, in memory", *measure(f"http://127.0.0.1:{port}", args)))
        memory.terminate()
        redis_server = shutil.which("redis-server")
        if redis_server is None:
            print("redis-server not found: the Redis rows are skipped")
        else:
            redis_port = free_port()
            tmp = tempfile.mkdtemp()
            started.append(
                start(
                    [
                        redis_server,
                        "--port",
                        str(redis_port),
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        tmp,
                    ],
                    redis_port,
                    core="1",
                )
            )
            shared = ["--redis", f"redis://127.0.0.1:{redis_port}/0"]
            leader, leader_port = gateway(upstream_port, shared)
            started.append(leader)
            time.sleep(1.0)  # the first replica takes the lease
            rows.append(("gateway with Redis, leader", *measure(f"http://127.0.0.1:{leader_port}", args)))
            follower, follower_port = gateway(upstream_port, shared)
            started.append(follower)
            rows.append(("gateway with Redis, follower", *measure(f"http://127.0.0.1:{follower_port}", args)))
    finally:
        for process in started:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=10)
    base_latency, base_rate = rows[0][1], rows[0][2]
    b50, b99 = np.percentile(base_latency, [50, 99])
    print(
        f"{args.prompt_tokens}-token prompts via /generate, streamed; sessions of {CALLS_PER_SESSION} calls"
    )
    rate_head = f"req/s @{args.connections}"
    heads = ("p50 ms", "p99 ms", "+p50 ms", "+p99 ms")
    print(f"{'':34s} " + " ".join(f"{h:>8s}" for h in heads) + f" {rate_head:>12s} {'ratio':>6s}")
    for name, latencies, rate in rows:
        p50, p99 = np.percentile(latencies, [50, 99])
        print(
            f"{name:34s} {1e3 * p50:8.2f} {1e3 * p99:8.2f} {1e3 * (p50 - b50):8.2f} {1e3 * (p99 - b99):8.2f}"
            f" {rate:12.0f} {rate / base_rate:6.2f}"
        )
    print("goal: +p50 <= 1 ms and +p99 <= 5 ms")


if __name__ == "__main__":
    main()
