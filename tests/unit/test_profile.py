"""κ profiling: the fit recovers a known cliff scale, refuses ramps that never reach the cliff, and a
simulated ramp gives a plausible κ and λc."""

import numpy as np
import pytest

from basin.errors import BasinError
from basin.hitcurve import reference_hit_rate
from basin.profile import RampSample, fit_kappa, profile_simulated


def synthetic_ramp(
    kappa: float, plateau_scale: float = 1.0, noise: float = 0.0, seed: int = 0, top: float = 3.2
) -> list[RampSample]:
    rng = np.random.default_rng(seed)
    x = np.linspace(0.3, top * kappa, 10)
    h = reference_hit_rate(x, kappa) * plateau_scale + noise * rng.standard_normal(x.size)
    return [RampSample(float(a), float(b)) for a, b in zip(x, h, strict=True)]


@pytest.mark.parametrize("kappa", [0.55, 0.81, 1.0, 1.38, 2.2])
def test_fit_recovers_a_known_kappa(kappa: float) -> None:
    assert fit_kappa(synthetic_ramp(kappa)) == pytest.approx(kappa, rel=0.10)


def test_fit_is_robust_to_a_lower_plateau_and_noise() -> None:
    for seed in range(5):
        samples = synthetic_ramp(1.2, plateau_scale=0.9, noise=0.02, seed=seed)
        assert fit_kappa(samples) == pytest.approx(1.2, rel=0.10)


def test_a_ramp_that_stays_on_the_plateau_is_refused() -> None:
    with pytest.raises(BasinError, match="never left the healthy plateau"):
        fit_kappa(synthetic_ramp(1.0, top=1.5))
    # The error says how low a step must fall: halfway from the plateau to the reference floor (0.30).
    rising = [RampSample(0.7, 0.97), RampSample(1.0, 0.95), RampSample(1.7, 0.90)]
    with pytest.raises(BasinError, match=r"hit rate 0\.65-0\.97 .* at or below 0\.64\)"):
        fit_kappa([*rising, RampSample(2.7, 0.65)])
    assert fit_kappa([*rising, RampSample(2.7, 0.60)]) > 0
    with pytest.raises(BasinError, match="at least 3 ramp samples"):
        fit_kappa([RampSample(0.5, 0.9), RampSample(3.0, float("nan"))])


def test_simulated_ramp_profiles_the_h100_deployment() -> None:
    profile = profile_simulated("h100-1p1d", ramps=2, steps=7, step_minutes=10)
    assert len(profile.kappas) == 2
    assert 0.7 < profile.kappa < 1.6
    assert profile.kappa <= max(profile.kappas)
    assert 3.0 < profile.lambda_c_per_min < 8.0
    assert profile.prefill_gpu_tokens == 1_090_000 and profile.decode_kv_tokens == 1_660_000


def test_ramp_steps_last_several_session_lifetimes() -> None:
    """Issue 15: with tool time x3 sessions last ~34 minutes; a 12-minute step never let the population
    settle, so the ramp never reached the cliff. Steps now last three mean lifetimes. With H200's 30 ms
    decode step, decoding is a larger share of a session's life, so tripling tool time doubles it
    (measured: 37 and 76 minutes)."""
    from basin.profile import settle_step_minutes
    from basin.workload import load_workload

    normal = settle_step_minutes("h200-1p3d", load_workload("terminal-bench", seed=0, sessions=60))
    slow = settle_step_minutes(
        "h200-1p3d", load_workload("terminal-bench", seed=0, sessions=60, tool_time_scale=3.0)
    )
    assert normal >= 12.0
    assert slow >= 1.8 * normal and slow >= 60.0
