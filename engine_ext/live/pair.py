"""A live SGLang prefill–decode pair on CPU behind sglang-router, for the live engine tests and by hand.

Real processes: `sglang.launch_server` as prefill and as decode (NIXL over UCX on loopback, KV in host
memory) and `sglang_router.launch_router --pd-disaggregation`, each in its own process group so that
stopping kills the server's scheduler and detokenizer too. Every port is a free one picked at start, so
several pairs (other checkouts, CI) can run on one machine; everything listens on 127.0.0.1 only.

The CPU-only workarounds (never needed on GPUs) are flags and the `site/` folder put on the servers'
PYTHONPATH; they are listed in docs/engine-ext.md ("Live on CPU"). By hand:

    VENV/bin/python engine_ext/live/pair.py MODEL_DIR WORKDIR   # starts, prints the URLs, Ctrl-C stops
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ENGINE_EXT = HERE.parent
REPO = ENGINE_EXT.parent
HOST = "127.0.0.1"

# Both roles: the tiny model on CPU with SGLang's torch-native paths, NIXL as the transfer backend.
CPU_ARGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--skip-server-warmup", "--grammar-backend", "none",
    "--mem-fraction-static", "0.1", "--disaggregation-transfer-backend", "nixl",
    # what each engine received, as SGLang itself logs it (one JSON line per request, without the prompt)
    "--log-requests", "--log-requests-level", "1", "--log-requests-format", "json",
)  # fmt: skip
# CPU-only: the overlap scheduler's early send of a cached prefix creates a torch.cuda.Event on prefill.
PREFILL_CPU_ARGS = ("--disable-overlap-schedule",)
# CPU-only: decode's default retraction backup is a pinned host pool (cudaHostRegister).
DECODE_CPU_ARGS = ("--disaggregation-decode-retraction-backup", "cpu_tensor")
# What a Basin deployment runs (the operator sets the same on both roles).
BASIN_ARGS = (
    "--enable-metrics", "--enable-priority-scheduling", "--schedule-low-priority-values-first",
    "--disaggregation-decode-allocation-policy", "prefill_complete",
)  # fmt: skip

# What sglang-router logs when it reaches for the Hugging Face hub (a tokenizer for a model name that is
# not a local path): none of these may appear in a test's router log.
HUB_MARKERS = ("huggingface.co", "hf-mirror", "Downloading", "download tokenizer", "hf_hub", "HF_ENDPOINT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def server_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The servers' environment: this checkout's plugin and the CPU workarounds first on the path, NIXL
    on DRAM over UCX's loopback device, the hub unreachable by configuration (offline mode)."""
    roots = [str(HERE / "site"), str(ENGINE_EXT), str(REPO / "basin")]
    path = os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = {
        **os.environ,
        "PYTHONPATH": path,
        "UCX_NET_DEVICES": "lo",
        "BASIN_NIXL_DRAM": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("TRITON_INTERPRET", None)  # the engine tests' setting; the servers run no Triton kernel
    env.pop("SGLANG_PLUGINS", None)
    env.update(extra or {})
    return env


@dataclass
class Process:
    """One server process (leader of its own process group) and its log file."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left after `grace_s`."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
            # the leader is gone; its children (scheduler, detokenizer) may not be
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return


def start(name: str, argv: Sequence[str], env: Mapping[str, str], workdir: Path) -> Process:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, env=dict(env), cwd=workdir,
            start_new_session=True,
        )  # fmt: skip
    return Process(name, proc, log_path)


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    import requests

    try:
        r = requests.get(url, timeout=timeout)
    except requests.RequestException:
        return 0, ""
    return r.status_code, r.text


# How a bind on a taken port reads in the logs: sglang-router (Rust), uvicorn, ZMQ.
PORT_CLASH = re.compile(r"address already in use|errno 98", re.IGNORECASE)


class PortTaken(RuntimeError):
    """A server exited because a port it was given was taken (its log says so, anywhere in it)."""


def wait_healthy(processes: Iterable[tuple[Process, str]], deadline_s: float) -> None:
    """Poll each process's health URL until all answer 200; fail at once when one exits, and at the
    deadline with every log's tail."""
    pending = list(processes)
    deadline = time.monotonic() + deadline_s
    while pending:
        for process, url in list(pending):
            if not process.alive():
                kind = PortTaken if PORT_CLASH.search(process.log()) else RuntimeError
                raise kind(f"{process.name} exited ({process.proc.returncode}):\n{process.tail()}")
            if get(url, timeout=5.0)[0] == 200:
                pending.remove((process, url))
        if not pending:
            return
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p, _ in pending)
            raise TimeoutError(
                f"not healthy after {deadline_s:.0f} s: {[p.name for p, _ in pending]}\n{tails}"
            )
        time.sleep(1.0)


def retry_on_port_clash(launch: Callable[[], list[Process]], attempts: int = 3) -> None:
    """Run `launch` (which picks its own free ports); when a process it started exited because its port
    was taken meanwhile, stop what it started and launch again on new ports, up to `attempts` times."""
    for attempt in range(1, attempts + 1):
        try:
            launch()
            return
        except PortTaken as error:
            if attempt == attempts:
                raise
            print(f"port taken before a server bound it, relaunching ({attempt}/{attempts}): {error}")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text as {'name{labels}': value} plus {'name': sum over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        out[name + labels] = value
        if labels:
            out[name] = out.get(name, 0.0) + value
    return out


@dataclass
class LivePair:
    """A prefill–decode pair plus sglang-router. `start()` returns once all three answer /health;
    `stop()` is safe to call at any point, also after a failed start."""

    python: str
    model: Path
    workdir: Path
    basin: bool = True  # Basin's plugin and the flags a Basin deployment runs with
    engine_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    max_total_tokens: int = 4096  # KV tokens per role (small: memory pressure within a test's reach)
    startup_deadline_s: float = 600.0
    prefill_port: int = 0
    decode_port: int = 0
    bootstrap_port: int = 0
    router_port: int = 0
    unit_port: int = 0
    processes: dict[str, Process] = field(default_factory=dict)

    @property
    def prefill_url(self) -> str:
        return f"http://{HOST}:{self.prefill_port}"

    @property
    def decode_url(self) -> str:
        return f"http://{HOST}:{self.decode_port}"

    @property
    def router_url(self) -> str:
        return f"http://{HOST}:{self.router_port}"

    def url(self, role: str) -> str:
        return {"prefill": self.prefill_url, "decode": self.decode_url, "router": self.router_url}[role]

    def start(self) -> LivePair:
        """Start prefill and decode, then the router. Ports are picked just before each launch, and a
        launch whose port was taken in between (the engines' own ZMQ, NIXL and torch ports come from the
        same ephemeral range, so a picked port can be gone minutes later) is retried on fresh ports."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            retry_on_port_clash(self._start_engines)
            retry_on_port_clash(self._start_router)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_engines(self) -> list[Process]:
        self.prefill_port, self.decode_port, self.bootstrap_port = free_port(), free_port(), free_port()
        if self.basin:
            self.unit_port = self.unit_port or free_port()
        env = self._server_env()
        common = [
            self.python, "-m", "sglang.launch_server", "--model-path", str(self.model), "--host", HOST,
            "--max-total-tokens", str(self.max_total_tokens),
            *CPU_ARGS, *(BASIN_ARGS if self.basin else ("--enable-metrics",)), *self.engine_args,
        ]  # fmt: skip
        prefill = self.processes["prefill"] = start(
            "prefill",
            [*common, "--port", str(self.prefill_port), "--disaggregation-mode", "prefill",
             "--disaggregation-bootstrap-port", str(self.bootstrap_port), *PREFILL_CPU_ARGS],
            env, self.workdir,
        )  # fmt: skip
        decode = self.processes["decode"] = start(
            "decode",
            [*common, "--port", str(self.decode_port), "--disaggregation-mode", "decode",
             *DECODE_CPU_ARGS],
            env, self.workdir,
        )  # fmt: skip
        try:
            wait_healthy(
                [(prefill, f"{self.prefill_url}/health"), (decode, f"{self.decode_url}/health")],
                self.startup_deadline_s,
            )
        except BaseException:
            prefill.stop()
            decode.stop()
            raise
        return [prefill, decode]

    def _server_env(self) -> dict[str, str]:
        extra = dict(self.env)
        if self.basin:
            extra = {"SGLANG_PLUGINS": "basin", "BASIN_ENGINE_UNIT_PORT": str(self.unit_port), **extra}
        return server_env(extra)

    def _start_router(self) -> list[Process]:
        self.router_port, router_metrics = free_port(), free_port()
        # The router loads the tokenizer of the workers' model; the model is a local path, and the
        # tokenizer is named too, so it never needs the hub (its log is checked by the tests).
        router = self.processes["router"] = start(
            "router",
            [self.python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
             "--prefill", self.prefill_url, str(self.bootstrap_port), "--decode", self.decode_url,
             "--host", HOST, "--port", str(self.router_port), "--prometheus-host", HOST,
             "--prometheus-port", str(router_metrics), "--tokenizer-path", str(self.model),
             "--log-level", "info"],
            self._server_env(), self.workdir,
        )  # fmt: skip
        try:
            wait_healthy([(router, f"{self.router_url}/health")], 120.0)
        except BaseException:
            router.stop()
            raise
        return [router]

    def stop(self) -> None:
        for name in ("router", "decode", "prefill"):
            process = self.processes.get(name)
            if process is not None:
                process.stop()

    def log(self, role: str) -> str:
        return self.processes[role].log()

    def metrics(self, role: str) -> dict[str, float]:
        status, text = get(f"{self.url(role)}/metrics")
        if status != 200:
            raise RuntimeError(f"{role} /metrics answered {status}")
        return parse_metrics(text)

    def received(self, role: str) -> list[dict[str, Any]]:
        """The requests this engine received, from SGLang's own request log (`request.received` JSON
        lines: rid, priority, sampling parameters with `custom_params`, bootstrap fields)."""
        return self.request_log(role, "request.received")

    def finished(self, role: str) -> dict[str, dict[str, Any]]:
        """This engine's finished requests by rid, from its request log (`request.finished`: the output's
        `meta_info`, e.g. prefill's `cached_tokens` and `forward_entry_time`)."""
        return {
            entry["rid"]: entry["out"]["meta_info"] for entry in self.request_log(role, "request.finished")
        }

    def request_log(self, role: str, event: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log(role).splitlines():
            start = line.find('{"timestamp"')
            if start < 0 or f'"{event}"' not in line:
                continue
            try:
                out.append(json.loads(line[start:]))
            except json.JSONDecodeError:
                continue
        return out

    def dispatch(self, route: str, body: Mapping[str, Any], timeout: float = 300.0) -> Any:
        """Send one call to the pair without the router, as sglang-router's PD mode does: the same body
        plus `bootstrap_host`/`bootstrap_port`/`bootstrap_room` (a random 63-bit room) posted to prefill
        and decode at once; decode's answer is the call's. Every field of the body reaches both engines."""
        full = {
            **body, "bootstrap_host": HOST, "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": random.getrandbits(63),
        }  # fmt: skip
        with ThreadPoolExecutor(2) as pool:
            prefill = pool.submit(self.post, "prefill", route, full, timeout)
            decode = pool.submit(self.post, "decode", route, full, timeout)
            answer = decode.result()
            prefill.result()
        return answer

    def post(self, role: str, path: str, body: Mapping[str, Any], timeout: float = 300.0) -> Any:
        import requests

        r = requests.post(f"{self.url(role)}{path}", json=dict(body), timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"{role} {path} answered {r.status_code}: {r.text[:2000]}")
        return r.json() if r.content else None


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    pair = LivePair(sys.executable, Path(argv[0]).resolve(), Path(argv[1]).resolve())

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):  # a background shell starts us with SIGINT ignored
        signal.signal(sig, interrupt)
    try:
        pair.start()
        print(f"prefill {pair.prefill_url}  decode {pair.decode_url}  router {pair.router_url}", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        pair.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
