"""Prefill side of decode-memory lending, in SGLang's prefill scheduler process (paper §6.2).

`PrefillFetcher` keeps the per-session index of the latest unit (which decode instance holds it, which
prompt), records a unit when a gateway-marked request's KV has gone to decode, and on the session's next
turn fetches what the unit covers beyond prefill's own radix match:

1. before SGLang's prefill admission pass, a waiting request of an indexed session is matched against
   the radix tree (SGLang's own `match_prefix`); when the unit covers more whole pages, the matched
   path is locked, destination pages are allocated (evicting from the tree if needed), and decode is
   asked to write the missing KV (`transfer.UnitFetch`, layer group by layer group, over NIXL);
2. while the fetch runs the request is held out of admission (it stays in SGLang's waiting queue, so
   aborts and bootstrap checks still see it); other requests are admitted as usual;
3. once every layer group has arrived, prefill's slots for [0, start) and the fetched slots are inserted
   into the radix tree under the prompt's tokens and the lock is dropped: SGLang's own prefix match at
   admission then finds the longer prefix and the request computes only the rest;
4. on a timeout, a refusal (decode has no matching unit any more) or a failed send, the request is
   admitted with its local match: it recomputes. A refused fetch's pages go back at once; a timed-out
   fetch's pages stay out of use until a grace period after the deadline sent with the request (decode
   posts no WRITE after it), so a late WRITE cannot land in pages another request already uses.

This is the host-side form of the fetch (the default): the request waits for the whole unit before its
forward pass. With `overlap` (`BASIN_ENGINE_LAYER_OVERLAP`) the request is instead left in the queue and
SGLang may admit it while its unit arrives: its prefix is then the locked local match plus the fetched
pages, which the request owns (`cache_protected_len` stays at the local match), the batch's attention
waits per layer group on the device (`overlap.py`), and the fetch is settled when that batch's result is
processed: complete, the request goes on as SGLang's own and its checkpoint puts the fetched pages in the
tree; failed, its output is dropped, its KV released without insertion (the fetched pages quarantined
as after a timeout) and it is queued again to recompute from its local match. A fetch that concludes
before SGLang admitted its request is settled on the host as above.

The held-unit report (which indexed units prefill's own tree still covers in full,
so decode reclaims those first) goes to every known decode instance on a timer.

Hybrid (Mamba / gated-delta) models, host-side form only: SGLang's prefill tree (`UnifiedRadixCache` with
the FULL and MAMBA components) matches a prefix only up to a node that holds a Mamba state
(`MambaComponent.create_match_validator`), and admission copies that node's state into the request's own
slot (`finalize_match_result_in_cache` with `cow_mamba`, the copy run by the model runner before the
forward). A recurrent state is valid at exactly one token position, and decode's unit holds the state
after its whole prompt, so a hybrid fetch is made only when the unit's pages cover exactly that prompt
(its length a whole number of pages, indexed only then) and the next prompt extends it. Prefill takes one
Mamba slot from SGLang's `MambaSlotAllocator` for the fetch; decode writes the unit's pages and state into
it; on completion the pages and the slot are inserted into the tree (the slot as the MAMBA value of the
node at the unit's end, as SGLang's own `cache_unfinished_req` inserts a donated state), so SGLang's
match finds the fetched prefix with its state and the request resumes exactly there. A failed fetch's
slot is freed (refusal) or quarantined with its pages (timeout) and never reaches the tree or a request.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from basin.tokens import common_prefix
from basin_engine_ext.config import LEND_KEY, SESSION_KEY
from basin_engine_ext.transfer import (
    IndexedUnit,
    KVLayout,
    NoticeRouter,
    PrefillUnitIndex,
    StateLayout,
    UnitFetch,
    encode_fetch,
    encode_held,
    make_agent,
)

logger = logging.getLogger(__name__)

FETCHER_ATTR = "_basin_fetcher"  # on the scheduler (and its allocator, for the memory check)
DECODE_ATTR = "_basin_decode"  # on a request: the decode unit-service address it was sent to
CHECKED_ATTR = "_basin_fetch_checked"  # on a request: its unit was already looked up
TAIL_ATTR = "_basin_fetch_tail"  # on a waiting request whose prefix includes a fetch's pages: the fetch
LAYERS_PER_GROUP = 4
HELD_REPORT_INTERVAL_S = 5.0
LATE_WRITE_GRACE_S = 2.0


def session_of(req: Any) -> str | None:
    """The gateway's session id on a request (`custom_params.basin_session`), lending or not."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    session = params.get(SESSION_KEY)
    return str(session) if session else None


def lends(req: Any) -> bool:
    params = getattr(req.sampling_params, "custom_params", None) or {}
    return bool(params.get(LEND_KEY)) and session_of(req) is not None


@dataclass
class _Fetching:
    req: Any
    session: str
    unit: IndexedUnit  # the index entry the fetch was planned from
    fetch: UnitFetch
    lock: Any  # SGLang TreeLock on the local match, held until the insert
    matched: torch.Tensor  # prefill's own slots of prompt tokens [0, start)
    tokens: list[int]  # prompt tokens [0, end)
    attached: bool = False  # in a batch SGLang is running: settled with that batch's result
    state: torch.Tensor | None = None  # hybrid: the Mamba slot decode writes the state at `end` into

    @property
    def start(self) -> int:
        return len(self.matched)

    @property
    def end(self) -> int:
        return len(self.tokens)


class PrefillFetcher:
    """Unit index, fetches and held-unit reports of one prefill scheduler (one TP rank).

    `tree_cache` is SGLang's `UnifiedRadixCache` over an MHA pool; `connect(address)` returns a zmq PUSH
    socket to a decode unit service; `unit_port` + `tp_rank` is where decode serves (same TP on both)."""

    def __init__(
        self,
        tree_cache: Any,
        agent: Any,
        agent_name: str,
        layout: KVLayout,
        connect: Callable[[str], Any],
        *,
        unit_port: int,
        tp_rank: int = 0,
        timeout_s: float = 2.0,
        layers_per_group: int = LAYERS_PER_GROUP,
        metrics: Any = None,
        held_interval_s: float = HELD_REPORT_INTERVAL_S,
        late_write_grace_s: float = LATE_WRITE_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        overlap: bool = False,
        flags_device: str = "cpu",
        state_pool: Any = None,
    ):
        # Hybrid models: SGLang's HybridReqToTokenPool (its Mamba pool and slot allocator). The per-layer
        # overlap does not apply (the state must be whole before the first linear layer runs).
        self.state_pool = state_pool
        self.state_layout = StateLayout.from_pool(state_pool.mamba_pool) if state_pool is not None else None
        overlap = overlap and state_pool is None
        self.overlap = overlap
        self.flags_device = flags_device  # where the wait kernel reads the flags: the model's device
        self.tree_cache = tree_cache
        self.allocator = tree_cache.token_to_kv_pool_allocator
        self.agent, self.agent_name, self.layout = agent, agent_name, layout
        self.connect = connect
        self.unit_port, self.tp_rank = unit_port, tp_rank
        self.timeout_s, self.layers_per_group = timeout_s, layers_per_group
        self.metrics = metrics
        self.held_interval_s, self.clock = held_interval_s, clock
        self.late_write_grace_s = late_write_grace_s
        # (free after, wall clock; KV slots; Mamba slot or None)
        self._quarantine: list[tuple[float, torch.Tensor, torch.Tensor | None]] = []
        self.index = PrefillUnitIndex()
        self.router = NoticeRouter(agent)
        self.fetching: dict[str, _Fetching] = {}  # by request id
        self.outcomes: list[tuple[str, str, int]] = []  # (rid, reason, fetched tokens), most recent last
        self._sockets: dict[str, Any] = {}
        self._ids = itertools.count()
        self._next_report = clock() + held_interval_s
        setattr(self.allocator, FETCHER_ATTR, self)
        if state_pool is not None:
            setattr(state_pool, FETCHER_ATTR, self)

    # ------------------------------------------------------------------ recording
    def decode_address(self, endpoint: str) -> str:
        return f"{endpoint}:{self.unit_port + self.tp_rank}"

    def note_decode(self, req: Any) -> None:
        """Remember which decode instance a marked request's KV goes to (read from the KV sender's
        bootstrap info, which the transfer worker drops once the transfer is done)."""
        if getattr(req, DECODE_ATTR, None) is not None or not lends(req):
            return
        endpoint = decode_endpoint(req)
        if endpoint is not None:
            setattr(req, DECODE_ATTR, self.decode_address(endpoint))

    def record_sent(self, req: Any) -> None:
        """A marked request's KV reached decode: its prompt's whole pages are now the session's latest
        unit there (if decode adopts it; a refused or reclaimed unit is answered with a miss later)."""
        decode = getattr(req, DECODE_ATTR, None)
        if decode is None or not lends(req):
            return
        prompt = list(req.origin_input_ids)
        whole = (len(prompt) // self.layout.page_size) * self.layout.page_size
        if self.state_pool is not None and whole != len(prompt):
            return  # decode's state is at the prompt's end, past its last whole page: never usable
        if whole > 0:
            self.index.record(session_of(req), decode, prompt[:whole])

    # ------------------------------------------------------------------ admission
    def before_admission(self, waiting_queue: Iterable[Any]) -> list[Any]:
        """Conclude finished fetches, start fetches for newly waiting requests of indexed sessions, send
        the held-unit report when due; returns the requests to keep out of this admission pass."""
        self.poll()
        for req in waiting_queue:
            self.note_decode(req)
            if getattr(req, CHECKED_ATTR, False):
                continue
            setattr(req, CHECKED_ATTR, True)
            self._maybe_start(req)
        if self.clock() >= self._next_report:
            self.report_held()
        if self.overlap:  # SGLang may admit them now (`extend_match`); a fetch that ends first is polled
            return [f.req for f in self.fetching.values() if not overlap_eligible(f.req)]
        return [f.req for f in self.fetching.values()]

    def poll(self) -> None:
        for rid, f in list(self.fetching.items()):
            if f.fetch.concluded and not f.attached:  # an attached fetch is settled with its batch
                if getattr(f.req, TAIL_ATTR, None) is f:
                    delattr(f.req, TAIL_ATTR)
                del self.fetching[rid]
                self._conclude(rid, f)
        now = time.time()
        due = [q for q in self._quarantine if q[0] <= now]
        self._quarantine = [q for q in self._quarantine if q[0] > now]
        for _, slots, state in due:
            self.allocator.free(slots)
            self._free_state(state)

    def inflight_tokens(self) -> int:
        """Slots of fetches still running or of timed-out fetches in their grace period (owned by neither
        a request nor the tree)."""
        running = sum(
            int(f.fetch.dst_slots.numel())
            for f in self.fetching.values()
            if f.fetch.dst_slots is not None and not f.attached  # attached: in the request's row
        )
        return running + sum(int(slots.numel()) for _, slots, _ in self._quarantine)

    def inflight_states(self) -> int:
        """Mamba slots of fetches still running or in their grace period (owned by neither a request nor
        the tree)."""
        running = sum(1 for f in self.fetching.values() if f.state is not None)
        return running + sum(1 for _, _, state in self._quarantine if state is not None)

    def _free_state(self, state: torch.Tensor | None) -> None:
        if state is not None:
            self.state_pool.mamba_allocator.free(state)

    def _alloc_state(self) -> torch.Tensor | None:
        """One Mamba slot for a fetch's state, evicting a tree state (SGLang's own eviction) if none is
        free; None when the pool has no room."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        slots = self.state_pool.mamba_allocator
        state = slots.alloc(1)
        if state is None:
            self.tree_cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=1))
            state = slots.alloc(1)
        return state

    def _maybe_start(self, req: Any) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        session = session_of(req)
        unit = self.index.lookup(session) if session is not None else None
        if unit is None:
            return
        prompt = list(req.origin_input_ids)
        ps = self.layout.page_size
        # SGLang's own match keeps at least the prompt's last token to compute; fetch no further.
        usable = ((len(prompt) - 1) // ps) * ps
        end = min((common_prefix(unit.token_ids, prompt) // ps) * ps, usable)
        if self.state_pool is not None and end != len(unit.token_ids):
            # decode's state is at the unit's end only; a shorter prefix has no state to resume from
            if self.metrics is not None:
                self.metrics.unit_misses.inc()
            return
        # On a hybrid tree SGLang's match stops at the last node holding a Mamba state.
        result = self.tree_cache.match_prefix(MatchPrefixParams(key=self._key(req, prompt)))
        start = (result.device_prefix_len // ps) * ps
        if end <= start:
            if self.metrics is not None:  # the unit adds nothing to prefill's own cache
                self.metrics.unit_misses.inc()
            return
        lock = self.tree_cache.lock(result.last_device_node)
        matched = self.tree_cache.path_device_indices(result.last_device_node)[:start]
        n = end - start
        if self.allocator.available_size() < n:
            evict_from_tree_cache(self.tree_cache, n)
        state = None
        if self.state_pool is not None:
            state = self._alloc_state()
            if state is None:
                self.tree_cache.unlock(lock)
                self.outcomes.append((req.rid, "no room", 0))
                return
        sock = self._socket(unit.decode)
        fetch = UnitFetch(
            self.agent, self.agent_name, self.allocator, self.layout,
            send=lambda request: _send(sock, encode_fetch(request)),
            peer_alive=lambda: True,  # a lost decode is noticed by the timeout
            timeout_s=self.timeout_s, layers_per_group=self.layers_per_group,
            metrics=self.metrics, device=self.flags_device, router=self.router,
        )  # fmt: skip
        fetch_id = f"{req.rid}-{next(self._ids)}"
        dst_state = int(state[0]) if state is not None else -1
        if not fetch.start(fetch_id, session, prompt[:end], start, end, dst_state, self.state_layout):
            self._free_state(state)
            self.tree_cache.unlock(lock)
            self.outcomes.append((req.rid, "no room", 0))
            return
        self.fetching[req.rid] = _Fetching(
            req, session, unit, fetch, lock, matched, prompt[:end], state=state
        )

    def _conclude(self, rid: str, f: _Fetching) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        outcome = f.fetch.finish(free=False)
        if not outcome.complete:
            self._give_up(rid, f, outcome)
            return
        slots = f.fetch.dst_slots
        value = torch.cat([f.matched.to(slots.dtype), slots])
        # Tokens [0, start) are the tree's own slots (locked); insert takes ownership of the fetched
        # ones and frees any the tree meanwhile got from another request. A hybrid fetch's state slot
        # becomes the MAMBA value of the node at the unit's end (as SGLang's `cache_unfinished_req`
        # inserts a donated state); if that node got a state meanwhile, the tree keeps its own.
        result = self.tree_cache.insert(
            InsertParams(
                key=self._key(f.req, f.tokens), value=value, prev_prefix_len=len(f.matched),
                mamba_value=f.state,
            )
        )  # fmt: skip
        if f.state is not None and result.mamba_exist:
            self._free_state(f.state)
        f.state = None
        fetched = len(f.tokens) - len(f.matched)
        f.fetch.dst_slots = None
        self.tree_cache.unlock(f.lock)
        self._record(rid, outcome.reason, fetched)

    def _give_up(self, rid: str, f: _Fetching, outcome: Any) -> None:
        """A failed fetch: its pages go back (at once after a refusal, after the grace period otherwise),
        the local match is unlocked, the index learns what failed."""
        if outcome.reason == "refused":  # decode said it writes nothing (more): pages back at once
            self.allocator.free(f.fetch.dst_slots)
            self._free_state(f.state)
            if self.index.lookup(f.session) is f.unit:  # decode no longer holds that unit
                self.index.forget(f.session)
        else:  # timeout, lost peer: decode may still post a WRITE until the deadline
            self._quarantine.append((f.fetch.deadline + self.late_write_grace_s, f.fetch.dst_slots, f.state))
            # A decode instance that let one fetch time out is likely gone or stalled: stop sending its
            # sessions' turns into the same wait; their next sent turns index them again.
            self.index.forget_decode(f.unit.decode)
        f.fetch.dst_slots = None
        f.state = None
        logger.info("basin unit fetch for %s: %s, recomputing", rid, outcome.reason)
        self.tree_cache.unlock(f.lock)
        self._record(rid, outcome.reason, 0)

    def _record(self, rid: str, reason: str, fetched: int) -> None:
        self.outcomes.append((rid, reason, fetched))
        del self.outcomes[:-64]

    # ------------------------------------------------------------------ per-layer overlap
    def extend_match(self, req: Any) -> None:
        """After SGLang matched a waiting request (`Req.init_next_round_input`): if its unit is still
        arriving and the tree matched exactly the locked local part, extend its prefix over the fetched
        pages, so admission computes only the rest. The request owns those pages (its
        `cache_protected_len` stays at the local match, set by SGLang's match)."""
        f = self.fetching.get(req.rid)
        if getattr(req, TAIL_ATTR, None) is not None:
            delattr(req, TAIL_ATTR)
        if not self.overlap or f is None or f.req is not req or f.attached or not overlap_eligible(req):
            return
        monitor = f.fetch.monitor
        if monitor is not None and monitor.outcome is not None and not monitor.outcome.complete:
            return  # failed already: the next poll gives it up, the request recomputes
        if req.prefix_len != f.start:  # the tree changed under the request (no longer our locked path)
            return
        req.prefix_len = f.end
        req.num_matched_prefix_tokens = f.end
        setattr(req, TAIL_ATTR, f)

    def attach(self, reqs: Iterable[Any]) -> list[Any]:
        """SGLang admitted these requests into a prefill batch: those carrying a fetch's pages now run
        with them; register their flags for the attention hook. Returns the attached requests."""
        from basin_engine_ext import overlap

        attached = []
        for req in reqs:
            f = getattr(req, TAIL_ATTR, None)
            if f is None or self.fetching.get(req.rid) is not f:
                continue
            f.attached = True
            overlap.register(req.rid, f.fetch.flags)
            attached.append(req)
        return attached

    def settle(self, reqs: list[Any]) -> list[tuple[int, Any, _Fetching]]:
        """After a batch's forward pass (its result is being processed): conclude the fetches it carried.
        A fetch is good only if it completed and every layer group's wait saw READY; the others are
        returned (batch position, request, fetch) for the caller to drop and recompute."""
        from basin_engine_ext import overlap

        failed = []
        for i, req in enumerate(reqs):
            f = getattr(req, TAIL_ATTR, None)
            if f is None or not f.attached or self.fetching.get(req.rid) is not f:
                continue
            del self.fetching[req.rid]
            delattr(req, TAIL_ATTR)
            overlap.unregister(req.rid)
            outcome = f.fetch.finish(free=False)
            if outcome.complete and f.fetch.flags.all_seen_ready():
                f.fetch.dst_slots = None  # the request's pages now; its checkpoint puts them in the tree
                self.tree_cache.unlock(f.lock)
                self._record(req.rid, outcome.reason, f.end - f.start)
            else:
                failed.append((i, req, f))
        return failed

    def recompute(self, req: Any, f: _Fetching, waiting_queue: list[Any]) -> None:
        """A request whose batch read a failed fetch: release its KV without inserting anything into the
        tree (the fetched pages kept out of the free list, then quarantined), reset it as SGLang resets
        a retracted request, and queue it first again; it recomputes from its local match."""
        self._drop_kv(req, f)
        req.reset_for_retract()
        if hasattr(req, "advance_cache_request_handle"):
            req.advance_cache_request_handle()
        waiting_queue.insert(0, req)

    def invalidate(self, req: Any, f: _Fetching) -> None:
        """A failed fetch in a batch whose result cannot be split per request: SGLang aborts the request
        (its KV is released without insertion and never sent) rather than pass on invalid output."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        req.kv.cache_protected_len = f.end  # SGLang's release must leave the fetched pages to us
        self._give_up(req.rid, f, _failed(f))
        req.discard_output_reason = FINISH_ABORT("basin: unit fetch failed during the forward pass")

    def _drop_kv(self, req: Any, f: _Fetching) -> None:
        from sglang.srt.mem_cache.common import release_kv_cache

        finish = getattr(self.tree_cache, "finish", None)
        handle = getattr(req, "cache_request_handle", None)
        if finish is not None and handle is not None:
            from sglang.srt.mem_cache.base_prefix_cache import CacheRequestOutcome

            finish(handle, CacheRequestOutcome.ABORT)
        # SGLang's release frees [cache_protected_len, owned): raising the protected length to the
        # fetch's end leaves the fetched pages to `_give_up` (a late WRITE may still land in them).
        req.kv.cache_protected_len = f.end
        release_kv_cache(req, self.tree_cache, checkpoint=False)
        self._give_up(req.rid, f, _failed(f))

    # ------------------------------------------------------------------ held report
    def report_held(self) -> None:
        """Tell every known decode instance which of its units prefill's own tree still covers in full
        (a read-only walk of the tree: no split, no LRU refresh)."""
        self._next_report = self.clock() + self.held_interval_s
        from sglang.srt.mem_cache.radix_cache import RadixKey

        core = self.tree_cache.tree_core

        def covered(tokens: list[int]) -> int:
            return core.match_full_device_prefix(RadixKey(array("q", tokens)))[0]

        held = self.index.held_sessions(covered)
        for decode in self.index.decodes():
            _send(self._socket(decode), encode_held(held.get(decode, [])))

    # ------------------------------------------------------------------ internals
    def _key(self, req: Any, tokens: list[int]) -> Any:
        from sglang.srt.mem_cache.radix_cache import RadixKey

        # SGLang's tree keys are int64 arrays
        return RadixKey(array("q", tokens), extra_key=req.extra_key, cache_salt=req.cache_salt)

    def _socket(self, address: str) -> Any:
        if address not in self._sockets:
            self._sockets[address] = self.connect(address)
        return self._sockets[address]

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()


def overlap_eligible(req: Any) -> bool:
    """Requests whose batch result can drop them alone if their fetch fails: no per-token outputs
    (input logprobs, hidden states, sampling masks) and no grammar state advanced by the result."""
    return not (
        getattr(req, "return_logprob", False)
        or getattr(req, "return_hidden_states", False)
        or getattr(req, "return_sampling_mask", False)
        or getattr(req, "grammar", None) is not None
    )


def _failed(f: _Fetching) -> Any:
    """The fetch's verdict for `_give_up` (a fetch that completed but was not seen READY counts as a
    timeout: its pages are quarantined)."""
    from basin_engine_ext.layer_wait import FetchOutcome

    outcome = f.fetch.monitor.outcome if f.fetch.monitor is not None else None
    if outcome is not None and not outcome.complete:
        return outcome
    return FetchOutcome(False, "timeout", 0, 0.0)


def _send(sock: Any, frames: list[bytes]) -> None:
    """Never block the scheduler: a full or unconnected queue drops the message (a fetch then times out
    and recomputes; a held report is sent again on the next timer)."""
    import zmq

    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        logger.warning("basin: decode unit service not reachable, message dropped")


def zmq_connect(address: str) -> Any:
    import zmq

    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    return sock


def decode_endpoint(req: Any) -> str | None:
    """The decode host a prefill request's KV goes to, from the NIXL/Mooncake sender's bootstrap info."""
    sender = getattr(req, "disagg_kv_sender", None)
    kv_mgr = getattr(sender, "kv_mgr", None)
    infos = getattr(kv_mgr, "transfer_infos", None)
    room = getattr(req, "bootstrap_room", None)
    if not infos or room is None:
        return None
    for info in (infos.get(room) or {}).values():
        endpoint = getattr(info, "endpoint", None)
        if endpoint:
            return str(endpoint)
    return None


# ---------------------------------------------------------------------- SGLang hooks
def fetcher_for(scheduler: Any, config: Any) -> PrefillFetcher | None:
    """The scheduler's fetcher, made on first use on a PD prefill scheduler with TP = PP = 1 whose tree is
    SGLang's unified radix cache over a full-attention MHA pool, or over an MHA + Mamba hybrid pool as
    `_hybrid_fetch_refusal` describes (None elsewhere: decode, mixed, other pools, larger TP)."""
    existing = getattr(scheduler, FETCHER_ATTR, None)
    if existing is not None:
        return existing or None
    fetcher: PrefillFetcher | bool = False
    try:
        fetcher = _make_fetcher(scheduler, config) or False
    finally:
        setattr(scheduler, FETCHER_ATTR, fetcher)
    return fetcher or None


def _make_fetcher(scheduler: Any, config: Any) -> PrefillFetcher | None:
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if getattr(scheduler, "disaggregation_mode", None) != DisaggregationMode.PREFILL:
        return None
    tp_size, pp_size, tp_rank = _parallel(scheduler)
    if tp_size != 1 or pp_size != 1:
        # Each rank would decide on its own when a fetch concluded, and SGLang's ranks must admit the
        # same requests: a fetch needs a rank-wide agreement (an all-reduce of outcomes) not built yet.
        logger.warning("basin unit fetch off: needs TP = PP = 1 on prefill")
        return None
    tree = scheduler.tree_cache
    pool = tree.token_to_kv_pool_allocator.get_kvcache()
    if not isinstance(tree, UnifiedRadixCache) or not tree.supports_prefix_sharing():
        logger.warning("basin unit fetch off: %s is not an enabled unified radix cache", type(tree).__name__)
        return None
    state_pool = None
    if type(pool) is not MHATokenToKVPool:
        why = _hybrid_fetch_refusal(tree, pool)
        if why is not None:
            logger.warning(
                "basin unit fetch off: %s over %s: %s", type(tree).__name__, type(pool).__name__, why
            )
            return None
        state_pool, pool = tree.req_to_token_pool, pool.full_kv_pool
        if config.layer_overlap:
            logger.warning(
                "basin per-layer overlap off on a hybrid model: a fetching request waits on the host "
                "(its recurrent state must be whole before the first linear layer runs)"
            )
    layout = KVLayout.from_pool(pool)
    mem_type = "VRAM" if str(pool.device).startswith("cuda") else "DRAM"
    name = f"basin-prefill-{socket.gethostname()}-{os.getpid()}-{tp_rank}"
    from basin_engine_ext.hooks import engine_metrics

    overlap = config.layer_overlap and state_pool is None
    state = StateLayout.from_pool(state_pool.mamba_pool) if state_pool is not None else None
    fetcher = PrefillFetcher(
        tree, make_agent(name, layout, mem_type, state), name, layout, zmq_connect,
        unit_port=config.unit_port, tp_rank=tp_rank, timeout_s=config.fetch_timeout_s,
        metrics=engine_metrics(), overlap=overlap, flags_device=str(pool.device) if overlap else "cpu",
        state_pool=state_pool,
    )  # fmt: skip
    logger.info(
        "basin unit fetch on%s: agent %s, decode unit port %d",
        " (hybrid: full-attention pages and recurrent state)" if state_pool is not None else "",
        name,
        config.unit_port,
    )
    return fetcher


def _hybrid_fetch_refusal(tree: Any, pool: Any) -> str | None:
    """Why a prefill tree over a non-MHA pool cannot take hybrid unit fetches (None: it can).

    Wired: SGLang's `HybridLinearKVPool` whose full-attention layers are an `MHATokenToKVPool`, the tree's
    components exactly FULL and MAMBA, its request pool a `HybridReqToTokenPool` over a plain `MambaPool`
    with SGLang's `MambaSlotAllocator`, without the Mamba extra buffer (`no_buffer`: states at sequence ends
    only, page size 1, which SGLang asserts), without int8 state checkpoints (the tree's values would be
    checkpoint slots, not Mamba slots) and without ReplaySSM rings (a slot's temporal state lags its
    ring)."""
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
    from sglang.srt.mem_cache.memory_pool import (
        HybridLinearKVPool,
        HybridReqToTokenPool,
        MambaPool,
        MHATokenToKVPool,
    )
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    req_pool = getattr(tree, "req_to_token_pool", None)
    full = getattr(pool, "full_kv_pool", None)
    if type(pool) is not HybridLinearKVPool or type(full) is not MHATokenToKVPool:
        return "not an MHA pool nor a hybrid pool with MHA full-attention layers"
    if tuple(tree.tree_components) != (ComponentType.FULL, ComponentType.MAMBA):
        return f"tree components {tree.tree_components} are not FULL and MAMBA"
    if (
        type(req_pool) is not HybridReqToTokenPool
        or type(req_pool.mamba_pool) is not MambaPool
        or type(req_pool.mamba_allocator) is not MambaSlotAllocator
        or req_pool.mamba_pool is not pool.mamba_pool
    ):
        return "request pool is not SGLang's HybridReqToTokenPool over the KV pool's plain MambaPool"
    if getattr(tree, "enable_mamba_extra_buffer", False):
        # SGLang's `auto` strategy picks the extra buffer whenever overlap scheduling is on or pages are
        # larger than 1 (and the model supports it). Its tree names states only at multiples of the
        # checkpoint grid (`mamba_checkpoint_grid`: lcm of the Mamba chunk size and the page), while a
        # unit's state sits at its prompt's end; its ping-pong tracking was not traced for a fetched state.
        return (
            "the Mamba extra buffer keeps tree states on its checkpoint grid, a unit's state is at its "
            "prompt end (run prefill with --mamba-radix-cache-strategy no_buffer)"
        )
    if getattr(req_pool, "mamba_ckpt_pool", None) is not None:
        return "int8 Mamba checkpoints are not wired"
    if getattr(req_pool.mamba_pool, "replayssm_write_pos", None) is not None:
        return "ReplaySSM state rings are not wired"
    return None


def _parallel(scheduler: Any) -> tuple[int, int, int]:
    """(TP size, PP size, TP rank) from SGLang's runtime context, published in every scheduler process;
    outside one (tests) from the scheduler object's own fields."""
    from sglang.srt.runtime_context import get_parallel

    try:
        parallel = get_parallel()
        return int(parallel.tp_size), int(parallel.pp_size), int(parallel.tp_rank)
    except (ValueError, RuntimeError):  # not published (or only in part): outside a scheduler
        return (
            int(getattr(scheduler, "tp_size", 1)),
            int(getattr(scheduler, "pp_size", 1)),
            int(getattr(scheduler, "tp_rank", 0)),
        )


def hold_fetching_requests(fetcher: PrefillFetcher, scheduler: Any, admit: Callable[[], Any]) -> Any:
    """Run one SGLang admission pass (`admit`) with requests whose unit is still arriving taken out of
    the waiting queue, then put them back in their places."""
    queue = list(scheduler.waiting_queue)
    held = set(map(id, fetcher.before_admission(queue)))
    if not held:
        return admit()
    scheduler.waiting_queue = [req for req in queue if id(req) not in held]
    try:
        return admit()
    finally:
        remaining = set(map(id, scheduler.waiting_queue))
        restored = [req for req in queue if id(req) in held or id(req) in remaining]
        known = set(map(id, queue))
        scheduler.waiting_queue = restored + [req for req in scheduler.waiting_queue if id(req) not in known]
