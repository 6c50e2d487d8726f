"""Time-series figure of a run in the style of the paper's Fig. 4: median TTFT, prefix hit rate, active
sessions and completed calls per minute, with the surge shaded."""

from __future__ import annotations

from pathlib import Path

from basin.evaluate.records import RunRecords
from basin.evaluate.summary import Summary


def plot_run(summary: Summary, records: RunRecords, out: str | Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [(w.start_s + w.end_s) / 120 for w in summary.windows]
    panels = [
        ("Median TTFT (s)", [w.median_ttft_s for w in summary.windows], True),
        ("Prefix hit rate", [w.hit_rate for w in summary.windows], False),
        ("Active sessions", [w.active_sessions for w in summary.windows], False),
        ("Completed calls / min", [w.completed_calls_per_min for w in summary.windows], False),
    ]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.4), constrained_layout=True)
    for ax, (label, values, log) in zip(axes, panels, strict=True):
        ax.plot(minutes, values, color="tab:blue", linewidth=1.4)
        if records.trigger_s is not None and records.trigger_end_s is not None:
            ax.axvspan(
                records.trigger_s / 60, records.trigger_end_s / 60, color="tab:red", alpha=0.15, label="surge"
            )
        if log:
            ax.set_yscale("log")
        if label == "Prefix hit rate":
            ax.set_ylim(0, 1.02)
        ax.set_xlabel("Time (min)")
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title} — {summary.label}" if title else summary.label, fontsize=11)
    fig.savefig(out, dpi=120)
    plt.close(fig)
