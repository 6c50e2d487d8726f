"""Continuum: program-level FCFS with pinned follow-ups first, TTL pins learned from tool durations,
and the engine's pin mechanics (expiry, release under memory pressure, latest program first)."""

from dataclasses import replace

from basin.policy import CallInfo, Continuum, SessionInfo
from basin.sim.deployments import H100, PAGE_TOKENS, Deployment
from basin.sim.engine import PDEngine, Request
from basin.sim.env import Environment


def trained(gap: float = 1.0, n: int = 60) -> Continuum:
    policy = Continuum(prefill_tokens_per_s=30_000, prefill_gpu_tokens=1_000_000)
    for i in range(n):
        sid = f"h{i}"
        policy.on_session_arrival(0.0, SessionInfo(sid, 0.0, "", 1000))
        policy.on_call_end(10.0, CallInfo(sid, 0, 1000), 2000)
        policy.on_call_start(10.0 + gap * (0.5 + i / n), CallInfo(sid, 1, 3000))
    return policy


def test_program_fcfs_with_pinned_follow_ups_first() -> None:
    policy = trained()
    policy.on_session_arrival(100.0, SessionInfo("old", 100.0, "", 1000))
    policy.on_session_arrival(200.0, SessionInfo("new", 200.0, "", 1000))
    assert policy.on_call_start(201.0, CallInfo("old", 0, 1000)).priority == 100.0
    assert policy.on_call_start(201.0, CallInfo("new", 0, 1000)).priority == 200.0
    assert policy.on_call_end(205.0, CallInfo("new", 0, 1000), 5000) > 0  # pinned for its tool
    follow = policy.on_call_start(206.0, CallInfo("new", 1, 6000)).priority
    assert follow is not None and follow < 100.0  # ahead of the older, unpinned program


def test_ttl_covers_the_usual_tool_time_and_refuses_huge_contexts() -> None:
    policy = trained(gap=2.0)  # tool durations spread over 1-3 s
    ttl = policy.ttl(20_000)  # a 2 % share of the cache: worth covering nearly every return
    assert 2.4 <= ttl <= 3.0
    assert policy.ttl(2_000_000) == 0.0  # holding more than the whole cache never pays
    assert Continuum(30_000, 1_000_000).ttl(20_000) == 0.0  # no history yet: no pin


def test_queueing_delay_lengthens_the_ttl_and_pins_what_reload_alone_would_not() -> None:
    """Continuum's TTL counts the queueing delay an evicted call would suffer, not the reload alone."""
    from basin.policy import Telemetry

    policy = trained(gap=2.0)
    big = 600_000  # 60 % of the cache: holding it costs more than the reload is worth
    assert policy.ttl(big) == 0.0
    quiet = policy.ttl(100_000)
    backlog = Telemetry(0.0, 0, 0, 0, 0.9, 600_000, 0, 0, 1, 0)  # 20 s of prefill queued
    policy.on_control(0.0, backlog)
    assert policy.queue_delay_s == 20.0
    assert policy.ttl(big) > 0.0
    assert policy.ttl(100_000) >= quiet


class _Quiet:
    def on_prefill_start(self, request: Request, now: float) -> None: ...
    def on_prefill_done(self, request: Request, now: float, uncached_tokens: int) -> None: ...
    def on_first_token(self, request: Request, now: float) -> None: ...
    def on_request_done(self, request: Request, now: float) -> None: ...


def _request(rid: int, pages: int, session: str) -> Request:
    return Request(rid, None, session, pages * PAGE_TOKENS, 5, tuple(range(rid * 1000, rid * 1000 + pages)))


def test_pins_hold_prefixes_expire_and_yield_to_pressure_latest_first() -> None:
    env = Environment()
    engine = PDEngine(
        env,
        Deployment("t", replace(H100, prefill_cache_tokens=100 * PAGE_TOKENS), 1, 1, host_tier=0.0),
        _Quiet(),
    )
    cache = engine.prefills[0].cache
    early, late = _request(1, 30, "early"), _request(2, 30, "late")
    for r in (early, late):
        engine.submit(r)
    env.run(10)
    engine.pin(early, ttl_s=100, rank=1.0)
    engine.pin(late, ttl_s=100, rank=2.0)
    assert cache.locked_gpu == 60
    filler = _request(3, 40, "filler")  # fits beside both pins
    engine.submit(filler)
    env.run(20)
    engine.pin(filler, ttl_s=100, rank=0.0)  # the oldest program: the cache is now all pinned
    assert cache.peek(early.keys) == 30 and cache.peek(late.keys) == 30
    engine.submit(_request(4, 30, "pressure"))  # needs one pin gone: the later program's goes first
    env.run(30)
    pins = engine.prefills[0].pins
    assert "late" not in pins and "early" in pins and "filler" in pins
    env.run(200)  # the TTL runs out
    assert not engine.prefills[0].pins and cache.locked_gpu == 0
    cache.check()
