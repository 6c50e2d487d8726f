"""The prefill side of a unit fetch, wired around SGLang's prefill admission.

Prefill's memory is SGLang's own on CPU (MHA pool, paged allocator, request rows, the enabled
`UnifiedRadixCache` a prefill instance builds); requests are real `Req`s; each admission pass is SGLang's
real `PrefillAdder` running `Req.init_next_round_input` (the radix match) and `add_one_req`; decode is a
separate process serving its lent unit over NIXL (UCX on DRAM). Stand-ins, and why: the scheduler object
(a `SimpleNamespace` with the fields the hooks read: building SGLang's `Scheduler` needs a model) and the
KV sender's bootstrap record (SGLang's real `TransferInfo`, held where NIXL's prefill manager keeps it).
"""

from __future__ import annotations

import itertools
import time
from array import array
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import zmq
from conftest import DecodeKV, Peer, admission_pass
from prometheus_client import CollectorRegistry
from unit_peer import LAYERS, PROMPT, SESSION, unit_values

from basin_engine_ext import hooks
from basin_engine_ext.config import EngineExtConfig
from basin_engine_ext.metrics import EngineMetrics
from basin_engine_ext.prefill import FETCHER_ATTR, PrefillFetcher, fetcher_for, zmq_connect
from basin_engine_ext.transfer import KVLayout, make_agent

pytestmark = pytest.mark.engine

AGENT_IDS = itertools.count()
LOCAL = 12  # prefill's tree still holds the first three pages of the session's prompt
MARK = {"basin_lend": True, "basin_session": SESSION}
METRIC_LABELS = {"model_name": "m", "engine_type": "prefill", "tp_rank": "0"}


def prefill_request(rid: str, prompt: list[int], custom_params: dict | None = None, room: int | None = None):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        rid=rid, origin_input_text="", origin_input_ids=array("q", prompt),
        sampling_params=SamplingParams(max_new_tokens=1, custom_params=custom_params),
    )  # fmt: skip
    if room is not None:
        req.bootstrap_room = room
    return req


def sent_to(req, endpoint: str) -> None:
    """The bootstrap record NIXL's prefill KV manager keeps for a request's room until its transfer is
    done: SGLang's `TransferInfo`, naming the decode host."""
    from sglang.srt.disaggregation.nixl.conn import TransferInfo

    info = TransferInfo(
        room=req.bootstrap_room, endpoint=endpoint, dst_port=1, agent_name="decode-0",
        dst_kv_indices=np.arange(4, dtype=np.int32), dst_aux_index=0, required_dst_info_num=1,
        dst_state_indices=[],
    )  # fmt: skip
    req.disagg_kv_sender = SimpleNamespace(
        kv_mgr=SimpleNamespace(transfer_infos={req.bootstrap_room: {"d": info}})
    )


class Prefill:
    """A prefill instance: SGLang memory with the session's first pages cached, a NIXL agent, a fetcher
    attached to a scheduler stand-in exactly where the hooks look for it."""

    def __init__(self, decode: Peer, timeout_s: float, local: bool = True):
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.radix_cache import RadixKey

        self.kv = DecodeKV(tokens=256, layers=LAYERS, radix=True)
        self.registry = CollectorRegistry()
        self.local = self.kv.allocator.alloc(LOCAL)
        for layer in range(LAYERS):
            self.kv.pool.k_buffer[layer][self.local] = unit_values(layer, 0, torch.arange(LOCAL))
            self.kv.pool.v_buffer[layer][self.local] = unit_values(layer, 1, torch.arange(LOCAL))
        if local:
            self.kv.tree.insert(InsertParams(key=RadixKey(array("q", PROMPT[:LOCAL])), value=self.local))
        else:
            self.kv.allocator.free(self.local)
        layout = KVLayout.from_pool(self.kv.pool)
        # a fresh name per instance: a decode service caches each peer's NIXL metadata by agent name
        name = f"prefill-{next(AGENT_IDS)}"
        self.fetcher = PrefillFetcher(
            self.kv.tree, make_agent(name, layout), name, layout, zmq_connect,
            unit_port=decode.port, timeout_s=timeout_s, layers_per_group=2, late_write_grace_s=0.5,
            metrics=EngineMetrics.create(METRIC_LABELS, self.registry),
        )  # fmt: skip
        self.scheduler = SimpleNamespace(
            waiting_queue=[], disagg_prefill_inflight_queue=[], tree_cache=self.kv.tree,
            token_to_kv_pool_allocator=self.kv.allocator, disaggregation_mode=DisaggregationMode.PREFILL,
            tp_rank=0,
        )  # fmt: skip
        setattr(self.scheduler, FETCHER_ATTR, self.fetcher)

    def previous_turn_sent(self, prompt: list[int]) -> None:
        """Turn 1 of the session: a marked request whose KV went to decode at 127.0.0.1."""
        req = prefill_request("turn-1", prompt, MARK, room=11)
        sent_to(req, "127.0.0.1")
        self.scheduler.disagg_prefill_inflight_queue = [req]

        def sglang_poll(scheduler):  # the transfer concludes; the worker drops its bootstrap record
            req.disagg_kv_sender.kv_mgr.transfer_infos.clear()
            scheduler.disagg_prefill_inflight_queue = []
            return [req]

        assert hooks.record_sent_units(sglang_poll, self.scheduler) == [req]

    def admit_until(self, req, deadline_s: float) -> tuple[list, float]:
        """Run admission passes through the plugin's hook until `req` is admitted; returns what each
        pass admitted and the seconds it took."""
        from sglang.srt.managers.schedule_batch import ScheduleBatch

        t0 = time.monotonic()
        passes = []
        while time.monotonic() - t0 < deadline_s:
            batch = ScheduleBatch(reqs=[], batch_is_full=False)
            admitted = hooks.admit_with_unit_fetch(admission_pass, self.scheduler, batch)
            passes.append(admitted)
            if req in admitted:
                return passes, time.monotonic() - t0
            time.sleep(0.01)
        raise AssertionError(
            f"{req.rid} not admitted within {deadline_s} s; outcomes {self.fetcher.outcomes}"
        )

    def conserved(self) -> bool:
        """SGLang's accounting: every slot is free, in the tree (evictable or locked) or in a fetch."""
        kv = self.kv
        return (
            kv.allocator.available_size() + kv.tree.evictable_size() + kv.tree.protected_size()
            + self.fetcher.inflight_tokens()
            == kv.allocator.size
        )  # fmt: skip

    def metric(self, name: str) -> float:
        return self.registry.get_sample_value(name, METRIC_LABELS) or 0.0

    def close(self) -> None:
        self.fetcher.close()


def test_a_sent_marked_request_is_indexed_under_the_decode_it_went_to(serving_decode) -> None:
    prefill = Prefill(serving_decode, timeout_s=20)
    try:
        prefill.previous_turn_sent([*PROMPT, 1, 2])  # 50 tokens: 12 whole pages
        unit = prefill.fetcher.index.lookup(SESSION)
        assert unit is not None and unit.decode == f"127.0.0.1:{serving_decode.port}"
        assert unit.token_ids == tuple(PROMPT)
        unmarked = prefill_request("plain", PROMPT, {"basin_session": "other"}, room=12)
        sent_to(unmarked, "127.0.0.1")
        prefill.scheduler.disagg_prefill_inflight_queue = [unmarked]
        hooks.record_sent_units(lambda s: [unmarked], prefill.scheduler)
        assert prefill.fetcher.index.lookup("other") is None  # no lending mark, no unit on decode
    finally:
        prefill.close()


def test_next_turn_is_held_while_its_unit_arrives_then_admitted_with_the_fetched_prefix(
    serving_decode,
) -> None:
    prefill = Prefill(serving_decode, timeout_s=20)
    try:
        prefill.previous_turn_sent(PROMPT)
        nxt = prefill_request("turn-2", [*PROMPT, 1, 2, 3], MARK)
        other = prefill_request("other", [5, 6, 7, 8, 9, 10, 11, 12, 13])
        prefill.scheduler.waiting_queue = [nxt, other]
        passes, _ = prefill.admit_until(nxt, deadline_s=30)
        assert passes[0] == [other]  # held out of the first pass; the rest of the queue goes on
        assert prefill.fetcher.outcomes[-1] == ("turn-2", "complete", len(PROMPT) - LOCAL)
        assert prefill.metric("sglang:basin_unit_fallbacks_total") == 0
        # SGLang's own match now covers the unit: only the three new tokens are computed
        assert nxt.prefix_len == len(PROMPT) and nxt.extend_len == 3
        slots = prefill.kv.tree.prefix_device_indices(nxt)
        assert torch.equal(slots[:LOCAL], prefill.local)  # prefill's own pages are kept, not refetched
        for layer in range(LAYERS):
            for kind, buf in ((0, prefill.kv.pool.k_buffer), (1, prefill.kv.pool.v_buffer)):
                expected = unit_values(layer, kind, torch.arange(len(PROMPT)))
                assert torch.equal(buf[layer][slots].view(torch.int16), expected.view(torch.int16))
        assert prefill.conserved() and prefill.fetcher.inflight_tokens() == 0
        assert prefill.scheduler.waiting_queue == []
    finally:
        prefill.close()


def test_a_unit_made_by_decodes_release_path_reaches_the_next_turn() -> None:
    """The whole chain through the plugin on both sides: decode keeps a finished marked request's prompt
    (SGLang's `release_kv_cache`, hooked) and serves it from its scheduler-loop hook; prefill indexes the
    turn after its transfer and fetches the unit for the next turn before admitting it."""
    decode = Peer("released")
    prefill = Prefill(decode, timeout_s=20)
    try:
        prefill.previous_turn_sent(PROMPT)
        nxt = prefill_request("turn-2", [*PROMPT, 1, 2, 3], MARK)
        prefill.scheduler.waiting_queue = [nxt]
        prefill.admit_until(nxt, deadline_s=30)
        assert prefill.fetcher.outcomes[-1] == ("turn-2", "complete", len(PROMPT) - LOCAL)
        assert nxt.prefix_len == len(PROMPT) and nxt.extend_len == 3
        slots = prefill.kv.tree.prefix_device_indices(nxt)
        for layer in range(LAYERS):
            expected = unit_values(layer, 1, torch.arange(len(PROMPT))).view(torch.int16)
            assert torch.equal(prefill.kv.pool.v_buffer[layer][slots].view(torch.int16), expected)
        assert prefill.conserved()
    finally:
        prefill.close()
        decode.close()


def test_a_stalled_decode_sends_the_request_to_recomputation_after_the_timeout(stalled_decode) -> None:
    prefill = Prefill(stalled_decode, timeout_s=1.5)
    try:
        prefill.previous_turn_sent(PROMPT)
        prefill.fetcher.index.record("same-decode", f"127.0.0.1:{stalled_decode.port}", [1, 2, 3, 4])
        prefill.fetcher.index.record("elsewhere", "10.0.0.9:7400", [1, 2, 3, 4])
        before = prefill.kv.allocator.available_size()
        nxt = prefill_request("turn-2", [*PROMPT, 1, 2, 3], MARK)
        prefill.scheduler.waiting_queue = [nxt]
        passes, waited = prefill.admit_until(nxt, deadline_s=30)
        assert passes[0] == []
        assert 1.4 <= waited < 1.5 + 5
        assert prefill.fetcher.outcomes[-1] == ("turn-2", "timeout", 0)
        assert prefill.metric("sglang:basin_unit_fallbacks_total") == 1
        assert nxt.prefix_len == LOCAL and nxt.extend_len == len(PROMPT) + 3 - LOCAL
        index = prefill.fetcher.index
        assert index.lookup(SESSION) is None and index.lookup("same-decode") is None  # no more waits there
        assert index.lookup("elsewhere") is not None
        # the fetch's pages stay out of use for the grace period (a late WRITE may still land)...
        assert prefill.fetcher.inflight_tokens() == len(PROMPT) - LOCAL and prefill.conserved()
        deadline = time.monotonic() + 10
        while prefill.kv.allocator.available_size() != before and time.monotonic() < deadline:
            prefill.fetcher.poll()
            time.sleep(0.05)
        assert prefill.kv.allocator.available_size() == before  # ...then they go back
        assert prefill.fetcher.inflight_tokens() == 0 and prefill.conserved()
    finally:
        prefill.close()


def test_concurrent_fetches_each_get_their_own_notices_and_the_tree_keeps_one_copy(serving_decode) -> None:
    """Two waiting turns fetch at once over one prefill agent (each monitor on its own thread); both
    complete, and the second insert gives its duplicate pages back instead of leaking them."""
    prefill = Prefill(serving_decode, timeout_s=20)
    try:
        prefill.previous_turn_sent(PROMPT)
        first = prefill_request("turn-2a", [*PROMPT, 1], MARK)
        second = prefill_request("turn-2b", [*PROMPT, 2], MARK)
        prefill.scheduler.waiting_queue = [first, second]
        assert hooks.admit_with_unit_fetch(admission_pass, prefill.scheduler, None) == []
        assert len(prefill.fetcher.fetching) == 2
        prefill.admit_until(second, deadline_s=30)
        if first in prefill.scheduler.waiting_queue:
            prefill.admit_until(first, deadline_s=30)
        outcomes = {rid: (reason, n) for rid, reason, n in prefill.fetcher.outcomes}
        assert outcomes == {"turn-2a": ("complete", 36), "turn-2b": ("complete", 36)}
        assert first.prefix_len == second.prefix_len == len(PROMPT)
        assert torch.equal(
            prefill.kv.tree.prefix_device_indices(first), prefill.kv.tree.prefix_device_indices(second)
        )
        assert prefill.conserved()
        held = prefill.kv.tree.evictable_size() + prefill.kv.tree.protected_size()
        assert (
            held == len(PROMPT) and prefill.kv.allocator.available_size() == prefill.kv.allocator.size - held
        )
    finally:
        prefill.close()


def test_without_a_local_match_the_whole_unit_is_fetched(serving_decode) -> None:
    prefill = Prefill(serving_decode, timeout_s=20, local=False)
    try:
        prefill.previous_turn_sent(PROMPT)
        nxt = prefill_request("turn-2", [*PROMPT, 1], MARK)
        prefill.scheduler.waiting_queue = [nxt]
        prefill.admit_until(nxt, deadline_s=30)
        assert prefill.fetcher.outcomes[-1] == ("turn-2", "complete", len(PROMPT))
        assert nxt.prefix_len == len(PROMPT) and nxt.extend_len == 1
        slots = prefill.kv.tree.prefix_device_indices(nxt)
        for layer in range(LAYERS):
            expected = unit_values(layer, 0, torch.arange(len(PROMPT))).view(torch.int16)
            assert torch.equal(prefill.kv.pool.k_buffer[layer][slots].view(torch.int16), expected)
        assert prefill.conserved()
    finally:
        prefill.close()


def test_a_unit_decode_no_longer_has_is_recomputed_without_waiting(serving_decode) -> None:
    prefill = Prefill(serving_decode, timeout_s=20)
    try:
        prefill.fetcher.index.record("gone", f"127.0.0.1:{serving_decode.port}", PROMPT)  # reclaimed there
        nxt = prefill_request("turn-2", [*PROMPT, 1], {"basin_session": "gone"})
        prefill.scheduler.waiting_queue = [nxt]
        _, waited = prefill.admit_until(nxt, deadline_s=30)
        assert waited < 10
        assert prefill.fetcher.outcomes[-1] == ("turn-2", "refused", 0)
        assert nxt.prefix_len == LOCAL and prefill.conserved()
        assert prefill.fetcher.index.lookup("gone") is None  # not asked again for that unit
    finally:
        prefill.close()


def test_no_fetch_when_the_local_match_already_covers_the_unit(serving_decode) -> None:
    prefill = Prefill(serving_decode, timeout_s=20)
    try:
        prefill.fetcher.index.record(SESSION, f"127.0.0.1:{serving_decode.port}", PROMPT[:LOCAL])
        nxt = prefill_request("turn-2", [*PROMPT, 1], MARK)
        prefill.scheduler.waiting_queue = [nxt]
        passes, _ = prefill.admit_until(nxt, deadline_s=5)
        assert len(passes) == 1 and prefill.fetcher.outcomes == []
        assert nxt.prefix_len == LOCAL
        assert prefill.metric("sglang:basin_unit_misses_total") == 1
    finally:
        prefill.close()


def test_held_unit_report_reaches_decode_and_sets_its_reclaim_order(decode_kv) -> None:
    from basin_engine_ext.hooks import make_lender
    from basin_engine_ext.service import UnitService

    lender = make_lender(decode_kv.allocator)
    for name in ("a", "b", "c"):
        assert lender.adopt(name, 1, PROMPT[:16], decode_kv.allocator.alloc(16)) == 16
    service_layout = KVLayout.from_pool(decode_kv.pool)
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    service = UnitService(lender, service_layout, make_agent("decode-held", service_layout), pull)
    now = [0.0]
    prefill = Prefill(SimpleNamespace(port=port), timeout_s=5)
    prefill.fetcher.clock = lambda: now[0]
    prefill.fetcher._next_report = 5.0
    try:
        decode = f"127.0.0.1:{port}"
        prefill.fetcher.index.record("a", decode, PROMPT[:8])  # prefill's tree covers it in full
        prefill.fetcher.index.record("b", decode, PROMPT[:16])  # only 12 of 16 tokens cached
        prefill.fetcher.index.record("c", decode, PROMPT[:LOCAL])
        hooks.admit_with_unit_fetch(admission_pass, prefill.scheduler, None)  # not due yet: no report
        now[0] = 6.0
        prefill.scheduler.waiting_queue = []
        hooks.admit_with_unit_fetch(lambda s, b: [], prefill.scheduler, None)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(u.prefill_holds for u in lender.store.units()):
            service.poll()
            time.sleep(0.01)
        assert {u.session for u in lender.store.units() if u.prefill_holds} == {"a", "c"}
        assert [u.session for u in lender.store.reclaim_order()] == ["a", "c", "b"]
    finally:
        prefill.close()
        pull.close()


def test_the_fetcher_is_made_only_on_a_pd_prefill_scheduler_with_a_radix_tree() -> None:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    config = EngineExtConfig(unit_port=7400)

    def scheduler(mode, radix: bool, tp_size: int = 1):
        kv = DecodeKV(tokens=64, layers=2, radix=radix)
        return SimpleNamespace(disaggregation_mode=mode, tree_cache=kv.tree, tp_rank=0, tp_size=tp_size)

    made = fetcher_for(scheduler(DisaggregationMode.PREFILL, True), config)
    assert isinstance(made, PrefillFetcher) and made.decode_address("10.0.0.7") == "10.0.0.7:7400"
    made.close()
    assert fetcher_for(scheduler(DisaggregationMode.DECODE, True), config) is None
    assert fetcher_for(scheduler(DisaggregationMode.NULL, True), config) is None
    assert fetcher_for(scheduler(DisaggregationMode.PREFILL, False), config) is None  # radix cache off
    assert fetcher_for(scheduler(DisaggregationMode.PREFILL, True, tp_size=2), config) is None
    decode_scheduler = scheduler(DisaggregationMode.DECODE, True)
    seen = []
    assert hooks.admit_with_unit_fetch(lambda s, b: seen.append(b) or "batch", decode_scheduler, 1) == "batch"
    assert seen == [1]


def test_sglang_memory_check_counts_the_pages_of_a_fetch_in_flight(plugin_loaded, stalled_decode) -> None:
    """While a unit arrives its pages belong to no request and no tree node; SGLang's conservation
    check (run when the scheduler idles, e.g. after the waiting request was aborted) must not call that
    a leak, and after the fetch concludes the plain check holds again."""
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

    prefill = Prefill(stalled_decode, timeout_s=1.0)
    kv = prefill.kv
    checker = object.__new__(SchedulerInvariantChecker)  # SGLang's class, fields a scheduler would set
    checker.token_to_kv_pool_allocator = kv.allocator
    checker.tree_cache = kv.tree
    checker.req_to_token_pool = kv.req_to_token
    checker.is_hybrid_swa = checker.is_hybrid_ssm = False
    checker.max_total_num_tokens = kv.allocator.size
    checker.pool_stats_observer = SimpleNamespace(session_held_tokens=lambda: 0)

    def stats():
        return SimpleNamespace(
            full_evictable_size=kv.tree.evictable_size(), full_available_size=kv.allocator.available_size()
        )

    try:
        prefill.previous_turn_sent(PROMPT)
        prefill.scheduler.waiting_queue = [prefill_request("turn-2", [*PROMPT, 1], MARK)]
        assert hooks.admit_with_unit_fetch(admission_pass, prefill.scheduler, None) == []
        assert prefill.fetcher.inflight_tokens() == len(PROMPT) - LOCAL
        prefill.scheduler.waiting_queue = []  # SGLang aborted the waiting request
        leak, msg = SchedulerInvariantChecker._check_full_pool.__wrapped__(checker, stats(), uncached=0)
        assert leak, msg  # SGLang alone sees the fetch's pages missing
        leak, msg = checker._check_full_pool(stats(), uncached=0)
        assert not leak, msg
        deadline = time.monotonic() + 10
        while prefill.fetcher.inflight_tokens() and time.monotonic() < deadline:  # fetch, then grace
            hooks.admit_with_unit_fetch(admission_pass, prefill.scheduler, None)
            leak, msg = checker._check_full_pool(stats(), uncached=0)
            assert not leak, msg
            time.sleep(0.05)
        assert prefill.fetcher.outcomes[-1] == ("turn-2", "timeout", 0)
        leak, msg = SchedulerInvariantChecker._check_full_pool.__wrapped__(checker, stats(), uncached=0)
        assert not leak, msg
    finally:
        prefill.close()
