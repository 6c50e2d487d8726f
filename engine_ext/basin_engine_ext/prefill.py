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

This is the host-side form of the fetch: the request waits for the whole unit before its forward pass.
The per-layer form (admit at once, launch `layer_wait`'s kernel before each layer) is not wired into
SGLang's forward yet. The held-unit report (which indexed units prefill's own tree still covers in full,
so decode reclaims those first) goes to every known decode instance on a timer.
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
    UnitFetch,
    encode_fetch,
    encode_held,
    make_agent,
)

logger = logging.getLogger(__name__)

FETCHER_ATTR = "_basin_fetcher"  # on the scheduler (and its allocator, for the memory check)
DECODE_ATTR = "_basin_decode"  # on a request: the decode unit-service address it was sent to
CHECKED_ATTR = "_basin_fetch_checked"  # on a request: its unit was already looked up
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
    ):
        self.tree_cache = tree_cache
        self.allocator = tree_cache.token_to_kv_pool_allocator
        self.agent, self.agent_name, self.layout = agent, agent_name, layout
        self.connect = connect
        self.unit_port, self.tp_rank = unit_port, tp_rank
        self.timeout_s, self.layers_per_group = timeout_s, layers_per_group
        self.metrics = metrics
        self.held_interval_s, self.clock = held_interval_s, clock
        self.late_write_grace_s = late_write_grace_s
        self._quarantine: list[tuple[float, torch.Tensor]] = []  # (free after, wall clock; slots)
        self.index = PrefillUnitIndex()
        self.router = NoticeRouter(agent)
        self.fetching: dict[str, _Fetching] = {}  # by request id
        self.outcomes: list[tuple[str, str, int]] = []  # (rid, reason, fetched tokens), most recent last
        self._sockets: dict[str, Any] = {}
        self._ids = itertools.count()
        self._next_report = clock() + held_interval_s
        setattr(self.allocator, FETCHER_ATTR, self)

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
        return [f.req for f in self.fetching.values()]

    def poll(self) -> None:
        for rid, f in list(self.fetching.items()):
            if f.fetch.concluded:
                del self.fetching[rid]
                self._conclude(rid, f)
        now = time.time()
        due = [slots for after, slots in self._quarantine if after <= now]
        self._quarantine = [(after, slots) for after, slots in self._quarantine if after > now]
        for slots in due:
            self.allocator.free(slots)

    def inflight_tokens(self) -> int:
        """Slots of fetches still running or of timed-out fetches in their grace period (owned by neither
        a request nor the tree)."""
        running = sum(
            int(f.fetch.dst_slots.numel()) for f in self.fetching.values() if f.fetch.dst_slots is not None
        )
        return running + sum(int(slots.numel()) for _, slots in self._quarantine)

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
        sock = self._socket(unit.decode)
        fetch = UnitFetch(
            self.agent, self.agent_name, self.allocator, self.layout,
            send=lambda request: _send(sock, encode_fetch(request)),
            peer_alive=lambda: True,  # a lost decode is noticed by the timeout
            timeout_s=self.timeout_s, layers_per_group=self.layers_per_group,
            metrics=self.metrics, device="cpu", router=self.router,
        )  # fmt: skip
        fetch_id = f"{req.rid}-{next(self._ids)}"
        if not fetch.start(fetch_id, session, prompt[:end], start, end):
            self.tree_cache.unlock(lock)
            self.outcomes.append((req.rid, "no room", 0))
            return
        self.fetching[req.rid] = _Fetching(req, session, unit, fetch, lock, matched, prompt[:end])

    def _conclude(self, rid: str, f: _Fetching) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        outcome = f.fetch.finish(free=False)
        fetched = 0
        if outcome.complete:
            slots = f.fetch.dst_slots
            value = torch.cat([f.matched.to(slots.dtype), slots])
            # Tokens [0, start) are the tree's own slots (locked); insert takes ownership of the fetched
            # ones and frees any the tree meanwhile got from another request.
            self.tree_cache.insert(
                InsertParams(key=self._key(f.req, f.tokens), value=value, prev_prefix_len=len(f.matched))
            )
            fetched = len(f.tokens) - len(f.matched)
        elif outcome.reason == "refused":  # decode said it writes nothing (more): pages back at once
            self.allocator.free(f.fetch.dst_slots)
            if self.index.lookup(f.session) is f.unit:  # decode no longer holds that unit
                self.index.forget(f.session)
        else:  # timeout: decode may still post a WRITE until the deadline
            self._quarantine.append((f.fetch.deadline + self.late_write_grace_s, f.fetch.dst_slots))
            # A decode instance that let one fetch time out is likely gone or stalled: stop sending its
            # sessions' turns into the same wait; their next sent turns index them again.
            self.index.forget_decode(f.unit.decode)
        f.fetch.dst_slots = None
        if not outcome.complete:
            logger.info("basin unit fetch for %s: %s, recomputing", rid, outcome.reason)
        self.tree_cache.unlock(f.lock)
        self.outcomes.append((rid, outcome.reason, fetched))
        del self.outcomes[:-64]

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
    SGLang's unified radix cache over a full-attention MHA pool (None elsewhere: decode, mixed, other
    pools, larger TP)."""
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
    if (
        not isinstance(tree, UnifiedRadixCache)
        or not tree.supports_prefix_sharing()
        or type(pool) is not MHATokenToKVPool
    ):
        logger.warning(
            "basin unit fetch off: %s over %s is not a unified radix cache over an MHA pool",
            type(tree).__name__,
            type(pool).__name__,
        )
        return None
    layout = KVLayout.from_pool(pool)
    mem_type = "VRAM" if str(pool.device).startswith("cuda") else "DRAM"
    name = f"basin-prefill-{socket.gethostname()}-{os.getpid()}-{tp_rank}"
    from basin_engine_ext.hooks import engine_metrics

    fetcher = PrefillFetcher(
        tree, make_agent(name, layout, mem_type), name, layout, zmq_connect,
        unit_port=config.unit_port, tp_rank=tp_rank, timeout_s=config.fetch_timeout_s,
        metrics=engine_metrics(),
    )  # fmt: skip
    logger.info("basin unit fetch on: agent %s, decode unit port %d", name, config.unit_port)
    return fetcher


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
