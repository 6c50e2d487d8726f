"""The engine model of an SGLang PD deployment: prefill instances, decode instances and the router.

Driven by an `Environment`; the simulator runs it in virtual time, the emulator in real time. A call's
path (SGLang's default, `allocation="early"`):
  router picks prefill and decode instances -> decode prealloc queue reserves KV for prompt + reserved
  output tokens -> prefill waiting queue -> chunked prefill (prefix match, host load-back, compute)
  -> KV transfer -> decode batch -> done.
With `allocation="prefill_complete"` the decode reservation waits until prefill finishes, and prefill
keeps the request's pages locked until the transfer ends.

Decode runs as continuous batching in closed form: every running request gains one token per step, so
progress is a per-instance step counter V; a request finishes when V reaches its join value plus its
output. Events happen only when the batch changes, not at every step.
"""

from __future__ import annotations

import heapq
import itertools
import math
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

from basin.sim.costs import (
    decode_step_seconds,
    load_back_seconds,
    pd_transfer_seconds,
    prefill_seconds,
    transfer_seconds,
)
from basin.sim.deployments import PAGE_TOKENS, Deployment, GpuCalibration
from basin.sim.env import Environment, Timer
from basin.sim.radix import Node, RadixCache
from basin.tokens import common_prefix


@dataclass(eq=False, slots=True)
class Request:
    """One call in the engine. The owner fills the first block; the engine fills the rest."""

    rid: int
    owner: Any  # the session state that submitted it (opaque to the engine)
    route_key: str  # stable per session (affinity routing)
    prompt_tokens: int
    output_tokens: int
    keys: tuple[int, ...]  # page keys of the prompt's full pages
    priority: float | None = None
    lend: bool = False  # keep the prompt on decode as a lent unit after the call (BASIN)
    released_at: float = 0.0
    # engine state
    state: str = "new"
    prefill: PrefillInstance | None = None
    decode: DecodeInstance | None = None
    reserved_tokens: int = 0
    cached_gpu_tokens: int = 0
    cached_host_tokens: int = 0
    fetched_tokens: int = 0  # prefix fetched from a lent unit on decode instead of recomputed
    remaining_prefill: int = 0
    position: int = 0
    allocated_pages: int = 0
    match_node: Node | None = None
    leaf_node: Node | None = None
    prefill_started_at: float | None = None
    prefill_done_at: float | None = None
    first_token_at: float | None = None
    done_at: float | None = None
    join_v: float = 0.0
    finish_v: float = 0.0
    join_violations: float = 0.0
    itl_violating_steps: float = 0.0
    generated_before_retract: int = 0
    retractions: int = 0
    queue_seq: int = 0

    @property
    def queue_key(self) -> tuple[float, int]:
        return (0.0 if self.priority is None else self.priority, self.queue_seq)

    @property
    def cached_tokens(self) -> int:
        return self.cached_gpu_tokens + self.cached_host_tokens + self.fetched_tokens


@dataclass(eq=False, slots=True)
class LentUnit:
    """A session's latest prompt kept in idle decode memory (BASIN's decode-memory lending)."""

    route_key: str
    keys: tuple[int, ...]
    tokens: int
    decode: DecodeInstance


class EngineObserver(Protocol):
    """Hooks the engine reports through (the metrics store, the session driver)."""

    def on_prefill_start(self, request: Request, now: float) -> None: ...
    def on_prefill_done(self, request: Request, now: float, uncached_tokens: int) -> None: ...
    def on_first_token(self, request: Request, now: float) -> None: ...
    def on_request_done(self, request: Request, now: float) -> None: ...


# SGLang 0.5.23, sglang/srt/managers/schedule_policy.py: how many waiting requests have their prefixes
# refreshed, and every how many scheduling passes (`Deployment.waiting_prefix_refresh`).
WAITING_QUEUE_PREFIX_MATCH_MAX = 128
WAITING_PREFIX_REFRESH_INTERVAL = 32


class _Queue:
    """A priority queue of requests (FIFO among equal priorities) that skips removed entries."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[float, int], Request]] = []
        self._members: set[int] = set()
        self.tokens = 0  # sum of prompt tokens of members

    def __len__(self) -> int:
        return len(self._members)

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.queue_key, request))
        self._members.add(request.rid)
        self.tokens += request.prompt_tokens

    def _clean(self) -> None:
        while self._heap and self._heap[0][1].rid not in self._members:
            heapq.heappop(self._heap)

    def peek(self) -> Request | None:
        self._clean()
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Request:
        self._clean()
        _, request = heapq.heappop(self._heap)
        self._members.discard(request.rid)
        self.tokens -= request.prompt_tokens
        return request

    def first(self, count: int) -> list[Request]:
        """The first `count` members in queue order."""
        entries = (entry for entry in self._heap if entry[1].rid in self._members)
        return [request for _, request in heapq.nsmallest(count, entries)]

    def ordered(self) -> list[Request]:
        """Members in queue order (for scans that may remove one)."""
        return [r for _, r in sorted(self._heap) if r.rid in self._members]

    def remove(self, request: Request) -> bool:
        if request.rid not in self._members:
            return False
        self._members.discard(request.rid)
        self.tokens -= request.prompt_tokens
        return True


class PrefillInstance:
    def __init__(self, engine: PDEngine, index: int) -> None:
        deployment = engine.deployment
        gpu = deployment.gpu
        self.engine = engine
        self.index = index
        self.gpu: GpuCalibration = gpu
        self.cache = RadixCache(
            gpu_pages=gpu.prefill_cache_tokens // PAGE_TOKENS,
            host_pages=int(gpu.prefill_cache_tokens * deployment.host_tier) // PAGE_TOKENS,
            write_through=deployment.write_through,
            state_slots=gpu.recurrent_state_slots,
        )
        self.waiting = _Queue()
        self.running: list[Request] = []  # started, not finished (chunked prefill in progress)
        self.busy = False
        self.backlog_tokens = 0  # uncached tokens still to compute, estimated at enqueue
        self.pins: dict[str, tuple[Node, float, Timer]] = {}  # session -> (locked node, rank, expiry)
        self.refresh_waiting = deployment.waiting_prefix_refresh
        self.passes = 0  # forward passes scheduled (the waiting-prefix refresh counts them)

    def enqueue(self, request: Request) -> None:
        request.state = "prefill_wait"
        request.prefill = self
        request.remaining_prefill = request.prompt_tokens - self.cache.peek(request.keys) * PAGE_TOKENS
        self.backlog_tokens += request.remaining_prefill
        self.waiting.push(request)
        self._kick()
        if request.decode is not None:
            request.decode.try_borrow()

    def _kick(self) -> None:
        if not self.busy:
            self._run_chunk()

    def _start(self, request: Request, now: float) -> bool:
        """Match, lock and allocate; False when the pages do not fit now."""
        cache = self.cache
        match = cache.match(request.keys, now)
        cache.lock(match.node)
        self.unpin(request.route_key, kick=False)  # its own lock holds the prefix now
        need = len(request.keys) - match.gpu_pages
        if not cache.can_allocate(need):
            self._release_pins(need)
        if not cache.allocate(need):
            cache.unlock(match.node)
            return False
        if match.host_pages:
            cache.load_back(match)
        request.match_node = match.node
        request.allocated_pages = need - match.host_pages
        request.cached_gpu_tokens = match.gpu_pages * PAGE_TOKENS
        request.cached_host_tokens = match.host_pages * PAGE_TOKENS
        # A lent unit that covers more than the local match is written over instead of recomputed.
        request.fetched_tokens = self.engine.fetch_unit(request, match.pages) * PAGE_TOKENS
        cached = match.pages * PAGE_TOKENS + request.fetched_tokens
        self.backlog_tokens += (request.prompt_tokens - cached) - request.remaining_prefill
        request.remaining_prefill = request.prompt_tokens - cached
        request.position = cached
        request.prefill_started_at = now
        request.state = "prefill"
        self.engine.observer.on_prefill_start(request, now)
        return True

    def _run_chunk(self) -> None:
        """Fill one forward pass of up to `prefill_chunk_tokens` new tokens and schedule its end."""
        env, gpu = self.engine.env, self.gpu
        if self.refresh_waiting:
            if self.passes % WAITING_PREFIX_REFRESH_INTERVAL == 0:
                self._touch_waiting(env.now)
            self.passes += 1
        budget = gpu.prefill_chunk_tokens
        seconds = gpu.prefill_chunk_overhead_s
        portions: list[tuple[Request, int]] = []
        for request in self.running:
            if budget <= 0:
                break
            take = min(budget, request.remaining_prefill)
            portions.append((request, take))
            budget -= take
        while budget > 0:
            head = self.waiting.peek()
            if head is None or not self._start(head, env.now):
                break
            self.waiting.pop()
            self.running.append(head)
            seconds += load_back_seconds(gpu, head.cached_host_tokens)
            if head.fetched_tokens:
                seconds += transfer_seconds(gpu, head.fetched_tokens)
            take = min(budget, head.remaining_prefill)
            portions.append((head, take))
            budget -= take
        if not portions:
            self.busy = False
            return
        for request, take in portions:
            seconds += prefill_seconds(gpu, take, request.position)
        self.busy = True
        env.schedule(seconds, self._chunk_done, portions)

    def _touch_waiting(self, now: float) -> None:
        """Mark the queue head's cached prefixes used, the head last so that LRU evicts the prefixes of
        later requests first (SGLang's waiting-prefix refresh)."""
        for request in reversed(self.waiting.first(WAITING_QUEUE_PREFIX_MATCH_MAX)):
            self.cache.match(request.keys, now, reusable=False)

    def _chunk_done(self, portions: list[tuple[Request, int]]) -> None:
        now = self.engine.env.now
        for request, take in portions:
            if request.state != "prefill":
                continue  # aborted while its chunk ran
            request.position += take
            request.remaining_prefill -= take
            self.backlog_tokens -= take
            if request.remaining_prefill <= 0:
                self.running.remove(request)
                self._finish(request, now)
        self.busy = False
        self._run_chunk()

    def _finish(self, request: Request, now: float) -> None:
        cache = self.cache
        leaf = cache.insert(request.keys, now, request.allocated_pages)
        request.allocated_pages = 0
        assert request.match_node is not None
        cache.lock(leaf)
        cache.unlock(request.match_node)
        request.match_node = None
        request.leaf_node = leaf
        request.prefill_done_at = now
        request.state = "prefilled"
        self.engine.observer.on_prefill_done(request, now, request.prompt_tokens - request.cached_tokens)
        self.engine.prefill_finished(request)

    def borrowable(self, decode: DecodeInstance) -> Request | None:
        """The oldest waiting request routed to `decode`, when the queue has a backlog (Crossflow). With
        early allocation it already holds its decode reservation; otherwise decode must reserve its KV
        before it can compute there (`DecodeInstance.try_borrow`)."""
        if not self.busy or len(self.waiting) == 0:
            return None
        early = self.engine.deployment.allocation == "early"
        for request in self.waiting.ordered():
            if request.decode is decode and (request.reserved_tokens or not early):
                self.waiting.remove(request)
                self.backlog_tokens -= request.remaining_prefill
                return request
        return None

    # ---------------------------------------------------------------- pins (Continuum's TTL retention)
    def pin(self, route_key: str, keys: tuple[int, ...], ttl_s: float, rank: float) -> None:
        """Lock a session's cached prompt for `ttl_s` seconds (or until its next call starts)."""
        self.unpin(route_key)
        match = self.cache.match(keys, self.engine.env.now)
        if match.node is self.cache.root or not match.node.gpu:
            return
        self.cache.lock(match.node)
        timer = self.engine.env.schedule(ttl_s, self.unpin, route_key)
        self.pins[route_key] = (match.node, rank, timer)

    def unpin(self, route_key: str, kick: bool = True) -> None:
        pinned = self.pins.pop(route_key, None)
        if pinned is not None:
            node, _, timer = pinned
            timer.cancel()
            self.cache.unlock(node)
            if kick:  # not from inside a chunk being filled
                self._kick()

    def _release_pins(self, pages: int) -> None:
        """Under memory pressure, drop pins of the latest-arriving sessions first until `pages` fit."""
        for route_key in sorted(self.pins, key=lambda k: self.pins[k][1], reverse=True):
            if self.cache.can_allocate(pages):
                return
            node, _, timer = self.pins.pop(route_key)
            timer.cancel()
            self.cache.unlock(node)

    def release(self, request: Request) -> None:
        """The KV left for decode (or the request was aborted): drop prefill's hold on its pages."""
        if request.leaf_node is not None:
            self.cache.unlock(request.leaf_node)
            request.leaf_node = None
            self._kick()  # freed pages may let a waiting request start

    def abort(self, request: Request) -> None:
        if self.waiting.remove(request):
            self.backlog_tokens -= request.remaining_prefill
        elif request in self.running:
            # Its current chunk may still be computing; the chunk end skips aborted requests.
            self.running.remove(request)
            self.backlog_tokens -= request.remaining_prefill
            self.cache.free(request.allocated_pages)
            request.allocated_pages = 0
            if request.match_node is not None:
                self.cache.unlock(request.match_node)
                request.match_node = None
        self.release(request)


class DecodeInstance:
    def __init__(self, engine: PDEngine, index: int) -> None:
        self.engine = engine
        self.index = index
        self.gpu = engine.deployment.gpu
        self.capacity = self.gpu.decode_kv_tokens
        self.used = 0  # reserved or held tokens
        self.prealloc = _Queue()  # requests waiting for a reservation
        self.batch: list[tuple[float, int, Request]] = []  # heap by finish_v
        self.members: dict[int, Request] = {}
        self.v = 0.0  # steps taken by the running batch since start
        self.violations = 0.0  # steps that exceeded the ITL SLO
        self.updated = 0.0
        self.step_s = self.gpu.decode_step_base_s
        self.sum_prompt = 0
        self.sum_join_v = 0.0
        self.timer: Timer | None = None
        self.waiting_transfer_tokens = 0  # reserved by requests not yet decoding
        self.units: dict[str, LentUnit] = {}  # by session, least recently adopted first
        self.lent = 0
        # Crossflow: one borrowed prefill at a time, computed in the decode steps under a lease.
        self.borrowed: Request | None = None
        self.borrow_remaining = 0.0
        self.borrow_rate = 0.0  # prefill tokens per second while borrowing
        self.borrow_computing = False  # the prefix has arrived and the suffix is being computed
        self.borrow_timer: Timer | None = None

    # ---------------------------------------------------------------- reservations
    def reservation(self, request: Request) -> int:
        if request.retractions:  # a resumed request reserves what it holds and still needs
            return request.prompt_tokens + request.output_tokens
        return request.prompt_tokens + self.engine.deployment.reserved_decode_tokens

    def request_reservation(self, request: Request) -> None:
        request.decode = self
        request.state = "decode_wait"
        self.prealloc.push(request)
        self.try_reserve()

    def try_reserve(self) -> None:
        while True:
            head = self.prealloc.peek()
            if head is None:
                return
            need = self.reservation(head)
            if self.used + self.lent + need > self.capacity:
                self.reclaim(self.used + self.lent + need - self.capacity)
            if self.used + need > self.capacity and self.used > 0:
                return
            self.prealloc.pop()
            self.used += need
            head.reserved_tokens = need
            self.waiting_transfer_tokens += need
            self.engine.reserved(head)

    @property
    def demand_tokens(self) -> int:
        return self.used + self.prealloc.tokens

    # ---------------------------------------------------------------- lending
    def adopt(self, request: Request) -> None:
        """Keep a finished call's prompt as the session's unit, if the cap and the headroom allow:
        at most `lend_cap` of memory lent, and room left above queued and running decode demand."""
        deployment = self.engine.deployment
        old = self.units.pop(request.route_key, None)
        if old is not None:
            self.lent -= old.tokens
        tokens = len(request.keys) * PAGE_TOKENS
        headroom = self.capacity - self.used - self.prealloc.tokens - self.lent
        if (
            tokens == 0
            or self.lent + tokens > deployment.lend_cap * self.capacity
            or headroom - tokens < deployment.lend_headroom * self.capacity
        ):
            return
        self.units[request.route_key] = LentUnit(request.route_key, request.keys, tokens, self)
        self.lent += tokens
        self.engine.units[request.route_key] = self.units[request.route_key]

    def drop(self, unit: LentUnit) -> None:
        if self.units.get(unit.route_key) is unit:
            del self.units[unit.route_key]
            self.lent -= unit.tokens
            if self.engine.units.get(unit.route_key) is unit:
                del self.engine.units[unit.route_key]

    def reclaim(self, tokens: int) -> int:
        """Free at least `tokens` of lent memory: units prefill also holds first, then the least
        recently adopted. Returns what was freed."""
        if not self.units:  # nothing lent (every policy but BASIN): skip building the scan lists
            return 0
        freed = 0
        redundant = [u for u in self.units.values() if self.engine.prefill_holds(u)]
        for unit in redundant + list(self.units.values()):
            if freed >= tokens:
                break
            if unit.route_key in self.units:
                freed += unit.tokens
                self.drop(unit)
        return freed

    # ---------------------------------------------------------------- batch
    def _advance(self, now: float) -> None:
        if self.members:
            steps = (now - self.updated) / self.step_s
            self.v += steps
            if self.step_s > self.engine.deployment.itl_slo_s:
                self.violations += steps
        if self.borrow_computing:
            self.borrow_remaining -= (now - self.updated) * self.borrow_rate
        self.updated = now

    def context_tokens(self) -> float:
        return self.sum_prompt + len(self.members) * self.v - self.sum_join_v

    def generated(self, request: Request, now: float) -> int:
        """Output tokens `request` has produced by `now` (the emulator streams them as they come)."""
        if request.state == "done":
            return request.output_tokens
        tokens = request.generated_before_retract
        if request.rid in self.members:
            v = self.v + (now - self.updated) / self.step_s
            tokens += max(0, int(v - request.join_v + 1e-9))
        return min(tokens, request.output_tokens)

    def _reschedule(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        n = len(self.members)
        self.step_s = decode_step_seconds(self.gpu, n, self.context_tokens())
        if self.borrow_computing:
            self._lease()
        while self.batch and self.batch[0][2].rid not in self.members:
            heapq.heappop(self.batch)
        if self.batch:
            finish_v = self.batch[0][0]
            delay = max(0.0, (finish_v - self.v) * self.step_s)
            self.timer = self.engine.env.schedule(delay, self._finish_due)

    # ---------------------------------------------------------------- Crossflow's borrowed prefill
    def _lease(self) -> None:
        """Crossflow's mixed step: decoding and the borrowed prefill share one forward pass and its
        token budget (SGLang's chunk size less one token per running request), so every running
        request's step carries the prefill lease and the per-chunk overhead (interference): the lease
        fills the step up to the 50 ms ITL SLO, at least 256 tokens even when decoding alone is slower.
        When nothing decodes, prefill runs in full chunks, each with its overhead. Re-prices the step and
        the prefill's finish.
        Overruns of a lease that trails the batch are not modelled: they depend on how far under the SLO
        Crossflow keeps its lease, which the paper does not give."""
        request = self.borrowed
        assert request is not None
        deployment = self.engine.deployment
        position = request.prompt_tokens - max(self.borrow_remaining, 0.0)
        per_token = prefill_seconds(self.gpu, 1, int(position))
        if self.members:
            overhead = self.gpu.prefill_chunk_overhead_s
            budget = max(self.gpu.prefill_chunk_tokens - len(self.members), 0)
            floor = min(deployment.crossflow_min_lease_tokens, budget)
            room = 0.999 * deployment.itl_slo_s - self.step_s - overhead
            lease = min(max(room / per_token, floor), budget)
            self.step_s += lease * per_token + overhead
            self.borrow_rate = lease / self.step_s
        else:  # prefill alone in the forward passes: full chunks, each with its fixed overhead
            chunk = self.gpu.prefill_chunk_tokens
            self.borrow_rate = chunk / (chunk * per_token + self.gpu.prefill_chunk_overhead_s)
        if self.borrow_timer is not None:
            self.borrow_timer.cancel()
        delay = max(self.borrow_remaining, 0.0) / self.borrow_rate if self.borrow_rate > 0 else 0.0
        self.borrow_timer = self.engine.env.schedule(delay, self._borrow_done)

    def try_borrow(self) -> None:
        """Take the oldest request routed here that still waits for prefill, if the prefill queue has a
        backlog. Decode holds the request's KV while it computes: a request without a reservation yet
        (allocation at prefill completion) reserves it first, and is left to prefill when decode memory
        is short. The cached prefix comes over from prefill first (the suffix attends to it); then
        decode computes the rest inside its own steps."""
        if self.borrowed is not None or not self.engine.deployment.decode_prefill:
            return
        for prefill in self.engine.prefills:
            request = prefill.borrowable(self)
            if request is None:
                continue
            if not request.reserved_tokens:
                need = self.reservation(request)
                if self.used + self.lent + need > self.capacity:
                    self.reclaim(self.used + self.lent + need - self.capacity)
                if self.used + need > self.capacity:
                    prefill.waiting.push(request)  # no room to hold its KV here: prefill keeps it
                    prefill.backlog_tokens += request.remaining_prefill
                    return
                self.used += need
                request.reserved_tokens = need
                self.waiting_transfer_tokens += need
            now = self.engine.env.now
            cached = prefill.cache.peek(request.keys) * PAGE_TOKENS
            request.cached_gpu_tokens = cached
            request.prefill_started_at = now
            request.state = "borrowed"
            self.engine.observer.on_prefill_start(request, now)
            self.borrowed = request
            self.engine.counters.borrowed_prefills += 1
            self.borrow_remaining = float(request.prompt_tokens - cached)
            delay = transfer_seconds(self.gpu, cached) if cached else 0.0  # nothing cached: nothing to move
            self.engine.env.schedule(delay, self._borrow_start, request)
            return

    def _borrow_start(self, request: Request) -> None:
        """The cached prefix is on decode: the suffix starts computing in the mixed steps."""
        if request is not self.borrowed or request.state != "borrowed":
            return
        self._advance(self.engine.env.now)
        self.borrow_computing = True
        self._reschedule()

    def _borrow_done(self) -> None:
        now = self.engine.env.now
        self.borrow_timer = None
        self._advance(now)
        request = self.borrowed
        assert request is not None
        self.borrowed = None
        self.borrow_computing = False
        self.borrow_remaining = 0.0
        self._reschedule()
        request.prefill_done_at = now
        self.engine.observer.on_prefill_done(request, now, request.prompt_tokens - request.cached_tokens)
        # Prefix and suffix are both on decode already: the request joins the batch.
        request.state = "transfer"
        self._borrowed_ready(request)
        self.try_borrow()

    def _borrowed_ready(self, request: Request) -> None:
        if request.state == "transfer":
            self.join(request)

    def join(self, request: Request) -> None:
        """The KV arrived: the request starts decoding."""
        now = self.engine.env.now
        self._advance(now)
        self.waiting_transfer_tokens -= request.reserved_tokens
        request.state = "decode"
        remaining = request.output_tokens - request.generated_before_retract
        request.join_v = self.v
        request.finish_v = self.v + remaining
        request.join_violations = self.violations
        self.members[request.rid] = request
        self.sum_prompt += request.prompt_tokens + request.generated_before_retract
        self.sum_join_v += self.v
        heapq.heappush(self.batch, (request.finish_v, request.rid, request))
        self._grow_for(request)
        self._reschedule()
        if request.first_token_at is None:
            request.first_token_at = now + self.step_s
            self.engine.observer.on_first_token(request, request.first_token_at)

    def _grow_for(self, request: Request) -> None:
        """Give a request whose output outgrows its reservation the memory it will need, retracting
        the latest-joined lower-priority requests when decode memory runs out (SGLang's retraction)."""
        need = request.prompt_tokens + request.output_tokens - request.reserved_tokens
        if need <= 0:
            return
        if self.used + self.lent + need > self.capacity:
            self.reclaim(self.used + self.lent + need - self.capacity)  # lent pages go before anyone
        while self.used + need > self.capacity:
            victims = [r for r in self.members.values() if r is not request]
            if not victims:
                break
            victim = max(victims, key=lambda r: (r.queue_key, r.join_v))
            self._retract(victim)
        self.used += need
        request.reserved_tokens += need

    def _retract(self, request: Request) -> None:
        generated = int(self.v - request.join_v)
        self._leave(request)
        request.generated_before_retract += generated
        request.retractions += 1
        self.engine.retracted(request)
        self.prealloc.push(request)  # it re-reserves, then recomputes its context on decode
        request.state = "decode_wait"

    def _leave(self, request: Request) -> None:
        del self.members[request.rid]
        self.sum_prompt -= request.prompt_tokens + request.generated_before_retract
        self.sum_join_v -= request.join_v
        self.used -= request.reserved_tokens
        request.reserved_tokens = 0
        request.itl_violating_steps += self.violations - request.join_violations

    def _finish_due(self) -> None:
        now = self.engine.env.now
        self.timer = None
        self._advance(now)
        finished = []
        while self.batch:
            finish_v, _, request = self.batch[0]
            if request.rid not in self.members:
                heapq.heappop(self.batch)
                continue
            if finish_v > self.v + 1e-6:
                break
            heapq.heappop(self.batch)
            self._leave(request)
            finished.append(request)
        self._reschedule()
        for request in finished:
            request.state = "done"
            request.done_at = now
            if request.lend:
                self.adopt(request)
            self.engine.finished(request)
            self.engine.observer.on_request_done(request, now)
        self.try_reserve()
        self.try_borrow()

    def abort(self, request: Request) -> None:
        if self.prealloc.remove(request):
            return
        if request is self.borrowed:
            self._advance(self.engine.env.now)
            self.borrowed = None
            self.borrow_computing = False
            if self.borrow_timer is not None:
                self.borrow_timer.cancel()
                self.borrow_timer = None
            self._reschedule()
        if request.rid in self.members:
            self._advance(self.engine.env.now)
            self._leave(request)
            self._reschedule()
        elif request.reserved_tokens:
            self.used -= request.reserved_tokens
            self.waiting_transfer_tokens -= request.reserved_tokens
            request.reserved_tokens = 0
        self.try_reserve()


@dataclass
class EngineCounters:
    submitted: int = 0
    completed: int = 0
    aborted: int = 0
    retractions: int = 0
    transfers: int = 0
    unit_fetches: int = 0
    borrowed_prefills: int = 0


class PDEngine:
    """The whole deployment behind its router."""

    def __init__(self, env: Environment, deployment: Deployment, observer: EngineObserver) -> None:
        deployment.validate()
        self.env = env
        self.deployment = deployment
        self.observer = observer
        self.prefills = [PrefillInstance(self, i) for i in range(deployment.prefill_instances)]
        self.decodes = [DecodeInstance(self, i) for i in range(deployment.decode_instances)]
        self.counters = EngineCounters()
        self._seq = itertools.count()
        self.requests: dict[int, Request] = {}
        self.units: dict[str, LentUnit] = {}  # each session's latest lent unit, wherever it lives

    # ---------------------------------------------------------------- routing
    def route_prefill(self, request: Request) -> PrefillInstance:
        prefills = self.prefills
        if len(prefills) == 1:
            return prefills[0]
        router = self.deployment.router
        if router == "affinity":
            return prefills[zlib.crc32(request.route_key.encode()) % len(prefills)]
        least_loaded = min(prefills, key=lambda p: (p.backlog_tokens, p.index))
        if router == "least_loaded":
            return least_loaded
        # cache_aware (SGLang router): the longest cached prefix if it covers enough of the prompt,
        # otherwise the least loaded instance.
        best = max(prefills, key=lambda p: (p.cache.peek(request.keys), -p.index))
        matched = best.cache.peek(request.keys)
        if request.keys and matched >= 0.5 * len(request.keys):
            return best
        return least_loaded

    def route_decode(self) -> DecodeInstance:
        """The decode instance with the least demand per capacity (the lowest index on a tie)."""
        best, best_load = self.decodes[0], math.inf
        for decode in self.decodes:  # a loop, not min(key=lambda): once per call
            load = (decode.used + decode.prealloc.tokens) / decode.capacity
            if load < best_load:
                best, best_load = decode, load
        return best

    # ---------------------------------------------------------------- lifecycle
    def submit(self, request: Request) -> None:
        request.released_at = self.env.now
        request.queue_seq = next(self._seq)
        self.counters.submitted += 1
        self.requests[request.rid] = request
        request.prefill = self.route_prefill(request)
        decode = self.route_decode()
        if self.deployment.allocation == "early":
            decode.request_reservation(request)
        else:
            request.decode = decode
            request.prefill.enqueue(request)

    def reserved(self, request: Request) -> None:
        """Decode reserved KV for the request: start (early) or transfer (prefill_complete)."""
        if request.retractions and request.prefill_done_at is not None:
            # A retracted request recomputes its context on the decode instance, then resumes.
            assert request.decode is not None
            gpu = self.deployment.gpu
            tokens = request.prompt_tokens + request.generated_before_retract
            self.env.schedule(prefill_seconds(gpu, tokens, 0), request.decode.join, request)
            return
        if self.deployment.allocation == "early":
            assert request.prefill is not None
            request.prefill.enqueue(request)
        else:
            self._transfer(request)

    def prefill_finished(self, request: Request) -> None:
        if self.deployment.allocation == "early":
            self._transfer(request)
        else:
            assert request.decode is not None
            request.decode.request_reservation(request)

    def _transfer(self, request: Request) -> None:
        request.state = "transfer"
        self.counters.transfers += 1
        self.env.schedule(
            pd_transfer_seconds(self.deployment.gpu, request.prompt_tokens), self._transfer_done, request
        )

    def _transfer_done(self, request: Request) -> None:
        if request.state != "transfer":
            return  # aborted meanwhile
        assert request.prefill is not None and request.decode is not None
        request.prefill.release(request)
        request.decode.join(request)

    def retracted(self, request: Request) -> None:
        self.counters.retractions += 1

    def finished(self, request: Request) -> None:
        self.requests.pop(request.rid, None)
        self.counters.completed += 1

    def abort(self, request: Request) -> None:
        """Remove a request wherever it is, freeing its reservations and cache locks."""
        if request.state in ("done", "aborted"):
            return
        if request.prefill is not None:
            request.prefill.abort(request)
        if request.decode is not None:
            request.decode.abort(request)
        request.state = "aborted"
        self.requests.pop(request.rid, None)
        self.counters.aborted += 1

    # ---------------------------------------------------------------- pins
    def pin(self, request: Request, ttl_s: float, rank: float) -> None:
        """Pin a finished request's prompt where prefill cached it (Continuum)."""
        if request.prefill is not None:
            request.prefill.pin(request.route_key, request.keys, ttl_s, rank)

    def unpin(self, route_key: str) -> None:
        for prefill in self.prefills:
            prefill.unpin(route_key)

    # ---------------------------------------------------------------- lending
    def fetch_unit(self, request: Request, matched_pages: int) -> int:
        """Pages of `request`'s prompt to take from its session's lent unit beyond the local match
        (the unit is consumed: prefill holds the prefix again)."""
        unit = self.units.get(request.route_key)
        if unit is None:
            return 0
        covered = common_prefix(unit.keys, request.keys)
        unit.decode.drop(unit)
        if covered <= matched_pages:
            return 0
        self.counters.unit_fetches += 1
        return covered - matched_pages

    def prefill_holds(self, unit: LentUnit) -> bool:
        return any(p.cache.peek(unit.keys) >= len(unit.keys) for p in self.prefills)

    def lent_tokens(self) -> int:
        return sum(d.lent for d in self.decodes)

    # ---------------------------------------------------------------- telemetry
    def prefill_backlog_tokens(self) -> int:
        return sum(p.backlog_tokens for p in self.prefills)

    def decode_waiting_requests(self) -> int:
        return sum(len(d.prealloc) for d in self.decodes)

    def decode_used_tokens(self) -> int:
        return sum(d.used for d in self.decodes)

    def decode_capacity_tokens(self) -> int:
        return sum(d.capacity for d in self.decodes)

    def decode_reserved_waiting_tokens(self) -> int:
        """Decode KV reserved by requests that are not decoding yet (awaiting prefill or transfer)."""
        return sum(d.waiting_transfer_tokens for d in self.decodes)
