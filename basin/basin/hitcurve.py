"""The reference hit-rate curve against working set over cache (paper §3, Fig. 6b), shared by the fluid
model, the κ fit and the BASIN controller (which scales the knee x_k by κ for its budget)."""

from __future__ import annotations

import numpy as np

# ~0.95 on the healthy plateau, easing to ~0.80 at the knee x_k ≈ 1.9, then a cliff to a floor of ~0.3.
HIT_PLATEAU = 0.95
HIT_AT_KNEE = 0.80
HIT_FLOOR = 0.30
KNEE = 1.9  # where the cliff begins
CLIFF_CENTER = 2.05  # the cliff is half done at ~2x the cache ...
CLIFF_WIDTH = 0.05  # ... and complete by ~2.3x


def reference_hit_rate(x: np.ndarray | float, kappa: float = 1.0) -> np.ndarray:
    """h(W/C) of the reference curve, stretched by the cliff scale κ (the knee moves to κ x_k)."""
    x = np.asarray(x, dtype=float) / kappa
    plateau = HIT_PLATEAU - (HIT_PLATEAU - HIT_AT_KNEE) * np.clip(x / KNEE, 0.0, 1.0) ** 2
    # Numerically safe logistic for the cliff.
    z = np.clip((x - CLIFF_CENTER) / CLIFF_WIDTH, -60, 60)
    weight = 1.0 / (1.0 + np.exp(z))
    return HIT_FLOOR + (plateau - HIT_FLOOR) * weight
