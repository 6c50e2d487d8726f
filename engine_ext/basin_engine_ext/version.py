"""Which SGLang this plugin was written against, and a guard that refuses any other.

The hooks patch SGLang internals by dotted path (allocators, disaggregation queues, the KV release
path). Those paths and their semantics change between SGLang releases, so running against another
version would patch the wrong thing or nothing at all; failing loudly at plugin load is the only safe
answer.
"""

from __future__ import annotations

from importlib import metadata

SUPPORTED_SGLANG = ("0.5.23",)


class UnsupportedSGLangVersion(RuntimeError):
    """The installed SGLang is not one this plugin was verified against."""


def installed_sglang_version() -> str | None:
    """The installed SGLang distribution's version, or None when SGLang is absent."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_sglang_version(installed: str | None = None) -> str:
    """Return the installed SGLang version, or raise with what is installed and what is supported."""
    version = installed if installed is not None else installed_sglang_version()
    if version is None:
        raise UnsupportedSGLangVersion(
            "basin_engine_ext needs SGLang, which is not installed; install sglang=="
            + " or ".join(SUPPORTED_SGLANG)
        )
    if version not in SUPPORTED_SGLANG:
        raise UnsupportedSGLangVersion(
            f"basin_engine_ext supports SGLang {', '.join(SUPPORTED_SGLANG)} only; found {version}. "
            "Install a supported SGLang or unset the plugin (SGLANG_PLUGINS without 'basin')."
        )
    return version
