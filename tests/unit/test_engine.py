"""The PD engine model on its own: one request at a time, queues, memory, routing and aborts."""

from dataclasses import replace

import pytest

from basin.errors import BasinError
from basin.sim.costs import (
    decode_step_seconds,
    pd_transfer_seconds,
    prefill_seconds,
    transfer_seconds,
    unloaded_call_seconds,
)
from basin.sim.deployments import H100, PAGE_TOKENS, Deployment
from basin.sim.engine import PDEngine, Request
from basin.sim.env import Environment


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, float]] = []

    def on_prefill_start(self, request: Request, now: float) -> None:
        self.events.append(("prefill_start", request.rid, now))

    def on_prefill_done(self, request: Request, now: float, uncached_tokens: int) -> None:
        self.events.append(("prefill_done", request.rid, now))

    def on_first_token(self, request: Request, now: float) -> None:
        self.events.append(("first_token", request.rid, now))

    def on_request_done(self, request: Request, now: float) -> None:
        self.events.append(("done", request.rid, now))

    def times(self, kind: str) -> dict[int, float]:
        return {rid: t for k, rid, t in self.events if k == kind}


def make_engine(deployment: Deployment | None = None) -> tuple[Environment, PDEngine, Recorder]:
    env, recorder = Environment(), Recorder()
    return env, PDEngine(env, deployment or Deployment("t", H100, 1, 1, host_tier=0.0), recorder), recorder


def request(
    rid: int,
    prompt: int,
    output: int,
    keys: tuple[int, ...] | None = None,
    session: str = "s",
    priority: float | None = None,
) -> Request:
    if keys is None:
        keys = tuple(range(rid * 10_000, rid * 10_000 + prompt // PAGE_TOKENS))
    return Request(rid, None, session, prompt, output, keys, priority=priority)


def assert_idle(engine: PDEngine) -> None:
    for prefill in engine.prefills:
        prefill.cache.check()
        assert prefill.cache.locked_gpu == 0 and prefill.cache.in_flight == 0
        assert prefill.backlog_tokens == 0 and not prefill.running and len(prefill.waiting) == 0
    for decode in engine.decodes:
        assert decode.used == 0 and not decode.members and len(decode.prealloc) == 0
        assert decode.waiting_transfer_tokens == 0


def test_single_request_matches_the_unloaded_cost_model() -> None:
    env, engine, rec = make_engine()
    engine.submit(request(1, 4096, 100))
    env.run(60)
    gpu = H100
    prefill = prefill_seconds(gpu, 4096, 0) + gpu.prefill_chunk_overhead_s
    first_token = prefill + pd_transfer_seconds(gpu, 4096) + decode_step_seconds(gpu, 1, 4096)
    assert rec.times("prefill_done")[1] == pytest.approx(prefill)
    assert rec.times("first_token")[1] == pytest.approx(first_token)
    # The engine prices steps at the batch's context when the batch last changed, the reference at the
    # midpoint context: equal to 0.1 % for a short output.
    assert rec.times("done")[1] == pytest.approx(unloaded_call_seconds(gpu, 4096, 4096, 100), rel=1e-3)
    assert_idle(engine)


@pytest.mark.parametrize("prompt", [4096, 65_536])
def test_the_pd_transfer_is_the_papers_fixed_charge_unless_proportional(prompt: int) -> None:
    """Issue 15: the paper charges a fixed 10 ms per PD transfer (§7.10); `--transfer proportional` prices
    it by the prompt, as lent-unit fetches always are."""
    from basin.sim import get_deployment

    fixed, proportional = get_deployment("h100-1p1d"), get_deployment("h100-1p1d", transfer="proportional")
    assert (fixed.transfer, proportional.transfer) == ("fixed", "proportional")
    timings = {}
    for deployment in (fixed, proportional):
        env, engine, rec = make_engine(deployment)
        engine.submit(request(1, prompt, 10))
        env.run(60)
        timings[deployment.transfer] = rec.times("first_token")[1] - rec.times("prefill_done")[1]
        assert_idle(engine)
    step = decode_step_seconds(H100, 1, prompt)
    assert timings["fixed"] == pytest.approx(0.010 + step)
    assert timings["proportional"] == pytest.approx(transfer_seconds(H100, prompt) + step)
    with pytest.raises(BasinError, match="unknown transfer pricing 'instant'"):
        get_deployment("h100-1p1d", transfer="instant")


def test_returning_call_hits_its_previous_prompt() -> None:
    env, engine, _ = make_engine()
    first = request(1, 6400, 50)
    engine.submit(first)
    env.run(30)
    second = request(2, 8000, 50, keys=first.keys + tuple(range(900_000, 900_000 + 25)))
    engine.submit(second)
    env.run(60)
    assert second.cached_tokens == 6400
    assert second.cached_gpu_tokens == 6400
    assert_idle(engine)


def test_chunked_prefill_splits_long_prompts() -> None:
    env, engine, rec = make_engine()
    engine.submit(request(1, 20_000, 10))
    env.run(60)
    chunks = -(-20_000 // H100.prefill_chunk_tokens)
    expected = prefill_seconds(H100, 20_000, 0) + chunks * H100.prefill_chunk_overhead_s
    assert rec.times("prefill_done")[1] == pytest.approx(expected)


def test_decode_memory_bounds_reservations_and_everything_drains() -> None:
    gpu = replace(H100, decode_kv_tokens=30_000)
    env, engine, rec = make_engine(Deployment("t", gpu, 1, 1, host_tier=0.0))
    for rid in range(1, 9):
        engine.submit(request(rid, 10_000, 200))
    env.run(0.001)
    decode = engine.decodes[0]
    assert decode.used <= decode.capacity
    assert engine.decode_waiting_requests() == 6  # two reservations of 10,512 tokens fit in 30,000
    env.run(600)
    assert len(rec.times("done")) == 8
    assert_idle(engine)


def test_early_allocation_holds_decode_memory_while_awaiting_prefill() -> None:
    env, engine, _ = make_engine()
    for rid in range(1, 4):
        engine.submit(request(rid, 50_000, 10))
    env.run(0.001)
    assert engine.decode_reserved_waiting_tokens() == 3 * (50_000 + 512)


def test_prefill_complete_allocation_reserves_after_prefill() -> None:
    deployment = Deployment("t", H100, 1, 1, host_tier=0.0, allocation="prefill_complete")
    env, engine, rec = make_engine(deployment)
    for rid in range(1, 4):
        engine.submit(request(rid, 50_000, 10))
    env.run(0.001)
    assert engine.decode_used_tokens() == 0
    env.run(120)
    assert len(rec.times("done")) == 3
    assert_idle(engine)


def test_priority_orders_the_prefill_queue() -> None:
    env, engine, rec = make_engine()
    engine.submit(request(1, 30_000, 10, priority=5.0))  # starts at once
    engine.submit(request(2, 30_000, 10, priority=9.0))
    engine.submit(request(3, 30_000, 10, priority=1.0))
    env.run(120)
    starts = rec.times("prefill_start")
    assert starts[1] < starts[3] < starts[2]


def test_fifo_without_priorities() -> None:
    env, engine, rec = make_engine()
    for rid in (1, 2, 3):
        engine.submit(request(rid, 30_000, 10))
    env.run(120)
    starts = rec.times("prefill_start")
    assert starts[1] < starts[2] < starts[3]


@pytest.mark.parametrize("at", [0.0005, 0.5, 1.2, 2.0])
def test_abort_anywhere_frees_everything(at: float) -> None:
    env, engine, rec = make_engine()
    victim = request(1, 40_000, 300)
    engine.submit(victim)
    engine.submit(request(2, 8_000, 20))
    env.run(at)
    engine.abort(victim)
    env.run(120)
    assert 1 not in rec.times("done") or rec.times("done")[1] <= at
    assert 2 in rec.times("done")
    assert_idle(engine)


def test_itl_violations_count_slow_steps_only() -> None:
    slow = replace(H100, decode_step_base_s=0.06)
    env, engine, _ = make_engine(Deployment("t", slow, 1, 1, host_tier=0.0))
    req = request(1, 1024, 40)
    engine.submit(req)
    env.run(60)
    assert req.itl_violating_steps == pytest.approx(40)
    env, engine, _ = make_engine()
    req = request(1, 1024, 40)
    engine.submit(req)
    env.run(60)
    assert req.itl_violating_steps == 0


def test_decode_retracts_when_outputs_outgrow_memory() -> None:
    gpu = replace(H100, decode_kv_tokens=12_000)
    env, engine, rec = make_engine(Deployment("t", gpu, 1, 1, host_tier=0.0))
    engine.submit(request(1, 4_000, 3_000, priority=1.0))
    engine.submit(request(2, 4_000, 3_000, priority=2.0))
    env.run(600)
    assert engine.counters.retractions >= 1
    assert len(rec.times("done")) == 2
    assert_idle(engine)


def test_routers_across_prefill_instances() -> None:
    deployment = Deployment("t", H100, 2, 1, host_tier=0.0)
    env, engine, _ = make_engine(deployment)
    first = request(1, 64_000, 10, session="a")
    engine.submit(first)
    env.run(60)
    home = first.prefill
    returning = request(2, 70_000, 10, keys=first.keys + tuple(range(5_000_000, 5_000_090)), session="a")
    assert engine.route_prefill(returning) is home  # cache-aware: the instance holding the prefix
    engine.submit(request(3, 64_000, 10, session="b"))  # busy instance: least-loaded takes the other
    stranger = request(4, 64_000, 10, session="c")
    assert engine.route_prefill(stranger) is not engine.requests[3].prefill
    affinity = Deployment("t", H100, 2, 1, host_tier=0.0, router="affinity")
    _, engine2, _ = make_engine(affinity)
    picks = {engine2.route_prefill(request(i, 6400, 1, session="same")).index for i in range(5, 10)}
    assert len(picks) == 1


def test_lent_unit_is_fetched_instead_of_recomputed() -> None:
    deployment = Deployment("t", replace(H100, prefill_cache_tokens=20_000), 1, 1, host_tier=0.0)
    env, engine, _ = make_engine(deployment)
    first = request(1, 12_800, 10, session="a")
    first.lend = True
    engine.submit(first)
    env.run(30)
    decode = engine.decodes[0]
    assert decode.lent == 12_800 and "a" in engine.units
    engine.submit(request(2, 19_200, 10, session="b"))  # evicts session a's prefix from prefill
    env.run(60)
    assert engine.prefills[0].cache.peek(first.keys) < len(first.keys)
    follow = request(3, 14_000, 10, keys=first.keys + tuple(range(7_000_000, 7_000_018)), session="a")
    engine.submit(follow)
    env.run(120)
    assert follow.fetched_tokens == 12_800 - follow.cached_gpu_tokens
    assert follow.cached_tokens == 12_800
    assert decode.lent == 0 and engine.counters.unit_fetches == 1
    assert_idle(engine)


def test_decode_reclaims_lent_memory_before_making_requests_wait() -> None:
    gpu = replace(H100, decode_kv_tokens=100_000)
    deployment = Deployment("t", gpu, 1, 1, host_tier=0.0, lend_cap=0.5, lend_headroom=0.0)
    env, engine, rec = make_engine(deployment)
    for rid in range(1, 6):
        r = request(rid, 12_800, 10, session=f"s{rid}")
        r.lend = True
        engine.submit(r)
    env.run(60)
    decode = engine.decodes[0]
    assert decode.lent <= 0.5 * decode.capacity  # the cap holds
    assert decode.lent == 3 * 12_800
    big = request(9, 60_000, 10, session="big")
    engine.submit(big)
    env.run(0.001)
    assert big.state != "decode_wait"  # it got its reservation by reclaiming units
    assert decode.lent <= decode.capacity - 60_512
    env.run(120)
    assert 9 in rec.times("done")


def test_crossflow_decode_borrows_prefill_work_within_the_itl_slo() -> None:
    deployment = Deployment("t", H100, 1, 1, host_tier=0.0, decode_prefill=True)
    env, engine, rec = make_engine(deployment)
    decoding = request(1, 2_048, 3_000)  # keeps the decode batch busy for a while
    engine.submit(decoding)
    env.run(1.0)
    for rid in range(2, 6):  # a prefill backlog: the decode instance takes one at a time
        engine.submit(request(rid, 60_000, 20))
    env.run(1.02)  # past the 5 ms prefix transfer: the suffix is computing
    decode = engine.decodes[0]
    assert decode.borrowed is not None and decode.borrowed.state == "borrowed"
    assert decode.step_s <= deployment.itl_slo_s + 1e-9  # the lease keeps mixed steps within the SLO
    # Interference: the decoding request's steps carry the lease, far slower than decoding alone.
    alone = decode_step_seconds(H100, len(decode.members), decode.context_tokens())
    assert decode.step_s > 3 * alone
    env.run(600)
    assert len(rec.times("done")) == 5
    assert decoding.itl_violating_steps == 0
    assert_idle(engine)
    assert 1 <= engine.counters.borrowed_prefills < 4  # the prefill instance kept some of the work


def test_crossflow_holds_decode_kv_while_the_borrowed_prefill_runs() -> None:
    """With reservation at prefill completion, decode reserves a borrowed request's KV before computing
    it, and leaves the request to prefill when decode memory is short."""
    deployment = Deployment(
        "t", H100, 1, 1, host_tier=0.0, decode_prefill=True, allocation="prefill_complete"
    )
    env, engine, rec = make_engine(deployment)
    decoding = request(1, 2_048, 3_000)
    engine.submit(decoding)
    env.run(1.0)
    for rid in range(2, 6):
        engine.submit(request(rid, 60_000, 20))
    env.run(1.02)  # past the 5 ms prefix transfer: the suffix is computing
    decode = engine.decodes[0]
    borrowed = decode.borrowed
    assert borrowed is not None and borrowed.reserved_tokens == 60_000 + deployment.reserved_decode_tokens
    assert decode.used >= decoding.reserved_tokens + borrowed.reserved_tokens
    env.run(600)
    assert len(rec.times("done")) == 5
    assert_idle(engine)

    short = Deployment(
        "t",
        replace(H100, decode_kv_tokens=50_000),
        1,
        1,
        host_tier=0.0,
        decode_prefill=True,
        allocation="prefill_complete",
    )
    env, engine, rec = make_engine(short)
    engine.submit(request(1, 2_048, 3_000))
    env.run(1.0)
    for rid in range(2, 4):
        engine.submit(request(rid, 60_000, 20))  # more than decode memory holds: no borrowing
    env.run(1.02)
    assert engine.decodes[0].borrowed is None and engine.counters.borrowed_prefills == 0


def _return_after_other_prefills(refresh: bool) -> Request:
    """A session's next call waits behind six other prompts that together outgrow the prefill cache; each
    pass refreshes the waiting prefixes (the interval shortened from SGLang's 32 to show the rule)."""
    gpu = replace(H100, prefill_cache_tokens=40 * PAGE_TOKENS, prefill_chunk_tokens=8 * PAGE_TOKENS)
    deployment = Deployment("t", gpu, 1, 1, host_tier=0.0, waiting_prefix_refresh=refresh)
    env, engine, _ = make_engine(deployment)
    first = request(1, 8 * PAGE_TOKENS, 1)
    engine.submit(first)
    env.run(10)
    engine.submit(request(2, 8 * PAGE_TOKENS, 1, priority=0.0))  # prefill is busy from here on
    later = request(3, 9 * PAGE_TOKENS, 1, keys=(*first.keys, 999_999), priority=9.0)
    engine.submit(later)
    for rid in range(4, 9):
        engine.submit(request(rid, 8 * PAGE_TOKENS, 1, priority=1.0))
    env.run(60)
    assert_idle(engine)
    return later


def test_waiting_prefix_refresh_keeps_a_queued_calls_prefix_from_lru(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's prefill scheduler re-touches the prefixes of the queue head (`_touch_waiting_prefixes`):
    the returning call finds its prefix although later prompts filled the cache while it waited. Without
    the refresh its prefix is the least recently used and goes first."""
    from basin.sim import engine as engine_module

    monkeypatch.setattr(engine_module, "WAITING_PREFIX_REFRESH_INTERVAL", 1)
    assert _return_after_other_prefills(refresh=True).cached_tokens == 8 * PAGE_TOKENS
    assert _return_after_other_prefills(refresh=False).cached_tokens == 0


def test_waiting_prefix_refresh_runs_every_32_passes_over_the_first_128(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from basin.sim import engine as engine_module
    from basin.sim.engine import _Queue

    touched: list[int] = []  # how many waiting requests each refresh walked
    first = _Queue.first

    def spy(queue: _Queue, count: int) -> list[Request]:
        head = first(queue, count)
        touched.append(len(head))
        return head

    monkeypatch.setattr(_Queue, "first", spy)
    gpu = replace(H100, prefill_chunk_tokens=PAGE_TOKENS)
    env, engine, _ = make_engine(Deployment("t", gpu, 1, 1, host_tier=0.0, waiting_prefix_refresh=True))
    for rid in range(1, 201):
        engine.submit(request(rid, PAGE_TOKENS, 1))
    env.run(600)
    passes = engine.prefills[0].passes
    assert passes >= 200 and engine_module.WAITING_PREFIX_REFRESH_INTERVAL == 32
    assert len(touched) == len(range(0, passes, 32))
    assert max(touched) == 128  # a longer queue refreshes only its first 128
