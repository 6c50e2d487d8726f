"""Who decides: `Coordinator` runs this replica's brain in memory (one replica, no Redis); the Redis
coordinator in `shared.py` extends it so one elected leader's brain decides for every replica.

It also owns the clock (model seconds since the deployment epoch, times the time scale), the control
loop (telemetry → `Brain.control` at the policy's interval) and the sweep of idle sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from typing import Any

import aiohttp

from basin.errors import BasinError
from basin.hitcurve import KNEE
from basin.policy import Basin
from basin_gateway.brain import Brain, EngineReading, Verdict
from basin_gateway.build import LoadedProfile, build_policy, load_predictor, read_profile
from basin_gateway.metrics import GatewayMetrics
from basin_gateway.plan_metrics import PlanGauges
from basin_gateway.settings import Settings
from basin_gateway.telemetry import PodEngines, PrometheusSource, ScrapeSource, Tracker
from basin_gateway.upstream import Upstreams

log = logging.getLogger("basin.gateway")

TELEMETRY_ONLY_S = 5.0  # model seconds between telemetry reads for a policy without a control step
RELOAD_S = 2.0  # wall seconds between checks of the profile and predictor files


def _stamp(path: str | None) -> tuple[float, int] | None:
    """When and how big a file is (a ConfigMap update replaces the file: both change)."""
    if not path:
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime, stat.st_size


class Clock:
    """Model seconds since the deployment epoch (a wall timestamp), times the time scale."""

    def __init__(self, scale: float, epoch: float | None = None) -> None:
        self.scale = scale
        self.epoch = time.time() if epoch is None else epoch

    def now(self) -> float:
        return (time.time() - self.epoch) * self.scale


class Coordinator:
    """In memory: this replica's brain makes every decision (one replica)."""

    mode = "memory"

    def __init__(self, settings: Settings, metrics: GatewayMetrics, profile: LoadedProfile | None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.profile = profile
        policy, self.policy_note = build_policy(settings, profile)
        self.brain = Brain(policy, settings.max_parked, settings.max_park_wait_s, settings.idle_timeout_s)
        self.clock = Clock(settings.time_scale)
        self.tracker: Tracker | None = None
        self.reading = EngineReading()
        self.next_control_wall = time.monotonic()
        self.tasks: list[asyncio.Task[Any]] = []
        self.refused: str = ""  # digest of a profile file refused (other deployment, or malformed)
        self.predictor_stamp = _stamp(settings.predictor_path)
        metrics.add_state(self.state_rows)
        self.plan = PlanGauges(self)  # basin_plan_*: headroom to the cliff at the measured load
        metrics.registry.register(self.plan)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, http: aiohttp.ClientSession) -> None:
        settings = self.settings
        selectors = tuple(s for s in (settings.prefill_selector, settings.decode_selector) if s)
        if settings.engines or not selectors:
            scrape = ScrapeSource(http, settings.engines or Upstreams.of(settings).engines())
        else:
            pods = PodEngines(
                settings.namespace or "default", selectors, settings.engine_port, settings.kubeconfig
            )
            scrape = ScrapeSource(http, (), pods=pods)
        source = (
            PrometheusSource(self.settings.prometheus_url, scrape) if self.settings.prometheus_url else scrape
        )
        self.tracker = Tracker(source)
        log.info("policy: %s; telemetry: %s", self.policy_note, source.describe())
        self.tasks = [
            asyncio.create_task(self._control_loop()),
            asyncio.create_task(self._sweep_loop()),
            asyncio.create_task(self._reload_loop()),
            asyncio.create_task(self.plan.loop()),
        ]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "policy": self.brain.policy.name, "leader": True}

    # ------------------------------------------------------------------ calls
    async def call(self, sid: str, task: str, prompt_tokens: int) -> Verdict:
        return self.brain.call(self.clock.now(), sid, task, prompt_tokens)

    def call_done(
        self, sid: str, index: int, prompt_tokens: int, context_tokens: int, cached_tokens: int | None = None
    ) -> None:
        self.brain.call_done(self.clock.now(), sid, index, prompt_tokens, context_tokens, cached_tokens)

    def end(self, sid: str, completed: bool, outcome: str, reason: str) -> None:
        self.brain.end(self.clock.now(), sid, completed, outcome, reason)

    async def delete(self, sid: str) -> bool:
        return self.brain.end(self.clock.now(), sid, False, "ended", "deleted")

    def retry_after_s(self) -> float:
        """Wall seconds until just after the next control step, when a parked session may be admitted."""
        if self.brain.policy.control_interval_s is None:
            return 1.0
        remaining = self.next_control_wall - time.monotonic()
        return min(max(remaining, 0.0) + 0.02, 60.0)

    def _fast_interval(self) -> float:
        config = getattr(self.brain.policy, "config", None)
        fast = getattr(config, "fast_interval_s", None)
        return float(fast) if fast else float(self.brain.policy.control_interval_s or 0.0)

    def backoff_s(self, attempts: int) -> float:
        """Extra wall seconds for a session parked many times: one more control step per four 429s, up to
        three. Retries of long-parked sessions were most of a surge's requests, at every step."""
        return min(attempts // 4, 3) * self._fast_interval() / self.clock.scale

    # ------------------------------------------------------------------ loops
    async def read_telemetry(self) -> EngineReading:
        assert self.tracker is not None
        reading = await self.tracker.read()
        if not reading.fresh:
            self.metrics.telemetry_failures.inc()
        self.reading = reading
        return reading

    async def _control_loop(self) -> None:
        await self.read_telemetry()  # the baseline of the first hit-rate delta
        interval = self.brain.policy.control_interval_s
        while True:
            step = interval if interval is not None else TELEMETRY_ONLY_S
            self.next_control_wall = time.monotonic() + step / self.clock.scale
            await asyncio.sleep(step / self.clock.scale)
            try:
                reading = await self.read_telemetry() if self.deciding() else self.reading
                interval = self.control(reading)
            except Exception:  # a failing step must not stop the loop; the next one retries
                log.exception("control step failed")
                interval = self.brain.policy.control_interval_s

    def deciding(self) -> bool:
        """Whether this replica's brain decides (so needs the engines' telemetry)."""
        return True

    def control(self, reading: EngineReading) -> float | None:
        policy_interval = self.brain.policy.control_interval_s
        if policy_interval is None:
            return None
        self.metrics.control_steps.inc()
        return self.brain.control(self.clock.now(), reading) or policy_interval

    async def _sweep_loop(self) -> None:
        period = min(1.0, max(0.05, 5.0 / self.clock.scale))
        while True:
            await asyncio.sleep(period)
            self.brain.sweep(self.clock.now())

    # ------------------------------------------------------------------ reload
    async def _reload_loop(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_S)
            try:
                self.reload()
            except Exception:  # a reload must never stop the gateway; the next check retries
                log.exception("reloading the profile or predictor failed")

    def reload(self) -> None:
        """Apply a changed profile or predictor file (a ConfigMap update) between two requests."""
        path = self.settings.profile_path
        if path:
            try:
                loaded = read_profile(path)
            except BasinError as exc:
                loaded = None
                if self.refused != str(exc):
                    self.refused = str(exc)
                    log.warning("profile not reloaded: %s", exc)
            expected = self.settings.fingerprint
            current = self.profile.digest if self.profile else ""
            if loaded is not None and loaded.digest not in (current, self.refused):
                if expected and loaded.fingerprint != expected:
                    self.refused = loaded.digest
                    log.warning(
                        "profile %s is for deployment %r, not %r: kept the one in force",
                        path,
                        loaded.fingerprint,
                        expected,
                    )
                else:
                    self.apply_profile(loaded)
        stamp = _stamp(self.settings.predictor_path)
        if stamp != self.predictor_stamp:
            self.predictor_stamp = stamp
            if hasattr(self.brain.policy, "predict"):
                try:
                    predict, note = load_predictor(self.settings.predictor_path)
                except BasinError as exc:
                    log.warning("predictor not reloaded: %s", exc)
                    return
                self.brain.set_predictor(predict)
                log.info("reloaded: %s", note)

    def apply_profile(self, loaded: LoadedProfile) -> None:
        policy = self.brain.policy
        self.profile = loaded
        if isinstance(policy, Basin):
            policy.profile = loaded.profile  # B0 and the shedding threshold follow at the next step
            log.info(
                "profile reloaded from %s (κ=%.2f, λc=%.2f/min)",
                loaded.source,
                loaded.profile.kappa,
                loaded.profile.lambda_c_per_min,
            )
            return
        # The policy waited for a profile (HiCache meanwhile): the real one takes over the running sessions.
        policy, self.policy_note = build_policy(self.settings, loaded)
        brain = Brain(
            policy, self.settings.max_parked, self.settings.max_park_wait_s, self.settings.idle_timeout_s
        )
        records = {sid: e.record() for sid, e in self.brain.sessions.items() if e.state == "active"}
        brain.restore(self.clock.now(), {}, records)
        self.brain = brain
        log.info("profile %s arrived: policy %s", loaded.source, self.policy_note)

    # ------------------------------------------------------------------ metrics
    def state_rows(self) -> list[tuple[str, str, dict[str, str], float]]:
        brain, policy, reading = self.brain, self.brain.policy, self.reading
        rows: list[tuple[str, str, dict[str, str], float]] = [
            ("sessions_active", "Sessions admitted and not ended.", {}, brain.active_count()),
            ("sessions_parked", "Sessions parked at the gateway.", {}, brain.parked_count),
            ("working_set_tokens", "Σ current contexts of active sessions (W).", {}, brain.working_set()),
            (
                "telemetry_hit_rate",
                "Prefix hit rate of the last telemetry reading (NaN: none).",
                {},
                reading.hit_rate,
            ),
            (
                "telemetry_prefill_backlog_tokens",
                "Q_P of the last reading.",
                {},
                reading.prefill_backlog_tokens,
            ),
            (
                "telemetry_decode_waiting_requests",
                "Q_D of the last reading.",
                {},
                reading.decode_waiting_requests,
            ),
            (
                "telemetry_stale",
                "1 while engine telemetry is unavailable.",
                {},
                0.0 if reading.fresh else 1.0,
            ),
            (
                "pins_ignored",
                "Prefix pins a policy asked for that no engine can hold.",
                {},
                brain.pins_ignored,
            ),
            (
                "budget_overruns",
                "Admissions that left Σ Ŵ of several residents above B (an audit; never expected).",
                {},
                brain.overruns,
            ),
        ]
        for (outcome, reason), count in brain.outcomes.items():
            rows.append(
                (
                    "sessions_ended",
                    "Sessions ended, by outcome and reason (running total).",
                    {"outcome": outcome, "reason": reason},
                    count,
                )
            )
        profile = self.profile
        rows.append(
            (
                "profile_refused",
                "1 while the profile file holds one this gateway refused.",
                {},
                float(bool(self.refused)),
            )
        )
        rows.append(
            (
                "profile_info",
                "The profile in force (1).",
                {
                    "source": profile.source if profile else "none",
                    "fingerprint": profile.fingerprint if profile else "",
                },
                1.0,
            )
        )
        if profile is not None:
            rows += self.profile_rows(profile)
        if isinstance(policy, Basin):
            rows += [
                ("budget_tokens", "B, the admission budget (+Inf: not engaged).", {}, policy.budget),
                ("b0_tokens", "B0, the budget's anchor.", {}, policy.b0),
                ("admission_active", "1 while admission is engaged.", {}, float(policy.admit)),
                ("ordering_active", "1 while ordering is engaged.", {}, float(policy.order)),
                ("lending_active", "1 while lending is engaged.", {}, float(policy.lend)),
                ("reserved_tokens", "Σ Ŵ of resident sessions.", {}, policy.reserved),
                ("warm_hit_rate", "Smoothed hit rate of warm returns (the budget's signal).", {}, policy.hit),
                ("warm_hit_plateau", "The healthy plateau of the warm-return hit rate.", {}, policy.plateau),
            ]
        rows += self.extra_rows()
        return [
            (n, d, lab, v if v is not None and not (isinstance(v, float) and math.isnan(v)) else math.nan)
            for n, d, lab, v in rows
        ]

    @staticmethod
    def profile_rows(profile: LoadedProfile) -> list[tuple[str, str, dict[str, str], float]]:
        """The profile in force, under every policy: the cliff alert compares HiCache alone's working set
        with κ·x_k·C too, and the dashboards plot κ, λc, the profile's age and its ramps."""
        prof = profile.profile
        capacity = max(prof.prefill_gpu_tokens, prof.host_tokens)
        rows: list[tuple[str, str, dict[str, str], float]] = [
            ("cliff_tokens", "κ·x_k·C, the cliff estimate.", {}, prof.kappa * KNEE * capacity),
            ("profile_kappa", "κ of the profile in force.", {}, prof.kappa),
            ("profile_lambda_c_per_min", "λc of the profile, sessions/min.", {}, prof.lambda_c_per_min),
            ("profile_cache_tokens", "C: the larger of GPU prefix cache and host tier.", {}, capacity),
            (
                "profile_timestamp_seconds",
                "Unix time the profile in force was measured (NaN: a preset, or not recorded).",
                {},
                profile.profiled_at if profile.profiled_at is not None else math.nan,
            ),
        ]
        for r, ramp in enumerate(profile.ramps):
            for s, step in enumerate(ramp):
                labels = {"ramp": str(r), "step": str(s)}
                rows += [
                    ("profile_ramp_hit_rate", "Hit rate a ramp step settled at.", labels, step.hit_rate),
                    (
                        "profile_ramp_working_set_ratio",
                        "W/C a profiling ramp step reached.",
                        labels,
                        step.working_set_over_cache,
                    ),
                    (
                        "profile_ramp_departures_per_min",
                        "Sessions/min departing during a profiling ramp step.",
                        labels,
                        step.departures_per_min,
                    ),
                ]
        return rows

    def extra_rows(self) -> list[tuple[str, str, dict[str, str], float]]:
        return [("leader", "1 when this replica makes admission decisions.", {}, 1.0)]
