"""`python -m basin_monitoring [--check]`: write the chart's dashboards and alert rules (or check them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from basin_monitoring import alerts, dashboards

CHART_FILES = Path(__file__).resolve().parents[2] / "helm" / "basin" / "files"


def generated() -> dict[Path, str]:
    """Every generated file, by its path in the repository."""
    out = {
        CHART_FILES / "dashboards" / f"{name}.json": dashboards.render(name) for name in dashboards.DASHBOARDS
    }
    out[CHART_FILES / "alerts" / "basin.yaml"] = alerts.render()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m basin_monitoring", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if a committed file differs")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generated().items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    for path in stale:
        print(f"out of date: {path} (run python -m basin_monitoring)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
