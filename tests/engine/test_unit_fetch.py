"""A real two-process unit fetch over NIXL (UCX on DRAM, 127.0.0.1): the decode process writes its lent
unit into the prefill process's SGLang KV pages in layer order, per-layer-group notices release the
Triton wait kernel layer by layer; a stalled or dead decode falls back to recomputation in time."""

from __future__ import annotations

import time

import pytest
import torch
import zmq
from conftest import Peer

from basin_engine_ext.transfer import KVLayout, PrefillUnitIndex, UnitFetch, make_agent

pytestmark = pytest.mark.engine


@pytest.fixture
def prefill():
    """The prefill side in this process: real SGLang pool and allocator, its own NIXL agent."""
    from conftest import DecodeKV
    from unit_peer import LAYERS

    kv = DecodeKV(tokens=256, layers=LAYERS)
    layout = KVLayout.from_pool(kv.pool)
    return kv, layout, make_agent("prefill-0", layout)


def test_unit_pages_arrive_byte_equal_in_layer_order(prefill) -> None:
    from unit_peer import LAYERS, PROMPT, SESSION, unit_values

    kv, layout, agent = prefill
    index = PrefillUnitIndex()
    index.record(SESSION, "decode-0", PROMPT)
    prompt = [*PROMPT, 1, 2, 3]
    local_match = 13  # prefill's radix cache still has the first 13 tokens
    covered = local_match + index.worth_fetching(SESSION, prompt, local_match)
    assert covered == len(PROMPT)
    before = kv.allocator.available_size()
    decode = Peer("serve")
    try:
        fetch = UnitFetch(agent, "prefill-0", kv.allocator, layout, decode.send, decode.alive, 20.0, 2)
        assert fetch.start("f1", SESSION, prompt, local_match, covered)
        assert (fetch.start_token, fetch.end_token) == (12, 48)
        positions = torch.arange(12, 48)
        for layer in range(LAYERS):
            assert fetch.wait_layer(layer), f"layer {layer} failed"
            # right after its wait, this layer's pages hold exactly the unit's bytes
            k = kv.pool.k_buffer[layer][fetch.dst_slots]
            v = kv.pool.v_buffer[layer][fetch.dst_slots]
            assert torch.equal(k.view(torch.int16), unit_values(layer, 0, positions).view(torch.int16))
            assert torch.equal(v.view(torch.int16), unit_values(layer, 1, positions).view(torch.int16))
        outcome = fetch.finish()
        assert outcome.complete and outcome.groups_ready == 3
        assert kv.allocator.available_size() == before - 36  # the fetched pages now belong to prefill
    finally:
        decode.close()


@pytest.mark.parametrize("mode, reason", [("stall", "timeout"), ("die", "peer lost")])
def test_stalled_or_dead_decode_falls_back_to_recomputation_within_the_timeout(prefill, mode, reason) -> None:
    from unit_peer import PROMPT, SESSION

    kv, layout, agent = prefill
    before = kv.allocator.available_size()
    decode = Peer(mode)
    timeout = 1.5
    try:
        fetch = UnitFetch(agent, "prefill-0", kv.allocator, layout, decode.send, decode.alive, timeout, 2)
        t0 = time.monotonic()
        assert fetch.start("f2", SESSION, PROMPT, 0, len(PROMPT))
        assert not fetch.wait_layer(0)  # released by the monitor, not by data
        waited = time.monotonic() - t0
        outcome = fetch.finish()
        assert outcome.reason == reason and not outcome.complete
        assert waited < timeout + 3.0
        if reason == "timeout":
            assert waited >= timeout - 0.05
        assert kv.allocator.available_size() == before  # destination pages went back
    finally:
        decode.close()


def test_decode_without_a_matching_unit_says_so_and_prefill_recomputes_at_once(prefill) -> None:
    """A unit that no longer matches the prompt (or is gone) gets a miss notice, not a timeout."""
    from unit_peer import PROMPT, SESSION

    kv, layout, agent = prefill
    decode = Peer("serve")
    try:
        fetch = UnitFetch(agent, "prefill-0", kv.allocator, layout, decode.send, decode.alive, 20.0, 2)
        t0 = time.monotonic()
        other = [1, *PROMPT]  # diverges at the first token
        assert fetch.start("f3", SESSION, other, 0, len(PROMPT))
        assert not fetch.wait_layer(0)
        outcome = fetch.finish()
        assert outcome.reason == "refused" and time.monotonic() - t0 < 10
    finally:
        decode.close()


def test_decode_writes_nothing_once_prefill_has_given_the_pages_up(prefill) -> None:
    """A request that reaches decode after its deadline (a stalled decode catching up) is answered with
    a miss, and no byte lands in prefill's pages, which prefill may already have handed on."""
    from unit_peer import LAYERS, PROMPT, SESSION

    from basin_engine_ext.transfer import FetchRequest, NoticeReader, pages_of

    kv, layout, agent = prefill
    decode = Peer("serve")
    try:
        slots = kv.allocator.alloc(len(PROMPT))
        decode.send(
            FetchRequest(
                fetch_id="late", session=SESSION, prompt_ids=list(PROMPT), local_match=0,
                dst_pages=pages_of(slots, layout.page_size), agent_metadata=agent.get_agent_metadata(),
                agent_name="prefill-0", layout=layout, layers_per_group=2, deadline=time.time() - 1,
            )
        )  # fmt: skip
        reader = NoticeReader(agent, "late")
        deadline = time.monotonic() + 20
        groups: list[int] = []
        while not reader.refused and time.monotonic() < deadline:
            groups += reader()
            time.sleep(0.01)
        assert reader.refused and groups == []
        for layer in range(LAYERS):
            assert not kv.pool.k_buffer[layer][slots].any() and not kv.pool.v_buffer[layer][slots].any()
    finally:
        decode.close()


def test_prefill_reports_the_units_its_own_cache_still_holds() -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    cache = RadixCache.create_simulated(page_size=1)
    cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5, 6]), value=torch.arange(6)))
    index = PrefillUnitIndex()
    index.record("a", "decode-0", [1, 2, 3, 4])
    index.record("b", "decode-1", [1, 2, 9, 9])
    index.record("c", "decode-0", [1, 2, 3, 4, 5, 6])

    def match(tokens: list[int]) -> int:
        return cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_prefix_len

    assert index.held_sessions(match) == {"decode-0": ["a", "c"]}
    assert index.worth_fetching("b", [1, 2, 9, 9, 10], local_match=2) == 2
    assert index.worth_fetching("b", [1, 2, 9], local_match=3) == 0


def test_decode_service_takes_prefill_held_report_into_its_reclaim_order(decode_kv) -> None:
    from basin_engine_ext.hooks import make_lender
    from basin_engine_ext.service import UnitService
    from basin_engine_ext.transfer import encode_held

    lender = make_lender(decode_kv.allocator)
    for name in ("a", "b", "c"):
        assert lender.adopt(name, 1, list(range(16)), decode_kv.allocator.alloc(16)) == 16
    layout = KVLayout.from_pool(decode_kv.pool)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        service = UnitService(lender, layout, make_agent("decode-held", layout), pull)
        push.send_multipart(encode_held(["c", "b"]))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not any(u.prefill_holds for u in lender.store.units()):
            service.poll()
            time.sleep(0.01)
        assert [u.session for u in lender.store.reclaim_order()] == ["b", "c", "a"]
    finally:
        push.close()
        pull.close()
        ctx.term()
