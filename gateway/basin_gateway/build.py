"""Building the live policy: the deployment profile, the peak predictor, then `basin.policy.make_policy`.

The profile comes from the profiler's `profile.json` (the mounted ConfigMap), or, for local runs against
the emulator, from a deployment preset exactly as `basin simulate` assumes it (κ = 1, λc from the fluid
model). The predictor is the configured file, else the default shipped with the package (trained on the
Terminal-Bench-like workload); calls that carry no task text (`/generate` with `input_ids`) are
predicted by its lengths-only twin, whose features they do carry.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from basin.errors import BasinError
from basin.policy import (
    NEEDS_PREDICTOR,
    NEEDS_PROFILE,
    Basin,
    DeploymentProfile,
    Policy,
    SessionInfo,
    make_policy,
)
from basin.predictor import PeakPredictor
from basin_gateway.settings import Settings

DEFAULT_PREDICTOR = "predictor-terminal-bench.json"
DEFAULT_LENGTHS_PREDICTOR = "predictor-terminal-bench-lengths.json"


@dataclass(frozen=True)
class RampResult:
    """One profiling ramp step as the profile records it: W/C reached, the hit rate and departures there."""

    working_set_over_cache: float
    hit_rate: float
    departures_per_min: float


@dataclass(frozen=True)
class LoadedProfile:
    profile: DeploymentProfile
    source: str  # file path or preset name
    fingerprint: str  # the deployment fingerprint the profile was measured on ("" if unknown)
    digest: str  # of the file's content: a reload happens only when it changes
    profiled_at: float | None = None  # Unix seconds the profiler measured it (None: a preset, or not said)
    ramps: tuple[tuple[RampResult, ...], ...] = ()  # the ramps' steps as measured (dashboards show them)


def _profiled_at(data: dict) -> float | None:
    value = data.get("profiled_at")
    if not isinstance(value, str):
        return None
    try:
        when = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return when.timestamp() if when.tzinfo is not None else None


def _ramps(data: dict) -> tuple[tuple[RampResult, ...], ...]:
    """The profile's ramps; steps without a measured W/C or hit rate (NaN or null) are left out."""
    ramps = data.get("ramps")
    if not isinstance(ramps, list):
        return ()
    out = []
    for ramp in ramps:
        steps = []
        for step in ramp if isinstance(ramp, list) else []:
            if not isinstance(step, dict):
                continue
            try:
                w = float(step["working_set_over_cache"])
                h = float(step["hit_rate"])
                d = float(step.get("departures_per_min", 0.0))
            except (KeyError, TypeError, ValueError):
                continue
            if math.isfinite(w) and math.isfinite(h):
                steps.append(RampResult(w, h, d))
        out.append(tuple(steps))
    return tuple(out)


def profile_from_dict(data: dict) -> DeploymentProfile:
    """The profiler's `profile.json` (basin.profile.Profile.to_dict() plus fingerprint) as the policy's."""
    try:
        return DeploymentProfile(
            kappa=float(data["kappa"]),
            lambda_c_per_min=float(data["lambda_c_per_min"]),
            prefill_gpu_tokens=int(data["prefill_gpu_tokens"]),
            host_tokens=int(data["host_tokens"]),
            decode_kv_tokens=int(data["decode_kv_tokens"]),
            prefill_tokens_per_s=float(data.get("prefill_tokens_per_s", 0.0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise BasinError(f"malformed profile ({exc!r})") from None


def read_profile(path: str) -> LoadedProfile | None:
    """The profile at `path`; None when the file is absent or empty (the ConfigMap before profiling)."""
    file = Path(path)
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return None
    if not raw.strip():
        return None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BasinError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BasinError(f"{path}: a profile is a JSON object")
    return LoadedProfile(
        profile_from_dict(data),
        path,
        str(data.get("fingerprint", "")),
        hashlib.sha256(raw).hexdigest()[:16],
        _profiled_at(data),
        _ramps(data),
    )


def preset_profile(preset: str) -> LoadedProfile:
    """What `basin simulate --deployment PRESET` assumes (its default profile on Terminal-Bench)."""
    from basin.sim import get_deployment
    from basin.sim.policies import default_profile
    from basin.workload import load_workload

    deployment = get_deployment(preset)
    profile = default_profile(deployment, load_workload("terminal-bench"))
    return LoadedProfile(profile, f"preset:{preset}", "", f"preset:{preset}")


def _packaged(name: str) -> PeakPredictor:
    with resources.as_file(resources.files("basin_gateway") / "data" / name) as path:
        return PeakPredictor.load(path)


def load_predictor(path: str | None) -> tuple[Callable[[SessionInfo], float], str]:
    """A predict function for the policy and a line saying which model it uses."""
    if path:
        model = PeakPredictor.load(path)

        def configured(info: SessionInfo) -> float:
            return float(model.predict(info.task, info.first_prompt_tokens))

        return configured, f"predictor {path} ({model.trained_sessions} sessions)"
    text, lengths = _packaged(DEFAULT_PREDICTOR), _packaged(DEFAULT_LENGTHS_PREDICTOR)

    def default(info: SessionInfo) -> float:
        model = text if info.task.strip() else lengths
        return float(model.predict(info.task, info.first_prompt_tokens))

    return default, "default predictor (Terminal-Bench-like workload, packaged)"


def build_policy(settings: Settings, profile: LoadedProfile | None) -> tuple[Policy, str]:
    """The policy `settings` names, or HiCache alone (forward everything) while it lacks a profile."""
    name = settings.policy_name
    if name not in NEEDS_PROFILE:
        return make_policy(name), name
    if profile is None:
        return make_policy("hicache"), f"{name} waiting for a profile: forwarding everything meanwhile"
    predict = None
    note = ""
    if name in NEEDS_PREDICTOR:
        predict, note = load_predictor(settings.predictor_path)
        for task in ("warm up the predictor", ""):  # imports scikit-learn now, not on a live call
            predict(SessionInfo("warm-up", 0.0, task, 1000))
    config = settings.policy_config
    policy = make_policy(name, profile.profile, predict, config)
    if isinstance(policy, Basin):
        # The first control step comes after the configured Δ (the class default is the paper's 30 s).
        policy.control_interval_s = config.interval_s  # type: ignore[misc]
    return policy, f"{name} on {profile.source} (κ={profile.profile.kappa:.2f}){'; ' + note if note else ''}"
