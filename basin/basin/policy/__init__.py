"""Session policies behind one interface (`base.Policy`): the plain engine now, BASIN and the
baselines as they land. `make_policy` is the registry the simulator, CLI and gateway use."""

from __future__ import annotations

from collections.abc import Callable

from basin.errors import BasinError
from basin.policy.base import (
    WARM_RETURN_S,
    Admission,
    CallDirectives,
    CallInfo,
    ControlActions,
    Policy,
    SessionInfo,
    Telemetry,
    WarmReturns,
    is_warm_return,
)
from basin.policy.basin import Basin, BasinArrival, BasinConfig, DeploymentProfile
from basin.policy.composition import Composition
from basin.policy.concur import Concur
from basin.policy.continuum import Continuum
from basin.policy.hicache import Crossflow, HiCache
from basin.policy.thunderagent import ThunderAgent

POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (HiCache, Continuum, ThunderAgent, Concur, Crossflow, Composition, Basin, BasinArrival)
}
NEEDS_PROFILE = ("continuum", "thunderagent", "composition", "basin", "basin-arrival")
NEEDS_PREDICTOR = ("basin", "basin-arrival")

__all__ = [
    "POLICIES",
    "WARM_RETURN_S",
    "Admission",
    "Basin",
    "BasinArrival",
    "BasinConfig",
    "CallDirectives",
    "CallInfo",
    "Composition",
    "Concur",
    "Continuum",
    "ControlActions",
    "Crossflow",
    "DeploymentProfile",
    "Policy",
    "SessionInfo",
    "Telemetry",
    "ThunderAgent",
    "WarmReturns",
    "is_warm_return",
    "make_policy",
]


def make_policy(
    name: str,
    profile: DeploymentProfile | None = None,
    predict: Callable[[SessionInfo], float] | None = None,
    config: BasinConfig | None = None,
) -> Policy:
    """A policy by name; Continuum needs the deployment profile, BASIN also a peak-context predictor."""
    if name not in POLICIES:
        raise BasinError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name not in NEEDS_PROFILE:
        return POLICIES[name]()
    if profile is None:
        raise BasinError(f"policy {name!r} needs a deployment profile")
    if name == "continuum":
        return Continuum(profile.prefill_tokens_per_s, profile.prefill_gpu_tokens)
    capacity = max(profile.prefill_gpu_tokens, profile.host_tokens)  # the larger cache tier
    if name == "thunderagent":
        return ThunderAgent(capacity)
    if name == "composition":
        return Composition(capacity, profile.prefill_tokens_per_s, profile.prefill_gpu_tokens)
    if predict is None:
        raise BasinError(f"policy {name!r} needs a peak-context predictor")
    return POLICIES[name](profile, predict, config)  # type: ignore[call-arg]
