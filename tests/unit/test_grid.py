"""The fluid model against the simulator on deployments at both ends of the grid."""

import math

import pytest

from basin.evaluate.summary import Window
from basin.fluid import FluidModel, FluidParameters, analyze
from basin.grid import (
    GridPoint,
    agreement,
    run_grid,
    simulated_first_limit,
    simulated_limit,
    steady_run_minutes,
)
from basin.profile import settle_step_minutes
from basin.sim import get_deployment
from basin.workload import load_workload

POOL = load_workload("terminal-bench", seed=0)

DECODE_KV = 1_000_000


def window(hit: float, decoding: float, awaiting_prefill: float = 0.0) -> Window:
    """A 2-minute window with the given hit rate and decode KV shares (of `DECODE_KV`)."""
    return Window(
        start_s=0.0,
        end_s=120.0,
        calls_first_token=100,
        median_ttft_s=1.0,
        p90_ttft_s=2.0,
        hit_rate=hit,
        uncached_prefill_tokens_per_s=1_000.0,
        active_sessions=50.0,
        parked_sessions=0.0,
        working_set_tokens=1e6,
        working_set_over_cache=1.0,
        decode_kv_decoding_tokens=decoding * DECODE_KV,
        decode_kv_waiting_tokens=awaiting_prefill * DECODE_KV,
        completed_calls_per_min=50.0,
        arrivals=10,
        median_first_call_wait_s=0.0,
        never_start_fraction=0.0,
    )


def test_what_limited_a_run_first() -> None:
    steady = [window(0.95, 0.5)] * 3
    # Decoding requests fill decode memory while reuse holds.
    assert simulated_limit([*steady, window(0.95, 0.95), window(0.94, 0.97)], DECODE_KV) == "decode"
    # Reuse falls; requests waiting for prefill then reserve the rest of decode memory (the trap, Fig. 6d).
    fell = [window(0.80, 0.45, 0.45), window(0.30, 0.05, 0.95), window(0.0, 0.04, 0.95)]
    assert simulated_limit([*steady, *fell], DECODE_KV) == "cache"
    # A single low window is noise, not a fall; the backlog grows in front of prefill with reuse intact.
    backlog = [window(0.94, 0.4, 0.5), window(0.80, 0.35, 0.6), window(0.93, 0.3, 0.65)]
    assert simulated_limit([*steady, *backlog], DECODE_KV) == "prefill"
    # Decode filling first wins even if reuse falls later.
    later = [window(0.95, 0.92), window(0.5, 0.5, 0.5), window(0.3, 0.1, 0.9)]
    assert simulated_limit([*steady, *later], DECODE_KV) == "decode"
    assert simulated_limit([window(math.nan, 0.0), *steady, *fell], DECODE_KV) == "cache"


def test_model_and_simulator_agree_on_a_cache_first_and_a_decode_first_deployment() -> None:
    cache_first, decode_first = run_grid(points=[("h200-1p3d", 0.0, 1.0), ("h200-1p1d", 10.0, 1.0)])
    assert (cache_first.model_first_limit, cache_first.simulated_first_limit) == ("cache", "cache")
    assert (decode_first.model_first_limit, decode_first.simulated_first_limit) == ("decode", "decode")
    assert cache_first.model_ratio < 1 < decode_first.model_ratio


def test_a_large_host_tier_runs_out_of_decode_before_reuse() -> None:
    """1P3D with a 10x host tier: Fig. 8b's flat cells are a decode limit, and the model agrees (the
    closed-loop and prefill peak is 1.11x the decode bound). The simulator first degrades one step past
    the model's departure peak (1.25x, ~42/min), with decoding requests filling decode KV (seed 0)."""
    deployment = get_deployment("h200-1p3d", host_tier=10.0)
    analysis = analyze(FluidModel(FluidParameters.from_workload(deployment, POOL)), 0.0)
    assert analysis.first_limit == "decode"
    limit, rate = simulated_first_limit(
        "h200-1p3d", 10.0, 1.0, analysis.d_peak_per_min, seed=0, duration_min=60.0
    )
    assert limit == "decode" and rate == pytest.approx(1.25 * analysis.d_peak_per_min)


def test_one_decode_instance_gpu_only_is_cache_first_in_both() -> None:
    """GPU-only 1P1D, tool time x1: the simulator's reuse collapses before decode fills, and the model
    flags it only with the loaded call time (ratio 0.88; 1.04 with the unloaded L0, docs/models.md)."""
    (point,) = run_grid(points=[("h200-1p1d", 0.0, 1.0)])
    assert (point.model_first_limit, point.simulated_first_limit) == ("cache", "cache")


def test_runs_last_until_the_population_settles() -> None:
    """An hour suffices for Terminal-Bench's ~10-minute sessions; with tool time x3 (sessions ~23 minutes
    unloaded) a run lasts a profiling ramp step, three lifetimes, before its last 20-minute window."""
    assert steady_run_minutes("h200-1p3d", 0.0, POOL) == 60.0
    slow = load_workload("terminal-bench", seed=0, tool_time_scale=3.0)
    minutes = steady_run_minutes("h200-1p3d", 0.0, slow)
    assert minutes == settle_step_minutes("h200-1p3d", slow, 0.0) + 20.0
    assert minutes > 80.0


def test_long_tool_gaps_trap_once_the_population_has_built_up() -> None:
    """GPU-only 1P3D with tool time x3: the model flags it (its prefill side peaks at 0.16 of the decode
    bound) and the simulator agrees once its runs are long enough. Measured (seed 0): at twice the model's
    peak (11.3/min) reuse holds at 0.83-0.85 for an hour and falls to 0.3 by minute 80; read after an hour,
    no run degraded and the deployment was classified `none`, as decode-limited."""
    (point,) = run_grid(points=[("h200-1p3d", 0.0, 3.0)])
    assert point.model_first_limit == "cache"
    assert point.simulated_first_limit == "cache"


def test_agreement_counts() -> None:
    points = [
        GridPoint("a", 0, 1, "cache", 0.5, "cache", 5.0),
        GridPoint("b", 0, 1, "cache", 0.5, "decode", 5.0),
        GridPoint("c", 0, 1, "decode", 1.5, "cache", 5.0),
        GridPoint("d", 0, 1, "decode", 1.5, "none", None),
        GridPoint("e", 0, 1, "cache", 0.5, "prefill", 5.0),
        GridPoint("f", 0, 1, "decode", 1.5, "prefill", 5.0),
    ]
    summary = agreement(points)
    assert summary["simulated_cache_first"] == 2
    assert summary["simulated_prefill_first"] == 2
    assert summary["flagged_of_simulated_cache_first"] == 1
    assert summary["agreement"] == 0.5
