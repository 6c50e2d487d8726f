"""The one profile document: what the profiler writes, the operator checks and the gateway loads.

`profile.json` (the profile ConfigMap's key, or `basin profile --out`) is `ProfileDocument` as JSON. Its
top-level names are `basin.profile.Profile`'s (`kappa`, `lambda_c_per_min`, `prefill_gpu_tokens`,
`host_tokens`, `decode_kv_tokens`, `deployment`, `kappas`, `ramps`) plus what a live deployment needs:
`prefill_tokens_per_s` (the backlog threshold's capacity), replica counts, the `fingerprint` the operator
passed, `profiled_at`, how it was measured and the tool versions. Unknown keys are ignored so an older
reader accepts a newer profiler's output; a missing or out-of-range capacity is an error, since a
gateway could not build its budget from it.
"""

from __future__ import annotations

import datetime as dt
import math
import platform
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_serializer, field_validator

from basin import __version__
from basin.errors import BasinError

SCHEMA_VERSION = 1


class RampStep(BaseModel):
    """One ramp step as measured: `basin.profile.RampSample`'s fields (None where a step had no
    prefill to date a hit rate by) plus, for live ramps, the offered rate and whether it settled."""

    model_config = ConfigDict(extra="ignore")

    working_set_over_cache: float | None = Field(default=None, ge=0)
    hit_rate: float | None = Field(default=None, ge=0, le=1)
    departures_per_min: float = Field(default=0.0, ge=0)
    rate_per_min: float | None = Field(default=None, ge=0)
    active_sessions: float | None = Field(default=None, ge=0)
    minutes: float | None = Field(default=None, ge=0)  # model minutes the step lasted
    settled: bool | None = None  # None: not checked (fixed-length steps mirror the simulator)

    @field_validator("working_set_over_cache", "hit_rate", "active_sessions", mode="before")
    @classmethod
    def _nan_is_none(cls, value: Any) -> Any:
        return None if isinstance(value, float) and not math.isfinite(value) else value


class ProfileDocument(BaseModel):
    """A deployment's profile: κ, λc and the capacities they were measured on (docs/profiling.md)."""

    model_config = ConfigDict(extra="ignore")

    schema_version: int = SCHEMA_VERSION
    kappa: float = Field(gt=0)
    lambda_c_per_min: float = Field(gt=0)
    prefill_gpu_tokens: int = Field(gt=0)
    host_tokens: int = Field(ge=0)
    decode_kv_tokens: int = Field(gt=0)
    prefill_tokens_per_s: float = Field(gt=0)
    prefill_replicas: int = Field(default=1, ge=1)
    decode_replicas: int = Field(default=1, ge=1)
    gpu: str | None = None
    deployment: str = ""  # the preset (simulated) or the BasinDeployment / target measured
    fingerprint: str = ""  # the operator's deployment fingerprint, written back unchanged
    profiled_at: dt.datetime
    source: Literal["live", "simulated"] = "live"
    target: str | None = None  # the URL a live ramp loaded
    workload: str = "terminal-bench"
    step_minutes: float | None = Field(default=None, gt=0)  # None: settle-detected steps
    kappas: list[float] = Field(default_factory=list)
    lambda_cs_per_min: list[float] = Field(default_factory=list)
    ramps: list[list[RampStep]] = Field(default_factory=list)
    versions: dict[str, str] = Field(default_factory=dict)

    @field_validator("profiled_at")
    @classmethod
    def _aware(cls, value: dt.datetime) -> dt.datetime:
        if value.tzinfo is None:
            raise ValueError("profiled_at needs a time zone (RFC 3339, e.g. 2026-12-01T10:00:00Z)")
        return value.astimezone(dt.UTC)

    @field_serializer("profiled_at")
    def _rfc3339(self, value: dt.datetime) -> str:
        return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    def deployment_profile(self):  # type: ignore[no-untyped-def]
        """The policy's view (`basin.policy.basin.DeploymentProfile`)."""
        from basin.policy.basin import DeploymentProfile

        return DeploymentProfile(
            kappa=self.kappa,
            lambda_c_per_min=self.lambda_c_per_min,
            prefill_gpu_tokens=self.prefill_gpu_tokens,
            host_tokens=self.host_tokens,
            decode_kv_tokens=self.decode_kv_tokens,
            prefill_tokens_per_s=self.prefill_tokens_per_s,
        )


def versions() -> dict[str, str]:
    """The tool versions a profile records (what measured it)."""
    return {"basin": __version__, "python": platform.python_version()}


def problems(error: ValidationError) -> str:
    """A validation error as one line naming each field."""
    parts = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "profile"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def parse_profile(text: str | bytes, where: str = "profile.json") -> ProfileDocument:
    """Validate a profile document; a BasinError names `where` and every bad field in one line."""
    try:
        return ProfileDocument.model_validate_json(text)
    except ValidationError as error:
        if any(item["type"] == "json_invalid" for item in error.errors()):
            raise BasinError(f"{where}: not JSON") from None
        raise BasinError(f"{where}: {problems(error)}") from None


def from_simulated(profile: Any, prefill_tokens_per_s: float, prefill: int, decode: int, gpu: str,
                   workload: str, step_minutes: float | None) -> ProfileDocument:  # fmt: skip
    """A `basin.profile.Profile` from `profile_simulated` as a document (no fingerprint: not a cluster's)."""
    return ProfileDocument(
        kappa=profile.kappa,
        lambda_c_per_min=profile.lambda_c_per_min,
        prefill_gpu_tokens=profile.prefill_gpu_tokens,
        host_tokens=profile.host_tokens,
        decode_kv_tokens=profile.decode_kv_tokens,
        prefill_tokens_per_s=prefill_tokens_per_s,
        prefill_replicas=prefill,
        decode_replicas=decode,
        gpu=gpu,
        deployment=profile.deployment,
        profiled_at=dt.datetime.now(dt.UTC),
        source="simulated",
        workload=workload,
        step_minutes=step_minutes,
        kappas=profile.kappas,
        ramps=[[RampStep(**vars(s)) for s in ramp] for ramp in profile.ramps],
        versions=versions(),
    )
