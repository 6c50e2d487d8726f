"""Lending hooked into SGLang's real decode memory: paged allocator, MHA KV pool on CPU, request rows,
the release path (`release_kv_cache`) and the decode capacity check that precedes retraction."""

from __future__ import annotations

import pytest
import torch

from basin_engine_ext import hooks
from basin_engine_ext.config import EngineExtConfig

pytestmark = pytest.mark.engine

MARK = {"basin_lend": True, "basin_session": "s1"}


def test_plugin_hooks_are_applied_to_sglang_targets(plugin_loaded) -> None:
    from sglang.srt.disaggregation import decode
    from sglang.srt.mem_cache import common
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

    assert BaseTokenToKVPoolAllocator.evict_to_free_tokens.__wrapped__ is not None
    # HookRegistry rebinds the copy decode.py imported with `from ... import release_kv_cache`
    assert decode.release_kv_cache is common.release_kv_cache
    assert common.release_kv_cache.__wrapped__.__name__ == "release_kv_cache"


@pytest.mark.parametrize("checkpoint", [False, True])  # SGLang's decode paths use both
def test_marked_finished_prompt_stays_as_a_unit_and_the_rest_is_freed(
    plugin_loaded, decode_kv, checkpoint: bool
) -> None:
    from sglang.srt.mem_cache.common import release_kv_cache

    lender = hooks.make_lender(decode_kv.allocator)
    prompt = list(range(100, 110))  # 10 tokens: two whole pages of 4
    req = decode_kv.finished_request("r1", prompt, outputs=4, custom_params=MARK)
    row = decode_kv.req_to_token.req_to_token[req.kv.req_pool_idx, :10].clone()
    full = decode_kv.allocator.available_size()
    release_kv_cache(req, decode_kv.tree, checkpoint=checkpoint)

    unit = lender.store.get("s1")
    assert unit is not None and unit.tokens == 8 and unit.token_ids == tuple(prompt[:8])
    assert torch.equal(unit.pages, row[:8])
    assert req.kv.is_kv_released
    # the request held 4 pages (14 tokens); 2 pages remain lent, 2 came back
    assert decode_kv.allocator.available_size() == full + 8
    assert decode_kv.allocator.available_size() + lender.store.lent == decode_kv.allocator.size


def test_unmarked_request_is_released_whole(plugin_loaded, decode_kv) -> None:
    from sglang.srt.mem_cache.common import release_kv_cache

    lender = hooks.make_lender(decode_kv.allocator)
    req = decode_kv.finished_request("r1", list(range(10)), outputs=4)
    release_kv_cache(req, decode_kv.tree, checkpoint=False)
    assert len(lender.store) == 0
    assert decode_kv.allocator.available_size() == decode_kv.allocator.size


def test_decode_capacity_check_reclaims_lent_pages_before_reporting_a_shortfall(
    plugin_loaded, decode_kv
) -> None:
    """A decode step that would not fit must first take lent pages back; only then may SGLang retract."""
    from sglang.srt.mem_cache.common import release_kv_cache

    lender = hooks.make_lender(decode_kv.allocator, EngineExtConfig(lend_cap=0.5, adopt_headroom=0.1))
    for i in range(3):
        mark = {"basin_lend": True, "basin_session": f"s{i}"}
        req = decode_kv.finished_request(
            f"r{i}", [i * 1000 + t for t in range(32)], outputs=2, custom_params=mark
        )
        release_kv_cache(req, decode_kv.tree, checkpoint=False)
    assert lender.store.lent == 96
    running = decode_kv.allocator.alloc(128)  # running requests take most of the rest
    assert running is not None
    free = decode_kv.allocator.available_size()
    need = free + 40  # a decode step needing more than is free
    assert decode_kv.allocator.check_decode_capacity(num_tokens=need, tree_cache=decode_kv.tree)
    assert decode_kv.allocator.available_size() >= need
    assert lender.store.lent == 32  # two LRU units (64 tokens) covered the 40-token shortfall
    assert [u.session for u in lender.store.units()] == ["s2"]
    # what no unit can cover is still reported, so SGLang retracts as before
    assert not decode_kv.allocator.check_decode_capacity(num_tokens=10_000, tree_cache=decode_kv.tree)
    assert len(lender.store) == 0


def test_reclaim_frees_units_prefill_also_holds_first(plugin_loaded, decode_kv) -> None:
    lender = hooks.make_lender(decode_kv.allocator)
    for name in ("a", "b", "c"):
        slots = decode_kv.allocator.alloc(16)
        assert lender.adopt(name, 1, list(range(16)), slots) == 16
    lender.store.set_prefill_holds(["c"])
    assert lender.reclaim(20) == 32
    assert [u.session for u in lender.store.units()] == ["b"]


def test_adoption_is_refused_without_headroom_and_pages_go_back(plugin_loaded, decode_kv) -> None:
    from sglang.srt.mem_cache.common import release_kv_cache

    lender = hooks.make_lender(decode_kv.allocator)
    # running demand 212 of 256: after a 24-token unit 20 tokens (< 10 %) would be left
    busy = decode_kv.allocator.alloc(212)
    assert busy is not None
    req = decode_kv.finished_request("r1", list(range(24)), outputs=4, custom_params=MARK)
    release_kv_cache(req, decode_kv.tree, checkpoint=False)
    assert len(lender.store) == 0
    assert decode_kv.allocator.available_size() == decode_kv.allocator.size - 212


def test_fetch_plan_hits_only_beyond_the_local_match(plugin_loaded, decode_kv) -> None:
    lender = hooks.make_lender(decode_kv.allocator)
    slots = decode_kv.allocator.alloc(24)
    prompt = list(range(24))
    lender.adopt("s1", 24, prompt, slots)
    nxt = [*prompt, 99, 98, 97]
    plan = lender.plan_fetch("s1", nxt, local_match=9)
    assert plan is not None and (plan.start, plan.end) == (8, 24)
    assert torch.equal(plan.src_indices, slots[8:24])
    assert lender.plan_fetch("s1", nxt, local_match=24) is None  # prefill already has it all
    assert lender.plan_fetch("s1", [5, *nxt], local_match=0) is None  # diverges at token 0
    assert lender.plan_fetch("nobody", nxt, local_match=0) is None


def test_queued_decode_demand_reclaims_units_down_to_the_lower_margin(plugin_loaded, decode_kv) -> None:
    """The BEFORE hook on DecodePreallocQueue.pop_preallocated, on SGLang's real queue accounting:
    requests waiting for decode memory and SGLang's decode reserve for active requests count as demand,
    and units are reclaimed until room above that demand is back at the reclaim margin (5 % of 256)."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    lender = hooks.make_lender(decode_kv.allocator)
    for name in ("a", "b", "c"):
        assert lender.adopt(name, 1, list(range(32)), decode_kv.allocator.alloc(32)) == 32
    queue = object.__new__(DecodePreallocQueue)  # SGLang's class; its constructor needs a KV manager
    queue.token_to_kv_pool_allocator = decode_kv.allocator
    queue.token_to_kv_pool = decode_kv.pool
    queue.num_reserved_decode_tokens = 8
    queue.retracted_queue = []
    queue.transfer_queue = SimpleNamespace(queue=[])
    queue.scheduler = SimpleNamespace(running_batch=SimpleNamespace(reqs=[]), waiting_queue=[])
    waiting = Req(  # asks for no more new tokens than the reserve: the reserve is what counts
        rid="w",
        origin_input_text="",
        origin_input_ids=list(range(120)),
        sampling_params=SamplingParams(max_new_tokens=8),
    )
    queue.queue = [DecodeRequest(req=waiting, kv_receiver=None)]
    need = queue._prealloc_required_tokens(waiting)[0]
    assert need == 120 + 8  # the prompt, page-aligned, and the per-request decode reserve

    hooks.rebalance_before_prealloc(queue)  # 256 - 128 queued - 96 lent = 32 free, above 12.8
    assert len(lender.store) == 3
    running = [
        Req(
            rid=f"r{i}",
            origin_input_text="",
            origin_input_ids=[1, 2, 3, 4],
            sampling_params=SamplingParams(max_new_tokens=8),
        )
        for i in range(3)
    ]
    queue.scheduler.running_batch.reqs = running  # SGLang reserves 8 tokens for each: 8 left
    hooks.rebalance_before_prealloc(queue)
    demand = need + max(queue._active_reserved_tokens(), queue._need_space_for_single_req(12))
    assert decode_kv.allocator.size - demand - lender.store.lent >= 0.05 * decode_kv.allocator.size
    assert [u.session for u in lender.store.units()] == ["b", "c"]  # the LRU unit went first
    hooks.rebalance_before_prealloc(queue)  # the margin holds: nothing more is taken
    assert len(lender.store) == 2


def test_a_queued_long_output_request_passes_sglangs_own_admission_after_rebalance(
    plugin_loaded, decode_kv
) -> None:
    """A request asking for more new tokens than the decode reserve: SGLang admits it only with room
    for prompt + min(max_new_tokens, clip). After the BEFORE hook rebalances, SGLang's own budget
    (`_allocatable_token_budgets`) covers SGLang's own need (`_required_admission_tokens`); counting
    prompt + reserve left units holding that room and the request waiting beside them."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    lender = hooks.make_lender(decode_kv.allocator)
    for name in ("a", "b", "c"):
        assert lender.adopt(name, 1, list(range(32)), decode_kv.allocator.alloc(32)) == 32
    queue = object.__new__(DecodePreallocQueue)
    queue.token_to_kv_pool_allocator = decode_kv.allocator
    queue.token_to_kv_pool = decode_kv.pool
    queue.num_reserved_decode_tokens = 8
    queue.retracted_queue = []
    queue.transfer_queue = SimpleNamespace(queue=[])
    queue.scheduler = SimpleNamespace(
        running_batch=SimpleNamespace(reqs=[]), waiting_queue=[], enable_hisparse=False, last_batch=None
    )
    waiting = Req(
        rid="w",
        origin_input_text="",
        origin_input_ids=list(range(100)),
        sampling_params=SamplingParams(max_new_tokens=64),
    )
    queue.queue = [DecodeRequest(req=waiting, kv_receiver=None)]

    def admitted() -> bool:
        need = queue._required_admission_tokens(
            waiting, queue._required_alloc_tokens(fill_len=100, prefix_len=0), 0, 0
        )
        return need <= queue._allocatable_token_budgets(retractable_tokens=0, count_retracted=True)

    assert not admitted()  # 256 - 96 lent = 160 free, SGLang wants 100 + 64 (and 8 held back)
    hooks.rebalance_before_prealloc(queue)
    assert admitted()
    assert len(lender.store) == 2  # one unit (the LRU one) was enough
    assert [u.session for u in lender.store.units()] == ["b", "c"]


def test_adoption_leaves_room_for_requests_queued_for_decode_memory(plugin_loaded, decode_kv) -> None:
    """The lender attached by the decode hook reads SGLang's prealloc queue when it adopts."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.common import release_kv_cache
    from sglang.srt.sampling.sampling_params import SamplingParams

    queue = object.__new__(DecodePreallocQueue)
    queue.token_to_kv_pool_allocator = decode_kv.allocator
    queue.token_to_kv_pool = decode_kv.pool
    queue.num_reserved_decode_tokens = 8
    queue.retracted_queue = []
    queue.transfer_queue = SimpleNamespace(queue=[])
    queue.scheduler = SimpleNamespace(running_batch=SimpleNamespace(reqs=[]), waiting_queue=[])
    queue.queue = []
    hooks.attach_lender(None, queue)
    lender = hooks.lender_for(decode_kv.allocator)

    waiting = Req(
        rid="w",
        origin_input_text="",
        origin_input_ids=list(range(200)),
        sampling_params=SamplingParams(max_new_tokens=8),
    )
    queue.queue = [DecodeRequest(req=waiting, kv_receiver=None)]  # needs 208 of 256
    req = decode_kv.finished_request("r1", list(range(24)), outputs=4, custom_params=MARK)
    release_kv_cache(req, decode_kv.tree, checkpoint=False)
    assert len(lender.store) == 0  # 256 - 208 - 24 would leave less than 10 %

    queue.queue = []
    req = decode_kv.finished_request("r2", list(range(24)), outputs=4, custom_params=MARK)
    release_kv_cache(req, decode_kv.tree, checkpoint=False)
    assert lender.store.lent == 24


def test_lender_attaches_to_full_attention_pools_only(plugin_loaded, decode_kv) -> None:
    """The AFTER hook on DecodePreallocQueue.__init__: a paged or token MHA allocator gets a lender, a
    sliding-window (hybrid) one does not."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    hooks.attach_lender(None, SimpleNamespace(token_to_kv_pool_allocator=decode_kv.allocator))
    assert hooks.lender_for(decode_kv.allocator) is not None

    token = TokenToKVPoolAllocator(
        size=64, dtype=torch.float16, device="cpu", kvcache=decode_kv.pool, need_sort=False
    )
    hooks.attach_lender(None, SimpleNamespace(token_to_kv_pool_allocator=token))
    assert hooks.lender_for(token) is not None

    swa_pool = SWAKVPool(
        size=64, size_swa=64, page_size=4, dtype=torch.float16, head_num=2, head_dim=8,
        swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu",
    )  # fmt: skip
    swa = SWATokenToKVPoolAllocator(
        size=64,
        size_swa=64,
        page_size=4,
        dtype=torch.float16,
        device="cpu",
        kvcache=swa_pool,
        need_sort=False,
    )
    hooks.attach_lender(None, SimpleNamespace(token_to_kv_pool_allocator=swa))
    assert hooks.lender_for(swa) is None


def test_unit_service_starts_with_the_lender_when_a_port_is_set(plugin_loaded, decode_kv) -> None:
    import socket
    from types import SimpleNamespace

    from basin_engine_ext.service import UnitService

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = hooks._State.config
    hooks.configure(EngineExtConfig(unit_port=port))
    try:
        queue = SimpleNamespace(token_to_kv_pool_allocator=decode_kv.allocator, queue=[], retracted_queue=[])
        hooks.attach_lender(None, queue)
        service = getattr(decode_kv.allocator, hooks.SERVICE_ATTR)
        assert isinstance(service, UnitService) and service.mem_type == "DRAM"
        hooks.rebalance_before_prealloc(queue)  # polls the service: nothing queued, nothing changes
        assert service.active == []
    finally:
        hooks.configure(before)
        getattr(decode_kv.allocator, hooks.SERVICE_ATTR).socket.close()


def test_sglang_memory_check_accounts_for_lent_slots(plugin_loaded, decode_kv) -> None:
    """SGLang's scheduler asserts available + evictable + protected + held + request-owned == total;
    lent slots belong to none of those, so without the hook its check reports a leak."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
    from sglang.srt.mem_cache.common import release_kv_cache

    lender = hooks.make_lender(decode_kv.allocator)
    req = decode_kv.finished_request("r1", list(range(24)), outputs=4, custom_params=MARK)
    release_kv_cache(req, decode_kv.tree, checkpoint=False)
    assert lender.store.lent == 24

    checker = object.__new__(SchedulerInvariantChecker)  # SGLang's class, fields a scheduler would set
    checker.token_to_kv_pool_allocator = decode_kv.allocator
    checker.tree_cache = decode_kv.tree
    checker.req_to_token_pool = decode_kv.req_to_token
    checker.is_hybrid_swa = checker.is_hybrid_ssm = False
    checker.max_total_num_tokens = decode_kv.allocator.size
    checker.pool_stats_observer = SimpleNamespace(session_held_tokens=lambda: 0)
    stats = SimpleNamespace(full_evictable_size=0, full_available_size=decode_kv.allocator.available_size())

    leak, msg = SchedulerInvariantChecker._check_full_pool.__wrapped__(checker, stats, uncached=0)
    assert leak, msg  # SGLang alone sees 24 tokens missing
    leak, msg = checker._check_full_pool(stats, uncached=0)
    assert not leak, msg


def test_a_cache_flush_forgets_units_instead_of_freeing_them_twice(plugin_loaded, decode_kv) -> None:
    lender = hooks.make_lender(decode_kv.allocator)
    for name in ("a", "b"):
        lender.adopt(name, 1, list(range(16)), decode_kv.allocator.alloc(16))
    decode_kv.allocator.clear()  # what SGLang's flush_cache does
    assert len(lender.store) == 0 and lender.store.lent == 0
    assert decode_kv.allocator.available_size() == decode_kv.allocator.size
    assert lender.reclaim(1000) == 0
    free = decode_kv.allocator.get_all_free_pages()
    assert torch.unique(free).numel() == free.numel()  # no page on the free list twice
