"""Unit fetch on a hybrid (Mamba / gated-delta) model: full-attention pages AND the unit's recurrent state.

Decode is a separate process (`unit_peer.py hybrid`): SGLang's hybrid decode pools (page size 1, two
full-attention MHA layers, four gated-delta layers), its unit made through the plugin (prompt-end state
copied at SGLang's `process_prebuilt`, the request's own slot then rewritten by two decode steps, the unit
adopted on SGLang's `release_kv_cache`), its unit service started by the plugin's decode hook and polled
as SGLang's `pop_preallocated` would. Prefill is SGLang's hybrid prefill memory on CPU in this process:
`HybridReqToTokenPool` with its `MambaPool` and `MambaSlotAllocator`, `HybridLinearKVPool` over an MHA
pool, the enabled `UnifiedRadixCache` with the FULL and MAMBA components; each admission pass is SGLang's
real `Req.init_next_round_input` (the radix match, with SGLang's copy-on-write of the matched Mamba state
into the request's slot) and `PrefillAdder.add_one_req`; the pages and state travel over NIXL (UCX on
DRAM, 127.0.0.1).

Stand-ins, and why: the scheduler object (a `SimpleNamespace` with the fields the hooks read: SGLang's
`Scheduler` needs a model); the KV sender's bootstrap record (SGLang's `TransferInfo`, as in
test_prefill_fetch); the model runner's copy of the matched state into the request's slot, which runs in
`ModelRunner` before the forward pass: the test makes the same call
(`HybridReqToTokenPool.copy_mamba_state` on the indices SGLang's `_collect_deferred_mamba_cow_and_clear`
collects), since building a model runner needs a model.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import HybridDecodeKV, Peer, admission_pass
from prometheus_client import CollectorRegistry
from test_prefill_fetch import METRIC_LABELS, prefill_request, sent_to
from unit_peer import (
    HYBRID_FULL,
    HYBRID_LINEAR,
    HYBRID_PROMPT,
    HYBRID_SESSION,
    HYBRID_STATE_SEED,
    unit_values,
)

from basin_engine_ext import hooks
from basin_engine_ext.config import EngineExtConfig
from basin_engine_ext.metrics import EngineMetrics
from basin_engine_ext.prefill import FETCHER_ATTR, PrefillFetcher, fetcher_for, zmq_connect
from basin_engine_ext.transfer import KVLayout, StateLayout, make_agent

pytestmark = pytest.mark.engine

AGENT_IDS = itertools.count()
LOCAL = 12  # prefill's tree holds the session's first 12 tokens with a Mamba state there
LOCAL_STATE_SEED = 777
MARK = {"basin_lend": True, "basin_session": HYBRID_SESSION}
N = len(HYBRID_PROMPT)


@pytest.fixture(scope="module")
def hybrid_decode():
    decode = Peer("hybrid")
    yield decode
    decode.close()


@pytest.fixture(scope="module")
def stalled_hybrid_decode():
    decode = Peer("hybrid-stall")
    yield decode
    decode.close()


class HybridPrefill:
    """A hybrid prefill instance with the session's first LOCAL tokens (and the state there) cached, a
    NIXL agent over its full-attention pages and Mamba pool, a fetcher where the hooks look for it."""

    def __init__(self, decode: Peer, timeout_s: float, grace_s: float = 0.5):
        from array import array

        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.kv = HybridDecodeKV(
            tokens=256, page=1, linear_layers=HYBRID_LINEAR, full_layers=HYBRID_FULL, prefill=True
        )
        kv = self.kv
        self.local = kv.allocator.alloc(LOCAL)
        full = kv.pool.full_kv_pool
        for layer in range(len(HYBRID_FULL)):
            full.k_buffer[layer][self.local] = unit_values(layer, 0, torch.arange(LOCAL))
            full.v_buffer[layer][self.local] = unit_values(layer, 1, torch.arange(LOCAL))
        self.local_state = kv.req_to_token.mamba_allocator.alloc(1)
        kv.write_state(self.local_state, LOCAL_STATE_SEED)
        kv.tree.insert(
            InsertParams(
                key=RadixKey(array("q", HYBRID_PROMPT[:LOCAL])),
                value=self.local,
                mamba_value=self.local_state,
            )
        )
        layout = KVLayout.from_pool(full)
        name = f"hybrid-prefill-{next(AGENT_IDS)}"
        self.registry = CollectorRegistry()
        self.fetcher = PrefillFetcher(
            kv.tree, make_agent(name, layout, "DRAM", StateLayout.from_pool(kv.mamba)), name, layout,
            zmq_connect, unit_port=decode.port, timeout_s=timeout_s, layers_per_group=1,
            late_write_grace_s=grace_s, metrics=EngineMetrics.create(METRIC_LABELS, self.registry),
            state_pool=kv.req_to_token,
        )  # fmt: skip
        self.scheduler = SimpleNamespace(
            waiting_queue=[], disagg_prefill_inflight_queue=[], tree_cache=kv.tree,
            token_to_kv_pool_allocator=kv.allocator, disaggregation_mode=DisaggregationMode.PREFILL,
            tp_rank=0,
        )  # fmt: skip
        setattr(self.scheduler, FETCHER_ATTR, self.fetcher)

    def previous_turn_sent(self) -> None:
        req = prefill_request("turn-1", HYBRID_PROMPT, MARK, room=21)
        sent_to(req, "127.0.0.1")
        self.scheduler.disagg_prefill_inflight_queue = [req]

        def sglang_poll(scheduler):
            req.disagg_kv_sender.kv_mgr.transfer_infos.clear()
            scheduler.disagg_prefill_inflight_queue = []
            return [req]

        assert hooks.record_sent_units(sglang_poll, self.scheduler) == [req]

    def admit_until(self, req, deadline_s: float) -> list:
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        t0 = time.monotonic()
        passes = []
        while time.monotonic() - t0 < deadline_s:
            admitted = hooks.admit_with_unit_fetch(
                admission_pass, self.scheduler, ScheduleBatch(reqs=[], batch_is_full=False)
            )
            passes.append(admitted)
            if req in admitted:
                return passes
            time.sleep(0.01)
        raise AssertionError(f"{req.rid} not admitted in {deadline_s} s; outcomes {self.fetcher.outcomes}")

    def run_cow(self, req) -> None:
        """SGLang's copy of the matched state into the request's slot: the indices
        `ScheduleBatch._collect_deferred_mamba_cow_and_clear` collects, copied as `ModelRunner` does
        before the forward pass (the stand-in: no model runner on CPU)."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        batch = ScheduleBatch(reqs=[req], batch_is_full=False)
        batch._collect_deferred_mamba_cow_and_clear([req])
        assert batch.mamba_cow_src_indices is not None
        pool = self.kv.req_to_token
        pool.copy_mamba_state(
            pool.translate_mamba_indices(batch.mamba_cow_src_indices),
            pool.translate_mamba_indices(batch.mamba_cow_dst_indices),
        )

    def mamba_conserved(self, requests: int = 0) -> bool:
        """SGLang's Mamba accounting: every slot free, in the tree, held by a request, or in a fetch."""
        kv, slots = self.kv, self.kv.req_to_token.mamba_allocator
        return (
            slots.available_size() + kv.tree.mamba_evictable_size() + kv.tree.mamba_protected_size()
            + requests + self.fetcher.inflight_states()
            == slots.size
        )  # fmt: skip

    def metric(self, name: str) -> float:
        return self.registry.get_sample_value(name, METRIC_LABELS) or 0.0

    def close(self) -> None:
        self.fetcher.close()


def state_equal(got: list, want: list) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want, strict=True))


def test_next_turn_resumes_from_the_fetched_pages_and_recurrent_state(hybrid_decode) -> None:
    prefill = HybridPrefill(hybrid_decode, timeout_s=20)
    kv = prefill.kv
    try:
        prefill.previous_turn_sent()
        assert prefill.fetcher.index.lookup(HYBRID_SESSION).token_ids == tuple(HYBRID_PROMPT)
        nxt = prefill_request("turn-2", [*HYBRID_PROMPT, 1, 2, 3], MARK)
        other = prefill_request("other", [5, 6, 7, 8, 9])
        prefill.scheduler.waiting_queue = [nxt, other]
        passes = prefill.admit_until(nxt, deadline_s=30)
        assert passes[0] == [other]  # held while its unit arrives
        assert prefill.fetcher.outcomes[-1] == ("turn-2", "complete", N - LOCAL)
        assert prefill.metric("sglang:basin_unit_fallbacks_total") == 0
        # SGLang's own match resumes at the unit's end: only the three new tokens are computed
        assert nxt.prefix_len == N and nxt.extend_len == 3
        slots = kv.tree.prefix_device_indices(nxt)
        assert torch.equal(slots[:LOCAL], prefill.local)  # prefill's own pages kept
        full = kv.pool.full_kv_pool
        for layer in range(len(HYBRID_FULL)):
            want_k, want_v = unit_values(layer, 0, torch.arange(N)), unit_values(layer, 1, torch.arange(N))
            assert torch.equal(full.k_buffer[layer][slots].view(torch.int16), want_k.view(torch.int16))
            assert torch.equal(full.v_buffer[layer][slots].view(torch.int16), want_v.view(torch.int16))
        # The state SGLang's match copies from is decode's prompt-end state, byte for byte (not the
        # state decode's request held when it finished, nor prefill's local state at LOCAL tokens).
        src = nxt.kv.mamba_cow_src_index
        assert src is not None and int(src) != int(prefill.local_state[0])
        want = kv.expected_state(HYBRID_STATE_SEED)
        assert state_equal(kv.state(src), want)
        assert not state_equal(want, kv.expected_state(10_001))  # the seeds differ (the test can fail)
        prefill.run_cow(nxt)
        assert state_equal(kv.state(nxt.kv.mamba_pool_idx), want)
        assert prefill.fetcher.inflight_states() == 0
        assert prefill.mamba_conserved(requests=1)  # the request's own slot
    finally:
        prefill.close()


def test_a_stalled_decode_recomputes_and_the_fetch_slot_never_reaches_the_tree(stalled_hybrid_decode) -> None:
    prefill = HybridPrefill(stalled_hybrid_decode, timeout_s=1.0, grace_s=0.3)
    kv, slots = prefill.kv, prefill.kv.req_to_token.mamba_allocator
    try:
        free_before = slots.available_size()
        prefill.previous_turn_sent()
        nxt = prefill_request("turn-2", [*HYBRID_PROMPT, 1], MARK)
        prefill.scheduler.waiting_queue = [nxt]
        prefill.admit_until(nxt, deadline_s=30)
        assert prefill.fetcher.outcomes[-1] == ("turn-2", "timeout", 0)
        assert prefill.metric("sglang:basin_unit_fallbacks_total") == 1
        # admitted with its local match: SGLang resumes from the tree's own state at LOCAL tokens
        assert nxt.prefix_len == LOCAL and nxt.extend_len == N + 1 - LOCAL
        assert int(nxt.kv.mamba_cow_src_index) == int(prefill.local_state[0])
        # the fetch's slot (quarantined: a late WRITE may still land) is neither the tree's nor the request's
        (_, _, state), *_ = prefill.fetcher._quarantine
        assert int(state[0]) not in kv.tree.all_mamba_values_flatten().tolist()
        assert int(state[0]) != int(nxt.kv.mamba_pool_idx)
        assert prefill.fetcher.inflight_states() == 1 and prefill.mamba_conserved(requests=1)
        prefill.run_cow(nxt)
        assert state_equal(kv.state(nxt.kv.mamba_pool_idx), kv.expected_state(LOCAL_STATE_SEED))
        deadline = time.monotonic() + 30
        while prefill.fetcher._quarantine and time.monotonic() < deadline:
            prefill.fetcher.poll()
            time.sleep(0.05)
        assert prefill.fetcher.inflight_states() == 0
        assert slots.available_size() == free_before - 1  # the request's own slot only
        assert prefill.mamba_conserved(requests=1)
    finally:
        prefill.close()


def test_a_unit_decode_does_not_hold_is_refused_and_the_slot_freed_at_once(hybrid_decode) -> None:
    prefill = HybridPrefill(hybrid_decode, timeout_s=20)
    slots = prefill.kv.req_to_token.mamba_allocator
    try:
        free_before = slots.available_size()
        prefill.fetcher.index.record("no-such-session", f"127.0.0.1:{hybrid_decode.port}", HYBRID_PROMPT)
        nxt = prefill_request(
            "turn-2", [*HYBRID_PROMPT, 1], {"basin_lend": True, "basin_session": "no-such-session"}
        )
        prefill.scheduler.waiting_queue = [nxt]
        prefill.admit_until(nxt, deadline_s=30)
        assert prefill.fetcher.outcomes[-1] == ("turn-2", "refused", 0)
        assert nxt.prefix_len == LOCAL
        assert prefill.fetcher._quarantine == [] and prefill.fetcher.inflight_states() == 0
        assert slots.available_size() == free_before - 1  # the request's own slot only
        assert prefill.mamba_conserved(requests=1)
    finally:
        prefill.close()


def test_no_fetch_when_the_prompt_leaves_the_unit_before_its_state(hybrid_decode) -> None:
    """The unit's state is valid only after its whole prompt: a prompt that diverges inside the unit
    (or stops there) cannot resume from it, so prefill does not fetch and computes from its own match."""
    prefill = HybridPrefill(hybrid_decode, timeout_s=20)
    try:
        prefill.previous_turn_sent()
        for rid, prompt in (
            ("diverges", [*HYBRID_PROMPT[:30], 1, 2, 3]),
            ("ends-there", list(HYBRID_PROMPT)),
        ):
            req = prefill_request(rid, prompt, MARK)
            prefill.scheduler.waiting_queue = [req]
            assert prefill.admit_until(req, deadline_s=30)[0] == [req]  # admitted in the first pass
            assert req.prefix_len == LOCAL and prefill.fetcher.fetching == {}
        assert prefill.metric("sglang:basin_unit_misses_total") == 2
    finally:
        prefill.close()


def test_sglang_mamba_pool_check_counts_the_slot_of_a_fetch_in_flight(
    plugin_loaded, stalled_hybrid_decode
) -> None:
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
    from sglang.srt.managers.scheduler_components.pool_stats_observer import PoolStats

    prefill = HybridPrefill(stalled_hybrid_decode, timeout_s=30)
    kv = prefill.kv
    try:
        prefill.previous_turn_sent()
        nxt = prefill_request("turn-2", [*HYBRID_PROMPT, 1], MARK)
        prefill.fetcher.before_admission([nxt])
        assert prefill.fetcher.inflight_states() == 1
        checker = object.__new__(SchedulerInvariantChecker)
        checker.req_to_token_pool = kv.req_to_token
        checker.tree_cache = kv.tree
        checker.token_to_kv_pool_allocator = kv.allocator
        checker.pool_stats_observer = SimpleNamespace(session_held_mamba_slots=lambda: 0)
        fields = {f.name: 0 for f in dataclasses.fields(PoolStats)}
        stats = PoolStats(
            **{
                **fields,
                "mamba_available_size": kv.req_to_token.mamba_allocator.available_size(),
                "mamba_evictable_size": kv.tree.mamba_evictable_size(),
            }
        )
        leak, msg = SchedulerInvariantChecker._check_mamba_pool.__wrapped__(checker, stats)
        assert leak, msg  # SGLang alone sees the fetch's slot missing
        leak, msg = checker._check_mamba_pool(stats)
        assert not leak, msg
    finally:
        for f in prefill.fetcher.fetching.values():
            f.fetch.monitor.join(40)
        prefill.close()


def test_the_fetcher_on_a_hybrid_prefill_takes_state_and_waits_on_the_host() -> None:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    def scheduler(kv):
        return SimpleNamespace(
            disaggregation_mode=DisaggregationMode.PREFILL, tree_cache=kv.tree,
            token_to_kv_pool_allocator=kv.allocator, tp_size=1, pp_size=1, tp_rank=0,
        )  # fmt: skip

    config = EngineExtConfig(unit_port=45000, layer_overlap=True)
    kv = HybridDecodeKV(tokens=64, page=1, prefill=True)
    made = fetcher_for(scheduler(kv), config)
    try:
        assert made is not None and made.state_pool is kv.req_to_token and not made.overlap
        assert made.layout.num_layers == 1 and made.state_layout is not None
    finally:
        made.close()
    # a hybrid decode instance's disabled tree takes no fetches
    assert fetcher_for(scheduler(HybridDecodeKV(tokens=64, page=1)), config) is None
    # nor a tree with the Mamba extra buffer (its states sit on the checkpoint grid); the flag is set on
    # the tree SGLang built, as `CacheInitParams.enable_mamba_extra_buffer` would
    extra = HybridDecodeKV(tokens=64, page=1, prefill=True)
    extra.tree.enable_mamba_extra_buffer = True
    assert fetcher_for(scheduler(extra), config) is None


def test_hybrid_decode_refuses_a_fetch_without_the_state_and_writes_nothing(hybrid_decode) -> None:
    """Pages without the recurrent state cannot resume a hybrid model: a state-less fetch (what an MHA
    prefill would send) gets a miss notice, and no byte lands in the pages it named."""
    from basin_engine_ext.transfer import FetchRequest, NoticeReader, pages_of

    kv = HybridDecodeKV(
        tokens=256, page=1, linear_layers=HYBRID_LINEAR, full_layers=HYBRID_FULL, prefill=True
    )
    full = kv.pool.full_kv_pool
    layout = KVLayout.from_pool(full)
    name = f"hybrid-prefill-{next(AGENT_IDS)}"
    agent = make_agent(name, layout, "DRAM", StateLayout.from_pool(kv.mamba))
    slots = kv.allocator.alloc(N)
    hybrid_decode.send(
        FetchRequest(
            fetch_id="stateless", session=HYBRID_SESSION, prompt_ids=list(HYBRID_PROMPT), local_match=0,
            dst_pages=pages_of(slots, 1), agent_metadata=agent.get_agent_metadata(), agent_name=name,
            layout=layout, layers_per_group=1, deadline=time.time() + 30,
        )
    )  # fmt: skip
    reader = NoticeReader(agent, "stateless")
    deadline = time.monotonic() + 30
    groups: list[int] = []
    while not reader.refused and time.monotonic() < deadline:
        groups += reader()
        time.sleep(0.01)
    assert reader.refused and groups == []
    for layer in range(len(HYBRID_FULL)):
        assert not full.k_buffer[layer][slots].any() and not full.v_buffer[layer][slots].any()
