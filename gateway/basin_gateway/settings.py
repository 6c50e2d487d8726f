"""The gateway's settings: flags for local use, the `BASIN_*` environment the operator sets
(docs/operator.md).

A flag given on the command line wins over the environment; the environment wins over the defaults.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from basin.errors import BasinError
from basin.policy import BasinConfig
from basin_gateway.upstream import PrefillEngine, parse_decode, parse_prefill_list

# Policies whose actions need engine features stock SGLang lacks: refused at start, with the reason.
REFUSED_POLICIES = {
    "continuum": "Continuum pins a session's prefix in the prefill cache for a TTL between calls; stock"
    " SGLang has no TTL pins, so the gateway cannot carry out its decisions",
    "composition": "the composition includes Continuum's TTL pins and Crossflow's prefill on decode"
    " instances; stock SGLang has neither",
    "crossflow": "Crossflow runs prefill chunks on decode instances; stock SGLang cannot",
}
ALIASES = {"passthrough": "hicache"}  # HiCache alone: forward everything in arrival order

# BASIN_POLICY_* (the operator's `gateway.policy`) → BasinConfig fields.
POLICY_ENV = {
    "BASIN_POLICY_INTERVAL_S": "interval_s",
    "BASIN_POLICY_FAST_INTERVAL_S": "fast_interval_s",
    "BASIN_POLICY_MARGIN": "margin",
    "BASIN_POLICY_ALPHA_LEND": "alpha_lend",
    "BASIN_POLICY_ALPHA_ORDER": "alpha_order",
    "BASIN_POLICY_ALPHA_RELEASE": "alpha_release",
    "BASIN_POLICY_LEND_CAP": "lend_cap",
    "BASIN_POLICY_SHED_AFTER_S": "shed_after_s",
    "BASIN_POLICY_PRIORITY_RATE": "priority_rate",
}


@dataclass(frozen=True)
class Settings:
    upstream: str = "http://127.0.0.1:30000"
    # Address the engines directly instead of the router (basin_gateway/upstream.py): both or neither.
    prefill: tuple[PrefillEngine, ...] = ()
    decode: tuple[str, ...] = ()
    direct: bool = False  # address the Ready engine pods found by the selectors (or the lists above)
    bootstrap_port: int = 8998  # the prefill pods' bootstrap port (the operator's engines use 8998)
    host: str = "0.0.0.0"
    port: int = 8080
    metrics_port: int | None = None  # /metrics and health on their own port too
    redis_url: str | None = None
    redis_password: str | None = None
    deployment: str = "local"  # Redis key namespace: basin:{deployment}:…
    session_header: str = "X-Session-ID"
    policy: str = "basin"
    policy_config: BasinConfig = field(default_factory=BasinConfig)
    profile_path: str | None = None
    preset: str | None = None  # local use: the profile the simulator assumes for this deployment preset
    fingerprint: str | None = None  # the deployment's fingerprint: a profile measured on another is refused
    predictor_path: str | None = None
    prometheus_url: str | None = None
    engines: tuple[str, ...] = ()
    prefill_selector: str | None = None
    decode_selector: str | None = None
    engine_port: int = 30000
    namespace: str | None = None
    kubeconfig: str | None = None  # engine pods found through this kubeconfig (default: in-cluster)
    time_scale: float = 1.0
    admin_token: str | None = None
    api_keys: frozenset[str] = frozenset()
    # Robustness bounds.
    max_body_bytes: int = 32 * 1024 * 1024
    max_header_bytes: int = 32 * 1024
    body_timeout_s: float = 30.0  # wall seconds to receive a request body
    upstream_connect_timeout_s: float = 10.0
    upstream_read_timeout_s: float = 600.0  # wall seconds between two reads of an upstream answer
    idle_timeout_s: float = 900.0  # model seconds without a call before a session ends
    max_parked: int = 10_000
    max_park_wait_s: float = 3600.0  # model seconds a parked session may wait before the gateway sheds it
    # A parked first call may be held open instead of answered 429 at once: for clients that cannot
    # retry. Both bounded: wall seconds one call is held, and calls held at once (past it: 429 at once).
    hold_parked_s: float = 0.0
    max_held: int = 1000
    telemetry_stale_s: float = 30.0  # model seconds after which a telemetry reading no longer counts
    lease_ttl_s: float = 5.0  # wall seconds of the leader lease (Redis)

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise BasinError(f"--time-scale must be positive, got {self.time_scale}")
        if not 0 <= self.port < 65536:
            raise BasinError(f"--port must be between 0 and 65535, got {self.port}")
        if not self.upstream.startswith(("http://", "https://")):
            raise BasinError(f"--upstream must be an http(s) URL, got {self.upstream!r}")
        if bool(self.prefill) != bool(self.decode):
            raise BasinError("addressing the engines directly needs both --prefill and --decode")
        if self.direct and not self.decode and not (self.prefill_selector and self.decode_selector):
            raise BasinError(
                "--direct needs the engines: --prefill and --decode, or the pod selectors"
                " BASIN_PREFILL_SELECTOR and BASIN_DECODE_SELECTOR"
            )
        if not 0 < self.bootstrap_port < 65536:
            raise BasinError(f"the bootstrap port must be between 1 and 65535, got {self.bootstrap_port}")
        name = ALIASES.get(self.policy, self.policy)
        if name in REFUSED_POLICIES:
            raise BasinError(f"policy {self.policy!r} cannot run live: {REFUSED_POLICIES[name]}")
        from basin.policy import POLICIES

        if name not in POLICIES:
            choices = ", ".join(sorted({*ALIASES, *POLICIES} - set(REFUSED_POLICIES)))
            raise BasinError(f"unknown policy {self.policy!r}; choose one of {choices}")
        if self.hold_parked_s < 0:
            raise BasinError(f"--hold-parked must not be negative, got {self.hold_parked_s}")
        for bound in ("max_body_bytes", "max_header_bytes", "max_parked", "max_held"):
            if getattr(self, bound) < 1:
                raise BasinError(f"{bound} must be positive")

    @property
    def policy_name(self) -> str:
        return ALIASES.get(self.policy, self.policy)


def _float(env: Mapping[str, str], name: str) -> float | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return float(value)
    except ValueError:
        raise BasinError(f"{name} must be a number, got {value!r}") from None


def from_environment(env: Mapping[str, str] | None = None, **flags: object) -> Settings:
    """Settings from `env` (default: os.environ) overridden by the flags that were given (not None)."""
    env = os.environ if env is None else env
    values: dict[str, object] = {}
    simple = {
        "BASIN_ROUTER_URL": "upstream",
        "BASIN_GATEWAY_HOST": "host",
        "BASIN_REDIS_URL": "redis_url",
        "BASIN_REDIS_PASSWORD": "redis_password",
        "BASIN_SESSION_HEADER": "session_header",
        "BASIN_PROFILE_PATH": "profile_path",
        "BASIN_PREDICTOR_PATH": "predictor_path",
        "BASIN_POLICY": "policy",
        "BASIN_PROMETHEUS_URL": "prometheus_url",
        "BASIN_PREFILL_SELECTOR": "prefill_selector",
        "BASIN_DECODE_SELECTOR": "decode_selector",
        "BASIN_NAMESPACE": "namespace",
        "BASIN_KUBECONFIG": "kubeconfig",
        "BASIN_ADMIN_TOKEN": "admin_token",
        "BASIN_PROFILE_FINGERPRINT": "fingerprint",
    }
    for name, attr in simple.items():
        if env.get(name):
            values[attr] = env[name]
    for name, attr in (
        ("BASIN_GATEWAY_PORT", "port"),
        ("BASIN_ENGINE_PORT", "engine_port"),
        ("BASIN_GATEWAY_METRICS_PORT", "metrics_port"),
        ("BASIN_BOOTSTRAP_PORT", "bootstrap_port"),
        ("BASIN_GATEWAY_MAX_HELD", "max_held"),
    ):
        number = _float(env, name)
        if number is not None:
            values[attr] = int(number)
    for name, attr in (
        ("BASIN_TIME_SCALE", "time_scale"),
        ("BASIN_GATEWAY_IDLE_TIMEOUT_S", "idle_timeout_s"),
        ("BASIN_GATEWAY_MAX_PARK_WAIT_S", "max_park_wait_s"),
        ("BASIN_GATEWAY_HOLD_PARKED_S", "hold_parked_s"),
    ):
        number = _float(env, name)
        if number is not None:
            values[attr] = number
    if env.get("BASIN_DIRECT_ENGINES"):
        values["direct"] = env["BASIN_DIRECT_ENGINES"].strip().lower() in ("1", "true", "yes")
    if env.get("BASIN_PREFILL_ENGINES"):
        values["prefill"] = parse_prefill_list(env["BASIN_PREFILL_ENGINES"])
    if env.get("BASIN_DECODE_ENGINES"):
        values["decode"] = tuple(
            parse_decode(u.strip()) for u in env["BASIN_DECODE_ENGINES"].split(",") if u.strip()
        )
    if env.get("BASIN_ENGINES"):
        values["engines"] = tuple(u.strip() for u in env["BASIN_ENGINES"].split(",") if u.strip())
    deployment = env.get("BASIN_DEPLOYMENT") or env.get("BASIN_PROFILE_CONFIGMAP", "").removesuffix(
        "-profile"
    )
    if deployment:
        values["deployment"] = deployment
    keys_file = env.get("BASIN_API_KEYS_FILE")
    if keys_file:
        with open(keys_file) as handle:
            values["api_keys"] = frozenset(line.strip() for line in handle if line.strip())
    config: dict[str, float] = {}
    for name, attr in POLICY_ENV.items():
        number = _float(env, name)
        if number is not None:
            config[attr] = number
    values["policy_config"] = dataclasses.replace(BasinConfig(), **config)  # type: ignore[arg-type]
    for attr, value in flags.items():
        if value is None or value == ():
            continue
        values[attr] = value
    return Settings(**values)  # type: ignore[arg-type]
