import numpy as np
import pytest

from basin.errors import BasinError
from basin.workload import RateSchedule, poisson_arrivals
from basin.workload.synthetic import generate

POOL = generate("terminal-bench", seed=0, sessions=40)


def test_surge_arrival_counts_follow_the_schedule() -> None:
    schedule = RateSchedule(
        base_rate=3.3,
        duration_min=120,
        surge_factor=2.0,
        surge_start_min=15,
        surge_minutes=10,
        post_surge_rate=2.0,
    )
    windows = {"before": (0, 15), "surge": (15, 25), "after": (25, 120)}
    counts: dict[str, list[int]] = {k: [] for k in windows}
    for seed in range(40):
        arrivals = poisson_arrivals(schedule, POOL, np.random.default_rng(seed))
        times = np.array([a.time_s / 60 for a in arrivals])
        assert np.all(np.diff(times) >= 0)
        for name, (a, b) in windows.items():
            inside = [x for x in arrivals if a * 60 <= x.time_s < b * 60]
            counts[name].append(len(inside))
            assert all(x.in_surge == (name == "surge") for x in inside)
    for name, (a, b) in windows.items():
        expected = schedule.expected_arrivals(a, b)
        mean = float(np.mean(counts[name]))
        # The mean of 40 Poisson counts has standard deviation sqrt(expected / 40).
        assert abs(mean - expected) < 4 * np.sqrt(expected / 40), (name, mean, expected)
        assert np.var(counts[name]) == pytest.approx(expected, rel=0.6)
    assert schedule.expected_arrivals(15, 25) == pytest.approx(66.0)


def test_pool_is_replayed_evenly_and_instances_are_unique() -> None:
    schedule = RateSchedule(base_rate=10, duration_min=60)
    arrivals = poisson_arrivals(schedule, POOL, np.random.default_rng(1))
    assert len({a.instance_id for a in arrivals}) == len(arrivals)
    uses = np.bincount([int(a.session.session_id.split("-")[1]) for a in arrivals], minlength=len(POOL))
    assert uses.max() - uses.min() <= 1


def test_warm_start_joins_mid_trajectory() -> None:
    schedule = RateSchedule(base_rate=1, duration_min=10)
    arrivals = poisson_arrivals(schedule, POOL, np.random.default_rng(2), warm_sessions=42)
    warm = [a for a in arrivals if a.warm]
    assert len(warm) == 42
    for a in warm:
        assert 0 < a.first_call < len(a.session.calls) or len(a.session.calls) == 1
        # The next call comes within the tool gap the session is in.
        assert 0 <= a.time_s <= a.session.calls[a.first_call - 1].tool_gap_s
    assert not any(a.warm for a in arrivals[42:])


def test_same_seed_same_arrivals() -> None:
    schedule = RateSchedule(base_rate=5, duration_min=30)
    a = poisson_arrivals(schedule, POOL, np.random.default_rng(9))
    b = poisson_arrivals(schedule, POOL, np.random.default_rng(9))
    assert [(x.time_s, x.instance_id) for x in a] == [(x.time_s, x.instance_id) for x in b]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_rate": -1, "duration_min": 10}, "base rate"),
        ({"base_rate": 1, "duration_min": 0}, "duration"),
        ({"base_rate": 1, "duration_min": 10, "surge_factor": -2, "surge_minutes": 1}, "surge factor"),
        ({"base_rate": 1, "duration_min": 20, "surge_start_min": 15, "surge_minutes": 10}, "past the end"),
        ({"base_rate": 1, "duration_min": 20, "post_surge_rate": -1}, "post-surge"),
    ],
)
def test_impossible_schedules_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(BasinError, match=message):
        RateSchedule(**kwargs)


def test_warm_sessions_are_length_biased() -> None:
    schedule = RateSchedule(base_rate=1, duration_min=10)
    arrivals = poisson_arrivals(schedule, POOL, np.random.default_rng(3), warm_sessions=400)
    lifetime = {s.session_id: sum(1.0 + c.tool_gap_s for c in s.calls) for s in POOL}
    warm_mean = np.mean([lifetime[a.session.session_id] for a in arrivals if a.warm])
    assert warm_mean > 1.3 * np.mean(list(lifetime.values()))
