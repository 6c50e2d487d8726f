"""Workload throughput: synthetic generation vs reading the same sessions back from a session file.

Run: python benchmarks/workload.py [--repeats N]
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

from basin.workload.sessionfile import read_sessions, write_sessions
from basin.workload.synthetic import generate


def best_of(repeats: int, fn) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    sessions = generate("terminal-bench", seed=0)
    calls = sum(len(s.calls) for s in sessions)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "tb.jsonl"
        buffer = io.StringIO()
        write_sessions(sessions, buffer)
        path.write_text(buffer.getvalue())
        t_generate = best_of(args.repeats, lambda: generate("terminal-bench", seed=0))
        t_read = best_of(args.repeats, lambda: read_sessions(path))
    size_mb = len(buffer.getvalue()) / 1e6
    print(f"terminal-bench: {len(sessions)} sessions, {calls} calls, file {size_mb:.2f} MB")
    print(f"generate: {t_generate * 1e3:8.1f} ms  ({calls / t_generate:,.0f} calls/s)")
    print(f"read:     {t_read * 1e3:8.1f} ms  ({calls / t_read:,.0f} calls/s)")
    print(f"ratio generate/read: {t_generate / t_read:.2f}")


if __name__ == "__main__":
    main()
