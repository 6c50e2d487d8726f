"""How late an asyncio event loop runs: the delay a busy process adds to everything it times.

The replay client and the engine emulator both stand in for something faster (many clients, a GPU): when
their own CPU work (tokenizing, JSON) keeps the loop busy, every answer is dated late by about the loop's
lag, and at a time scale S that lag is S times larger in model seconds. Both measure it so a run can say
when it measured its own machine rather than the engine's behaviour.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import numpy as np

PROBE_INTERVAL_S = 0.05  # wall seconds between probes
KEEP = 12_000  # probes kept: the last ten minutes


class LoopLagProbe:
    """Sleeps `PROBE_INTERVAL_S` over and over and records how much later than asked it woke."""

    def __init__(self) -> None:
        self.lags: deque[float] = deque(maxlen=KEEP)

    async def run(self) -> None:
        """Probe until cancelled."""
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(PROBE_INTERVAL_S)
            self.lags.append(max(time.perf_counter() - asked - PROBE_INTERVAL_S, 0.0))

    def mean(self) -> float:
        """The mean lag in wall seconds: about how late an answer arriving at a random moment is read."""
        return float(np.mean(self.lags)) if self.lags else 0.0

    def quantile(self, q: float) -> float:
        """The q-quantile of the recorded lags in wall seconds (0 before the first probe)."""
        return float(np.quantile(self.lags, q)) if self.lags else 0.0
