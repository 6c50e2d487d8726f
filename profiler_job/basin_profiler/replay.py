"""The session replay client: the paper's partly-open agent load against any OpenAI-compatible endpoint.

Sessions arrive as a Poisson process (`basin.workload`, the same draws `basin simulate` makes for one
seed). Each session sends its calls in order; every prompt resends the conversation so far (the
carried part of the previous prompt and its output) followed by new tokens, so prefix reuse on the
server is real. The next call leaves after the previous answer plus the tool gap. Times are model
seconds: with `time_scale` S, a wall second is S model seconds (match the emulator's `--time-scale`).

The gateway contract (docs/replay.md): the session id travels in `X-Session-ID`, the last call carries
`X-Session-Final: 1`; a 429 answer parks the session (retry after `Retry-After` seconds), a 503 sheds it
(or rejects it, per `X-Basin-Outcome`). Connection errors and other failures end the session as
`failed` and are counted; after `max_errors` of them the run stops early.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import orjson

from basin import tokens
from basin.evaluate import CallRecord, RunRecords, Sample, SessionRecord, Summary, summarize
from basin.looplag import LoopLagProbe
from basin.sim.costs import unloaded_call_times, unloaded_session_seconds
from basin.sim.deployments import GpuCalibration
from basin.workload import Arrival, Session, poisson_arrivals
from basin.workload.arrivals import Schedule

SESSION_HEADER = "X-Session-ID"
FINAL_HEADER = "X-Session-Final"
OUTCOME_HEADER = "X-Basin-Outcome"
SAMPLE_INTERVAL_S = 10.0  # model seconds between samples of the client's state
ITL_SLO_S = 0.050  # §7.1, as the simulator's
DEFAULT_RETRY_AFTER_S = 1.0
# The client's delay is said to dominate when its mean event-loop lag reaches this share of the
# median TTFT it measured: every first token it dates is late by about that lag.
CLIENT_LAG_SHARE = 0.25


@dataclass(frozen=True)
class ReplayConfig:
    target: str  # base URL, e.g. http://127.0.0.1:30000
    schedule: Schedule
    reference_gpu: GpuCalibration  # slowdown's denominator: unloaded session times on this GPU
    api: str = "openai"  # openai: /v1/chat/completions; sglang: /generate with input_ids
    seed: int = 0
    time_scale: float = 1.0
    max_concurrency: int = 512  # requests in flight at once
    max_errors: int = 50  # connection errors and failed requests before the run stops early
    request_timeout_s: float = 600.0  # wall seconds per request
    model: str = "default"
    cache_tokens: int = 0  # the server's prefix cache, for the working set ratio (0: unknown)
    # Sessions joined mid-trajectory at time 0, as the simulator's warm start draws them (same seed, same
    # draws); each first sends its previous prompt for one token so the server caches it, as the
    # simulator's warm start leaves it cached.
    warm_sessions: int = 0
    # Sent with every call: the profiling Job's bypass of the gateway's controls (`X-Basin-Bypass` with
    # the admin token the operator shares between the two).
    headers: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.api not in ("openai", "sglang"):
            raise ValueError(f"unknown api {self.api!r}: openai or sglang")
        if self.time_scale <= 0 or self.max_concurrency < 1 or self.max_errors < 1:
            raise ValueError("time scale, concurrency and error budget must be positive")


@dataclass
class ReplayCounts:
    requests: int = 0
    answered: int = 0
    parked_answers: int = 0  # 429s
    cut_off: int = 0  # requests in flight when the run ended: sent, but their answers were never read
    connection_errors: int = 0
    failed_requests: int = 0  # other non-2xx answers and broken streams
    stopped_early: str = ""  # why the run ended before its duration, if it did
    first_errors: list[str] = field(default_factory=list)

    @property
    def errors(self) -> int:
        return self.connection_errors + self.failed_requests


@dataclass(frozen=True)
class ClientLoad:
    """The replay client's own cost: a busy client dates answers late and measures itself, not the server.

    The event-loop lag is how late a timer fired (wall seconds); every response the client reads waits
    about as long. Model seconds scale it by the time scale, as every other figure of the run."""

    loop_lag_mean_s: float
    loop_lag_p90_s: float
    cpu_fraction: float  # the client process's CPU seconds per wall second (1.0: one core saturated)
    time_scale: float

    @property
    def lag_mean_model_s(self) -> float:
        return self.loop_lag_mean_s * self.time_scale

    @property
    def lag_p90_model_s(self) -> float:
        return self.loop_lag_p90_s * self.time_scale

    def dominates(self, median_ttft_s: float) -> bool:
        """True when the client's lag is a large share of the TTFT it measured."""
        if math.isnan(median_ttft_s):
            return False
        return self.lag_mean_model_s >= CLIENT_LAG_SHARE * median_ttft_s

    def to_dict(self) -> dict[str, float]:
        return {
            "client_loop_lag_mean_model_s": self.lag_mean_model_s,
            "client_loop_lag_p90_model_s": self.lag_p90_model_s,
            "client_cpu_fraction": self.cpu_fraction,
        }


@dataclass
class ReplayResult:
    summary: Summary
    records: RunRecords
    counts: ReplayCounts
    wall_seconds: float
    model_seconds: float
    client: ClientLoad

    @property
    def median_ttft_s(self) -> float:
        """Median TTFT over every answered call of the run (model seconds)."""
        ttfts = [c.ttft_s for c in self.records.calls if c.ttft_s is not None]
        return float(np.median(ttfts)) if ttfts else math.nan


class _Answer:
    """What one call got back: output ids, cached tokens, when the first token came."""

    def __init__(self) -> None:
        self.output: list[int] = []
        self.text = ""
        self.cached_tokens = 0
        self.first_token_s: float | None = None


class _Outcome(Exception):
    """A session ends early: shed, rejected or failed."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class Replay:
    def __init__(
        self,
        config: ReplayConfig,
        pool: Sequence[Session],
        progress: Callable[[float, ReplayCounts], None] | None = None,
    ) -> None:
        self.config = config
        self.progress = progress
        rng = np.random.default_rng(config.seed)  # the simulator's first draws: the same arrivals
        gpu = config.reference_gpu
        self.arrivals = poisson_arrivals(
            config.schedule,
            pool,
            rng,
            warm_sessions=config.warm_sessions,
            call_seconds=lambda s: unloaded_call_times(gpu, s),
        )
        schedule = config.schedule
        surge = schedule.surge_minutes > 0
        self.records = RunRecords(
            duration_s=schedule.duration_min * 60.0,
            trigger_s=schedule.surge_start_min * 60 if surge else None,
            trigger_end_s=schedule.surge_end_min * 60 if surge else None,
            cache_tokens=config.cache_tokens,
        )
        self.counts = ReplayCounts()
        self.active: dict[str, int] = {}  # session -> context tokens (the working set)
        self.parked: set[str] = set()
        self._references: dict[str, float] = {}
        self._started = 0.0
        self._stop = asyncio.Event()
        self._loop_lag = LoopLagProbe()
        self._tasks: list[asyncio.Task[None]] = []

    # ------------------------------------------------------------------ clock
    def now(self) -> float:
        """Model seconds since the run started."""
        return (time.monotonic() - self._started) * self.config.time_scale

    async def _sleep_until(self, model_s: float) -> None:
        delay = (model_s - self.now()) / self.config.time_scale
        if delay > 0:
            await asyncio.sleep(delay)

    # ------------------------------------------------------------------ run
    async def run(self) -> ReplayResult:
        """Replay until the duration ends, the error budget runs out, or `stop` is called."""
        config = self.config
        timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
        connector = aiohttp.TCPConnector(limit=config.max_concurrency)
        self._semaphore = asyncio.Semaphore(config.max_concurrency)
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            self._http = http
            self._started = time.monotonic()
            self._tasks = [asyncio.create_task(self._session(a)) for a in self.arrivals]
            helpers = [
                asyncio.create_task(self._sample()),
                asyncio.create_task(self._loop_lag.run()),
                asyncio.create_task(self.feed()),
            ]
            end = self.records.duration_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), end / config.time_scale)
            for task in [*self._tasks, *helpers]:
                task.cancel()
            await asyncio.gather(*self._tasks, *helpers, return_exceptions=True)
        wall = time.perf_counter() - wall_start
        client = ClientLoad(
            loop_lag_mean_s=self._loop_lag.mean(),
            loop_lag_p90_s=self._loop_lag.quantile(0.9),
            cpu_fraction=(time.process_time() - cpu_start) / wall if wall > 0 else 0.0,
            time_scale=config.time_scale,
        )
        model_seconds = min(self.now(), end)
        if self.counts.stopped_early:
            self.records.duration_s = model_seconds
        return ReplayResult(
            summarize(self.records),
            self.records,
            self.counts,
            wall,
            model_seconds,
            client,
        )

    async def feed(self) -> None:
        """Arrivals decided while the run goes (a ramp whose steps end when the load settles); the
        scheduled arrivals were started already, so by default there are none."""

    def add_arrival(self, arrival: Arrival) -> None:
        """Start one more session during the run (`arrival.time_s` in model seconds from the start)."""
        self._tasks.append(asyncio.create_task(self._session(arrival)))

    def stop(self, reason: str) -> None:
        """End the run now (Ctrl-C, the error budget); the summary covers what ran."""
        if not self.counts.stopped_early:
            self.counts.stopped_early = reason
        self._stop.set()

    async def _sample(self) -> None:
        while True:
            self.records.samples.append(
                Sample(
                    t=self.now(),
                    active_sessions=len(self.active),
                    parked_sessions=len(self.parked),
                    working_set_tokens=sum(self.active.values()),
                )
            )
            if self.progress is not None:
                self.progress(self.now(), self.counts)
            await asyncio.sleep(SAMPLE_INTERVAL_S / self.config.time_scale)

    # ------------------------------------------------------------------ sessions
    def _reference(self, session: Session) -> float:
        if session.session_id not in self._references:
            self._references[session.session_id] = unloaded_session_seconds(
                self.config.reference_gpu, session
            )
        return self._references[session.session_id]

    async def _session(self, arrival: Arrival) -> None:
        session, sid = arrival.session, arrival.instance_id
        record = SessionRecord(
            sid, arrival.time_s, self._reference(session), warm=arrival.warm, in_surge=arrival.in_surge
        )
        self.records.sessions.append(record)
        rng = np.random.default_rng([self.config.seed, zlib.crc32(sid.encode())])
        history: list[int] = []  # the previous prompt and its output: what the next prompt resends
        first = arrival.first_call
        if not arrival.warm:
            await self._sleep_until(arrival.time_s)
        self.active[sid] = 0
        try:
            if first > 0:
                history = await self._prime(sid, rng, session, session.calls[first - 1].prompt_tokens)
                self.active[sid] = len(history)
                await self._sleep_until(arrival.time_s)
            for index, call in enumerate(session.calls):
                if index < first:
                    continue
                if history:
                    carried = min(call.carried_tokens, len(history))
                    prompt = history[:carried] + tokens.filler(rng, call.prompt_tokens - carried)
                else:
                    prompt = _opening(session, rng, call.prompt_tokens)
                self.active[sid] = len(prompt)
                final = index == len(session.calls) - 1
                answer, call_record = await self._call(record, index, prompt, call.output_tokens, final)
                if self.config.api == "openai":
                    prompt = self._chat_ids(prompt)
                history = prompt + answer.output
                self.active[sid] = len(history)
                record.decode_steps += call_record.output_tokens
                record.itl_violating_steps += call_record.itl_violating_steps
                if not final:
                    await asyncio.sleep(call.tool_gap_s / self.config.time_scale)
            record.outcome = "completed"
            record.done_s = self.now()
        except _Outcome as ended:
            record.outcome = ended.outcome
        finally:
            self.active.pop(sid, None)
            self.parked.discard(sid)

    async def _call(
        self, record: SessionRecord, index: int, prompt: list[int], output_tokens: int, final: bool
    ) -> tuple[_Answer, CallRecord]:
        """Send one call, waiting out 429s; returns the answer and the call's record."""
        answer, released = await self._send(record.session_id, prompt, output_tokens, final)
        self.counts.answered += 1
        self.parked.discard(record.session_id)
        self.active[record.session_id] = len(prompt)
        done = self.now()
        if record.first_call_s is None:
            record.first_call_s = released
        call = CallRecord(record.session_id, index, len(prompt), len(answer.output), released)
        first = answer.first_token_s if answer.first_token_s is not None else done
        # A client sees no prefill events: it dates the call's prefill (and its hit) by the first token.
        call.prefill_start_s = call.prefill_done_s = call.first_token_s = first
        call.cached_tokens = answer.cached_tokens
        call.uncached_tokens = len(prompt) - answer.cached_tokens
        call.done_s = done
        if len(answer.output) > 1 and (done - first) / (len(answer.output) - 1) > ITL_SLO_S:
            call.itl_violating_steps = len(answer.output) - 1  # mean inter-token latency over the SLO
        if record.first_token_s is None:
            record.first_token_s = first
        self.records.calls.append(call)
        return answer, call

    async def _prime(
        self, sid: str, rng: np.random.Generator, session: Session, prompt_tokens: int
    ) -> list[int]:
        """A warm session's previous prompt, sent for one token so the server caches it (not recorded as
        a call); returns the history its next call resends. Through a gateway it is the session's first
        call, parked or shed like any other."""
        prompt = _opening(session, rng, prompt_tokens)
        answer, _ = await self._send(sid, prompt, 1)
        if self.config.api == "openai":
            prompt = self._chat_ids(prompt)
        return prompt + answer.output

    async def _send(
        self, sid: str, prompt: list[int], output_tokens: int, final: bool = False
    ) -> tuple[_Answer, float]:
        """POST one call until it is answered, as the client contract says: a 429 is waited out
        (Retry-After) and sent again, a 503 ends the session; returns the answer and when the attempt
        that was answered left."""
        headers = {**self.config.headers, SESSION_HEADER: sid, "Content-Type": "application/json"}
        if final:
            headers[FINAL_HEADER] = "1"
        url, body = self._request(prompt, output_tokens)
        while True:
            released = self.now()
            try:
                async with self._semaphore:
                    self.counts.requests += 1
                    try:
                        async with self._http.post(url, data=body, headers=headers) as response:
                            if response.status == 429:
                                self.counts.parked_answers += 1
                                self.parked.add(sid)
                                self.active.pop(sid, None)
                                retry = _retry_after(response.headers.get("Retry-After"))
                            elif response.status == 503:
                                outcome = response.headers.get(OUTCOME_HEADER, "shed")
                                raise _Outcome(outcome if outcome in ("shed", "rejected") else "shed")
                            elif response.status != 200:
                                detail = (await response.text())[:200]
                                self._error("failed_requests", f"HTTP {response.status} from {url}: {detail}")
                                raise _Outcome("failed")
                            else:
                                return await self._read(response), released
                    except asyncio.CancelledError:
                        # The run ended with this request out: the server may have answered it (a 429
                        # it counted, say) without the client reading the answer.
                        self.counts.cut_off += 1
                        raise
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:  # orjson errors are ValueErrors
                kind = "failed_requests" if isinstance(error, ValueError) else "connection_errors"
                self._error(kind, f"{type(error).__name__} from {url}: {error}")
                raise _Outcome("failed") from None
            await asyncio.sleep(retry)

    def _error(self, kind: str, message: str) -> None:
        setattr(self.counts, kind, getattr(self.counts, kind) + 1)
        if len(self.counts.first_errors) < 5:
            self.counts.first_errors.append(message)
        if self.counts.errors >= self.config.max_errors:
            self.stop(f"{self.counts.errors} errors (the last: {message})")

    # ------------------------------------------------------------------ wire formats
    def _chat_ids(self, prompt: list[int]) -> list[int]:
        """What the chat template makes of `prompt` on the emulator: the role word replaces token 0."""
        return tokens.encode("user") + prompt[1:]

    def _request(self, prompt: list[int], output_tokens: int) -> tuple[str, bytes]:
        """The call's URL and encoded body (encoded before the clock starts: TTFT is the server's)."""
        base = self.config.target.rstrip("/")
        body: dict[str, Any]
        if self.config.api == "sglang":
            url = f"{base}/generate"
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": output_tokens, "ignore_eos": True},
                "stream": True,
            }
        else:
            url = f"{base}/v1/chat/completions"
            body = {
                "model": self.config.model,
                "messages": [{"role": "user", "content": tokens.decode(prompt[1:])}],
                "max_tokens": output_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        return url, orjson.dumps(body)

    async def _read(self, response: aiohttp.ClientResponse) -> _Answer:
        """Parse an SSE stream (SGLang native or OpenAI chunks) into an answer.

        SGLang's native chunks each carry the whole output so far, so only the first chunk with
        output (for the TTFT) and the last one are decoded; OpenAI chunks carry deltas."""
        answer = _Answer()
        native = self.config.api == "sglang"
        last: bytes | None = None
        async for raw in response.content:
            arrived = self.now()
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            if native:
                last = data
                if answer.first_token_s is None and self._native_output(orjson.loads(data), answer):
                    answer.first_token_s = arrived
                continue
            chunk = orjson.loads(data)
            for choice in chunk.get("choices") or []:
                answer.text += (choice.get("delta") or {}).get("content") or ""
            details = (chunk.get("usage") or {}).get("prompt_tokens_details") or {}
            answer.cached_tokens = int(details.get("cached_tokens") or answer.cached_tokens)
            if answer.first_token_s is None and answer.text.strip():
                answer.first_token_s = arrived
        if native and last is not None:
            self._native_output(orjson.loads(last), answer)
        elif not native:
            answer.output = tokens.encode(answer.text)
        return answer

    @staticmethod
    def _native_output(chunk: dict[str, Any], answer: _Answer) -> bool:
        """Take a native chunk's output and cached tokens into `answer`; True if it has output."""
        meta = chunk.get("meta_info") or {}
        ids = chunk.get("output_ids")
        answer.output = list(ids) if ids is not None else tokens.encode(chunk.get("text", ""))
        answer.cached_tokens = int(meta.get("cached_tokens", answer.cached_tokens))
        return bool(answer.output)


def _opening(session: Session, rng: np.random.Generator, prompt_tokens: int) -> list[int]:
    """A session's opening prompt: the workload's shared prefix (the same ids in every session), then
    new content of its own."""
    shared = tokens.shared_prefix(session.workload, min(session.shared_prefix_tokens, prompt_tokens))
    return shared + tokens.filler(rng, prompt_tokens - len(shared))


def _retry_after(value: str | None) -> float:
    try:
        seconds = float(value) if value is not None else DEFAULT_RETRY_AFTER_S
    except ValueError:
        seconds = DEFAULT_RETRY_AFTER_S
    return seconds if math.isfinite(seconds) and seconds >= 0 else DEFAULT_RETRY_AFTER_S


@dataclass(frozen=True)
class ServerInfo:
    """What the server says of itself on `/get_server_info`, where it says it (the emulator does)."""

    cache_tokens: int = 0  # the prefix cache in tokens (0: unknown)
    gpu: str | None = None
    time_scale: float | None = None  # model seconds per wall second of an emulator
    loop_lag_mean_s: float | None = None  # an emulator's own event-loop lag (wall seconds)


async def server_info(target: str) -> ServerInfo:
    """Read `/get_server_info`; a server that does not answer it (or answers oddly) says nothing."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
            http.get(f"{target.rstrip('/')}/get_server_info") as response,
        ):
            info = await response.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return ServerInfo()
    if not isinstance(info, dict):
        return ServerInfo()
    try:
        prefill = int(info.get("prefill_cache_tokens") or 0) * int(info.get("prefill_instances") or 1)
        host = int(info.get("host_cache_tokens") or 0) * int(info.get("prefill_instances") or 1)
        scale = info.get("time_scale")
        time_scale = float(scale) if isinstance(scale, int | float) and scale > 0 else None
        lag = info.get("loop_lag_mean_s")
        loop_lag = float(lag) if isinstance(lag, int | float) and lag >= 0 else None
    except (TypeError, ValueError):
        return ServerInfo()
    gpu = info.get("gpu")
    return ServerInfo(max(prefill, host), gpu if isinstance(gpu, str) else None, time_scale, loop_lag)
