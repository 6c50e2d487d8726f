"""The profile's figure: hit rate against working set over cache per ramp, with the fitted reference
curve and the cliff, and departures against offered rate with λc (docs/profiling.md says how to read it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from basin.hitcurve import KNEE, reference_hit_rate
from basin.profile import REFERENCE_MIDPOINT
from basin.profile_schema import ProfileDocument


def plot_profile(profile: ProfileDocument, out: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    top = 0.0
    for index, ramp in enumerate(profile.ramps, start=1):
        points = [(s.working_set_over_cache, s.hit_rate) for s in ramp if s.working_set_over_cache is not None
                  and s.hit_rate is not None]  # fmt: skip
        if points:
            x, h = np.array(points).T
            top = max(top, float(x.max()))
            left.plot(x, h, "o-", alpha=0.7, label=f"ramp {index}")
        rates = [(s.rate_per_min, s.departures_per_min) for s in ramp if s.rate_per_min is not None]
        if rates:
            r, d = np.array(rates).T
            right.plot(r, d, "o-", alpha=0.7, label=f"ramp {index}")
    grid = np.linspace(0, max(top, profile.kappa * 2.6), 400)
    left.plot(grid, reference_hit_rate(grid, profile.kappa), "k-", linewidth=1.5,
              label=f"reference curve, κ = {profile.kappa:.2f}")  # fmt: skip
    left.axvline(profile.kappa * REFERENCE_MIDPOINT, color="tab:red", linestyle="--", label="fitted cliff")
    left.axvline(profile.kappa * KNEE, color="tab:gray", linestyle=":", label="knee κ·x_k")
    left.set(xlabel="working set / cache", ylabel="prefix hit rate", ylim=(0, 1.02))
    left.legend(fontsize=8)
    right.axhline(profile.lambda_c_per_min, color="tab:red", linestyle="--",
                  label=f"λc = {profile.lambda_c_per_min:.2f}/min")  # fmt: skip
    right.set(xlabel="offered arrivals (sessions/min)", ylabel="departures (sessions/min)")
    right.legend(fontsize=8)
    fig.suptitle(f"profile of {profile.deployment} ({profile.source}, {profile.workload})")
    fig.savefig(out, dpi=120)
    plt.close(fig)
