"""Every policy on single- and multi-instance deployments with both decode allocation modes: the run
finishes under a surge and the engine keeps its books."""

import pytest

from basin.policy import POLICIES
from basin.sim import Simulation, SimulationConfig, get_deployment
from basin.sim.policies import build_policy
from basin.workload import RateSchedule, load_workload

POOL = load_workload("terminal-bench", seed=0, sessions=80)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize(
    ("preset", "allocation"), [("h100-1p1d", "prefill_complete"), ("h200-2p6d", "early")]
)
def test_policy_runs_and_books_balance(policy: str, preset: str, allocation: str) -> None:
    deployment = get_deployment(preset, allocation=allocation)
    schedule = RateSchedule(base_rate=6, duration_min=25, surge_factor=4, surge_start_min=5, surge_minutes=10)
    sim = Simulation(
        SimulationConfig(deployment, schedule, seed=1), build_policy(policy, deployment, POOL, 1), POOL
    )
    summary = sim.run().summary
    assert summary.measured_sessions > 50
    for prefill in sim.engine.prefills:
        prefill.cache.check()
    for decode in sim.engine.decodes:
        assert decode.used >= 0 and decode.lent >= 0 and decode.waiting_transfer_tokens >= 0
    records = {r.session_id for r in sim.records.sessions}
    assert len(records) == len(sim.records.sessions)
