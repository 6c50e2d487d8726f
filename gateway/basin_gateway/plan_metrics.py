"""`basin_plan_*` on `/metrics`: `basin plan`'s numbers for the running deployment, so the early-warning
dashboard shows how far the cliff is at the current load and how large a surge it would still recover from.

The fluid model (`basin.plan.headroom_now`) is built from the profile in force: κ, the capacities and the
prefill rate; replicas, GPU kind and workload from the profile file where it names them (else 1P1D, the
H200 preset's decode costs, Terminal-Bench), or a preset (`--deployment`) as the simulator assumes it.
The load is measured here: arrivals per minute over the last `RATE_WINDOW_S` model seconds (from the
brain's arrival count) and the active sessions now. The figures are recomputed off the event loop every
`REFRESH_S` model seconds (the model is rebuilt only when the profile changes), so a scrape never waits
for them. Only the replica that decides publishes them (a follower's brain sees no arrivals).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from basin.errors import BasinError
from basin.fluid import FluidModel, FluidParameters
from basin.plan import Headroom, headroom_now, running_deployment
from basin.sim.deployments import GPUS

if TYPE_CHECKING:
    from basin_gateway.build import LoadedProfile
    from basin_gateway.coordinator import Coordinator

log = logging.getLogger("basin.gateway")

PREFIX = "basin_plan"
RATE_WINDOW_S = 600.0  # model seconds of arrivals the load is measured over
MIN_RATE_SPAN_S = 60.0  # no rate (and no figures) from less than this much history
REFRESH_S = 30.0  # model seconds between recomputations
SURGE_MINUTES = (10.0, 20.0)  # the recoverable surge is given for surges of these lengths
DEFAULT_WORKLOAD = "terminal-bench"


@dataclass(frozen=True)
class RunningModel:
    """The fluid model of the deployment a profile describes, and what it was built from."""

    digest: str
    model: FluidModel
    capacities: str  # "profile" or "preset"
    gpu: str
    workload: str
    split: str  # e.g. 1P3D


@dataclass(frozen=True)
class Figures:
    running: RunningModel
    headroom: dict[float, Headroom]  # by surge minutes


class ArrivalRate:
    """Arrivals per model minute over a sliding window, from samples of a running arrival count; a count
    that falls (a new brain: profile arrival, leadership change) starts the window again."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()
        self.owner: int | None = None

    def add(self, now: float, arrived: int, owner: int) -> float | None:
        if owner != self.owner or (self.samples and arrived < self.samples[-1][1]):
            self.samples.clear()
            self.owner = owner
        self.samples.append((now, arrived))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW_S:
            self.samples.popleft()
        start, first = self.samples[0]
        if now - start < MIN_RATE_SPAN_S:
            return None
        return (arrived - first) / ((now - start) / 60.0)


def build_model(loaded: LoadedProfile) -> RunningModel:
    """The fluid model for `loaded` (seconds of work: loads the workload; run off the event loop)."""
    from basin.workload import load_workload

    profile = loaded.profile
    if loaded.source.startswith("preset:"):
        from basin.sim import get_deployment

        deployment = get_deployment(loaded.source.removeprefix("preset:"))
        pool = load_workload(DEFAULT_WORKLOAD)
        params = FluidParameters.from_workload(deployment, pool, profile.kappa)
        split = f"{deployment.prefill_instances}P{deployment.decode_instances}D"
        gpu = deployment.gpu.name
        return RunningModel(loaded.digest, FluidModel(params), "preset", gpu, DEFAULT_WORKLOAD, split)
    data: dict[str, Any] = {}
    try:
        parsed = json.loads(Path(loaded.source).read_bytes())
        data = parsed if isinstance(parsed, dict) else {}
    except (OSError, ValueError):
        pass  # the profile in force stays valid; only the optional fields are missing
    gpu = data.get("gpu") if data.get("gpu") in GPUS else "h200"
    workload = str(data.get("workload") or DEFAULT_WORKLOAD)
    try:
        pool = load_workload(workload)
    except BasinError:  # e.g. a session file the profiler read that this pod does not have
        workload, pool = DEFAULT_WORKLOAD, load_workload(DEFAULT_WORKLOAD)
    prefill, decode = int(data.get("prefill_replicas") or 1), int(data.get("decode_replicas") or 1)
    deployment = running_deployment(profile, pool, str(gpu), prefill, decode)
    params = FluidParameters.from_workload(deployment, pool, profile.kappa)
    split = f"{prefill}P{decode}D"
    return RunningModel(loaded.digest, FluidModel(params), "profile", str(gpu), workload, split)


class PlanGauges(Collector):
    """Publishes the last `Figures`; `loop` (a coordinator task) keeps them current."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator
        self.rate = ArrivalRate()
        self.running: RunningModel | None = None
        self.figures: Figures | None = None

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # computed once the gateway runs; registering must not compute them

    async def loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # a failed figure must never stop the gateway; the next one retries
                log.exception("basin_plan figures failed")
            await asyncio.sleep(max(0.2, min(5.0, REFRESH_S / self.coordinator.clock.scale)))

    async def refresh(self) -> None:
        """Sample the load on the event loop, compute in a thread."""
        c = self.coordinator
        loaded = c.profile
        if loaded is None:
            self.figures = None
            return
        running = self.running
        if running is None or running.digest != loaded.digest:
            # Every replica builds it (~1 s of CPU, at start or on a new profile), so a follower that
            # takes over the lease is not busy with it while it does.
            running = self.running = await asyncio.to_thread(build_model, loaded)
        brain = c.brain
        rate = self.rate.add(c.clock.now(), brain.arrived, id(brain))
        if not c.deciding():
            self.figures = None
            return
        population = float(brain.active_count())
        if rate is None:
            self.figures = Figures(running, {})
            return
        headroom = await asyncio.to_thread(
            lambda: {m: headroom_now(running.model, rate, population, m) for m in SURGE_MINUTES}
        )
        self.figures = Figures(running, headroom)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        figures = self.figures
        if figures is None:
            return
        r = figures.running
        info = GaugeMetricFamily(
            f"{PREFIX}_info",
            "The model behind basin_plan_*: capacities from the profile or a preset (1).",
            labels=["capacities", "gpu", "workload", "split"],
        )
        info.add_metric([r.capacities, r.gpu, r.workload, r.split], 1.0)
        yield info
        if not figures.headroom:
            return
        first = figures.headroom[SURGE_MINUTES[0]]
        rows: tuple[tuple[str, str, float | None], ...] = (
            ("arrival_rate_per_min", "Measured arrivals, sessions/min, over the last 10 model minutes.",
             first.arrival_rate_per_min),
            ("sessions", "Active sessions the figures start from.", first.population),
            ("departure_peak_per_min", "D(N*): the most sessions/min the deployment completes.",
             first.departure_peak_per_min),
            ("rate_headroom_per_min", "D(N*) minus the measured arrivals: extra load before overload.",
             first.rate_headroom_per_min),
            ("cliff_sessions", "N_u at the measured arrivals: past it sessions pile up (+Inf: none).",
             first.cliff_population),
            ("cliff_headroom_sessions", "N_u minus active sessions: headroom to the cliff (< 0: past it).",
             first.cliff_headroom_sessions),
        )  # fmt: skip
        for name, doc, value in rows:
            gauge = GaugeMetricFamily(f"{PREFIX}_{name}", doc)
            gauge.add_metric([], math.nan if value is None else float(value))
            yield gauge
        surge = GaugeMetricFamily(
            f"{PREFIX}_recoverable_surge_factor",
            "The largest surge (times the measured arrivals) for MINUTES from now that still recovers"
            " without control (0: none; 50: the search's ceiling).",
            labels=["minutes"],
        )
        for minutes, headroom in figures.headroom.items():
            factor = headroom.recoverable_surge_factor
            surge.add_metric([f"{minutes:g}"], math.nan if factor is None else factor)
        yield surge
