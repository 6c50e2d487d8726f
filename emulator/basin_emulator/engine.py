"""The simulator's engine model run against the wall clock: the emulator's core.

`LiveEngine` owns one `Environment` and one `PDEngine` (the very code `basin simulate` runs) and a clock
task that advances the model to `(wall time since start) × time_scale`, sleeping until the next model
event or the next submission. Each HTTP request becomes a `LiveCall`: an engine `Request` whose page
keys hash the prompt's actual tokens, plus the events its handler waits on. Per-instance counters
(prompt, cached and computed tokens) feed `/metrics` and `/v1/loads` through `snapshot`; latency
histograms (TTFT, inter-token, end-to-end, KV transfer) are observed in model seconds, on SGLang's buckets.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from basin import tokens
from basin.sim.deployments import PAGE_TOKENS, Deployment
from basin.sim.engine import PDEngine, Request
from basin.sim.env import Environment

HIT_RATE_WINDOW = 64  # prefills the per-instance recent hit rate averages over
MAX_HOLD_S = 0.05  # wall seconds the model may wait for a request that is still being read and parsed

# SGLang 0.5.23's default buckets (sglang/srt/observability/metrics_collector.py).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
               0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)  # fmt: skip
KV_TRANSFER_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)


class Histogram:
    """Bucket counts and sum per label key, exported as a Prometheus histogram by the collector."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, key: tuple[str, ...], value: float) -> None:
        counts, total = self.series.setdefault(key, ([0] * (len(self.buckets) + 1), [0.0]))
        index = next((i for i, bound in enumerate(self.buckets) if value <= bound), len(self.buckets))
        counts[index] += 1
        total[0] += value

    def cumulative(self, key: tuple[str, ...]) -> tuple[list[tuple[str, float]], float]:
        """(le, cumulative count) pairs ending with +Inf, and the sum."""
        counts, total = self.series[key]
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(running)))
        return out, total[0]


class _Engine(PDEngine):
    """The simulator's engine with the two events SGLang's metrics count that its observer lacks:
    retractions, and KV transfers from prefill to decode with their duration."""

    def __init__(self, env: Environment, deployment: Deployment, live: LiveEngine) -> None:
        super().__init__(env, deployment, live)
        self.live = live
        self._transfer_started: dict[int, float] = {}

    def retracted(self, request: Request) -> None:
        super().retracted(request)
        if request.decode is not None:
            self.live.decode_counters[request.decode.index].retractions += 1

    def _transfer(self, request: Request) -> None:
        self._transfer_started[request.rid] = self.env.now
        super()._transfer(request)

    def _transfer_done(self, request: Request) -> None:
        started = self._transfer_started.pop(request.rid, None)
        if started is not None and request.state == "transfer" and request.prefill is not None:
            self.live.kv_transfer_ms.observe(
                ("prefill", str(request.prefill.index)), (self.env.now - started) * 1e3
            )
        super()._transfer_done(request)


@dataclass(eq=False)
class LiveCall:
    """One request in flight: what the handler sent and the events it waits on."""

    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    request: Request
    output_ids: list[int]
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    submitted_model_s: float = 0.0
    aborted: bool = False
    streaming: bool = False  # SGLang's `is_streaming` label on its request metrics

    @property
    def cached_tokens(self) -> int:
        return self.request.cached_tokens


@dataclass
class InstanceCounters:
    """Cumulative counters of one engine instance, named after SGLang's."""

    prompt_tokens: int = 0
    cached_device_tokens: int = 0
    cached_host_tokens: int = 0
    fetched_tokens: int = 0  # prefix taken from a lent unit on decode (BASIN)
    computed_tokens: int = 0  # prefill_effective_tokens_total{mode="input"}
    generation_tokens: int = 0
    requests: int = 0
    aborted: int = 0
    retractions: int = 0  # sglang:num_retracted_requests_total (decode)
    # The request counters SGLang labels with `is_streaming` ("true"/"false"), split that way.
    prompt_by_stream: dict[str, int] = field(default_factory=lambda: {"false": 0, "true": 0})
    generation_by_stream: dict[str, int] = field(default_factory=lambda: {"false": 0, "true": 0})
    requests_by_stream: dict[str, int] = field(default_factory=lambda: {"false": 0, "true": 0})
    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=HIT_RATE_WINDOW))

    def recent_hit_rate(self) -> float:
        prompt = sum(p for p, _ in self.recent)
        return sum(c for _, c in self.recent) / prompt if prompt else 0.0


class LiveEngine:
    """The deployment model driven in real time (× `time_scale`)."""

    def __init__(self, deployment: Deployment, time_scale: float = 1.0, lending: bool = False) -> None:
        if time_scale <= 0:
            raise ValueError("time scale must be positive")
        self.deployment = deployment
        self.time_scale = time_scale
        self.lending = lending
        self.env = Environment()
        self.prefill_counters = [InstanceCounters() for _ in range(deployment.prefill_instances)]
        self.decode_counters = [InstanceCounters() for _ in range(deployment.decode_instances)]
        # Keyed by (engine_type, dp_rank[, is_streaming]) of the instance that observed it.
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.kv_transfer_ms = Histogram(KV_TRANSFER_MS_BUCKETS)
        self.engine: PDEngine = _Engine(self.env, deployment, self)
        self.calls: dict[str, LiveCall] = {}
        self._rids = itertools.count(1)
        self._started = time.monotonic()
        self._wake: asyncio.Event | None = None
        self._holds: dict[int, float] = {}  # requests being read: handle -> model arrival time
        self._handles = itertools.count(1)

    # ------------------------------------------------------------------ clock
    def model_now(self) -> float:
        return (time.monotonic() - self._started) * self.time_scale

    def catch_up(self) -> None:
        """Process every model event due by now, but not past the arrival of a request still being read
        (for at most MAX_HOLD_S wall seconds), so that request can enter the model when it arrived."""
        until = self.model_now()
        if self._holds:
            oldest = min(self._holds.values())
            until = max(min(until, oldest), until - MAX_HOLD_S * self.time_scale)
        self.env.run(until)

    def hold(self) -> int:
        """Mark a request's arrival now; `submit` it with the returned handle, then `release` it."""
        handle = next(self._handles)
        self._holds[handle] = self.model_now()
        return handle

    def release(self, handle: int) -> None:
        if self._holds.pop(handle, None) is not None:
            self._poke()

    async def run_clock(self) -> None:
        """Advance the model forever: wake at the next event or when a request arrives."""
        self._wake = asyncio.Event()
        while True:
            self.catch_up()
            next_event = self.env.peek()
            if next_event is None:
                timeout = None
            elif self._holds and next_event <= self.model_now():
                timeout = MAX_HOLD_S  # held for a request being read; `release` wakes the clock
            else:
                timeout = max(0.0, (next_event - self.model_now()) / self.time_scale)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ requests
    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        max_new_tokens: int,
        session_id: str | None,
        priority: float | None,
        lend: bool,
        arrival: int | None = None,
        streaming: bool = False,
    ) -> LiveCall:
        """Start a request at its arrival (a `hold` handle) or now; its page keys come from its tokens."""
        self.catch_up()
        arrived = self._holds.pop(arrival, None) if arrival is not None else None
        if arrived is not None and arrived > self.env.now:
            self.env.run(arrived)
        keys = tokens.page_keys(prompt_ids, PAGE_TOKENS)
        request = Request(
            next(self._rids),
            None,
            session_id or rid,
            len(prompt_ids),
            max_new_tokens,
            keys,
            priority=priority,
            lend=lend and self.lending,
        )
        seed = hash((keys[-1] if keys else 0, tuple(prompt_ids[len(keys) * PAGE_TOKENS :])))
        call = LiveCall(rid, prompt_ids, max_new_tokens, request, tokens.output_ids(seed, max_new_tokens))
        call.submitted_model_s = self.env.now
        call.streaming = streaming
        request.owner = call
        self.calls[rid] = call
        self.engine.submit(request)
        self._poke()
        return call

    def abort(self, rid: str) -> bool:
        """Abort a request wherever it is; False when no such request is in flight (a finished one
        keeps its answer)."""
        self.catch_up()
        call = self.calls.get(rid)
        if call is None or call.request.state in ("done", "aborted"):
            return False
        del self.calls[rid]
        self.engine.abort(call.request)
        if call.request.decode is not None:
            self.decode_counters[call.request.decode.index].aborted += 1
        call.aborted = True
        call.first_token.set()
        call.done.set()
        self._poke()
        return True

    def finish(self, call: LiveCall) -> None:
        """The handler is done with `call`."""
        self.calls.pop(call.rid, None)

    def generated(self, call: LiveCall) -> int:
        """Output tokens produced so far (none before the request reaches decode)."""
        request = call.request
        return 0 if request.decode is None else request.decode.generated(request, self.model_now())

    def flush_cache(self) -> int:
        """Drop every cached page no request holds (SGLang's /flush_cache); returns pages dropped."""
        dropped = 0
        for prefill in self.engine.prefills:
            dropped += prefill.cache.evict_gpu(prefill.cache.gpu_capacity)
            dropped += prefill.cache.evict_host(prefill.cache.host_capacity)
        for decode in self.engine.decodes:
            decode.reclaim(decode.lent)
        return dropped

    # ------------------------------------------------------------------ engine observer
    def on_prefill_start(self, request: Request, now: float) -> None:
        assert request.prefill is not None
        counters = self.prefill_counters[request.prefill.index]
        counters.prompt_tokens += request.prompt_tokens
        counters.prompt_by_stream[_stream(request)] += request.prompt_tokens
        counters.cached_device_tokens += request.cached_gpu_tokens
        counters.cached_host_tokens += request.cached_host_tokens
        counters.fetched_tokens += request.fetched_tokens
        counters.recent.append((request.prompt_tokens, request.cached_tokens))

    def on_prefill_done(self, request: Request, now: float, uncached_tokens: int) -> None:
        assert request.prefill is not None
        counters = self.prefill_counters[request.prefill.index]
        counters.computed_tokens += uncached_tokens
        counters.requests += 1
        counters.requests_by_stream[_stream(request)] += 1

    def on_first_token(self, request: Request, now: float) -> None:
        # The engine reports the first token one decode step ahead; release it at that model time.
        self.env.schedule_at(now, request.owner.first_token.set)
        if request.decode is not None:
            key = ("decode", str(request.decode.index), _stream(request))
            self.ttft.observe(key, now - request.released_at)

    def on_request_done(self, request: Request, now: float) -> None:
        assert request.decode is not None
        counters = self.decode_counters[request.decode.index]
        counters.generation_tokens += request.output_tokens
        counters.requests += 1
        stream = _stream(request)
        counters.generation_by_stream[stream] += request.output_tokens
        counters.requests_by_stream[stream] += 1
        instance = ("decode", str(request.decode.index))
        self.e2e.observe((*instance, stream), now - request.released_at)
        if request.output_tokens > 1 and request.first_token_at is not None:
            # One observation per request of its mean gap (SGLang observes each streamed chunk's).
            self.itl.observe(instance, (now - request.first_token_at) / (request.output_tokens - 1))
        request.owner.first_token.set()
        request.owner.done.set()

    # ------------------------------------------------------------------ telemetry
    def snapshot(self) -> list[dict[str, float | int | str]]:
        """One record per engine instance, SGLang's load fields plus the queues of PD serving."""
        self.catch_up()
        engine = self.engine
        bootstrap = [0] * len(engine.prefills)
        inflight = [0] * len(engine.prefills)
        transfer = [0] * len(engine.decodes)
        retracted = [0] * len(engine.decodes)
        for request in engine.requests.values():
            if request.state == "decode_wait" and request.prefill_done_at is None and request.prefill:
                bootstrap[request.prefill.index] += 1
            if request.state == "transfer" and request.prefill is not None:
                inflight[request.prefill.index] += 1  # prefilled, its KV still being sent
            if request.state == "decode_wait" and request.retractions and request.decode is not None:
                retracted[request.decode.index] += 1  # retracted, waiting to resume
            if request.reserved_tokens and request.state != "decode" and request.decode is not None:
                transfer[request.decode.index] += 1
        records: list[dict[str, float | int | str]] = []
        for prefill, counters in zip(engine.prefills, self.prefill_counters, strict=True):
            cache = prefill.cache
            used = cache.gpu_capacity - cache.gpu_free - cache.gpu_evictable
            records.append(
                {
                    "engine_type": "prefill",
                    "dp_rank": prefill.index,
                    "num_running_reqs": len(prefill.running),
                    "num_waiting_reqs": len(prefill.waiting) + bootstrap[prefill.index],
                    "num_queue_reqs": len(prefill.waiting),
                    "num_prefill_bootstrap_queue_reqs": bootstrap[prefill.index],
                    "num_prefill_inflight_queue_reqs": inflight[prefill.index],
                    "num_waiting_uncached_tokens": prefill.backlog_tokens,
                    "num_used_tokens": used * PAGE_TOKENS,
                    "max_total_num_tokens": cache.gpu_capacity * PAGE_TOKENS,
                    "kv_available_tokens": (cache.gpu_free + cache.gpu_evictable) * PAGE_TOKENS,
                    "token_usage": used / cache.gpu_capacity,
                    "cache_hit_rate": counters.recent_hit_rate(),
                    "hicache_host_used_tokens": cache.host_used * PAGE_TOKENS,
                    "hicache_host_total_tokens": cache.host_capacity * PAGE_TOKENS,
                }
            )
        for decode in engine.decodes:
            records.append(
                {
                    "engine_type": "decode",
                    "dp_rank": decode.index,
                    "num_running_reqs": len(decode.members),
                    "num_waiting_reqs": len(decode.prealloc) + transfer[decode.index],
                    "num_queue_reqs": len(decode.prealloc) + transfer[decode.index],
                    "num_decode_prealloc_queue_reqs": len(decode.prealloc),
                    "num_decode_transfer_queue_reqs": transfer[decode.index],
                    "num_retracted_reqs": retracted[decode.index],
                    "num_waiting_uncached_tokens": 0,
                    "num_used_tokens": decode.used,
                    "max_total_num_tokens": decode.capacity,
                    "kv_available_tokens": decode.capacity - decode.used - decode.lent,
                    "token_usage": decode.used / decode.capacity,
                    "cache_hit_rate": 0.0,
                    "lent_tokens": decode.lent,
                    "lent_units": len(decode.units),
                }
            )
        return records


def _stream(request: Request) -> str:
    return "true" if getattr(request.owner, "streaming", False) else "false"
