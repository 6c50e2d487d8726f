"""`basin plan`'s recommendation for four H200s, checked in the simulator (paper §7.2's base rates)."""

from __future__ import annotations

import pytest

from basin.evaluate.suites import ABLATION_SCENARIOS
from basin.plan import Surge, WorkloadSpec, grid_verdicts, plan, verify

pytestmark = pytest.mark.slow


# The ablation suite's x5 surges' base rates (2x host tier, GPU-only).
@pytest.mark.parametrize("base_rate", [scenario.base_rate for scenario in ABLATION_SCENARIOS[:2]])
def test_the_recommended_split_recovers_and_the_last_one_traps(base_rate: float) -> None:
    surge = Surge(5, 20)
    workload = WorkloadSpec("terminal-bench")
    ranked = plan(4, "h200", workload.load(), base_rate, surge, [0.0, 2.0, 10.0])
    best, worst = ranked[0], ranked[-1]
    assert best.recovers and not worst.recovers
    checked = verify([best, worst], "h200", workload, base_rate, surge, "hicache", processes=2)
    assert [v.agrees for v in checked] == [True, True], checked
    assert checked[0].label in ("healthy", "recovering") and checked[1].label == "trapped"


def test_verdicts_agree_with_the_simulator_across_the_papers_grid() -> None:
    """The 36 deployments of `basin analyze --grid`, each at half its model departure peak with a ×5 surge
    for 20 minutes. Measured: 29 of 36 agree (81 %; 33 of 36 under the former 30 ms H200 decode step); the
    seven misses are all at tool time ×3 (GPU-only and 2× host tiers on every split, and 1P3D with a 10×
    tier), where the model expects a slow drain and the simulator stays healthy. Every trapped run is one
    the model flags."""
    verdicts = grid_verdicts(Surge(5, 20), base_fraction=0.5, processes=2)
    assert len(verdicts) == 36
    assert sum(v.agrees for v in verdicts) >= 0.8 * len(verdicts)
    trapped = [v for v in verdicts if v.simulated_label == "trapped"]
    assert trapped and not any(v.model_recovers for v in trapped)
