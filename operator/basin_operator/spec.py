"""The BasinDeployment API: pydantic models, the one source of truth for the CRD schema and for parsing.

`basin_operator.crd` turns these models into the CRD's structural OpenAPI schema (defaults, minimums,
enums, descriptions); the handlers parse `.spec` with them. Cross-field rules the apiserver of
Kubernetes 1.20 cannot express without CEL live in `BasinDeploymentSpec.check`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from basin import __version__
from basin.errors import BasinError
from basin.policy.basin import BasinConfig
from basin.sim.deployments import PRESETS, get_deployment, shape_name
from basin_operator.constants import BASIN_IMAGE, ENGINE_IMAGE

_DEFAULTS = BasinConfig()  # the paper's controller defaults (§6.6): one source of truth


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are an error when parsing."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


Quantity = int | str  # a Kubernetes quantity ("500m", "16Gi", 2): int-or-string in the schema


class Resources(ApiModel):
    """Container resource requests and limits, as in a Pod spec."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        description="Resource requests by name (cpu, memory, ...), as Kubernetes quantities.",
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        description="Resource limits by name (cpu, memory, ...), as Kubernetes quantities.",
    )


class Toleration(ApiModel):
    """A Pod toleration (for GPU-node taints)."""

    key: str | None = Field(None, description="Taint key the toleration applies to; empty matches all.")
    operator: Literal["Exists", "Equal"] = Field(
        "Equal", description="Exists (any value of the key) or Equal (the value below)."
    )
    value: str | None = Field(None, description="Taint value to match with operator Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="Taint effect to match; empty matches all effects."
    )
    toleration_seconds: int | None = Field(
        None, description="How long a NoExecute taint is tolerated before eviction."
    )


class ModelSpec(ApiModel):
    """The served model."""

    path: str = Field(
        min_length=1,
        description="Model name on the Hugging Face hub or a path in the engine image (SGLang --model-path).",
    )
    served_name: str | None = Field(
        None, description="Model name clients send (SGLang --served-model-name); defaults to the path."
    )


class Images(ApiModel):
    """Container images of the children."""

    engine: str = Field(
        f"{ENGINE_IMAGE}:{__version__}",
        min_length=1,
        description=(
            "SGLang image (lmsysorg/sglang:v0.5.23) with the Basin engine extension and NIXL: images/engine,"
            " built by `make images`; the tag is Basin's version."
        ),
    )
    basin: str = Field(
        f"{BASIN_IMAGE}:{__version__}",
        min_length=1,
        description=(
            "Basin image (images/basin, built by `make images`; the tag is Basin's version): the gateway"
            " (`basin gateway run`), the profiler (`python -m basin_profiler`) and the emulator"
            " (`basin emulate`)."
        ),
    )
    redis: str = Field(
        "redis:7.4-alpine", min_length=1, description="Image of the managed Redis (redis.mode managed)."
    )
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent",
        description="imagePullPolicy of every child container (engines, router, gateway, Redis, Jobs).",
    )


class HiCache(ApiModel):
    """SGLang hierarchical cache: a host-memory tier behind the GPU prefix cache."""

    host_ratio: float = Field(
        2.0,
        ge=0,
        description="Host tier size as a multiple of the GPU cache (--hicache-ratio); 0 turns HiCache off.",
    )
    write_policy: Literal["write_through", "write_back", "write_through_selective"] = Field(
        "write_through", description="When the host tier receives KV (SGLang --hicache-write-policy)."
    )


class RoleSpec(ApiModel):
    """One side of the prefill–decode pair: its engines and where they run."""

    replicas: int = Field(
        1, ge=1, description="Engine instances (pods); prefill's is the scale subresource (kubectl scale bd)."
    )
    gpus_per_replica: int = Field(
        1,
        ge=1,
        description="GPUs per instance: tensor parallel size (--tp-size) and the nvidia.com/gpu limit.",
    )
    resources: Resources = Field(
        default_factory=Resources,
        description="Extra requests and limits of each engine pod; the GPU limit is set from gpusPerReplica.",
    )
    hicache: HiCache = Field(
        default_factory=HiCache,
        description="Hierarchical cache (host-memory tier) settings of these engines.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        description="Appended to `sglang.launch_server`'s arguments, after the operator's.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="Node labels the engine pods require (e.g. a GPU node pool)."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations of the engine pods (for GPU-node taints)."
    )


class DecodeHiCache(HiCache):
    """Decode-side hierarchical cache: off unless asked (the paper runs HiCache on prefill)."""

    host_ratio: float = Field(
        0.0,
        ge=0,
        description="Host tier size as a multiple of the GPU cache (--hicache-ratio); 0 turns HiCache off.",
    )


class DecodeRoleSpec(RoleSpec):
    """Decode engines."""

    hicache: DecodeHiCache = Field(
        default_factory=DecodeHiCache,
        description=(
            "Hierarchical cache (host-memory tier) settings of these engines; off by default on decode."
        ),
    )


class RouterSpec(ApiModel):
    """SGLang's PD router, discovering prefill and decode pods by label selector."""

    image: str | None = Field(
        None, description="Router image; unset: images.engine (the SGLang image ships sglang_router)."
    )
    policy: Literal["cache_aware", "round_robin", "random", "power_of_two"] = Field(
        "cache_aware", description="The router's load-balancing policy across engine pods (--policy)."
    )
    resources: Resources = Field(
        default_factory=Resources, description="Requests and limits of the router pod."
    )


class GatewayPolicy(ApiModel):
    """BASIN controller parameters (paper Table 1, §6.6); the defaults are the paper's."""

    control_interval_seconds: float = Field(
        _DEFAULTS.interval_s,
        gt=0,
        description="Δ: the control interval of the leader's controller loop, seconds.",
    )
    fast_control_interval_seconds: float = Field(
        _DEFAULTS.fast_interval_s,
        gt=0,
        description=(
            "Δ while a backlog or an active control (admission, ordering, lending) persists, seconds."
        ),
    )
    margin: float = Field(
        _DEFAULTS.margin,
        gt=0,
        le=1,
        description="m: budget margin in the budget anchor B0 = min(m·κ·x_k·C, C).",
    )
    alpha_lend: float = Field(
        _DEFAULTS.alpha_lend,
        gt=0,
        le=1,
        description="α_L: decode-memory lending engages when the working set W ≥ α_L·B0.",
    )
    alpha_order: float = Field(
        _DEFAULTS.alpha_order,
        gt=0,
        le=1,
        description="α_O: session-priority ordering engages when the working set W ≥ α_O·B0.",
    )
    alpha_release: float = Field(
        _DEFAULTS.alpha_release,
        gt=0,
        le=1,
        description="α_R: admission control releases once the working set W < α_R·B0.",
    )
    lend_cap: float = Field(
        _DEFAULTS.lend_cap,
        gt=0,
        le=1,
        description=(
            "φ: share of decode KV memory that may be lent as a cache tier (also set on decode engines)."
        ),
    )
    shed_after_seconds: float = Field(
        _DEFAULTS.shed_after_s,
        ge=0,
        description="T_s: the parked head session waits this long before sessions are shed, seconds.",
    )
    priority_rate: float = Field(
        _DEFAULTS.priority_rate,
        gt=0,
        description=(
            "r: tokens per second in the session priority p = a + Ŵ/r (a: arrival, Ŵ: predicted peak)."
        ),
    )


class PredictorSource(ApiModel):
    """A trained peak-context predictor (`basin predictor train`) in a ConfigMap."""

    config_map: str = Field(
        min_length=1,
        description="ConfigMap (same namespace) holding the model file of `basin predictor train`.",
    )
    key: str = Field(
        "model.json",
        min_length=1,
        description="Key of the model file in the ConfigMap (mounted at /etc/basin/predictor).",
    )


class GatewaySpec(ApiModel):
    """The Basin session gateway in front of the router."""

    replicas: int = Field(
        2,
        ge=1,
        description="Gateway pods; they share state in Redis and one leader runs the controller loop.",
    )
    resources: Resources = Field(
        default_factory=Resources, description="Requests and limits of each gateway pod."
    )
    session_header: str = Field(
        "X-Session-ID", min_length=1, description="HTTP header carrying the session id of each call."
    )
    policy: GatewayPolicy = Field(
        default_factory=GatewayPolicy,
        description=(
            "BASIN controller parameters (paper §6.6; defaults are basin.policy.basin.BasinConfig's)."
        ),
    )
    predictor: PredictorSource | None = Field(
        None,
        description="A trained peak-context predictor to mount; unset: the gateway's built-in default model.",
    )
    addressing: Literal["direct", "router"] = Field(
        "direct",
        description=(
            "How calls reach the engines: direct (the gateway posts each call to a Ready prefill pod and a"
            " Ready decode pod with the PD bootstrap fields, as the router's PD mode does, so lending marks,"
            " priorities and rids reach the engines on every route) or router (through the SGLang router,"
            " which drops some of them; docs/gateway.md). Emulated engines are always reached through the"
            " router's Service."
        ),
    )


class SecretKeyRef(ApiModel):
    """A key in a Secret of the same namespace."""

    name: str = Field(min_length=1, description="Name of the Secret (same namespace).")
    key: str = Field(min_length=1, description="Key in the Secret holding the value.")


class RedisSpec(ApiModel):
    """Shared gateway state: a managed Redis (StatefulSet + Service) or an external one."""

    mode: Literal["managed", "external"] = Field(
        "managed",
        description="managed (a StatefulSet and headless Service, no persistence) or external (redis.url).",
    )
    url: str | None = Field(
        None,
        description=(
            "redis:// or rediss:// URL of the external Redis: required with mode external, refused with "
            "managed."
        ),
    )
    password_secret: SecretKeyRef | None = Field(
        None, description="Secret key holding the external Redis password (mode external only)."
    )
    resources: Resources = Field(
        default_factory=Resources, description="Requests and limits of the managed Redis pod."
    )


class DisaggregationSpec(ApiModel):
    """How prefill hands requests to decode: SGLang's PD flags, set on both engine roles."""

    decode_allocation: Literal["early", "prefill_complete"] = Field(
        "early",
        description=(
            "When decode reserves KV for a request (--disaggregation-decode-allocation-policy): early"
            " (SGLang's default, at bootstrap) or prefill_complete (reservation at prefill completion,"
            " which the Basin engine extension accepts on NIXL)."
        ),
    )
    transfer_backend: Literal["mooncake", "nixl"] | None = Field(
        None,
        description=(
            "KV transfer backend (--disaggregation-transfer-backend); unset: nixl with"
            " decodeAllocation prefill_complete, else SGLang's default (mooncake)."
        ),
    )

    def backend(self) -> str | None:
        """The transfer backend to pass, None for SGLang's default."""
        if self.transfer_backend is not None:
            return self.transfer_backend
        return "nixl" if self.decode_allocation == "prefill_complete" else None


EMULATOR_PRESETS = tuple(PRESETS)  # basin emulate's named presets


def emulator_shape_known(name: str) -> bool:
    """`basin emulate --deployment` takes `name`: a preset, or another `<gpu>-<P>p<D>d` shape."""
    try:
        get_deployment(name)
    except BasinError:
        return False
    return True


class EmulatorSpec(ApiModel):
    """The emulated-engine mode: `basin emulate` (the calibrated engine model behind SGLang's HTTP API) in
    place of the prefill and decode engines and the router, behind the same Service, so the control plane
    runs on clusters without GPUs (demos, CI, kind)."""

    enabled: bool = Field(
        False,
        description="Run `basin emulate` instead of the SGLang engines and the router (no GPUs needed).",
    )
    preset: str | None = Field(
        None,
        description=(
            "Emulated deployment (basin emulate --deployment): a preset (h100-1p1d, h200-1p1d, h200-1p2d,"
            " h200-1p3d, h200-2p6d) or another shape <gpu>-<P>p<D>d of h100 or h200; unset:"
            " <gpuKind>-<P>p<D>d from the replica counts, so scaling the replicas reshapes the emulator."
        ),
    )
    time_scale: float = Field(
        1.0, gt=0, description="Model seconds per wall second (basin emulate --time-scale)."
    )
    resources: Resources = Field(
        default_factory=Resources, description="Requests and limits of the emulator pod."
    )


class ProfilingSpec(ApiModel):
    """The profiling Job: stepped load ramps through the gateway that fit κ and λc."""

    workload: str = Field(
        "terminal-bench",
        min_length=1,
        description=(
            "Workload the ramps replay: terminal-bench, swe-pro or a session file in the Basin image."
        ),
    )
    ramps: int = Field(4, ge=1, description="Repeated load ramps; κ is the lower quartile of their fits.")
    steps: int = Field(8, ge=3, description="Load steps per ramp, from low load to past the cliff.")
    step_seconds: int = Field(720, ge=10, description="Length of one load step, seconds.")
    top_rate: float = Field(
        2.0,
        gt=0,
        le=4,
        description=(
            "The last step's arrival rate as a multiple of the fluid model's peak departure rate (steps run"
            " from a fifth of it up); lower it where the deployment's cliff comes early and the deepest"
            " overload only slows the ramp (an emulator on a small machine)."
        ),
    )
    on_scale: bool = Field(
        True, description="Profile again after every scale event; false: only the first profile is measured."
    )
    debounce_seconds: int = Field(
        300,
        ge=0,
        description=(
            "A new shape (a spec scale, or ready replicas that differ from the spec or recovered) must hold"
            " this long before it is profiled, seconds."
        ),
    )
    backoff_seconds: int = Field(
        60, ge=1, description="First retry delay after a failed profiling Job, seconds."
    )
    max_backoff_seconds: int = Field(
        3600,
        ge=1,
        description="Longest retry delay (the delay doubles per failure), seconds; at least backoffSeconds.",
    )
    deadline_seconds: int | None = Field(
        None,
        ge=60,
        description=(
            "activeDeadlineSeconds of a profiling Job; unset: twice ramps x steps x stepSeconds plus"
            " 600 s (a hung profiler fails and is retried instead of running forever)."
        ),
    )
    resources: Resources = Field(
        default_factory=Resources, description="Requests and limits of the profiling Job's pod."
    )


GPU_KINDS = ("h100", "h200")


class BasinDeploymentSpec(ApiModel):
    """A Basin-managed SGLang prefill–decode deployment."""

    model: ModelSpec = Field(description="The served model (the only required field).")
    gpu_kind: Literal["h100", "h200"] = Field(
        "h200",
        description="GPU kind of the engines: picks the calibration the fluid-model classification uses.",
    )
    images: Images = Field(default_factory=Images, description="Container images of the children.")
    prefill: RoleSpec = Field(
        default_factory=RoleSpec, description="Prefill engines (SGLang --disaggregation-mode prefill)."
    )
    decode: DecodeRoleSpec = Field(
        default_factory=DecodeRoleSpec, description="Decode engines (SGLang --disaggregation-mode decode)."
    )
    router: RouterSpec = Field(
        default_factory=RouterSpec, description="SGLang's PD router, discovering engine pods by label."
    )
    disaggregation: DisaggregationSpec = Field(
        default_factory=DisaggregationSpec, description="Prefill-to-decode handoff (SGLang PD flags)."
    )
    emulator: EmulatorSpec = Field(
        default_factory=EmulatorSpec, description="Emulated engines instead of GPUs (basin emulate)."
    )
    gateway: GatewaySpec = Field(
        default_factory=GatewaySpec, description="The Basin session gateway in front of the engines."
    )
    redis: RedisSpec = Field(
        default_factory=RedisSpec, description="The gateway replicas' shared state store."
    )
    profiling: ProfilingSpec = Field(
        default_factory=ProfilingSpec, description="The profiling Job that measures κ and λc (load ramps)."
    )

    def emulator_preset(self) -> str:
        """The preset the emulator runs: `emulator.preset`, else the one named by GPU kind and replicas."""
        if self.emulator.preset:
            return self.emulator.preset
        return shape_name(self.gpu_kind, self.prefill.replicas, self.decode.replicas)

    def check(self) -> list[str]:
        """Cross-field problems, each naming its field (the apiserver checks everything else)."""
        problems = []
        if self.redis.mode == "external" and not self.redis.url:
            problems.append("spec.redis.url: required when spec.redis.mode is external")
        if (
            self.redis.mode == "external"
            and self.redis.url
            and not self.redis.url.startswith(("redis://", "rediss://"))
        ):
            problems.append(f"spec.redis.url: must start with redis:// or rediss://, got {self.redis.url!r}")
        if self.redis.mode == "managed" and (self.redis.url or self.redis.password_secret):
            problems.append("spec.redis.url/passwordSecret: only for spec.redis.mode external")
        if self.emulator.enabled and not emulator_shape_known(self.emulator_preset()):
            field = "spec.emulator.preset" if self.emulator.preset else "spec.emulator.preset (derived)"
            problems.append(
                f"{field}: {self.emulator_preset()!r} is not an emulator preset;"
                f" one of {', '.join(EMULATOR_PRESETS)} or another shape <gpu>-<P>p<D>d"
            )
        if self.profiling.max_backoff_seconds < self.profiling.backoff_seconds:
            problems.append(
                "spec.profiling.maxBackoffSeconds: must be at least spec.profiling.backoffSeconds"
            )
        return problems


class Condition(ApiModel):
    """A status condition, as in Kubernetes API conventions."""

    type: str = Field(
        description=(
            "PrefillReady, DecodeReady, RouterReady, GatewayReady (with the managed Redis), Profiled or "
            "Ready."
        )
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason (e.g. InvalidSpec, Profiling).")
    message: str = Field(description="Human-readable detail of the reason.")
    last_transition_time: str = Field(description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(None, description="Generation the condition was computed for.")


class ProfileStatus(ApiModel):
    """The profile the gateway runs on."""

    kappa: float = Field(description="κ: cache cliff scale.")
    lambda_c_per_min: float = Field(description="λc: peak session departure rate, sessions per minute.")
    profiled_at: str = Field(description="When the profile was measured (RFC 3339).")
    fingerprint: str = Field(description="Fingerprint of the deployment shape it was measured on.")
    state: Literal["fresh", "stale"] = Field(
        description="fresh while the deployment still has the shape it was measured on, else stale."
    )


class ProfilingStatus(ApiModel):
    """The current or last profiling Job."""

    job: str = Field(description="Name of the profiling Job.")
    fingerprint: str = Field(description="Deployment fingerprint the Job measures.")
    prefill_replicas: int = Field(description="Prefill replicas the Job measures.")
    decode_replicas: int = Field(description="Decode replicas the Job measures.")
    trigger: str = Field(description="Why it runs: create, spec scale, ready replicas or retry.")
    attempt: int = Field(description="Attempt number for this fingerprint, from 1.")
    state: Literal["Running", "Succeeded", "Failed"] = Field(description="Running, Succeeded or Failed.")
    started_at: str = Field(description="When the Job was created (RFC 3339).")
    # Never "": the 1.20 apiserver built from Debian's source decodes "" in custom resources as null.
    message: str | None = Field(None, description="Why the Job failed (with the profiler's own reason).")
    retry_at: str | None = Field(None, description="When a failed attempt is retried (RFC 3339).")


class ReadyObservation(ApiModel):
    """Ready replicas as last observed and since when they have held (for the debounce)."""

    prefill: int = Field(description="Ready prefill replicas.")
    decode: int = Field(description="Ready decode replicas.")
    spec_prefill: int = Field(description="Prefill replicas the spec asked for at the time.")
    spec_decode: int = Field(description="Decode replicas the spec asked for at the time.")
    since: str = Field(description="When these four counts were first observed together (RFC 3339).")


class BasinDeploymentStatus(ApiModel):
    """What the operator observed."""

    observed_generation: int | None = Field(None, description="Generation of the spec last reconciled.")
    phase: str | None = Field(
        None,
        description=(
            "Invalid, Pending (children not ready or no profile yet), Profiling (serving on a stale profile"
            " while a Job runs), ProfilingFailed or Ready."
        ),
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Readiness conditions, one per type (see conditions[].type)."
    )
    prefill_replicas: int | None = Field(
        None, description="Ready prefill pods (the scale subresource's status)."
    )
    decode_replicas: int | None = Field(None, description="Ready decode pods.")
    prefill_selector: str | None = Field(
        None, description="Label selector of the prefill pods (the scale subresource's, for an autoscaler)."
    )
    ready_observed: ReadyObservation | None = Field(
        None, description="Ready and spec replica counts and since when they have held (the debounce clock)."
    )
    profile: ProfileStatus | None = Field(None, description="The profile the gateway runs on.")
    profiling: ProfilingStatus | None = Field(None, description="Current or last profiling Job.")
    first_limit: Literal["cache-first", "decode-first"] | None = Field(
        None,
        description=(
            "Fluid model: which resource limits service first as load rises (basin analyze), for gpuKind."
        ),
    )
    peak_departures_per_min: float | None = Field(
        None, description="Fluid model: predicted peak session departure rate D(N*)."
    )
