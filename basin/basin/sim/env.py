"""The event loop: one clock and one heap, owned here and nowhere else.

Entries are (time, seq, callback, args): ties break by scheduling order, so runs are deterministic.
Callbacks schedule follow-up events through `schedule`; a callback that raises stops the run loudly.
The simulator runs the loop as fast as it can; the emulator runs the same loop against the wall clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class Timer:
    """A scheduled callback that can be cancelled before it fires."""

    __slots__ = ("cancelled", "time")

    def __init__(self, time: float) -> None:
        self.time = time
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Environment:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[tuple[float, int, Timer, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self.events = 0

    def schedule(self, delay: float, callback: Callable[..., Any], *args: Any) -> Timer:
        time = self.now + delay  # `schedule_at` inlined: one call per event saved
        if time < self.now:
            raise ValueError(f"cannot schedule in the past: {time} < {self.now}")
        timer = Timer(time)
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, timer, callback, args))
        return timer

    def schedule_at(self, time: float, callback: Callable[..., Any], *args: Any) -> Timer:
        if time < self.now:
            raise ValueError(f"cannot schedule in the past: {time} < {self.now}")
        timer = Timer(time)
        self._seq += 1
        heapq.heappush(self._heap, (time, self._seq, timer, callback, args))
        return timer

    def peek(self) -> float | None:
        """Time of the next live event, or None when nothing is scheduled."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def step(self) -> None:
        time, _, timer, callback, args = heapq.heappop(self._heap)
        if timer.cancelled:
            return
        self.now = time
        self.events += 1
        callback(*args)

    def run(self, until: float) -> None:
        """Process every event up to and including `until`, then set the clock to `until`."""
        heap, pop = self._heap, heapq.heappop
        while heap and heap[0][0] <= until:  # `step` inlined: this loop runs once per event
            time, _, timer, callback, args = pop(heap)
            if timer.cancelled:
                continue
            self.now = time
            self.events += 1
            callback(*args)
        self.now = max(self.now, until)
