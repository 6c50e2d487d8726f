"""The GPU check script, run as a CPU smoke test (tiny sizes, Triton interpreter) so it cannot rot
between the rare sessions that have an H200; its figures only mean something on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

SCRIPT = Path(__file__).resolve().parents[2] / "engine_ext" / "gpu_check.py"


def test_gpu_check_runs_its_checks_on_cpu() -> None:
    args = ["--device", "cpu", "--tokens", "64", "--page", "4", "--layers", "4", "--heads", "2", "--dim", "8"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--layers-per-group", "2", "--repeats", "2"],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "destination pages byte-equal to the source" in out.stdout
    assert "every layer read its pages only after its flag" in out.stdout
    assert "gpu check: all passed" in out.stdout
