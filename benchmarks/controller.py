"""BASIN control-step cost with 10,000 resident and 10,000 parked sessions (goal: <= 5 ms per step).

Baseline in the same run: the same step with 100 residents and 100 parked, to show how the cost grows.
Run: python benchmarks/controller.py [--sessions N] [--steps K]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from basin.policy import Basin, CallInfo, DeploymentProfile, SessionInfo, Telemetry

GOAL_MS = 5.0


def build(sessions: int, seed: int = 0) -> Basin:
    rng = np.random.default_rng(seed)
    peaks = rng.lognormal(np.log(40_000), 0.7, 2 * sessions)
    profile = DeploymentProfile(
        kappa=1.0,
        lambda_c_per_min=1e9,
        prefill_gpu_tokens=10**12,
        host_tokens=0,
        decode_kv_tokens=10**12,
        prefill_tokens_per_s=50_000,
    )
    policy = Basin(profile, lambda info: float(peaks[int(info.session_id)]))
    for i in range(sessions):  # residents: admission is inactive, everyone enters
        policy.on_session_arrival(float(i), SessionInfo(str(i), float(i), "", 10_000))
        policy.on_call_end(float(i), CallInfo(str(i), 0, 10_000), 30_000)
    policy.admit, policy.budget = True, policy.reserved  # full: the next sessions park
    for i in range(sessions, 2 * sessions):
        policy.on_session_arrival(float(i), SessionInfo(str(i), float(i), "", 10_000))
    assert len(policy.parked) == sessions
    return policy


def step_ms(policy: Basin, steps: int) -> float:
    start_now = 1e6
    times = []
    for k in range(steps):
        now = start_now + 5.0 * k
        telemetry = Telemetry(now, policy.residents, len(policy.parked), 0, 0.9, 0, 0, 0, 10**9, 0)
        begin = time.perf_counter()
        policy.on_control(now, telemetry)
        times.append(time.perf_counter() - begin)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    small = step_ms(build(100), args.steps)
    large = step_ms(build(args.sessions), args.steps)
    print(f"control step, 100 resident + 100 parked:        {small:.3f} ms (baseline)")
    print(f"control step, {args.sessions:,} resident + {args.sessions:,} parked: {large:.3f} ms")
    print(
        f"ratio: {large / small:.2f}x for {args.sessions // 100}x the sessions;"
        f" goal <= {GOAL_MS:.0f} ms: {'meets' if large <= GOAL_MS else 'misses'}"
    )


if __name__ == "__main__":
    main()
