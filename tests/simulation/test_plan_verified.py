"""`basin plan`'s recommendation for four H200s, checked in the simulator (paper §7.2's base rates)."""

from __future__ import annotations

import pytest

from basin.plan import Surge, WorkloadSpec, plan, verify

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("base_rate", [8.0, 6.0])  # the main comparison's base rates (host tier, GPU-only)
def test_the_recommended_split_recovers_and_the_last_one_traps(base_rate: float) -> None:
    surge = Surge(5, 20)
    workload = WorkloadSpec("terminal-bench")
    ranked = plan(4, "h200", workload.load(), base_rate, surge, [0.0, 2.0, 10.0])
    best, worst = ranked[0], ranked[-1]
    assert best.recovers and not worst.recovers
    checked = verify([best, worst], "h200", workload, base_rate, surge, "hicache", processes=2)
    assert [v.agrees for v in checked] == [True, True], checked
    assert checked[0].label in ("healthy", "recovering") and checked[1].label == "trapped"
