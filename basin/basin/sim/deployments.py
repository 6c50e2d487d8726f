"""Deployment presets and the calibrated engine constants: every number the engine model uses.

Where each constant comes from (published, with the paper's section; fitted, to which figure; or assumed)
is tabled in docs/simulator.md, "Constants and their sources" (a test keeps every field there). Model:
Qwen3.6-35B-A3B in FP8 (30 linear-attention layers of 40), SGLang PD disaggregation, page size 64.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from basin.errors import BasinError

PAGE_TOKENS = 64  # SGLang page size used in the paper's deployments (§7.2)


@dataclass(frozen=True)
class GpuCalibration:
    """Per-instance capacities and costs of one GPU kind."""

    name: str
    # Prefill instance prefix cache (GPU tier), tokens. H100: 1.09M (§3). H200: ~2x H100 (§4).
    prefill_cache_tokens: int
    # Decode instance KV capacity, tokens. H100: 1.66M (§3). H200: ~2x H100 (§4).
    decode_kv_tokens: int
    # Prefill cost per new token: base + slope x position (the 10 full-attention layers grow with
    # position). H100 saturates at ~31K uncached tokens/s at the Terminal-Bench median context (§3);
    # H200 is 1.6-1.75x faster (§4), we use 1.7x.
    prefill_s_per_token: float
    prefill_s_per_token_position: float
    prefill_chunk_tokens: int  # SGLang --chunked-prefill-size
    prefill_chunk_overhead_s: float  # fixed cost of one forward pass
    # Decode step = base + per request in batch + per token of running context. Batch-one decode of this
    # A3B MoE is ~8 ms on H100; each request adds expert and sampling work; the KV read of the 10
    # full-attention layers (~10 KB per token in FP8) adds ~4 ns per token at HBM bandwidth. Steps stay
    # under the 50 ms ITL SLO (§7.1) unless decode concurrency grows far past memory-bound batches, as
    # the paper sees violations only then (§7.7).
    decode_step_base_s: float
    decode_step_per_request_s: float
    decode_step_per_context_token_s: float
    # KV copies between instances over NIXL (lent-unit fetches, Crossflow's borrowed prefix; the PD
    # transfer when proportional) and host-tier load-back over PCIe: a 25K-token unit moves in tens of
    # milliseconds (§6.6).
    transfer_s_per_token: float
    transfer_overhead_s: float
    load_back_s_per_token: float
    # The PD transfer of a request's KV to decode: the paper charges a fixed 10 ms (§7.10, where a
    # prompt-proportional charge moves BASIN's goodput by at most 1.4 %). None: proportional, priced as
    # the copies above (`--transfer proportional`).
    pd_transfer_fixed_s: float | None = 0.010
    # Recurrent-state snapshots the prefill instance keeps for prefix reuse (the hybrid model's 30
    # linear-attention layers, paper §2): a cached prefix is reusable only up to a kept snapshot. None:
    # no limit.
    recurrent_state_slots: int | None = None


H100 = GpuCalibration(
    name="h100",
    prefill_cache_tokens=1_090_000,
    decode_kv_tokens=1_660_000,
    prefill_s_per_token=1 / 40_000,
    prefill_s_per_token_position=2.9e-10,  # 1/40K + 25.6K x 2.9e-10 = 1/31K s per token
    prefill_chunk_tokens=8_192,
    prefill_chunk_overhead_s=0.004,
    decode_step_base_s=0.016,
    decode_step_per_request_s=0.0005,
    decode_step_per_context_token_s=8e-9,
    transfer_s_per_token=0.5e-6,
    transfer_overhead_s=0.005,
    load_back_s_per_token=0.4e-6,
)

H200 = GpuCalibration(
    name="h200",
    prefill_cache_tokens=2_180_000,
    decode_kv_tokens=3_320_000,
    prefill_s_per_token=H100.prefill_s_per_token / 1.7,
    prefill_s_per_token_position=H100.prefill_s_per_token_position / 1.7,
    prefill_chunk_tokens=8_192,
    prefill_chunk_overhead_s=0.003,
    decode_step_base_s=0.015,
    decode_step_per_request_s=0.00015,
    decode_step_per_context_token_s=3e-9,
    transfer_s_per_token=0.4e-6,
    transfer_overhead_s=0.004,
    load_back_s_per_token=0.3e-6,
)


GPUS: dict[str, GpuCalibration] = {"h100": H100, "h200": H200}


@dataclass(frozen=True)
class Deployment:
    """A PD deployment: instance counts, GPU kind and cache/queue options."""

    name: str
    gpu: GpuCalibration
    prefill_instances: int
    decode_instances: int
    host_tier: float = 2.0  # host tier capacity as a multiple of the GPU prefix cache; 0 = GPU-only
    write_through: bool = True  # HiCache write policy on prefill
    allocation: str = "early"  # decode KV reserved before prefill ("early", SGLang's default) or at
    # prefill completion ("prefill_complete")
    router: str = "cache_aware"  # prefill routing: cache_aware, affinity or least_loaded
    reserved_decode_tokens: int = 512  # SGLang reserves room for this many output tokens per request
    lend_cap: float = 0.5  # φ: decode memory that lent units may hold (paper §6.6)
    lend_headroom: float = 0.1  # units are adopted only with this share of decode memory left above demand
    decode_prefill: bool = False  # Crossflow: decode instances borrow prefill work under an ITL lease
    crossflow_min_lease_tokens: int = 256  # prefill tokens per mixed step even when decode is slow
    itl_slo_s: float = 0.050  # §7.1
    # SGLang's prefill scheduler re-touches the cached prefixes of the first 128 waiting requests every
    # 32 scheduling passes, so LRU spares them while they queue (`SchedulePolicy._touch_waiting_prefixes`,
    # on by default in SGLang 0.5.23). Off here until the engine is recalibrated with it (issue 15).
    waiting_prefix_refresh: bool = False

    @property
    def transfer(self) -> str:
        """How the PD transfer is priced: "fixed" (the paper's 10 ms) or "proportional" to the prompt."""
        return "proportional" if self.gpu.pd_transfer_fixed_s is None else "fixed"

    @property
    def prefill_cache_tokens(self) -> int:
        return self.gpu.prefill_cache_tokens * self.prefill_instances

    @property
    def host_cache_tokens(self) -> int:
        return int(self.gpu.prefill_cache_tokens * self.host_tier) * self.prefill_instances

    @property
    def decode_kv_tokens(self) -> int:
        return self.gpu.decode_kv_tokens * self.decode_instances

    @property
    def cache_tokens(self) -> int:
        """C = max(C_G, C_H), the cache a working set is measured against: write-through keeps every GPU
        page on the host tier too, so the larger tier bounds what reuse can hold."""
        return max(self.prefill_cache_tokens, self.host_cache_tokens)

    def with_options(self, **changes: object) -> Deployment:
        deployment = replace(self, **changes)  # type: ignore[arg-type]
        deployment.validate()
        return deployment

    def validate(self) -> None:
        if self.host_tier < 0:
            raise BasinError(f"--host-tier must not be negative, got {self.host_tier}")
        if self.allocation not in ALLOCATIONS:
            raise BasinError(
                f"unknown allocation policy {self.allocation!r}; choose {', '.join(ALLOCATIONS)}"
            )
        if self.router not in ROUTERS:
            raise BasinError(f"unknown router policy {self.router!r}; choose {', '.join(ROUTERS)}")


ALLOCATIONS = ("early", "prefill_complete")
ROUTERS = ("cache_aware", "affinity", "least_loaded")
TRANSFERS = ("fixed", "proportional")  # how the PD transfer is priced (`GpuCalibration.pd_transfer_fixed_s`)

PRESETS: dict[str, Deployment] = {
    # The paper's real deployments: H100 NVL 1P1D (§3) and one four-H200 node in 1P3D (§7.2); 1P2D,
    # 1P1D and 2P6D on H200 are simulated variants (§4, §7.6).
    "h100-1p1d": Deployment("h100-1p1d", H100, 1, 1, host_tier=0.0),
    "h200-1p1d": Deployment("h200-1p1d", H200, 1, 1),
    "h200-1p2d": Deployment("h200-1p2d", H200, 1, 2),
    "h200-1p3d": Deployment("h200-1p3d", H200, 1, 3),
    "h200-2p6d": Deployment("h200-2p6d", H200, 2, 6),
}


SHAPE = re.compile(r"(?P<gpu>h100|h200)-(?P<prefill>[1-9][0-9]?)p(?P<decode>[1-9][0-9]?)d")


def shape_name(gpu: str, prefill: int, decode: int) -> str:
    """The `<gpu>-<P>p<D>d` name of a shape (what `SHAPE` reads back); a preset's name where it is one."""
    return f"{gpu}-{prefill}p{decode}d"


def get_deployment(name: str, host_tier: float | None = None, **options: object) -> Deployment:
    """A preset by name, or any other `<gpu>-<P>p<D>d` shape of a calibrated GPU (the calibration is per
    instance; the shape only counts instances: `basin plan` builds every split the same way), with
    `host_tier` and other options overriding its defaults. A shape that is not a preset gets the GPU's
    default host tier (2x)."""
    base = PRESETS.get(name)
    if base is None:
        match = SHAPE.fullmatch(name)
        if match is None:
            raise BasinError(
                f"unknown deployment {name!r}; choose one of {', '.join(PRESETS)},"
                " or another shape <gpu>-<P>p<D>d (gpu h100 or h200, 1-99 instances each)"
            )
        base = Deployment(name, GPUS[match["gpu"]], int(match["prefill"]), int(match["decode"]))
    changes: dict[str, object] = {k: v for k, v in options.items() if v is not None}
    if host_tier is not None:
        changes["host_tier"] = host_tier
    gpu = base.gpu
    transfer = changes.pop("transfer", None)
    if transfer is not None:
        if transfer not in TRANSFERS:
            raise BasinError(f"unknown transfer pricing {transfer!r}; choose {', '.join(TRANSFERS)}")
        if transfer == "proportional":
            gpu = replace(gpu, pd_transfer_fixed_s=None)
    state_slots = changes.pop("state_slots", None)
    if state_slots is not None:
        if not isinstance(state_slots, int) or state_slots < 1:
            raise BasinError(f"--state-slots must be a positive number of snapshots, got {state_slots}")
        gpu = replace(gpu, recurrent_state_slots=state_slots)
    if gpu is not base.gpu:
        changes["gpu"] = gpu
    return base.with_options(**changes)
