"""Lending on a hybrid (Mamba / gated-delta) decode instance, on SGLang's real hybrid pools on CPU:
`HybridMambaDecodeReqToTokenPool` with its `MambaPool` and slot allocator, the `HybridLinearKVPool` over
it, the paged allocator, the disabled `UnifiedRadixCache` with the MAMBA component, SGLang's prebuilt
batch (`process_prebuilt`) and release path (`release_kv_cache`)."""

from __future__ import annotations

import pytest
import torch

from basin_engine_ext import hooks
from basin_engine_ext.config import EngineExtConfig

pytestmark = pytest.mark.engine


def mark(session: str) -> dict:
    return {"basin_lend": True, "basin_session": session}


def prebuild(kv, reqs: list) -> None:
    """SGLang's step between a finished transfer and the first decode forward: a prebuilt batch of the
    transferred requests, `process_prebuilt` seeding their first decode input."""
    from types import SimpleNamespace

    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    spec = SpeculativeAlgorithm.NONE
    model = SimpleNamespace(vocab_size=256)  # the only model field the batch reads here (no weights on CPU)
    batch = ScheduleBatch.init_new(reqs, kv.req_to_token, kv.allocator, kv.tree, model, False, spec)
    batch.req_pool_indices = torch.tensor([r.kv.req_pool_idx for r in reqs], dtype=torch.int64)
    batch.process_prebuilt(FutureMap(torch.device("cpu"), spec, kv.req_to_token))


def lend(kv, rid: str, prompt: list[int], session: str):
    """A marked request through transfer, SGLang's first-step seeding and its release: the lender keeps
    the prompt (pages and state) as the session's unit when its rules allow."""
    from sglang.srt.mem_cache.common import release_kv_cache

    req = kv.transferred_request(rid, prompt, custom_params=mark(session))
    prebuild(kv, [req])
    kv.finish(req)
    release_kv_cache(req, kv.tree, checkpoint=False)
    return req


def hybrid_lender(kv, **cfg):
    from types import SimpleNamespace

    queue = SimpleNamespace(
        token_to_kv_pool_allocator=kv.allocator,
        req_to_token_pool=kv.req_to_token,
        queue=[],
        retracted_queue=[],
    )
    before = hooks._State.config
    hooks.configure(EngineExtConfig(**cfg))
    try:
        hooks.attach_lender(None, queue)
    finally:
        hooks.configure(before)
    lender = hooks.lender_for(kv.allocator)
    assert lender is not None and lender.state_pool is kv.req_to_token
    return lender, queue


def test_marked_release_keeps_pages_and_the_prompt_end_state(plugin_loaded, hybrid_kv) -> None:
    from sglang.srt.mem_cache.common import release_kv_cache

    kv = hybrid_kv
    lender, _ = hybrid_lender(kv)
    free_pages, free_states = kv.allocator.available_size(), kv.req_to_token.mamba_allocator.available_size()
    prompt = list(range(100, 110))  # two whole pages of 4
    req = kv.transferred_request("r1", prompt, custom_params=mark("s1"))
    prompt_end = kv.state(req.kv.mamba_pool_idx)
    row = kv.req_to_token.req_to_token[req.kv.req_pool_idx, :8].to(torch.int64)

    prebuild(kv, [req])  # the plugin copies the state here, before any decode step
    for step in range(3):
        kv.decode_step(req, step)  # SGLang's decode forward rewrites the request's slot in place
    assert not torch.equal(kv.state(req.kv.mamba_pool_idx)[-1], prompt_end[-1])
    kv.finish(req)
    release_kv_cache(req, kv.tree, checkpoint=False)

    unit = lender.store.get("s1")
    assert unit is not None and unit.tokens == 8 and unit.states == 1
    assert torch.equal(unit.pages, row)
    for got, want in zip(kv.state(unit.state), prompt_end, strict=True):
        assert torch.equal(got, want)
    assert req.kv.is_kv_released and req.kv.mamba_pool_idx is None  # SGLang freed the request's own slot
    assert kv.allocator.available_size() == free_pages - 8
    assert kv.req_to_token.mamba_allocator.available_size() == free_states - 1

    assert lender.reclaim(1) == 8  # reclaim returns both to SGLang's pools
    assert len(lender.store) == 0 and lender.store.lent_states == 0
    assert kv.allocator.available_size() == free_pages
    assert kv.req_to_token.mamba_allocator.available_size() == free_states


def test_unmarked_request_releases_as_sglang_does(plugin_loaded, hybrid_kv) -> None:
    from sglang.srt.mem_cache.common import release_kv_cache

    kv = hybrid_kv
    lender, _ = hybrid_lender(kv)
    free_pages, free_states = kv.allocator.available_size(), kv.req_to_token.mamba_allocator.available_size()
    req = kv.transferred_request("r1", list(range(12)))
    prebuild(kv, [req])
    assert lender.state_copies == {}  # no copy taken for an unmarked request
    kv.decode_step(req, 0)
    kv.finish(req)
    release_kv_cache(req, kv.tree, checkpoint=True)
    assert len(lender.store) == 0
    assert kv.allocator.available_size() == free_pages
    assert kv.req_to_token.mamba_allocator.available_size() == free_states


def test_state_cap_refuses_a_unit_and_frees_its_copy(plugin_loaded, hybrid_kv) -> None:
    """Six request rows, six Mamba slots: φ = 0.5 lends at most three states, whatever the KV room."""
    from sglang.srt.mem_cache.common import release_kv_cache

    kv = hybrid_kv
    lender, _ = hybrid_lender(kv, adopt_headroom=0.0, reclaim_headroom=0.0)
    assert lender.store.state_capacity == kv.req_to_token.mamba_allocator.size == 6
    free_states = kv.req_to_token.mamba_allocator.available_size()
    for i in range(4):
        req = kv.transferred_request(f"r{i}", [i * 100 + t for t in range(8)], custom_params=mark(f"s{i}"))
        prebuild(kv, [req])
        kv.decode_step(req, i)
        kv.finish(req)
        release_kv_cache(req, kv.tree, checkpoint=False)
    assert [u.session for u in lender.store.units()] == ["s0", "s1", "s2"]
    assert lender.store.lent == 24  # 24 of 256 tokens: the token cap did not refuse s3
    assert lender.state_copies == {}
    assert kv.req_to_token.mamba_allocator.available_size() == free_states - 3


def test_mamba_shortfall_reclaims_unit_states_before_sglang_gives_up(plugin_loaded, hybrid_kv) -> None:
    """SGLang's `ensure_mamba_capacity` (what prealloc asks before admitting a request) finds no free
    slot; the plugin frees a lent unit's state slot (and its pages) so the request is admitted."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache import allocation
    from sglang.srt.sampling.sampling_params import SamplingParams

    kv = hybrid_kv
    lender, _ = hybrid_lender(kv, adopt_headroom=0.0, reclaim_headroom=0.0)
    lend(kv, "r0", list(range(8)), "s0")
    assert lender.store.lent_states == 1
    busy = kv.req_to_token.mamba_allocator.alloc(kv.req_to_token.mamba_allocator.available_size())
    assert busy is not None  # running requests hold every other slot

    waiting = Req(rid="w", origin_input_text="", origin_input_ids=[1, 2, 3], sampling_params=SamplingParams())
    assert not allocation.ensure_mamba_capacity.__wrapped__(kv.req_to_token, [waiting], kv.tree)
    assert allocation.ensure_mamba_capacity(kv.req_to_token, [waiting], kv.tree)
    assert len(lender.store) == 0
    assert kv.allocator.available_size() == kv.allocator.size


def test_sglang_mamba_pool_check_accounts_for_lent_states(plugin_loaded, hybrid_kv) -> None:
    import dataclasses
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
    from sglang.srt.managers.scheduler_components.pool_stats_observer import PoolStats

    kv = hybrid_kv
    lender, _ = hybrid_lender(kv)
    lend(kv, "r0", list(range(8)), "s0")
    assert lender.store.lent_states == 1

    checker = object.__new__(SchedulerInvariantChecker)
    checker.req_to_token_pool = kv.req_to_token
    checker.tree_cache = kv.tree
    checker.token_to_kv_pool_allocator = kv.allocator
    checker.pool_stats_observer = SimpleNamespace(session_held_mamba_slots=lambda: 0)
    fields = {f.name: 0 for f in dataclasses.fields(PoolStats)}
    stats = PoolStats(**{**fields, "mamba_available_size": kv.req_to_token.mamba_allocator.available_size()})
    leak, msg = SchedulerInvariantChecker._check_mamba_pool.__wrapped__(checker, stats)
    assert leak, msg  # SGLang alone sees the unit's slot missing
    leak, msg = checker._check_mamba_pool(stats)
    assert not leak, msg


def test_a_flush_forgets_units_and_their_states(plugin_loaded, hybrid_kv) -> None:

    kv = hybrid_kv
    lender, _ = hybrid_lender(kv)
    lend(kv, "r0", list(range(8)), "s0")
    kv.req_to_token.clear()  # SGLang's flush_cache: request pool (every Mamba slot) first,
    kv.allocator.clear()  # then the KV allocator
    assert len(lender.store) == 0 and lender.store.lent_states == 0
    assert lender.reclaim(1000) == 0
    slots = kv.req_to_token.mamba_allocator
    assert slots.available_size() == slots.size
    assert torch.unique(slots.free_slots).numel() == slots.size  # no slot freed twice


def test_lender_stays_off_on_mla_hybrid_pools(plugin_loaded, hybrid_kv) -> None:
    """A hybrid pool whose full-attention layers are MLA is not lent (its KV layout is not wired)."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool

    kv = hybrid_kv
    assert hooks.lending_kind(kv.allocator, kv.req_to_token) == "hybrid"
    assert hooks.lending_kind(kv.allocator, None) is None  # no Mamba pool to hold the state
    mla = object.__new__(HybridLinearKVPool)  # SGLang's class, its full-attention layers not MHA
    mla.full_kv_pool = SimpleNamespace()
    mla.mamba_pool = kv.mamba
    kv.allocator._kvcache = mla
    try:
        assert hooks.lending_kind(kv.allocator, kv.req_to_token) is None
        hooks.attach_lender(
            None, SimpleNamespace(token_to_kv_pool_allocator=kv.allocator, req_to_token_pool=kv.req_to_token)
        )
        assert hooks.lender_for(kv.allocator) is None
    finally:
        kv.allocator._kvcache = kv.pool


def test_a_hybrid_unit_is_fetched_only_up_to_exactly_its_state(plugin_loaded, hybrid_kv) -> None:
    """A recurrent state is valid at one prompt position: decode plans a fetch of a hybrid unit only when
    it ends exactly where the unit's state was taken (its whole prompt, a whole number of pages)."""

    kv = hybrid_kv
    lender, _ = hybrid_lender(kv)
    aligned, ragged = list(range(100, 108)), list(range(200, 210))  # 8 tokens; 10 tokens (8 in pages)
    for session, prompt in (("s1", aligned), ("s2", ragged)):
        lend(kv, session, prompt, session)
    unit = lender.store.get("s1")
    assert (unit.tokens, unit.state_tokens) == (8, 8)
    plan = lender.plan_fetch("s1", aligned, local_match=4)
    assert plan is not None and (plan.start, plan.end) == (4, 8) and plan.state is unit.state
    assert lender.plan_fetch("s1", aligned[:4], local_match=0) is None  # ends before the state
    assert lender.plan_fetch("s1", [*aligned, 1, 2, 3, 4], local_match=0) is None  # asks past it
    assert lender.plan_fetch("s1", aligned, local_match=8) is None  # nothing beyond prefill's match
    assert (lender.store.get("s2").tokens, lender.store.get("s2").state_tokens) == (8, 10)
    assert lender.plan_fetch("s2", ragged[:8], local_match=0) is None  # pages end before the state
