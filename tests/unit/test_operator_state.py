"""The reconcile loop's pure decisions: conditions, debounce, the profiling plan, backoff, spec problems."""

import datetime as dt

import pytest

pytest.importorskip("kopf")  # the `operator` extra

from basin_operator.handlers import spec_problems
from basin_operator.spec import BasinDeploymentSpec, ProfilingStatus
from basin_operator.state import (
    backoff_seconds,
    choose_attempt,
    classify,
    job_state,
    merge_patch,
    observe_ready,
    plan_profiling,
    rfc3339,
    set_condition,
    target_shape,
)

T0 = dt.datetime(2026, 11, 30, 10, 0, 0, tzinfo=dt.UTC)


def spec(**extra: object) -> BasinDeploymentSpec:
    return BasinDeploymentSpec.model_validate({"model": {"path": "m"}, **extra})


def profiling(**changes: object) -> ProfilingStatus:
    base = {
        "job": "x-profile-abc-1",
        "fingerprint": "abc",
        "prefill_replicas": 1,
        "decode_replicas": 1,
        "trigger": "create",
        "attempt": 1,
        "state": "Running",
        "started_at": rfc3339(T0),
    }
    return ProfilingStatus(**{**base, **changes})


def later(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def test_condition_transition_time_moves_only_on_status_change() -> None:
    conditions = set_condition([], "Ready", False, "A", "a", T0, 1)
    conditions = set_condition(conditions, "Ready", False, "B", "b", later(5), 2)
    assert conditions[0].last_transition_time == rfc3339(T0) and conditions[0].reason == "B"
    conditions = set_condition(conditions, "Ready", True, "C", "c", later(9), 2)
    assert conditions[0].last_transition_time == rfc3339(later(9))
    conditions = set_condition(conditions, "PrefillReady", True, "R", "r", later(9), 2)
    assert [c.type for c in conditions] == ["PrefillReady", "Ready"]


def test_spec_scale_and_ready_changes_both_wait_for_the_debounce() -> None:
    s = spec(profiling={"debounceSeconds": 60})
    seen = observe_ready(None, 1, 1, s, T0)
    assert target_shape(s, seen, None, T0) == (1, 1, "create")  # the first profile starts at once
    scaled = spec(prefill={"replicas": 2}, profiling={"debounceSeconds": 60})
    seen = observe_ready(seen, 1, 1, scaled, later(100))
    assert seen.since == rfc3339(later(100))  # the spec change restarts the clock
    # Within the debounce the current profiling keeps its shape: an autoscaler flapping the scale
    # subresource cannot thrash profiling.
    assert target_shape(scaled, seen, profiling(), later(110)) == (1, 1, "create")
    # The new pod becomes ready (the clock restarts); once that has held, the new shape is profiled.
    ready = observe_ready(seen, 2, 1, scaled, later(120))
    assert target_shape(scaled, ready, profiling(), later(179)) == (1, 1, "create")
    assert target_shape(scaled, ready, profiling(), later(180)) == (2, 1, "scale")
    # The new pod never becomes ready: after the debounce, what serves is what was measured; nothing new.
    assert target_shape(scaled, observe_ready(seen, 1, 1, scaled, later(161)), profiling(), later(161)) == (
        1,
        1,
        "create",
    )
    # Serving differs from both the spec and the last profile: profile what serves, after the debounce.
    down = observe_ready(seen, 1, 1, scaled, later(100))
    two = profiling(prefill_replicas=2, decode_replicas=2)
    assert target_shape(scaled, down, two, later(159)) == (2, 2, "create")
    assert target_shape(scaled, down, two, later(160)) == (1, 1, "ready replicas")
    # Ready replicas recover and hold again: the spec's shape is measured again, after the debounce too.
    measured = profiling(trigger="ready replicas")
    back = observe_ready(seen, 2, 1, scaled, later(300))
    assert target_shape(scaled, back, measured, later(330)) == (1, 1, "ready replicas")
    assert target_shape(scaled, back, measured, later(360)) == (2, 1, "ready replicas")
    # Nothing serving is nothing to profile.
    empty = observe_ready(None, 0, 1, scaled, T0)
    assert target_shape(scaled, empty, profiling(), later(1000)) == (2, 1, "scale")
    # Without onScale the first profile's shape stays.
    fixed = spec(prefill={"replicas": 3}, profiling={"onScale": False})
    assert target_shape(fixed, observe_ready(None, 3, 1, fixed, T0), profiling(), later(999)) == (
        1,
        1,
        "create",
    )


def test_profiling_plan() -> None:
    assert plan_profiling("abc", "create", None, None, T0).kind == "start"
    changed = plan_profiling("def", "scale", profiling(), "running", T0)
    assert (changed.kind, changed.attempt, changed.trigger) == ("start", 1, "scale")
    assert plan_profiling("abc", "create", profiling(), "running", T0).kind == "wait"
    assert plan_profiling("abc", "create", profiling(), "succeeded", T0).kind == "collect"
    failed = plan_profiling("abc", "create", profiling(), "failed: BackoffLimitExceeded: boom", T0)
    assert (failed.kind, failed.message) == ("fail", "BackoffLimitExceeded: boom")
    gone = plan_profiling("abc", "create", profiling(attempt=2), None, T0)
    assert (gone.kind, gone.attempt) == ("start", 2)  # same name again: no duplicate
    waiting = profiling(state="Failed", retry_at=rfc3339(later(60)))
    assert plan_profiling("abc", "create", waiting, "failed: x", later(59)).kind == "none"
    retry = plan_profiling("abc", "create", waiting, "failed: x", later(60))
    assert (retry.kind, retry.attempt, retry.trigger) == ("start", 2, "retry")
    assert (
        plan_profiling("abc", "create", profiling(state="Succeeded"), "succeeded", later(60)).kind == "none"
    )


def test_backoff_doubles_up_to_the_cap() -> None:
    s = spec(profiling={"backoffSeconds": 10, "maxBackoffSeconds": 35})
    assert [backoff_seconds(s, n) for n in (1, 2, 3, 4)] == [10, 20, 35, 35]


def test_job_state() -> None:
    assert job_state(None) is None
    assert job_state({"status": {}}) == "running"
    assert job_state({"status": {"conditions": [{"type": "Complete", "status": "True"}]}}) == "succeeded"
    failed = {"status": {"conditions": [{"type": "Failed", "status": "True", "reason": "DeadlineExceeded"}]}}
    assert job_state(failed) == "failed: DeadlineExceeded"


def test_spec_problems_name_their_fields() -> None:
    ok, problems = spec_problems("x", {"model": {"path": "m"}})
    assert ok is not None and problems == []
    _, problems = spec_problems("x" * 41, {"model": {"path": "m"}})
    assert problems[0].startswith("metadata.name")
    _, problems = spec_problems("x", {"model": {"path": "m"}, "redis": {"mode": "external"}})
    assert problems == ["spec.redis.url: required when spec.redis.mode is external"]
    _, problems = spec_problems(
        "x", {"model": {"path": "m"}, "redis": {"mode": "external", "url": "http://r"}}
    )
    assert problems[0].startswith("spec.redis.url: must start with redis://")
    _, problems = spec_problems("x", {"model": {"path": "m"}, "prefill": {"replicas": 0}})
    assert problems[0].startswith("spec.prefill.replicas:")
    _, problems = spec_problems(
        "x", {"model": {"path": "m"}, "profiling": {"backoffSeconds": 9, "maxBackoffSeconds": 3}}
    )
    assert problems == ["spec.profiling.maxBackoffSeconds: must be at least spec.profiling.backoffSeconds"]


def test_fluid_classification_of_the_spec() -> None:
    """The paper's 1P3D with a 2x host tier limits on cache first; cache grows with prefill replicas."""
    limit, peak = classify(spec(prefill={"replicas": 1}, decode={"replicas": 3}))
    assert limit == "cache-first" and peak > 0
    many_prefill = classify(
        spec(prefill={"replicas": 4, "hicache": {"hostRatio": 10}}, decode={"replicas": 1})
    )
    assert many_prefill[0] == "decode-first"


def test_attempt_numbering_never_duplicates_a_job() -> None:
    assert choose_attempt(1, True, {}) == (1, True)
    # An operator that stopped before recording its Job adopts it instead of starting another.
    assert choose_attempt(1, True, {1: "running"}) == (1, False)
    # A shape measured before: number past its old Jobs.
    assert choose_attempt(1, True, {1: "succeeded", 2: "failed: x"}) == (3, True)
    # The same run: a deleted Job is recreated under its name; a retry takes the next number.
    assert choose_attempt(2, False, {}) == (2, True)
    assert choose_attempt(2, False, {2: "running"}) == (2, False)
    assert choose_attempt(3, False, {1: "failed: x", 2: "failed: y"}) == (3, True)


def test_merge_patch_removes_keys_at_any_depth() -> None:
    before = {"phase": "ProfilingFailed", "profiling": {"job": "j1", "message": "boom", "retryAt": "t"}}
    after = {"phase": "Pending", "profiling": {"job": "j2"}}
    assert merge_patch(before, after) == {
        "phase": "Pending",
        "profiling": {"job": "j2", "message": None, "retryAt": None},
    }
    assert merge_patch(after, after) == {}
    assert merge_patch({"profile": {"kappa": 1}}, {}) == {"profile": None}
    assert merge_patch({}, {"profile": {"kappa": 1}}) == {"profile": {"kappa": 1}}
