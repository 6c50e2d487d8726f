"""Session policies behind one interface (`base.Policy`): the plain engine now, BASIN and the
baselines as they land. `make_policy` is the registry the simulator, CLI and gateway use."""

from __future__ import annotations

from basin.errors import BasinError
from basin.policy.base import (
    Admission,
    CallDirectives,
    CallInfo,
    ControlActions,
    Policy,
    SessionInfo,
    Telemetry,
)
from basin.policy.hicache import HiCache

POLICIES: dict[str, type[Policy]] = {cls.name: cls for cls in (HiCache,)}

__all__ = [
    "POLICIES",
    "Admission",
    "CallDirectives",
    "CallInfo",
    "ControlActions",
    "Policy",
    "SessionInfo",
    "Telemetry",
    "make_policy",
]


def make_policy(name: str) -> Policy:
    if name not in POLICIES:
        raise BasinError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()
