"""Run metrics: windows, goodput, and the healthy/recovering/overloaded/trapped labels (paper §7.1)."""

import math

import pytest

from basin.evaluate import CallRecord, RunRecords, Sample, SessionRecord, summarize, windows
from basin.evaluate.summary import label_run


def call(released: float, ttft: float, prompt: int = 1000, cached: int = 900) -> CallRecord:
    return CallRecord(
        "s",
        0,
        prompt,
        10,
        released,
        prefill_start_s=released,
        cached_tokens=cached,
        prefill_done_s=released + ttft / 2,
        uncached_tokens=prompt - cached,
        first_token_s=released + ttft,
        done_s=released + ttft + 1,
    )


def test_window_figures() -> None:
    records = RunRecords(duration_s=240, cache_tokens=1000)
    records.calls = [call(10, 1.0), call(20, 3.0), call(30, 2.0, cached=0), call(130, 10.0)]
    records.sessions = [
        SessionRecord("a", 5, 100, first_call_s=5, first_token_s=6),
        SessionRecord("b", 50, 100, first_call_s=110),  # released at 110 s, still no token at 240 s
        SessionRecord("w", 0, 100, warm=True),  # warm sessions are not arrivals
    ]
    records.samples = [Sample(t, 4, 1, 2000, 0, 0, 0, 0) for t in (0, 60, 120, 180)]
    first, second = windows(records, 120)
    assert first.median_ttft_s == 2.0
    assert first.hit_rate == pytest.approx(1800 / 3000)
    assert first.uncached_prefill_tokens_per_s == pytest.approx(1200 / 120)
    assert first.arrivals == 2 and first.never_start_fraction == 0.5
    # Arrival to first token: a waited 1 s; b is still waiting at the end, counted with its 190 s so far.
    assert first.median_first_call_wait_s == pytest.approx((1 + 190) / 2)
    assert first.working_set_over_cache == 2.0
    assert second.median_ttft_s == 10.0 and second.arrivals == 0


def test_first_call_wait_runs_to_the_first_token_not_the_release() -> None:
    """A session released to the engine at once whose first token comes 355 s later waited 355 s (the
    Continuum case of issue 15): the window of its arrival is degraded by that wait, not healthy."""
    records = RunRecords(duration_s=2400, cache_tokens=1000)
    records.sessions = [
        SessionRecord(f"s{i}", 100 + i, 100, first_call_s=100 + i, first_token_s=455 + i, done_s=900 + i)
        for i in range(5)
    ]
    assert records.sessions[0].first_call_wait_s == pytest.approx(355)
    assert records.sessions[0].admission_wait_s == 0
    first = windows(records, 1200)[0]
    assert first.median_first_call_wait_s == pytest.approx(355) and first.degraded
    summary = summarize(records)
    assert summary.median_first_call_wait_s == pytest.approx(355)


def test_refused_sessions_have_no_first_call_wait_and_waiting_ones_count_so_far() -> None:
    shed = SessionRecord("shed", 10, 100, outcome="shed")
    waiting = SessionRecord("parked", 10, 100)
    assert shed.first_call_wait_until_s(1000) is None
    assert waiting.first_call_wait_until_s(1000) == 990


def _window(ttft: float, hit: float, wait: float = 0.0, never: float = 0.0):
    from basin.evaluate.summary import Window

    return Window(0, 1200, 100, ttft, ttft, hit, 0, 0, 0, 0, 0, 0, 0, 0, 10, wait, never)


def _label(previous, last, pre_hit: float = 0.95) -> str:
    records = RunRecords(duration_s=7200, trigger_s=900)
    records.calls = [CallRecord("s", 0, 100, 1, 10, prefill_start_s=10, cached_tokens=int(pre_hit * 100))]
    return label_run(records, [previous, last])[0]


def test_labels_follow_the_paper_definitions() -> None:
    assert _label(_window(0.2, 0.95), _window(0.3, 0.94)) == "healthy"
    assert _label(_window(60, 0.3), _window(61, 0.3)) == "trapped"
    assert _label(_window(60, 0.3), _window(30, 0.4)) == "recovering"  # severity fell by half
    assert _label(_window(60, 0.3), _window(3, 0.9)) == "recovering"  # no longer degraded
    assert _label(_window(60, 0.93), _window(61, 0.92)) == "overloaded"  # degraded but reuse kept
    assert _label(_window(1, 0.9, wait=400), _window(1, 0.9, wait=420)) == "overloaded"
    assert _label(_window(1, 0.9, never=0.3), _window(1, 0.9, never=0.3)) == "overloaded"
    # Less than 25 % improvement still counts as not improving.
    assert _label(_window(60, 0.3), _window(50, 0.3)) == "trapped"


def test_goodput_counts_measured_sessions_within_both_slos() -> None:
    records = RunRecords(duration_s=7200)
    good = SessionRecord("good", 100, 100, done_s=400, outcome="completed", decode_steps=100)
    slow = SessionRecord("slow", 100, 100, done_s=600, outcome="completed", decode_steps=100)
    jittery = SessionRecord(
        "itl", 100, 100, done_s=200, outcome="completed", decode_steps=100, itl_violating_steps=6
    )
    late = SessionRecord("late", 6000, 100, done_s=6100, outcome="completed")  # after the measured 90 min
    warm = SessionRecord("warm", 0, 100, warm=True, done_s=50, outcome="completed")
    shed = SessionRecord("shed", 200, 100, outcome="shed")
    records.sessions = [good, slow, jittery, late, warm, shed]
    summary = summarize(records)
    assert summary.measured_sessions == 4
    assert summary.goodput_sessions_per_h == pytest.approx(1 / 1.5)
    assert summary.completed_fraction == pytest.approx(3 / 4)
    assert summary.shed_fraction == pytest.approx(1 / 4)
    assert math.isnan(summary.hit_rate_pre)
    assert summary.to_dict()["hit_rate_pre"] is None  # JSON gets null, not NaN
