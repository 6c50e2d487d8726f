"""A simulation is a function of its seed: the same command gives the same result in any process.

Python randomizes string hashing per process, so a policy that iterates a set of session ids (ties in a
sort, for instance) would silently give each process its own answer. Each policy runs twice under
different hash seeds in a scenario where every baseline pauses, parks or pins sessions."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from basin.policy import POLICIES

BASIN = str(Path(sys.executable).with_name("basin"))  # the checkout under test, never a `basin` on PATH

# 1P3D with tool time x3 and a x5 surge: warm sessions all arrive at time 0 (ties), controls engage.
ARGS = [
    *("--deployment", "h200-1p3d", "--host-tier", "2", "--tool-time-scale", "3", "--base-rate", "10"),
    *("--surge-factor", "5", "--surge-minutes", "20", "--duration-min", "50", "--quiet", "--json", "-"),
]


def simulate(policy: str, hash_seed: str) -> dict:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run(
        [BASIN, "simulate", "--policy", policy, *ARGS], env=env, capture_output=True, text=True, check=True
    )
    result = json.loads(out.stdout)
    result.pop("wall_seconds")
    return result


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_results_do_not_depend_on_the_process_hash_seed(policy: str) -> None:
    first = simulate(policy, "1")
    assert first["measured_sessions"] > 500
    assert simulate(policy, "2") == first
