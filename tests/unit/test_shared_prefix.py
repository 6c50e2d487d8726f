"""A workload's shared prefix (system prompt and tool schema) is cached once and reused by every
session's first call, in the simulator and in the replay client's prompts alike."""

from dataclasses import replace

import numpy as np
import pytest

from basin import tokens
from basin.sim import Simulation, SimulationConfig, get_deployment
from basin.sim.deployments import PAGE_TOKENS
from basin.sim.policies import build_policy
from basin.workload import RateSchedule
from basin.workload.model import Call, Session
from basin_profiler.replay import _opening

SHARED = 32 * PAGE_TOKENS


def _pool(shared: int) -> list[Session]:
    calls = (Call(prompt_tokens=3_000, new_tokens=3_000, output_tokens=4),)
    return [Session(f"s-{i}", "", calls, workload="agent", shared_prefix_tokens=shared) for i in range(20)]


def _first_calls(shared: int) -> list[int]:
    pool = _pool(shared)
    deployment = get_deployment("h100-1p1d")
    schedule = RateSchedule(base_rate=20, duration_min=2)
    config = SimulationConfig(deployment, schedule, seed=1, warm_sessions=0)
    sim = Simulation(config, build_policy("hicache", deployment, pool, 1), pool)
    sim.run()
    calls = sorted(sim.records.calls, key=lambda c: c.released_s)
    return [c.cached_tokens for c in calls if c.prefill_start_s is not None]


def test_every_session_after_the_first_finds_the_shared_prefix_cached() -> None:
    cached = _first_calls(SHARED)
    assert len(cached) > 20
    assert cached[0] == 0  # the very first call is cold
    assert all(c == SHARED for c in cached[1:])  # every later one reuses exactly the shared pages
    assert set(_first_calls(0)) == {0}  # without it, single-call sessions share nothing


def test_replay_prompts_open_with_the_same_ids_and_nothing_else_in_common() -> None:
    (session,) = _pool(SHARED)[:1]
    a = _opening(session, np.random.default_rng(1), 3_000)
    b = _opening(replace(session, session_id="other"), np.random.default_rng(2), 3_000)
    assert len(a) == len(b) == 3_000
    assert tokens.common_prefix(a, b) == SHARED
    assert a[:SHARED] == tokens.shared_prefix("agent", SHARED)
    other_workload = _opening(replace(session, workload="another"), np.random.default_rng(1), 3_000)
    assert tokens.common_prefix(a, other_workload) == 0
    assert _opening(session, np.random.default_rng(1), 100) == tokens.shared_prefix("agent", 100)


@pytest.mark.parametrize("shared", [0, SHARED])
def test_the_prompt_length_is_kept(shared: int) -> None:
    (session,) = _pool(shared)[:1]
    assert len(_opening(session, np.random.default_rng(0), 3_000)) == 3_000


def test_load_workload_shares_a_prefix_and_refuses_what_cannot_take_one(tmp_path) -> None:
    """`load_workload(shared_prefix=...)` is the one place every command adds the prefix: a synthetic pool
    gets it in every session (all of a shorter first prompt); a negative size or a trace whose blocks
    already say what is shared is a one-line user error."""
    import json

    from basin.errors import BasinError
    from basin.workload import load_workload

    pool = load_workload("terminal-bench", seed=0, sessions=40, shared_prefix=12_000)
    assert {s.shared_prefix_tokens for s in pool} == {min(12_000, s.first_prompt_tokens) for s in pool}
    assert any(s.shared_prefix_tokens == 12_000 for s in pool)
    assert any(s.shared_prefix_tokens < 12_000 for s in pool)  # a first prompt shorter than the prefix
    # The workload's own prefix is the default (Terminal-Bench: 8K, synthetic.PROFILES); 0 removes it.
    default = load_workload("terminal-bench", seed=0, sessions=40)
    assert {s.shared_prefix_tokens for s in default} == {min(8_192, s.first_prompt_tokens) for s in default}
    assert all(
        s.shared_prefix_tokens == 0
        for s in load_workload("terminal-bench", seed=0, sessions=40, shared_prefix=0)
    )
    with pytest.raises(BasinError, match="--shared-prefix must not be negative"):
        load_workload("terminal-bench", shared_prefix=-1)
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 100, "hash_ids": [7, 1, 2]},
        {"timestamp": 30_000, "input_length": 2100, "output_length": 50, "hash_ids": [7, 1, 3, 4, 5]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert load_workload(str(trace))  # loads without one
    with pytest.raises(BasinError, match="names its prompts' blocks"):
        load_workload(str(trace), shared_prefix=1024)
