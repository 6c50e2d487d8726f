"""The fluid model (paper §5): hit curve, departure curve, equilibria, first limit and drain time."""

from dataclasses import replace

import numpy as np
import pytest

from basin.errors import BasinError
from basin.fluid import FluidModel, FluidParameters, analyze
from basin.hitcurve import KNEE, reference_hit_rate
from basin.sim import get_deployment
from basin.workload import load_workload

POOL = load_workload("terminal-bench", seed=0)


def model(
    preset: str, host_tier: float | None = None, tool_scale: float = 1.0, kappa: float = 1.0
) -> FluidModel:
    pool = POOL if tool_scale == 1 else load_workload("terminal-bench", seed=0, tool_time_scale=tool_scale)
    return FluidModel(FluidParameters.from_workload(get_deployment(preset, host_tier=host_tier), pool, kappa))


def test_reference_hit_curve_has_plateau_knee_and_cliff() -> None:
    assert reference_hit_rate(0.2) == pytest.approx(0.95, abs=0.01)
    assert reference_hit_rate(KNEE * 0.97) == pytest.approx(0.80, abs=0.06)
    assert reference_hit_rate(2.5) < 0.32
    x = np.linspace(0, 4, 200)
    assert np.all(np.diff(reference_hit_rate(x)) <= 1e-12)  # never rises with the working set
    assert reference_hit_rate(2.0 * KNEE * 0.9, kappa=2.0) > 0.75  # κ = 2 moves the knee out


def test_departures_rise_peak_and_fall_to_the_low_reuse_rate_when_cache_limits() -> None:
    """Fig. 9a's deployment: 1P3D with HiCache, at a base load inside its vulnerable range."""
    m = model("h200-1p3d")
    result = analyze(m, base_rate_per_min=8.0)
    assert result.first_limit == "cache"
    n = m.population_grid()
    d = m.departures_per_min(n)
    peak = int(np.argmax(d))
    assert np.all(np.diff(d[: peak // 2]) > 0)
    assert d[-1] == pytest.approx(result.d_low_per_min, rel=0.01)
    assert result.d_low_per_min < 0.6 * result.d_peak_per_min
    # Both equilibria sit where departures meet the base rate, on either side of the peak.
    assert result.n_stable < result.n_peak < result.n_unstable
    for value in (result.n_stable, result.n_unstable):
        assert m.departures_per_min(np.array([value]))[0] == pytest.approx(8.0, rel=0.05)
    assert result.state == "vulnerable"
    low, high = result.vulnerable_range_per_min
    assert low < 8.0 < high


def test_the_single_h100_engine_saturates_decode_first_yet_its_departures_fall_past_the_cliff() -> None:
    """§7.2: "On H100 1P1D, decode saturates first (Eq. 2)"; §3 still traps it at 3.3 sessions/min. The
    decode bound caps the departure peak, and past the cliff departures fall below the base rate."""
    for host_tier in (0.0, 2.0):
        result = analyze(model("h100-1p1d", host_tier=host_tier), base_rate_per_min=3.3)
        assert result.first_limit == "decode" and result.cache_first_ratio > 1.0 + 0.01
        assert result.d_low_per_min < 3.3 < result.d_peak_per_min
        assert result.state == "vulnerable" and result.n_unstable is not None


def test_rates_outside_the_vulnerable_range() -> None:
    m = model("h100-1p1d")
    probe = analyze(m, 1.0)
    over = analyze(m, probe.d_peak_per_min * 1.1)
    assert over.state == "overloaded" and over.n_stable is None and over.n_unstable is None
    assert over.drain_minutes is None
    below = analyze(m, probe.d_low_per_min * 0.8)
    assert below.n_unstable is None and below.n_stable is not None


def test_capacity_raises_the_departure_peak() -> None:
    gpu_only = analyze(model("h200-1p3d", host_tier=0), 8).d_peak_per_min
    host = analyze(model("h200-1p3d", host_tier=2), 8).d_peak_per_min
    assert host > 1.3 * gpu_only


def test_decode_instances_and_tool_time_shift_the_first_limit_toward_the_cache() -> None:
    one = analyze(model("h200-1p1d"), 5).cache_first_ratio
    three = analyze(model("h200-1p3d"), 5).cache_first_ratio
    assert three < one
    assert analyze(model("h200-1p1d", tool_scale=10), 2).cache_first_ratio < one
    assert analyze(model("h200-1p1d"), 5).first_limit == "decode"  # §4: 1P1D with a host tier
    assert analyze(model("h200-1p3d"), 5).first_limit == "cache"


def test_calls_slow_with_the_decode_batch_the_population_implies() -> None:
    """L(N) starts at the unloaded call time, grows with the per-instance batch and stops growing where
    decode memory is full; three decode instances split the batch, so their calls slow less."""
    one, three = model("h200-1p1d", host_tier=0), model("h200-1p3d", host_tier=0)
    n = np.array([1.0, 60.0, 120.0, 10_000.0, 20_000.0])
    slow = one.call_seconds(n)
    assert slow[0] == pytest.approx(one.p.unloaded_call_s)
    assert np.all(np.diff(slow[:4]) > 0)
    assert slow[3] == pytest.approx(slow[4])  # the batch is capped at what fits
    assert three.call_seconds(n)[2] - three.p.unloaded_call_s < 0.5 * (slow[2] - one.p.unloaded_call_s)


def test_gpu_only_1p1d_is_cache_first_once_calls_slow_under_load() -> None:
    """The grid's GPU-only 1P1D at tool time x1 is cache-first in the simulator (docs/models.md); with the
    unloaded L0 in the closed loop the model put it at 1.04x the decode bound, past the 1 % tolerance."""
    m = model("h200-1p1d", host_tier=0)
    assert analyze(m, 5).first_limit == "cache"
    unloaded = FluidModel(replace(m.p, decode_slowdown_s=0.0))
    assert analyze(unloaded, 5).first_limit == "decode"


def test_drain_time_is_backlog_over_the_departure_surplus() -> None:
    result = analyze(model("h200-1p3d"), 8, backlog_sessions=120)
    assert result.drain_minutes == pytest.approx(120 / (result.d_peak_per_min - 8))


def test_model_peak_is_near_the_simulated_overload_rate() -> None:
    # The paper's reference overload on H200 1P3D with a 2x host tier is 16.5 sessions/min (§5.2).
    assert analyze(model("h200-1p3d", host_tier=2), 8).d_peak_per_min == pytest.approx(16.5, rel=0.15)


def test_bad_parameters() -> None:
    m = model("h100-1p1d")
    with pytest.raises(BasinError, match="base rate"):
        analyze(m, -1)
    with pytest.raises(BasinError, match="backlog"):
        analyze(m, 1, backlog_sessions=-5)
    with pytest.raises(BasinError, match="kappa"):
        FluidParameters.from_workload(get_deployment("h100-1p1d"), POOL, kappa=0)
    p = FluidParameters.from_workload(get_deployment("h100-1p1d"), POOL)
    assert replace(p, kappa=2.0).kappa == 2.0
