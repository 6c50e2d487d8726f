"""kopf handlers: one idempotent reconcile, run on create/update/resume and by an operator-wide resync task.

The reconcile reads the BasinDeployment fresh, builds every child (`builders`), server-side applies them
(a deleted child comes back, a hand-edited owned field is put back), starts or collects the profiling Job
(`state.plan_profiling`), and writes the status. Child and Job names are deterministic, so a restarted
operator finds what it made instead of duplicating it. A per-object lock serializes the resync task and
the change handlers."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import threading
from collections.abc import Callable
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import DynamicApiError
from pydantic import ValidationError

from basin.errors import BasinError
from basin.profile_schema import ProfileDocument, parse_profile
from basin_operator import builders, kube
from basin_operator import constants as c
from basin_operator.spec import (
    BasinDeploymentSpec,
    BasinDeploymentStatus,
    ProfileStatus,
    ProfilingStatus,
    ReadyObservation,
)
from basin_operator.state import (
    Readiness,
    backoff_seconds,
    choose_attempt,
    classify,
    job_state,
    merge_patch,
    now_utc,
    observe_ready,
    plan_profiling,
    rfc3339,
    set_condition,
    target_shape,
)

Emit = Callable[[str, str, str], None]  # (type, reason, message)


def spec_problems(name: str, raw: dict[str, Any]) -> tuple[BasinDeploymentSpec | None, list[str]]:
    """The parsed spec, or the problems that stop reconciling it, each naming its field."""
    problems = []
    if len(name) > c.MAX_NAME_LENGTH:
        problems.append(f"metadata.name: at most {c.MAX_NAME_LENGTH} characters (child names extend it)")
    try:
        spec = BasinDeploymentSpec.model_validate(raw)
    except ValidationError as error:
        for item in error.errors():
            where = ".".join(str(part) for part in ("spec", *item["loc"]))
            problems.append(f"{where}: {item['msg']}")
        return None, problems
    problems += spec.check()
    return (spec if not problems else None), problems


def _readiness(kind: str, name: str, namespace: str, desired: int, rolled_out: bool = False) -> Readiness:
    """A child's ready replicas. With `rolled_out` (a Deployment), 0 until its rollout is complete (the
    newest spec observed, every replica updated, no old one left): the emulator stands in for every engine,
    so a scale replaces it, and until the old Pod is gone a profile would measure calls cut by its removal."""
    child = kube.get("apps/v1", kind, name, namespace)
    if child is None:
        return Readiness(None, desired)
    status = child.get("status") or {}
    done = not rolled_out or (
        int(status.get("observedGeneration") or 0) >= int(child["metadata"].get("generation") or 0)
        and int(status.get("updatedReplicas") or 0) == desired
        and int(status.get("replicas") or 0) == desired
    )
    return Readiness(int(status.get("readyReplicas") or 0) if done else 0, desired)


def _collect_profile(name: str, namespace: str, fingerprint: str) -> tuple[ProfileDocument | None, str]:
    """The profile the Job wrote into the ConfigMap, validated with the shared schema, if it is for this
    fingerprint; else why not."""
    configmap = kube.get("v1", "ConfigMap", c.child_name(name, "profile"), namespace)
    text = ((configmap or {}).get("data") or {}).get(c.PROFILE_KEY)
    if not text:
        return None, f"the Job succeeded but ConfigMap {c.child_name(name, 'profile')} has no {c.PROFILE_KEY}"
    try:
        profile = parse_profile(text, c.PROFILE_KEY)
    except BasinError as error:
        return None, f"not a valid profile: {error}"
    if profile.fingerprint != fingerprint:
        return None, f"{c.PROFILE_KEY} is for fingerprint {profile.fingerprint!r}, expected {fingerprint!r}"
    return profile, ""


def _profiler_reason(name: str, namespace: str, fingerprint: str) -> str:
    """The failure reason the profiler left in the ConfigMap's status key for this fingerprint, if any."""
    configmap = kube.get("v1", "ConfigMap", c.child_name(name, "profile"), namespace)
    text = ((configmap or {}).get("data") or {}).get(c.PROFILE_STATUS_KEY)
    try:
        status = json.loads(text) if text else {}
    except ValueError:
        return ""
    if not isinstance(status, dict) or status.get("fingerprint") != fingerprint:
        return ""
    return str(status.get("reason") or "") if status.get("state") == "failed" else ""


def reconcile(name: str, namespace: str, emit: Emit, logger: Any) -> None:
    """One pass over one BasinDeployment; safe to repeat at any time."""
    obj = kube.get_basin_deployment(name, namespace)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return
    now = now_utc()
    generation = obj["metadata"].get("generation")
    raw_status = obj.get("status") or {}
    try:
        current = BasinDeploymentStatus.model_validate(raw_status)
    except ValidationError:
        logger.warning("status unreadable; rebuilding it")
        current = BasinDeploymentStatus()
    conditions = list(current.conditions)
    spec, problems = spec_problems(name, obj.get("spec") or {})
    if spec is None:
        message = "; ".join(problems)
        previous = next((x for x in conditions if x.type == "Ready"), None)
        if previous is None or previous.message != message:
            emit("Warning", "InvalidSpec", message)
            logger.warning(f"invalid spec: {message}")
        conditions = set_condition(conditions, "Ready", False, "InvalidSpec", message, now, generation)
        # Keep what was observed (the profile, the last Job): the children still run as last reconciled.
        kept = {k: v for k, v in raw_status.items() if k != "conditions"}
        kept.update(observedGeneration=generation, phase="Invalid")
        _write_status(obj, raw_status, kept, conditions)
        return

    admin = builders.build_admin_secret(name, namespace)
    kopf.adopt(admin, owner=obj)
    if kube.create(admin):  # created once: its random token is never replaced
        emit("Normal", "Created", f"created Secret {admin['metadata']['name']}")
        logger.info(f"created Secret {admin['metadata']['name']}")

    for manifest in builders.build_children(name, namespace, spec):
        kopf.adopt(manifest, owner=obj)
        result = kube.ensure(manifest)
        if result != "unchanged":
            what = f"{manifest['kind']} {manifest['metadata']['name']}"
            emit("Normal", result.capitalize(), f"{result} {what}")
            logger.info(f"{result} {what}")

    for api_version, kind, child in builders.obsolete_children(name, spec):
        if kube.get(api_version, kind, child, namespace) is not None:
            kube.delete(api_version, kind, child, namespace)
            emit("Normal", "Deleted", f"deleted {kind} {child}: not part of this engine mode")
            logger.info(f"deleted {kind} {child}")

    wanted = {"prefill": spec.prefill.replicas, "decode": spec.decode.replicas, "router": 1}
    wanted["gateway"] = spec.gateway.replicas
    parts = {
        f"{what.capitalize()}Ready": (
            what,
            _readiness("Deployment", c.child_name(name, what), namespace, count),
        )
        for what, count in wanted.items()
    }
    if spec.emulator.enabled:
        # One emulator pod stands in for every engine and the router: while it is ready, so are they all.
        emulator = _readiness("Deployment", c.child_name(name, "emulator"), namespace, 1, rolled_out=True)
        for what in ("prefill", "decode", "router"):
            ready = None if emulator.ready is None else (wanted[what] if emulator.ok else 0)
            parts[f"{what.capitalize()}Ready"] = (f"{what} (emulated)", Readiness(ready, wanted[what]))
    redis = None
    if spec.redis.mode == "managed":
        redis = _readiness("StatefulSet", c.child_name(name, "redis"), namespace, 1)
    for kind, (what, readiness) in parts.items():
        reason, message = readiness.describe(what)
        ok = readiness.ok
        if kind == "GatewayReady" and redis is not None and not redis.ok:
            ok, reason = False, "RedisNotReady"
            message = f"{message}; {redis.describe('redis')[1]}"
        conditions = set_condition(conditions, kind, ok, reason, message, now, generation)

    prefill_ready = parts["PrefillReady"][1].ready or 0
    decode_ready = parts["DecodeReady"][1].ready or 0
    ready_seen = observe_ready(current.ready_observed, prefill_ready, decode_ready, spec, now)
    profiling, profile = _profiling(name, namespace, spec, obj, current, ready_seen, now, emit, logger)

    fresh = profile is not None and profile.state == "fresh"
    if fresh:
        message = "the profile matches the deployment"
        conditions = set_condition(conditions, "Profiled", True, "ProfileFresh", message, now, generation)
    elif profiling is not None and profiling.state == "Failed":
        retry = f"; retry at {profiling.retry_at}" if profiling.retry_at else ""
        message = f"Job {profiling.job} failed: {profiling.message}{retry}"
        conditions = set_condition(conditions, "Profiled", False, "ProfilingFailed", message, now, generation)
    else:
        job = profiling.job if profiling is not None else "none"
        stale = "the profile is stale; " if profile is not None else ""
        message = f"{stale}profiling Job {job} is running"
        conditions = set_condition(conditions, "Profiled", False, "Profiling", message, now, generation)

    waiting = [kind for kind in parts if next(x for x in conditions if x.type == kind).status != "True"]
    if waiting:
        ready, reason, message = False, "ChildrenNotReady", "not ready: " + ", ".join(waiting)
    elif profile is None:
        ready, reason, message = False, "NotProfiled", "waiting for the first profile"
    else:
        ready, reason, message = True, "Ready", f"serving with a {profile.state} profile"
    conditions = set_condition(conditions, "Ready", ready, reason, message, now, generation)
    if not ready:
        phase = "Pending"
    elif fresh:
        phase = "Ready"
    else:
        phase = "ProfilingFailed" if profiling is not None and profiling.state == "Failed" else "Profiling"

    first_limit, peak = classify(spec)
    status = BasinDeploymentStatus(
        observed_generation=generation,
        phase=phase,
        conditions=conditions,
        prefill_replicas=prefill_ready,
        decode_replicas=decode_ready,
        prefill_selector=builders.selector_string(name, "prefill"),
        ready_observed=ready_seen,
        profile=profile,
        profiling=profiling,
        first_limit=first_limit,
        peak_departures_per_min=round(peak, 3),
    )
    payload = status.model_dump(by_alias=True, exclude_none=True, mode="json")
    payload.pop("conditions")
    _write_status(obj, raw_status, payload, conditions)


def _profiling(
    name: str,
    namespace: str,
    spec: BasinDeploymentSpec,
    obj: dict[str, Any],
    current: BasinDeploymentStatus,
    ready_seen: ReadyObservation,
    now: dt.datetime,
    emit: Emit,
    logger: Any,
) -> tuple[ProfilingStatus | None, ProfileStatus | None]:
    """Start, watch, collect or retry the profiling Job; returns the new profiling and profile status."""
    last, profile = current.profiling, current.profile
    prefill, decode, trigger = target_shape(spec, ready_seen, last, now)
    fingerprint = builders.profile_fingerprint(spec, prefill, decode)
    job = kube.get("batch/v1", "Job", last.job, namespace) if last is not None else None
    action = plan_profiling(fingerprint, trigger, last, job_state(job), now)
    profiling = last
    if action.kind == "start":
        if last is not None and last.state == "Running" and last.fingerprint != fingerprint:
            kube.delete("batch/v1", "Job", last.job, namespace)
            emit("Normal", "ProfilingSuperseded", f"deleted Job {last.job}: the deployment changed shape")
        selector = f"{builders.selector_string(name, 'profiler')},{c.LABEL_FINGERPRINT}={fingerprint}"
        existing = {
            int(job["metadata"]["name"].rsplit("-", 1)[1]): job_state(job)
            for job in kube.list_objects("batch/v1", "Job", namespace, selector)
            if not job["metadata"].get("deletionTimestamp")
        }
        fresh = last is None or last.fingerprint != fingerprint
        attempt, needed = choose_attempt(action.attempt, fresh, existing)
        manifest = builders.build_profile_job(name, namespace, spec, fingerprint, prefill, decode, attempt)
        kopf.adopt(manifest, owner=obj)
        job_name = manifest["metadata"]["name"]
        if needed and kube.create(manifest):
            message = (
                f"started Job {job_name} (attempt {attempt}, {action.trigger}):"
                f" {prefill} prefill + {decode} decode replicas"
            )
            emit("Normal", "ProfilingStarted", message)
            logger.info(message)
        profiling = ProfilingStatus(
            job=job_name,
            fingerprint=fingerprint,
            prefill_replicas=prefill,
            decode_replicas=decode,
            trigger=action.trigger,
            attempt=attempt,
            state="Running",
            started_at=rfc3339(now),
        )
    elif action.kind == "collect" and last is not None:
        data, problem = _collect_profile(name, namespace, fingerprint)
        if data is None:
            action = type(action)("fail", action.attempt, action.trigger, problem)
        else:
            profile = ProfileStatus(
                kappa=data.kappa,
                lambda_c_per_min=data.lambda_c_per_min,
                profiled_at=rfc3339(data.profiled_at),
                fingerprint=fingerprint,
                state="fresh",
            )
            profiling = last.model_copy(update={"state": "Succeeded", "message": None, "retry_at": None})
            message = f"κ={profile.kappa:.3g}, λc={profile.lambda_c_per_min:.3g}/min from Job {last.job}"
            emit("Normal", "Profiled", message)
            logger.info(message)
    if action.kind == "fail" and last is not None:
        reason = _profiler_reason(name, namespace, last.fingerprint)
        if reason:
            action = type(action)("fail", action.attempt, action.trigger, f"{action.message}: {reason}")
        delay = backoff_seconds(spec, action.attempt)
        retry_at = rfc3339(now + dt.timedelta(seconds=delay))
        profiling = last.model_copy(
            update={"state": "Failed", "message": action.message, "retry_at": retry_at}
        )
        message = f"Job {last.job} failed: {action.message}; retry in {delay} s"
        emit("Warning", "ProfilingFailed", message)
        logger.warning(message)
    if profile is not None:
        state = "fresh" if profile.fingerprint == fingerprint else "stale"
        profile = profile.model_copy(update={"state": state})
    if profiling is not None:
        _clean_up_jobs(name, namespace, profiling.job, logger)
    return profiling, profile


def _clean_up_jobs(name: str, namespace: str, current: str, logger: Any) -> None:
    """Delete finished profiling Jobs other than `current` and the latest `KEEP_FINISHED_JOBS` (whose pod
    logs one may still want): without this every retry and reprofile leaves a Job and a pod behind, on
    clusters whose API ignores ttlSecondsAfterFinished too."""
    jobs = [
        job
        for job in kube.list_objects("batch/v1", "Job", namespace, builders.selector_string(name, "profiler"))
        if job["metadata"]["name"] != current
        and not job["metadata"].get("deletionTimestamp")
        and job_state(job) not in (None, "running")
    ]
    jobs.sort(key=lambda job: job["metadata"]["creationTimestamp"], reverse=True)
    for job in jobs[c.KEEP_FINISHED_JOBS :]:
        kube.delete("batch/v1", "Job", job["metadata"]["name"], namespace)
        logger.info(f"deleted finished Job {job['metadata']['name']}: superseded")


def _write_status(
    obj: dict[str, Any], before: dict[str, Any], payload: dict[str, Any], conditions: list
) -> None:
    """Patch only what changed (every write is a watch event); keys no longer set are removed at any depth."""
    after = dict(payload)
    after["conditions"] = [x.model_dump(by_alias=True, exclude_none=True) for x in conditions]
    patch = merge_patch(before, after)
    if patch:
        kube.patch_status(obj["metadata"]["name"], obj["metadata"]["namespace"], patch)


def run_reconcile(name: str, namespace: str, lock: threading.Lock, logger: Any) -> None:
    """The handlers' and the resync loop's shared body: one lock per object, API errors retried by kopf
    without a traceback. Events are posted with the operator's own client (not `kopf.event`, which works
    only inside kopf's per-object tasks: the resync loop is not one)."""

    def emit(kind: str, reason: str, message: str) -> None:
        obj = kube.get_basin_deployment(name, namespace)
        if obj is not None:
            kube.post_event(obj, kind, reason, message, logger)

    with lock:
        try:
            reconcile(name, namespace, emit, logger)
        except (ApiException, DynamicApiError) as error:
            raise kopf.TemporaryError(f"API error: {api_message(error)}; retrying", delay=5) from None


def api_message(error: Exception) -> str:
    """The apiserver's own message of a failed call (it names the object and field), else the status."""
    body = getattr(error, "body", None)
    try:
        message = json.loads(body)["message"] if body else ""
    except (ValueError, KeyError, TypeError):
        message = ""
    reason = message or getattr(error, "reason", "") or type(error).__name__
    return f"{getattr(error, 'status', '?')} {reason}"


def register(registry: kopf.OperatorRegistry, resync_seconds: float) -> None:
    """Attach the handlers to `registry`; the resync interval is a run option, so registration is a call.

    No handler here needs a finalizer, so none is added and deleting a BasinDeployment never waits for the
    operator (owner references garbage-collect the children). That rules out kopf timers and daemons,
    which always add one: the periodic resync is one operator-wide task over an index of the watched
    objects instead. An operator that stopped after an older version added `basin.dev/finalizer` has kopf
    remove it on resume, since nothing requires it any more.
    """
    resource = (c.GROUP, c.VERSION, c.PLURAL)
    locks: dict[str, threading.Lock] = {}  # one per object, shared by the handlers and the resync task

    def lock_of(namespace: str, name: str) -> threading.Lock:
        return locks.setdefault(c.object_key(namespace, name), threading.Lock())

    @kopf.index(*resource, id="basin_deployments", registry=registry)
    def basin_deployments(name: str, namespace: str, **_: Any) -> dict[str, None]:
        return {c.object_key(namespace, name): None}

    @kopf.on.resume(*resource, id="reconcile", registry=registry)
    @kopf.on.create(*resource, id="reconcile", registry=registry)
    @kopf.on.update(*resource, id="reconcile", registry=registry, field="spec")
    def on_change(name: str, namespace: str, logger: Any, **_: Any) -> None:
        run_reconcile(name, namespace, lock_of(namespace, name), logger)

    async def resync(index: kopf.Index, logger: Any) -> None:
        """Every `resync_seconds`, one reconcile pass per indexed object (drift, readiness, Jobs)."""
        while True:
            await asyncio.sleep(resync_seconds)
            keys = sorted(index)
            for stale in set(locks) - set(keys):
                locks.pop(stale, None)
            for key in keys:
                namespace, name = key.split("/", 1)
                try:
                    await asyncio.to_thread(run_reconcile, name, namespace, lock_of(namespace, name), logger)
                except kopf.TemporaryError as error:
                    logger.warning(f"Resync of {key} failed: {error}")
                except Exception as error:  # one object's bug must not stop the resync of the others
                    logger.error(f"Resync of {key} failed: {error!r}")
                else:
                    logger.info(f"Resync of {key} succeeded.")

    @kopf.on.startup(id="resync", registry=registry)
    async def start_resync(memo: kopf.Memo, logger: Any, **kwargs: Any) -> None:
        memo["resync_task"] = asyncio.create_task(resync(kwargs["basin_deployments"], logger))

    @kopf.on.cleanup(id="resync", registry=registry)
    async def stop_resync(memo: kopf.Memo, **_: Any) -> None:
        task = memo.get("resync_task")
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
