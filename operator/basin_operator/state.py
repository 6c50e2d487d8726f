"""Pure decisions of the reconcile loop: conditions, the profiling plan with its debounce and backoff, and
the fluid-model classification. No API calls here; `basin_operator.handlers` applies what these decide.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from basin_operator.spec import BasinDeploymentSpec, Condition, ProfilingStatus, ReadyObservation

CONDITION_TYPES = ("PrefillReady", "DecodeReady", "RouterReady", "GatewayReady", "Profiled", "Ready")


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(microsecond=0)


def rfc3339(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> dt.datetime:
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)


def set_condition(
    conditions: list[Condition], kind: str, ok: bool | None, reason: str, message: str, now: dt.datetime,
    generation: int | None,
) -> list[Condition]:  # fmt: skip
    """Conditions with `kind` set; its transition time moves only when its status changes."""
    status = "Unknown" if ok is None else ("True" if ok else "False")
    previous = next((x for x in conditions if x.type == kind), None)
    since = (
        previous.last_transition_time if previous is not None and previous.status == status else rfc3339(now)
    )
    updated = Condition(
        type=kind,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=since,
        observed_generation=generation,
    )
    others = [x for x in conditions if x.type != kind]
    ordered = {x.type: x for x in [*others, updated]}
    return [ordered[k] for k in CONDITION_TYPES if k in ordered] + [
        x for k, x in ordered.items() if k not in CONDITION_TYPES
    ]


def merge_patch(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The JSON merge patch (RFC 7386) that turns `before` into `after`: only what changed, nested objects
    patched key by key, and a null for every key `after` no longer has, at any depth (a merge patch that
    sets a nested object merges it: without the nulls a failed attempt's `message` and `retryAt` would
    survive onto the next record)."""
    patch: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if old == value and key in before:
            continue
        if isinstance(value, dict) and isinstance(old, dict):
            patch[key] = merge_patch(old, value)
        else:
            patch[key] = value
    patch.update({key: None for key in before if key not in after})
    return patch


@dataclass(frozen=True)
class Readiness:
    """Ready and desired replicas of one child workload (None ready = the child does not exist yet)."""

    ready: int | None
    desired: int

    @property
    def ok(self) -> bool:
        return self.ready is not None and self.ready >= self.desired

    def describe(self, what: str) -> tuple[str, str]:
        if self.ready is None:
            return "Missing", f"{what} does not exist yet"
        if self.ok:
            return "ReplicasReady", f"{self.ready}/{self.desired} {what} replicas ready"
        return "ReplicasNotReady", f"{self.ready}/{self.desired} {what} replicas ready"


def observe_ready(
    previous: ReadyObservation | None, prefill: int, decode: int, spec: BasinDeploymentSpec, now: dt.datetime
) -> ReadyObservation:
    """Ready counts and since when they (and the spec's counts) have held; the debounce clock restarts
    on either change, so a spec scale is profiled at the new spec counts first."""
    wanted = (spec.prefill.replicas, spec.decode.replicas)
    if previous is not None and (
        previous.prefill,
        previous.decode,
        previous.spec_prefill,
        previous.spec_decode,
    ) == (
        prefill,
        decode,
        *wanted,
    ):
        return previous
    return ReadyObservation(
        prefill=prefill, decode=decode, spec_prefill=wanted[0], spec_decode=wanted[1], since=rfc3339(now)
    )


def target_shape(
    spec: BasinDeploymentSpec, ready: ReadyObservation, last: ProfilingStatus | None, now: dt.datetime
) -> tuple[int, int, str]:
    """The (prefill, decode) replicas the profile should describe, and why.

    The first profile starts at once with the spec's counts. After that a new shape is profiled only once
    it has held for the debounce period (`ready.since`: spec and ready counts unchanged), whether the
    spec was scaled (an autoscaler on the scale subresource would otherwise restart profiling on every
    step) or ready replicas changed: the spec's counts, unless serving replicas (at least one of each)
    differ from them, then the capacity actually serving. Until then the current shape stays. Without
    `onScale`, the first profile's shape stays.
    """
    if last is not None and not spec.profiling.on_scale:
        return last.prefill_replicas, last.decode_replicas, last.trigger
    wanted = (spec.prefill.replicas, spec.decode.replicas)
    if last is None:
        return *wanted, "create"
    serving = (ready.prefill, ready.decode)
    if min(serving) >= 1 and serving != wanted:
        candidate, trigger = serving, "ready replicas"
    else:
        candidate, trigger = wanted, ("ready replicas" if last.trigger == "ready replicas" else "scale")
    held = (now - parse_time(ready.since)).total_seconds()
    if candidate == (last.prefill_replicas, last.decode_replicas) or held < spec.profiling.debounce_seconds:
        return last.prefill_replicas, last.decode_replicas, last.trigger
    return *candidate, trigger


def backoff_seconds(spec: BasinDeploymentSpec, attempt: int) -> int:
    """Delay before retrying after failed attempt `attempt` (1, 2, ...): doubling, capped."""
    return min(spec.profiling.backoff_seconds * 2 ** (attempt - 1), spec.profiling.max_backoff_seconds)


@dataclass(frozen=True)
class ProfilingAction:
    """What the loop does about profiling this tick."""

    kind: str  # start, wait, collect, fail, none
    attempt: int = 1
    trigger: str = ""
    message: str = ""


def plan_profiling(
    target: str, trigger: str, last: ProfilingStatus | None, job_state: str | None, now: dt.datetime
) -> ProfilingAction:
    """Decide from the target fingerprint, the last profiling record and its Job's state
    (None = no Job, 'running', 'succeeded', 'failed: <reason>')."""
    if last is None or last.fingerprint != target:
        return ProfilingAction("start", 1, trigger)
    if last.state == "Running":
        if job_state is None:  # deleted under us: start the same attempt again (same name, no duplicate)
            return ProfilingAction("start", last.attempt, last.trigger)
        if job_state == "succeeded":
            return ProfilingAction("collect", last.attempt, last.trigger)
        if job_state.startswith("failed"):
            return ProfilingAction("fail", last.attempt, last.trigger, job_state.partition(": ")[2])
        return ProfilingAction("wait", last.attempt, last.trigger)
    if last.state == "Failed" and last.retry_at is not None and now >= parse_time(last.retry_at):
        return ProfilingAction("start", last.attempt + 1, "retry")
    return ProfilingAction("none", last.attempt, last.trigger)


def choose_attempt(planned: int, fresh: bool, existing: dict[int, str | None]) -> tuple[int, bool]:
    """The attempt to run and whether its Job must be created, given this fingerprint's existing Jobs
    (attempt -> job_state). A fresh start adopts a Job still running for the fingerprint (an operator that
    stopped before recording it) and otherwise numbers past old ones (a shape measured before)."""
    if fresh and existing:
        running = [n for n, state in existing.items() if state == "running"]
        if running:
            return max(running), False
        return max(planned, max(existing) + 1), True
    return planned, planned not in existing


def job_state(job: dict | None) -> str | None:
    """'running', 'succeeded' or 'failed: <reason>' from a Job's status conditions (None: no Job)."""
    if job is None:
        return None
    status = job.get("status") or {}
    for condition in status.get("conditions") or []:
        if condition.get("status") != "True":
            continue
        if condition.get("type") == "Complete":
            return "succeeded"
        if condition.get("type") == "Failed":
            reason = condition.get("reason") or "Failed"
            message = condition.get("message") or ""
            return f"failed: {reason}{': ' + message if message else ''}"
    if status.get("succeeded"):
        return "succeeded"
    return "running"


@lru_cache(maxsize=256)
def _classify(gpu: str, prefill: int, decode: int, host_ratio: float, workload: str) -> tuple[str, float]:
    from basin.fluid import FluidModel, FluidParameters, analyze
    from basin.sim import get_deployment
    from basin.workload import load_workload

    preset = "h100-1p1d" if gpu == "h100" else "h200-1p1d"
    deployment = get_deployment(preset, host_tier=host_ratio).with_options(
        prefill_instances=prefill, decode_instances=decode
    )
    sessions = load_workload(workload, seed=0)
    analysis = analyze(FluidModel(FluidParameters.from_workload(deployment, sessions)), 0.0)
    return ("cache-first" if analysis.first_limit == "cache" else "decode-first"), analysis.d_peak_per_min


def classify(spec: BasinDeploymentSpec) -> tuple[str, float]:
    """The fluid model's first limit (cache-first or decode-first) and peak departure rate of the spec, on
    the engine model calibrated for its GPU kind; synthetic workloads only (a session file in the image
    is not readable here, so those fall back to terminal-bench)."""
    workload = (
        spec.profiling.workload
        if spec.profiling.workload in ("terminal-bench", "swe-pro")
        else "terminal-bench"
    )
    return _classify(
        spec.gpu_kind, spec.prefill.replicas, spec.decode.replicas, spec.prefill.hicache.host_ratio, workload
    )
