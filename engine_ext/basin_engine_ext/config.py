"""The plugin's settings, read once from the environment of the engine process.

The operator sets these on prefill and decode pods; defaults are the paper's (§6.6). Every field here
changes behaviour; there are no placeholders.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ENV_PREFIX = "BASIN_ENGINE_"

# Keys the gateway sets in a request's `sampling_params.custom_params` (JSON-safe, they survive
# SGLang's msgpack IPC between tokenizer and scheduler).
SESSION_KEY = "basin_session"  # the session id (str)
LEND_KEY = "basin_lend"  # true: decode keeps this call's prompt as the session's unit


@dataclass(frozen=True)
class EngineExtConfig:
    lending: bool = True  # decode keeps marked prompts as lent units
    lend_cap: float = 0.5  # φ: at most this share of decode KV is lent
    adopt_headroom: float = 0.10  # adopt only if this share stays free above decode demand
    reclaim_headroom: float = 0.05  # reclaim units once free room above demand falls below this
    bootstrap_priority: bool = True  # order the prefill bootstrap queue by request priority
    prefill_complete_nixl: bool = True  # accept the prefill_complete allocation policy on NIXL
    unit_port: int = 0  # decode: serve unit fetches on this TCP port (+ tp rank); prefill: fetch from it
    fetch_timeout_s: float = 2.0  # prefill: give up a unit fetch after this long and recompute
    # prefill: admit a fetching request at once and wait per layer on the device (§6.6) instead of holding
    # it until its whole unit arrived; off until it has run on a GPU
    layer_overlap: bool = False
    metrics: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.lend_cap <= 1.0:
            raise ValueError(f"lend_cap must lie in [0, 1], got {self.lend_cap}")
        if not 0.0 <= self.reclaim_headroom <= self.adopt_headroom < 1.0:
            raise ValueError(
                "need 0 <= reclaim_headroom <= adopt_headroom < 1 (reclaim starts at a lower margin than "
                f"adoption), got {self.reclaim_headroom} and {self.adopt_headroom}"
            )
        if not 0 <= self.unit_port < 65536:
            raise ValueError(f"unit_port must be a TCP port or 0, got {self.unit_port}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> EngineExtConfig:
        """Read BASIN_ENGINE_* variables; unknown BASIN_ENGINE_* names are an error, not a silent typo."""
        env = dict(os.environ if env is None else env)
        fields = {
            "LENDING": ("lending", _bool),
            "LEND_CAP": ("lend_cap", float),
            "ADOPT_HEADROOM": ("adopt_headroom", float),
            "RECLAIM_HEADROOM": ("reclaim_headroom", float),
            "BOOTSTRAP_PRIORITY": ("bootstrap_priority", _bool),
            "PREFILL_COMPLETE_NIXL": ("prefill_complete_nixl", _bool),
            "UNIT_PORT": ("unit_port", int),
            "FETCH_TIMEOUT": ("fetch_timeout_s", float),
            "LAYER_OVERLAP": ("layer_overlap", _bool),
            "METRICS": ("metrics", _bool),
        }
        kwargs: dict[str, object] = {}
        for name, value in env.items():
            if not name.startswith(ENV_PREFIX):
                continue
            key = name[len(ENV_PREFIX) :]
            if key not in fields:
                known = ", ".join(ENV_PREFIX + k for k in fields)
                raise ValueError(f"unknown setting {name}; known: {known}")
            attr, parse = fields[key]
            kwargs[attr] = parse(value)
        return cls(**kwargs)  # type: ignore[arg-type]


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")
