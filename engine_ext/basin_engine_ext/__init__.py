"""Basin's SGLang plugin: decode-memory lending, bootstrap-queue priority and their metrics (paper §6.2).

SGLang loads it from the `sglang.srt.plugins` entry point `basin` (see docs/engine-ext.md); the entry
point is `register`, which checks the SGLang version, reads BASIN_ENGINE_* settings and registers hooks.
"""

from __future__ import annotations

from basin_engine_ext.version import SUPPORTED_SGLANG, UnsupportedSGLangVersion, check_sglang_version

__all__ = ["SUPPORTED_SGLANG", "UnsupportedSGLangVersion", "check_sglang_version", "register"]


def register() -> None:
    """SGLang plugin entry point. SGLang's loader logs and swallows plugin exceptions, which would leave
    an engine running without the behaviour the gateway relies on, so a wrong SGLang version or bad
    settings stop the process (SystemExit) with the reason."""
    from basin_engine_ext import hooks
    from basin_engine_ext.config import EngineExtConfig

    try:
        check_sglang_version()
        config = EngineExtConfig.from_env()
    except (UnsupportedSGLangVersion, ValueError) as exc:
        raise SystemExit(f"basin_engine_ext: {exc}") from exc
    hooks.configure(config)
    hooks.register_hooks()
