"""The plugin as SGLang loads it: entry point `basin` in group `sglang.srt.plugins`, run by SGLang's own
`load_plugins` in a fresh interpreter (each engine process does the same)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from conftest import checkout_env

pytestmark = pytest.mark.engine

PROBE = textwrap.dedent(
    """
    import torchvision_shim
    import sys
    {prelude}
    from sglang.srt.plugins import load_plugins
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator as A
    load_plugins()
    print("patched" if hasattr(A.evict_to_free_tokens, "__wrapped__") else "untouched")
    """
)


def run_probe(env: dict[str, str], prelude: str = "") -> subprocess.CompletedProcess:
    clean = {k: v for k, v in checkout_env().items() if not k.startswith(("BASIN_ENGINE_", "SGLANG_PLUGINS"))}
    return subprocess.run(
        [sys.executable, "-c", PROBE.format(prelude=prelude)],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_entry_point_is_registered_in_the_sglang_plugin_group() -> None:
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "basin"]
    assert ep.value == "basin_engine_ext:register"


def test_sglang_loader_runs_the_plugin_and_applies_its_hooks() -> None:
    out = run_probe({"SGLANG_PLUGINS": "basin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("patched")


def test_sglang_plugins_filter_leaves_sglang_untouched() -> None:
    out = run_probe({"SGLANG_PLUGINS": "someone_else"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("untouched")


def test_lending_off_places_no_lending_hook() -> None:
    out = run_probe({"SGLANG_PLUGINS": "basin", "BASIN_ENGINE_LENDING": "0"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("untouched")


def test_unsupported_sglang_version_stops_the_process_with_the_reason() -> None:
    """SGLang's loader swallows plugin exceptions; the guard must still stop the engine."""
    prelude = "import basin_engine_ext.version as v; v.SUPPORTED_SGLANG = ('0.4.0',)"
    out = run_probe({"SGLANG_PLUGINS": "basin"}, prelude)
    assert out.returncode != 0
    assert "supports SGLang 0.4.0 only; found 0.5.23" in out.stderr


def test_a_misspelt_setting_stops_the_process() -> None:
    out = run_probe({"SGLANG_PLUGINS": "basin", "BASIN_ENGINE_LEND_CAPP": "0.4"})
    assert out.returncode != 0
    assert "unknown setting BASIN_ENGINE_LEND_CAPP" in out.stderr


def test_version_guard_accepts_the_supported_release_only() -> None:
    from basin_engine_ext.version import UnsupportedSGLangVersion, check_sglang_version

    assert check_sglang_version() == "0.5.23"
    for other in ("0.5.22", "0.5.24", "0.6.0"):
        with pytest.raises(UnsupportedSGLangVersion, match=other):
            check_sglang_version(other)


FETCH_PROBE = textwrap.dedent(
    """
    import torchvision_shim
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as M
    from basin_engine_ext import hooks
    def ours(f):  # HookRegistry's AROUND wrapper closes over the hook function
        return any(c.cell_contents in (hooks.admit_with_unit_fetch, hooks.record_sent_units)
                   for c in (f.__closure__ or ()))
    print([ours(f) for f in (Scheduler.get_new_batch_prefill, M.process_disagg_prefill_inflight_queue,
                             Scheduler.process_disagg_prefill_inflight_queue)])
    """
)


@pytest.mark.parametrize("port, expected", [("7400", "[True, True, True]"), ("0", "[False, False, False]")])
def test_prefill_fetch_hooks_are_placed_on_sglangs_scheduler_only_with_a_unit_port(port, expected) -> None:
    clean = {k: v for k, v in checkout_env().items() if not k.startswith(("BASIN_ENGINE_", "SGLANG_PLUGINS"))}
    env = {**clean, "SGLANG_PLUGINS": "basin", "BASIN_ENGINE_UNIT_PORT": port}
    out = subprocess.run(
        [sys.executable, "-c", FETCH_PROBE], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == expected


def test_loading_the_plugin_leaves_prometheus_client_unimported() -> None:
    """SGLang loads plugins in its HTTP process before it sets PROMETHEUS_MULTIPROC_DIR; prometheus_client
    picks its value store when imported, so a plugin that imports it there hides SGLang's own tokenizer
    metrics (TTFT, e2e latency, prompt and cached tokens) from /metrics. Seen live: the gateway's hit
    rate had no `sglang:prompt_tokens_total` to read."""
    prelude = "import sglang.launch_server"
    probe = PROBE.replace('print("patched"', 'print("prometheus_client" in sys.modules, "patched"')
    out = subprocess.run(
        [sys.executable, "-c", probe.format(prelude=prelude)],
        env={**checkout_env(), "SGLANG_PLUGINS": "basin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("False patched")
