"""The hooks this plugin places on SGLang 0.5.23, each a small function over SGLang's own objects.

Targets (dotted paths resolved by SGLang's HookRegistry, which also rebinds `from X import f` copies):
- `DecodePreallocQueue.__init__` (AFTER): attach a `DecodeLender` to the decode allocator;
- `DecodePreallocQueue.pop_preallocated` (BEFORE): poll the unit service (when `BASIN_ENGINE_UNIT_PORT`
  is set), then reclaim units at the lower margin against running plus queued decode demand, so queued
  requests find their room;
- `BaseTokenToKVPoolAllocator.evict_to_free_tokens` (AROUND): after SGLang's own tree eviction, free
  lent units before the caller falls back to retracting a running request;
- `mem_cache.common.release_kv_cache` (BEFORE): a finished, gateway-marked request's prompt pages become
  the session's unit instead of going back to the free list;
- `SchedulerInvariantChecker._check_full_pool` (AROUND): count lent slots in SGLang's memory-conservation
  check (available + evictable + protected + held + request-owned = total), which otherwise reports
  them as a leak;
- `PagedTokenToKVPoolAllocator.clear`, `TokenToKVPoolAllocator.clear` (AFTER): a cache flush returns
  every page, units included, so the lender forgets its units rather than free them twice later;
- hybrid (Mamba / gated-delta) decode pools only: `ScheduleBatchDisaggregationDecodeMixin.process_prebuilt`
  (BEFORE) copies a marked request's recurrent state, still the prompt-end state the transfer delivered,
  into a Mamba slot kept for its unit before the first decode step overwrites it;
  `mem_cache.allocation.ensure_mamba_capacity` (AROUND) frees units' state slots (then pending copies)
  before SGLang's prealloc gives up on Mamba room; `SchedulerInvariantChecker._check_mamba_pool`
  (AROUND) counts those slots in SGLang's Mamba-pool conservation check (and, on a hybrid prefill, the
  Mamba slots of unit fetches in flight); with a unit port the hybrid lender's unit service also serves
  each unit's state slot;
- `PrefillBootstrapQueue.pop_bootstrapped` (AROUND): order the bootstrap queue by request priority;
- `Scheduler.get_new_batch_prefill` (AROUND, PD prefill only, with `BASIN_ENGINE_UNIT_PORT`): before
  SGLang's admission pass, start unit fetches for waiting requests of indexed sessions and hold those
  requests out of admission until the unit's KV (on a hybrid model, and its recurrent state as the tree
  node's MAMBA value) is in the radix tree or the fetch failed (`prefill.py`);
- `SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue` (AROUND, same): note the
  decode instance of marked requests in transfer, record the session's unit once the transfer succeeded;
- with `BASIN_ENGINE_LAYER_OVERLAP` as well (prefill admits a fetching request at once, `prefill.py`):
  `Req.init_next_round_input` (AFTER) extends a fetching request's match over the fetched pages;
  `UnifiedRadixCache.prefix_device_indices` (AROUND) hands SGLang's extend allocation those pages after
  the tree's path; `PrefillAdder.add_one_req` (AROUND) leaves such a request waiting rather than chunk
  it; `AttentionBackend.forward` (AROUND) launches the layer-wait kernel for the batches that carry one
  (`overlap.py`); `process_batch_result_disagg_prefill` (AROUND) settles their fetches and sends a
  request whose fetch failed mid-forward back to recomputation;
- reservation at prefill completion over NIXL: see `reservation.py`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from basin_engine_ext.config import LEND_KEY, SESSION_KEY, EngineExtConfig
from basin_engine_ext.lending import DecodeLender
from basin_engine_ext.units import UnitStore

if TYPE_CHECKING:  # prometheus_client is imported only in the scheduler (see `engine_metrics`)
    from basin_engine_ext.metrics import EngineMetrics

logger = logging.getLogger(__name__)

LENDER_ATTR = "_basin_lender"

TARGETS = {
    "attach": "sglang.srt.disaggregation.decode.DecodePreallocQueue.__init__",
    "rebalance": "sglang.srt.disaggregation.decode.DecodePreallocQueue.pop_preallocated",
    "reclaim": "sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator.evict_to_free_tokens",
    "adopt": "sglang.srt.mem_cache.common.release_kv_cache",
    "bootstrap": "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.pop_bootstrapped",
    "memcheck": "sglang.srt.managers.scheduler_components.invariant_checker."
    "SchedulerInvariantChecker._check_full_pool",
    "clear_paged": "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.clear",
    "clear_token": "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.clear",
    "state_copy": "sglang.srt.disaggregation.decode_schedule_batch_mixin."
    "ScheduleBatchDisaggregationDecodeMixin.process_prebuilt",
    "state_room": "sglang.srt.mem_cache.allocation.ensure_mamba_capacity",
    "state_memcheck": "sglang.srt.managers.scheduler_components.invariant_checker."
    "SchedulerInvariantChecker._check_mamba_pool",
    "fetch": "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill",
    "record": "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
    "process_disagg_prefill_inflight_queue",
}

OVERLAP_TARGETS = {
    "match": "sglang.srt.managers.schedule_batch.Req.init_next_round_input",
    "prefix": "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.prefix_device_indices",
    "chunk": "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
    "attention": "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.forward",
    "settle": "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin."
    "process_batch_result_disagg_prefill",
}


class _State:
    """The process's plugin settings and metrics (one SGLang scheduler process, one state)."""

    config: EngineExtConfig = EngineExtConfig()
    metrics: EngineMetrics | None = None


def configure(config: EngineExtConfig) -> None:
    _State.config = config


def engine_metrics() -> EngineMetrics | None:
    """The process's metrics, created on first use with SGLang's scheduler labels."""
    if not _State.config.metrics:
        return None
    if _State.metrics is None:
        # Imported here, in the scheduler process: SGLang loads plugins in its HTTP process before it sets
        # PROMETHEUS_MULTIPROC_DIR, and prometheus_client picks its value store on import, so importing
        # it at plugin load hid SGLang's own tokenizer metrics (TTFT, e2e latency, prompt and cached
        # tokens) from /metrics.
        from basin_engine_ext.metrics import EngineMetrics

        _State.metrics = EngineMetrics.create(_sglang_labels())
    return _State.metrics


def _sglang_labels() -> dict[str, str]:
    try:
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.runtime_context import get_disagg, get_parallel, get_serving

        return {
            "model_name": str(get_serving().served_model_name),
            "engine_type": DisaggregationMode.to_engine_type(get_disagg().disaggregation_mode),
            "tp_rank": str(get_parallel().tp_rank),
        }
    except Exception:  # runtime context not initialised (outside a scheduler process)
        return {"model_name": "", "engine_type": "", "tp_rank": ""}


def register_hooks() -> None:
    """Register every enabled hook with SGLang's HookRegistry (applied by `load_plugins`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    cfg = _State.config
    if cfg.lending:
        HookRegistry.register(TARGETS["attach"], attach_lender, HookType.AFTER)
        HookRegistry.register(TARGETS["rebalance"], rebalance_before_prealloc, HookType.BEFORE)
        HookRegistry.register(TARGETS["reclaim"], evict_then_reclaim, HookType.AROUND)
        HookRegistry.register(TARGETS["adopt"], adopt_before_release, HookType.BEFORE)
        HookRegistry.register(TARGETS["memcheck"], count_lent_in_memory_check, HookType.AROUND)
        HookRegistry.register(TARGETS["clear_paged"], forget_units_on_clear, HookType.AFTER)
        HookRegistry.register(TARGETS["clear_token"], forget_units_on_clear, HookType.AFTER)
        HookRegistry.register(TARGETS["state_copy"], copy_prompt_state_before_decode, HookType.BEFORE)
        HookRegistry.register(TARGETS["state_room"], ensure_mamba_room_reclaiming_units, HookType.AROUND)
        HookRegistry.register(TARGETS["state_memcheck"], count_lent_states_in_memory_check, HookType.AROUND)
        if cfg.unit_port:
            HookRegistry.register(TARGETS["fetch"], admit_with_unit_fetch, HookType.AROUND)
            HookRegistry.register(TARGETS["record"], record_sent_units, HookType.AROUND)
            if cfg.layer_overlap:
                register_overlap_hooks()
    if cfg.bootstrap_priority:
        HookRegistry.register(TARGETS["bootstrap"], pop_bootstrapped_by_priority, HookType.AROUND)
    if cfg.prefill_complete_nixl:
        from basin_engine_ext import reservation

        reservation.register_hooks()


# ---------------------------------------------------------------------- lending
def lender_for(allocator: Any) -> DecodeLender | None:
    return getattr(allocator, LENDER_ATTR, None)


def make_lender(
    allocator: Any, config: EngineExtConfig | None = None, state_pool: Any = None
) -> DecodeLender:
    """Attach a lender to a real SGLang allocator (its `size` is decode capacity C); on a hybrid model
    `state_pool` is SGLang's HybridReqToTokenPool, whose Mamba slots (S of them) units also hold."""
    cfg = config or _State.config
    store: UnitStore = UnitStore(
        capacity=int(allocator.size),
        lend_cap=cfg.lend_cap,
        adopt_headroom=cfg.adopt_headroom,
        reclaim_headroom=cfg.reclaim_headroom,
        state_capacity=int(state_pool.mamba_allocator.size) if state_pool is not None else 0,
    )
    lender = DecodeLender(allocator, store, engine_metrics(), state_pool=state_pool)
    setattr(allocator, LENDER_ATTR, lender)
    if state_pool is not None:
        setattr(state_pool, LENDER_ATTR, lender)
    return lender


def attach_lender(result: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    allocator = queue.token_to_kv_pool_allocator
    req_pool = getattr(queue, "req_to_token_pool", None)
    kind = lending_kind(allocator, req_pool)
    if kind is None:
        # MLA, sliding-window and unified (byte-shared) pools: a unit would need state not wired here.
        logger.warning(
            "basin lending disabled: %s over %s (request pool %s) is neither a full-attention MHA pool "
            "nor an MHA + Mamba hybrid pool",
            type(allocator).__name__,
            type(allocator.get_kvcache()).__name__,
            type(req_pool).__name__,
        )
        return
    lender = make_lender(allocator, state_pool=req_pool if kind == "hybrid" else None)
    lender.queued_demand = lambda: queued_demand(queue)
    if kind == "hybrid":
        lender.queued_state_demand = lambda: queued_state_demand(queue)
        if _State.config.unit_port:
            start_unit_service(
                lender, allocator, _State.config.unit_port + int(_sglang_labels()["tp_rank"] or 0)
            )
        logger.info(
            "basin lending on (hybrid): capacity %d tokens, %d state slots, cap %.2f",
            allocator.size,
            lender.store.state_capacity,
            _State.config.lend_cap,
        )
        return
    if _State.config.unit_port:
        start_unit_service(lender, allocator, _State.config.unit_port + int(_sglang_labels()["tp_rank"] or 0))
    logger.info("basin lending on: capacity %d tokens, cap %.2f", allocator.size, _State.config.lend_cap)


SERVICE_ATTR = "_basin_unit_service"


def start_unit_service(lender: DecodeLender, allocator: Any, port: int) -> Any:
    """Decode's unit service on `port` (all interfaces): a NIXL agent over this KV pool (on a hybrid
    model its full-attention MHA pool and the lender's Mamba pool) and a control socket prefill pushes
    fetch requests and held-unit reports to; polled by the scheduler thread."""
    import socket

    import zmq

    from basin_engine_ext.service import UnitService
    from basin_engine_ext.transfer import KVLayout, StateLayout, make_agent

    pool = allocator.get_kvcache()
    state = None
    if lender.state_pool is not None:
        pool = pool.full_kv_pool  # HybridLinearKVPool: the full-attention layers' MHA pool
        state = StateLayout.from_pool(lender.state_pool.mamba_pool)
    layout = KVLayout.from_pool(pool)
    mem_type = "VRAM" if str(pool.device).startswith("cuda") else "DRAM"
    control = zmq.Context.instance().socket(zmq.PULL)
    control.setsockopt(zmq.LINGER, 0)
    control.bind(f"tcp://*:{port}")
    name = f"basin-decode-{socket.gethostname()}-{port}"
    agent = make_agent(name, layout, mem_type, state)
    service = UnitService(lender, layout, agent, control, mem_type, state_layout=state)
    setattr(allocator, SERVICE_ATTR, service)
    logger.info("basin unit service %s on port %d (%s)", name, port, mem_type)
    return service


def lendable(allocator: Any) -> bool:
    """Lending needs SGLang's shared eviction path (hooked here) and a plain MHA pool (one K and one V
    buffer per layer, what a unit holds and a fetch copies)."""
    return lending_kind(allocator, None) == "mha"


def lending_kind(allocator: Any, req_pool: Any) -> str | None:
    """ "mha" for a plain MHA pool; "hybrid" for SGLang's Mamba hybrid (`HybridLinearKVPool` whose
    full-attention layers are MHA, with a `HybridReqToTokenPool` over a plain `MambaPool` and its slot
    allocator); None for anything else (MLA, DSA, sliding window, the unified byte-shared pools)."""
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
    from sglang.srt.mem_cache.memory_pool import (
        HybridLinearKVPool,
        HybridReqToTokenPool,
        MambaPool,
        MHATokenToKVPool,
    )

    if type(allocator).evict_to_free_tokens is not BaseTokenToKVPoolAllocator.evict_to_free_tokens:
        return None
    pool = allocator.get_kvcache()
    if type(pool) is MHATokenToKVPool:
        return "mha"
    if (
        type(pool) is not HybridLinearKVPool
        or type(getattr(pool, "full_kv_pool", None)) is not MHATokenToKVPool
    ):
        return None
    from sglang.srt.disaggregation.decode import HybridMambaDecodeReqToTokenPool

    if (
        type(req_pool) in (HybridReqToTokenPool, HybridMambaDecodeReqToTokenPool)
        and type(req_pool.mamba_pool) is MambaPool
        and type(req_pool.mamba_allocator) is MambaSlotAllocator
        and req_pool.mamba_pool is pool.mamba_pool
    ):
        return "hybrid"
    return None


def queued_state_demand(queue: Any) -> int:
    """Mamba slots the requests waiting in SGLang's prealloc and retracted queues will take (as
    `ensure_mamba_capacity` counts them)."""
    pool = queue.req_to_token_pool
    reqs = [dr.req for dr in queue.queue] + list(queue.retracted_queue)
    tracking = int(getattr(pool, "mamba_initial_tracking_slots", 0))
    return sum(
        (0 if r.kv.holds_mamba else 1) + (tracking if r.kv.mamba_ping_pong_track_buffer is None else 0)
        for r in reqs
    )


def copy_prompt_state_before_decode(batch: Any, *args: Any, **kwargs: Any) -> None:
    """Before SGLang seeds the first decode step of freshly transferred requests: a marked request's
    Mamba slot still holds the prompt-end state prefill sent; keep a copy for its unit."""
    lender = lender_for(batch.token_to_kv_pool_allocator)
    if lender is None or lender.state_pool is None or tree_caches_requests(batch.tree_cache):
        return None
    for req in batch.reqs:
        if (
            lend_mark(req) is None
            or not req.kv.holds_mamba
            or len(req.output_ids) != 1  # only prefill's token: the state has seen the prompt alone
            or getattr(req, "retracted_stain", False)
        ):
            continue
        lender.copy_prompt_state(req.rid, req.kv.mamba_pool_idx)
    return None


def ensure_mamba_room_reclaiming_units(
    original: Any, req_to_token_pool: Any, reqs: Any, tree_cache: Any
) -> bool:
    """SGLang's Mamba-room check (after its own tree eviction); when still short, free lent units'
    state slots, then prompt-end copies of running requests, before the caller gives up."""
    ok = original(req_to_token_pool, reqs, tree_cache)
    lender = getattr(req_to_token_pool, LENDER_ATTR, None)
    if ok or lender is None:
        return ok
    return lender.ensure_states(lambda: original(req_to_token_pool, reqs, tree_cache))


def count_lent_states_in_memory_check(original: Any, checker: Any, ps: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's Mamba pool check: available + evictable + protected + session-held == size; slots held
    by units and prompt-end copies (decode) or by unit fetches (prefill) are none of those, so they are
    added to `available` here."""
    import dataclasses

    from basin_engine_ext.prefill import FETCHER_ATTR

    lender = getattr(checker.req_to_token_pool, LENDER_ATTR, None)
    fetcher = getattr(checker.req_to_token_pool, FETCHER_ATTR, None)
    held = lender.store.lent_states + len(lender.state_copies) if lender is not None else 0
    held += fetcher.inflight_states() if fetcher else 0
    if held:
        ps = dataclasses.replace(ps, mamba_available_size=ps.mamba_available_size + held)
    return original(checker, ps, *args, **kwargs)


def rebalance_before_prealloc(queue: Any, *args: Any, **kwargs: Any) -> None:
    """Once per decode scheduler iteration: serve unit fetches, then apply the reclaim margin."""
    lender = lender_for(queue.token_to_kv_pool_allocator)
    if lender is None:
        return None
    service = getattr(queue.token_to_kv_pool_allocator, SERVICE_ATTR, None)
    if service is not None:
        service.poll()
    lender.rebalance(queued_demand(queue))
    return None


def queued_demand(queue: Any) -> int:
    """Decode KV that requests waiting in SGLang's prealloc (and retracted) queues will need.

    Each queued request counts what SGLang's own admission test asks of it
    (`_required_admission_tokens`: the prompt plus min(max_new_tokens, its clip), less what running
    requests could give back, never under the prompt plus the decode reserve); counting only the
    reserve let units hold the room a long-output request needs, so it waited beside them forever.
    """
    if not queue.queue and not queue.retracted_queue:
        return 0
    running = queue.scheduler.running_batch.reqs
    retractable = sum(len(r.origin_input_ids) + len(r.output_ids) for r in running)
    queued = sum(_admission_tokens(queue, dr.req, retractable) for dr in queue.queue)
    # SGLang's budget subtracts a retracted request's prealloc need (prompt + reserve) as is.
    queued += sum(queue._prealloc_required_tokens(req)[0] for req in queue.retracted_queue)
    # SGLang admits from the queue only above max(its decode reserve for active requests, the room
    # one running request may still grow into); count the same, or units could hold exactly the room
    # that keeps the queue out.
    queued += max(queue._active_reserved_tokens(), queue._need_space_for_single_req(retractable))
    return queued


def _admission_tokens(queue: Any, req: Any, retractable: int) -> int:
    """SGLang's admission need for one queued request with no decode-side prefix hit (the upper
    bound: a prefix hit only lowers it)."""
    allocated = queue._required_alloc_tokens(fill_len=queue._pre_alloc_fill_len(req), prefix_len=0)
    return int(queue._required_admission_tokens(req, allocated, 0, retractable))


def evict_then_reclaim(original: Any, allocator: Any, tree_cache: Any, num_tokens: int) -> Any:
    """SGLang's eviction first; then lent units, so a shortfall never retracts while units are held."""
    result = original(allocator, tree_cache, num_tokens)
    lender = lender_for(allocator)
    if lender is not None and allocator.available_size() < num_tokens:
        lender.ensure_available(num_tokens)
    return result


def forget_units_on_clear(result: Any, allocator: Any, *args: Any, **kwargs: Any) -> None:
    lender = lender_for(allocator)
    if lender is not None:
        lender.forget_all()


def count_lent_in_memory_check(original: Any, checker: Any, ps: Any, uncached: int = 0) -> Any:
    """Decode: lent units; prefill: pages of unit fetches still arriving (owned by no request or tree)."""
    from basin_engine_ext.prefill import FETCHER_ATTR

    allocator = checker.token_to_kv_pool_allocator
    lender = lender_for(allocator)
    if lender is not None:
        uncached += lender.store.lent
    fetcher = getattr(allocator, FETCHER_ATTR, None)
    if fetcher is not None:
        uncached += fetcher.inflight_tokens()
    return original(checker, ps, uncached=uncached)


# ---------------------------------------------------------------------- prefill: unit fetch
def admit_with_unit_fetch(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Around SGLang's prefill admission: fetch units, hold requests whose unit is still arriving (or,
    with the per-layer overlap, let SGLang admit them and attach their fetches to the new batch)."""
    from basin_engine_ext import prefill

    fetcher = prefill.fetcher_for(scheduler, _State.config)
    if fetcher is None:
        return original(scheduler, *args, **kwargs)
    batch = prefill.hold_fetching_requests(fetcher, scheduler, lambda: original(scheduler, *args, **kwargs))
    if fetcher.overlap:
        fetcher.attach(_admitted(batch))
    return batch


def _admitted(batch: Any) -> list[Any]:
    """The requests of what an admission pass returned: SGLang's `ScheduleBatch` (or None), or a list."""
    if batch is None:
        return []
    if isinstance(batch, list):
        return batch
    return list(getattr(batch, "reqs", None) or [])


# ---------------------------------------------------------------------- prefill: per-layer overlap
def register_overlap_hooks() -> None:
    """The hooks of the per-layer overlap; each is inert for requests and batches without a fetch."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from basin_engine_ext import overlap

    HookRegistry.register(OVERLAP_TARGETS["match"], extend_match_over_fetch, HookType.AFTER)
    HookRegistry.register(OVERLAP_TARGETS["prefix"], prefix_with_fetched_pages, HookType.AROUND)
    HookRegistry.register(OVERLAP_TARGETS["chunk"], admit_fetching_unchunked, HookType.AROUND)
    HookRegistry.register(OVERLAP_TARGETS["attention"], overlap.wait_before_attention, HookType.AROUND)
    HookRegistry.register(OVERLAP_TARGETS["settle"], settle_fetched_batch, HookType.AROUND)


def _fetcher_of_tree(tree_cache: Any) -> Any:
    from basin_engine_ext.prefill import FETCHER_ATTR

    allocator = getattr(tree_cache, "token_to_kv_pool_allocator", None)
    return getattr(allocator, FETCHER_ATTR, None)


def extend_match_over_fetch(result: Any, req: Any, tree_cache: Any = None, *args: Any, **kwargs: Any) -> None:
    """After SGLang's prefix match of a waiting request: a request whose unit is arriving matches the
    fetched pages too."""
    fetcher = _fetcher_of_tree(tree_cache) if tree_cache is not None else None
    if fetcher is not None and fetcher.fetching:
        fetcher.extend_match(req)
    return None


def prefix_with_fetched_pages(original: Any, tree_cache: Any, req: Any) -> Any:
    """The prefix slots SGLang writes into a new request's row: the tree's path, then the fetch's pages."""
    from basin_engine_ext.prefill import TAIL_ATTR

    f = getattr(req, TAIL_ATTR, None)
    if f is None or req.prefix_len <= f.start:
        return original(tree_cache, req)
    full = req.prefix_len
    req.prefix_len = f.start  # SGLang reads the tree's path only as far as the tree holds it
    try:
        head = original(tree_cache, req)
    finally:
        req.prefix_len = full
    import torch

    return torch.cat([head, f.fetch.dst_slots.to(head.dtype)])[:full]


def admit_fetching_unchunked(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """A request carrying a fetch is admitted whole or not in this pass: a chunk's result would be
    published and sent before the fetch is settled. Skipped, it stays waiting (the loop goes on)."""
    from basin_engine_ext.prefill import TAIL_ATTR

    if getattr(req, TAIL_ATTR, None) is not None and adder.rem_chunk_tokens is not None:
        extend = len(req.full_untruncated_fill_ids) - req.prefix_len
        if adder.ceil_paged_tokens(extend) > adder.rem_chunk_tokens:
            from sglang.srt.managers.schedule_policy import AddReqResult

            return AddReqResult.CONTINUE
    return original(adder, req, *args, **kwargs)


def settle_fetched_batch(
    original: Any, scheduler: Any, batch: Any, result: Any, *args: Any, **kwargs: Any
) -> Any:
    """Around SGLang's processing of a prefill batch's result: settle the fetches the batch carried. A
    request whose fetch failed is taken out of the batch before SGLang processes it (no token, no tree
    checkpoint, no KV sent to decode) and queued again to recompute; where the result cannot be split
    per request (logprobs, auxiliary outputs, speculative drafts) it is aborted instead."""
    from basin_engine_ext.prefill import FETCHER_ATTR

    fetcher = getattr(scheduler, FETCHER_ATTR, None)
    if not fetcher or not fetcher.overlap or not any(f.attached for f in fetcher.fetching.values()):
        return original(scheduler, batch, result, *args, **kwargs)
    copy_done = getattr(result, "copy_done", None)
    if copy_done is not None:
        copy_done.synchronize()  # the forward (and its waits) has finished before flags are read
    failed = fetcher.settle(batch.reqs)
    if not failed:
        return original(scheduler, batch, result, *args, **kwargs)
    if not _separable(batch, result):
        for _, req, f in failed:
            fetcher.invalidate(req, f)
        return original(scheduler, batch, result, *args, **kwargs)
    import torch

    dropped = {i for i, _, _ in failed}
    keep = [i for i in range(len(batch.reqs)) if i not in dropped]
    reqs, tokens = batch.reqs, result.next_token_ids
    batch.reqs = [reqs[i] for i in keep]
    result.next_token_ids = tokens[torch.as_tensor(keep, dtype=torch.long, device=tokens.device)]
    try:
        out = original(scheduler, batch, result, *args, **kwargs)
    finally:
        batch.reqs, result.next_token_ids = reqs, tokens
    for _, req, f in failed:
        fetcher.recompute(req, f, scheduler.waiting_queue)
    return out


def _separable(batch: Any, result: Any) -> bool:
    """Whether SGLang's prefill result processing reads nothing per request but `batch.reqs[i]` and
    `next_token_ids[i]` (so a request can be taken out of both)."""
    per_token = ("return_logprob", "return_sampling_mask")
    if any(getattr(r, name, False) for r in batch.reqs for name in per_token):
        return False
    extra = ("auxiliary_host_output", "routed_experts_output", "indexer_topk_output", "next_draft_input")
    return all(getattr(result, name, None) is None for name in extra)


def record_sent_units(original: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """Around SGLang's poll of prefill transfers: note each marked request's decode instance while its
    bootstrap info is still there, and index the session's unit once its KV reached decode."""
    from basin_engine_ext import prefill

    fetcher = prefill.fetcher_for(scheduler, _State.config)
    if fetcher is None:
        return original(scheduler, *args, **kwargs)
    for req in scheduler.disagg_prefill_inflight_queue:
        fetcher.note_decode(req)
    done = original(scheduler, *args, **kwargs)
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    for req in done or []:
        if not isinstance(req.finished_reason, FINISH_ABORT):
            fetcher.record_sent(req)
    return done


def lend_mark(req: Any) -> str | None:
    """The session id when the gateway asked decode to keep this request's prompt, else None."""
    params = getattr(req.sampling_params, "custom_params", None) or {}
    if not params.get(LEND_KEY):
        return None
    session = params.get(SESSION_KEY)
    return str(session) if session else None


def adopt_before_release(req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> None:
    """Keep a finished marked prompt's pages (and, on a hybrid model, its prompt-end state copy) as the
    session's unit (the release then skips the pages)."""
    lender = lender_for(tree_cache.token_to_kv_pool_allocator)
    if lender is None:
        return None
    state = lender.take_state_copy(req.rid) if lender.state_pool is not None else None
    if not req.kv.holds_kv or not req.finished():
        lender.free_state(state)  # retracted or never allocated: the copy goes with the release
        return None
    session = lend_mark(req)
    if session is None or tree_caches_requests(tree_cache) or req.kv.cache_protected_len > 0:
        # Unmarked; or a decode radix tree takes the request's KV on release (a unit over the same
        # pages would give them two owners, and the tree would evict and reuse what the unit lends);
        # or part of the prompt is not the request's to lend.
        lender.free_state(state)
        return None
    prompt = list(req.origin_input_ids)
    row = tree_cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(prompt)]
    page = lender.page_size
    releasing = -(-int(req.kv.kv_allocated_len) // page) * page  # the request's whole pages
    kept = lender.adopt(
        session,
        len(prompt),
        prompt,
        row.to(dtype=_int64()),
        releasing=releasing,
        state=state,
        releasing_states=1 if req.kv.holds_mamba else 0,
    )
    if kept:
        # SGLang's release frees [cache_protected_len, owned); the unit now owns [0, kept).
        req.kv.cache_protected_len = kept
    return None


def tree_caches_requests(tree_cache: Any) -> bool:
    """Whether SGLang's release inserts a finished request's KV into this tree (the decode radix cache
    is on); a disabled tree (SGLang's decode default) only frees it."""
    return not getattr(tree_cache, "disable", True)


def _int64() -> Any:
    import torch

    return torch.int64


# ---------------------------------------------------------------------- bootstrap priority
def pop_bootstrapped_by_priority(original: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    """Stable-sort the bootstrap queue by priority before SGLang scans it, so higher-priority requests
    take metadata buffers first and enter the waiting queue first (SGLang scans it FIFO)."""
    sort_by_priority(queue.queue, low_values_first=_low_values_first(queue))
    return original(queue, *args, **kwargs)


def sort_by_priority(reqs: list[Any], low_values_first: bool) -> None:
    """In place; requests without a priority keep their FIFO place after every prioritised one."""

    def key(req: Any) -> tuple[int, float]:
        p = getattr(req, "priority", None)
        if p is None:
            return (1, 0.0)
        return (0, p if low_values_first else -p)

    reqs.sort(key=key)


def _low_values_first(queue: Any) -> bool:
    scheduler = getattr(queue, "scheduler", None)
    return bool(getattr(scheduler, "schedule_low_priority_values_first", False))
