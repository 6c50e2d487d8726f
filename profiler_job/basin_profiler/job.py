"""The profiling Job's entrypoint (`python -m basin_profiler`), configured by the operator's environment
(the table is in docs/profiling.md): target (`BASIN_GATEWAY_URL`, or `BASIN_PROFILE_TARGET` for the router
or an emulator), the ConfigMap (`BASIN_NAMESPACE`, `BASIN_PROFILE_CONFIGMAP`, `BASIN_PROFILE_KEY`), the
BasinDeployment Events are about (`BASIN_DEPLOYMENT`), the fingerprint to write back, the ramp
(`BASIN_PROFILE_WORKLOAD`, `_RAMPS`, `_STEPS`, `_STEP_SECONDS` with 0 for settle-detected steps,
`_BUDGET_MINUTES`, `_TIME_SCALE`, `_API`, `_SEED`, `_TOP_RATE`), how long a target that does not answer yet
is waited for (`BASIN_PROFILE_WAIT_SECONDS`) and the shape (`BASIN_GPU_KIND`,
`BASIN_PREFILL_REPLICAS`, `BASIN_DECODE_REPLICAS`, `BASIN_HOST_RATIO`); `BASIN_ADMIN_TOKEN`, the gateway's
admin token, makes the ramp's calls bypass the gateway's controls.

Credentials: in-cluster (the Job's ServiceAccount), else `$KUBECONFIG`. Bad configuration is one line on
stderr, written as the failure reason where possible, and exit status 2.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from functools import partial
from typing import TypeVar

from basin.errors import BasinError
from basin_profiler import configmap
from basin_profiler.ramp import DEFAULT_BUDGET_MINUTES, RampSettings
from basin_profiler.run import Outputs, Shape, execute

EXIT_BAD_CONFIG = 2
# The operator creates the Job with the gateway it ramps through; a new gateway Pod is Ready within a minute
# or two (image pull, the predictor's load). Waiting in the Job beats failing and backing off a retry.
DEFAULT_WAIT_S = 300.0
BYPASS_HEADER, ADMIN_HEADER = "X-Basin-Bypass", "X-Basin-Admin-Token"  # the gateway's (basin_gateway.app)
T = TypeVar("T")


def _value(env: Mapping[str, str], name: str, kind: Callable[[str], T], default: T | None = None) -> T | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise BasinError(f"{name}={raw!r} is not a valid {kind.__name__}") from None


def _required(env: Mapping[str, str], name: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        raise BasinError(f"{name} is not set (the operator sets it on the profiling Job)")
    return value


def ramp_headers(env: Mapping[str, str]) -> dict[str, str]:
    """Through the gateway the ramp must not be admitted, ordered or shed by it: the bypass header, which
    the gateway honours only with the admin token the operator shares between the two. None when the
    ramp goes elsewhere (`BASIN_PROFILE_TARGET`) or no token is given."""
    token = env.get("BASIN_ADMIN_TOKEN", "").strip()
    if not token or env.get("BASIN_PROFILE_TARGET", "").strip():
        return {}
    return {BYPASS_HEADER: "1", ADMIN_HEADER: token}


def destination(env: Mapping[str, str]) -> configmap.Destination:
    return configmap.Destination(
        namespace=_required(env, "BASIN_NAMESPACE"),
        name=_required(env, "BASIN_PROFILE_CONFIGMAP"),
        key=env.get("BASIN_PROFILE_KEY", "").strip() or "profile.json",
        deployment=env.get("BASIN_DEPLOYMENT", "").strip(),
        kubeconfig=env.get("KUBECONFIG") or None,
    )


def main(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    echo: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    dest: configmap.Destination | None = None
    fingerprint = env.get("BASIN_PROFILE_FINGERPRINT", "").strip()
    try:
        dest = destination(env)
        target = env.get("BASIN_PROFILE_TARGET", "").strip() or _required(env, "BASIN_GATEWAY_URL")
        headers = ramp_headers(env)
        workload = env.get("BASIN_PROFILE_WORKLOAD", "").strip() or "terminal-bench"
        step_seconds = _value(env, "BASIN_PROFILE_STEP_SECONDS", float, 720.0)
        if step_seconds is not None and step_seconds < 0:
            raise BasinError(f"BASIN_PROFILE_STEP_SECONDS must not be negative, got {step_seconds:g}")
        gpu = _value(env, "BASIN_GPU_KIND", str)
        if gpu is not None and gpu not in ("h100", "h200"):
            raise BasinError(f"BASIN_GPU_KIND must be h100 or h200, got {gpu!r}")
        api = env.get("BASIN_PROFILE_API", "").strip() or "openai"
        if api not in ("openai", "sglang"):
            raise BasinError(f"BASIN_PROFILE_API must be openai or sglang, got {api!r}")
        time_scale = _value(env, "BASIN_PROFILE_TIME_SCALE", float)
        if time_scale is not None and time_scale <= 0:
            raise BasinError(f"BASIN_PROFILE_TIME_SCALE must be positive, got {time_scale:g}")
        shape = Shape(
            gpu=gpu,
            prefill=_value(env, "BASIN_PREFILL_REPLICAS", int),
            decode=_value(env, "BASIN_DECODE_REPLICAS", int),
            host_ratio=_value(env, "BASIN_HOST_RATIO", float),
        )
        from basin.workload import load_workload

        load_workload(workload, seed=0)

        def pool(seed: int):  # type: ignore[no-untyped-def]
            return load_workload(workload, seed=seed)

        settings_for = partial(
            RampSettings,
            target=target,
            pool_factory=pool,
            workload=workload,
            ramps=_value(env, "BASIN_PROFILE_RAMPS", int, 4),
            steps=_value(env, "BASIN_PROFILE_STEPS", int, 8),
            step_minutes=(step_seconds / 60) if step_seconds else None,
            top_rate=_value(env, "BASIN_PROFILE_TOP_RATE", float, 2.0),
            budget_minutes=_value(env, "BASIN_PROFILE_BUDGET_MINUTES", float, DEFAULT_BUDGET_MINUTES),
            seed=_value(env, "BASIN_PROFILE_SEED", int, 0),
            api=api,
            fingerprint=fingerprint,
            deployment_name=env.get("BASIN_DEPLOYMENT", "").strip(),
            headers=headers,
        )
        wait_s = _value(env, "BASIN_PROFILE_WAIT_SECONDS", float, DEFAULT_WAIT_S)
        if wait_s < 0:
            raise BasinError(f"BASIN_PROFILE_WAIT_SECONDS must not be negative, got {wait_s:g}")
        return execute(
            target,
            shape,
            pool,
            settings_for,
            time_scale,
            Outputs(destination=dest),
            True,
            echo,
            fingerprint,
            wait_s,
        )
    except BasinError as error:
        echo(f"error: {error}")
        if dest is not None:
            for problem in configmap.write_failure(dest, f"bad configuration: {error}", fingerprint):
                echo(f"error: {problem}")
        return EXIT_BAD_CONFIG


if __name__ == "__main__":
    sys.exit(main())
