"""`basin operator` as a user runs it: bad input is one error line and exit status 2, never a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kopf")  # the `operator` extra

BASIN = str(Path(sys.executable).with_name("basin"))


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([BASIN, *args], capture_output=True, text=True, timeout=60, check=False, env=env)


def test_missing_kubeconfig_is_a_user_error(tmp_path: Path) -> None:
    result = run("operator", "run", "--kubeconfig", str(tmp_path / "absent"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: --kubeconfig {tmp_path / 'absent'}: no such file"


def test_no_credentials_is_a_user_error(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "none")}
    result = run("operator", "run", env=env)
    assert result.returncode == 2
    assert result.stderr.startswith("error: no usable Kubernetes credentials")
    assert "Traceback" not in result.stderr


def test_bad_options(tmp_path: Path) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text("apiVersion: v1\nkind: Config\n")
    result = run("operator", "run", "--kubeconfig", str(config), "--resync-seconds", "0")
    assert result.returncode == 2 and "--resync-seconds must be positive" in result.stderr
    result = run("operator", "crd", "--out", str(tmp_path / "missing" / "crd.yaml"))
    assert result.returncode == 2 and "does not exist" in result.stderr
