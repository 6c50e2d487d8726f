"""Per-layer waits for unit data that is still arriving (paper §6.6).

When prefill fetches a lent unit, decode writes the missing KV into prefill's pages in layer order and
publishes a completion flag per layer group. Before each layer runs, a one-thread Triton kernel spins on
that group's flag in device memory, so the forward pass overlaps the transfer instead of waiting for all
of it. SGLang's `LayerDoneCounter` (managers/cache_controller.py) is the host-side precedent: it blocks
the CPU on CUDA events per layer; a device-side spin keeps the launch queue full instead.

A CPU monitor owns each fetch: completion notices set groups READY; a passed deadline or a lost decode
peer sets every pending group FAILED, which releases the kernel at once, and the batch recomputes those
tokens instead of reading half-written pages. The kernel is launched only for batches that fetch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

PENDING, READY, FAILED = 0, 1, 2


@cache
def _kernel() -> Any:
    """Built on first use, so TRITON_INTERPRET (read when a kernel is defined) can be set before."""
    import triton
    import triton.language as tl

    @triton.jit
    def wait_flag(flags_ptr, status_ptr, group, max_spins):
        spins = 0
        value = tl.load(flags_ptr + group, volatile=True)
        while (value == 0) & (spins < max_spins):
            spins += 1
            value = tl.load(flags_ptr + group, volatile=True)
        # A flag still pending after max_spins counts as failed: never read unconfirmed pages.
        tl.store(status_ptr + group, tl.where(value == 0, 2, value))

    return wait_flag


def layer_groups(num_layers: int, layers_per_group: int) -> list[range]:
    """Consecutive layer ranges that decode completes (and flags) together."""
    if layers_per_group <= 0:
        raise ValueError("layers_per_group must be positive")
    return [range(s, min(s + layers_per_group, num_layers)) for s in range(0, num_layers, layers_per_group)]


class LayerGroupFlags:
    """Completion flags of one fetch, in memory the model's device reads (int32, one per group).

    `flags` is written by the CPU side (monitor, transfer notices); `status` by the wait kernel: what each
    layer actually saw (READY, or FAILED when released by a failure or by the spin bound)."""

    def __init__(self, num_layers: int, layers_per_group: int, device: str | torch.device = "cpu"):
        self.groups = layer_groups(num_layers, layers_per_group)
        self.num_layers = num_layers
        self.layers_per_group = layers_per_group
        self.device = torch.device(device)
        self.flags = torch.zeros(len(self.groups), dtype=torch.int32, device=self.device)
        self.status = torch.zeros(len(self.groups), dtype=torch.int32, device=self.device)
        self._writer = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._lock = threading.Lock()
        self._host = [PENDING] * len(self.groups)

    def group_of(self, layer: int) -> int:
        return layer // self.layers_per_group

    # ---------------------------------------------------------------- CPU side
    def mark(self, group: int, value: int) -> None:
        """Publish READY/FAILED for a group; a group never goes back to PENDING or from READY to FAILED."""
        with self._lock:
            if self._host[group] != PENDING:
                return
            self._host[group] = value
            if self._writer is None:
                self.flags[group] = value
            else:
                # A side stream, so the write lands while the compute stream spins in the kernel.
                with torch.cuda.stream(self._writer):
                    self.flags[group : group + 1].fill_(value)

    def fail_pending(self) -> int:
        """Release every group still pending as FAILED; returns how many."""
        pending = [g for g, v in enumerate(self._host) if v == PENDING]
        for g in pending:
            self.mark(g, FAILED)
        return len(pending)

    def host_state(self) -> list[int]:
        with self._lock:
            return list(self._host)

    # ---------------------------------------------------------------- device side
    def wait_layer(self, layer: int, max_spins: int = 1 << 30) -> None:
        """Launch the wait kernel for `layer`'s group on the current stream (returns at once on a GPU;
        under TRITON_INTERPRET it runs, and so blocks, on the calling thread)."""
        _kernel()[(1,)](self.flags, self.status, self.group_of(layer), max_spins)

    def layer_failed(self, layer: int) -> bool:
        """After the kernel ran: did this layer's group fail (read after synchronising the stream)?"""
        return int(self.status[self.group_of(layer)]) == FAILED

    def all_seen_ready(self) -> bool:
        """After a forward pass waited on every layer: did each group's kernel see READY? (A group no
        kernel waited on reads PENDING: not confirmed, so not ready.)"""
        return bool((self.status == READY).all())


@dataclass
class FetchOutcome:
    complete: bool
    reason: str  # "complete", "timeout", "peer lost" or "refused" (decode declined: no unit, no room)
    groups_ready: int
    seconds: float


class FetchMonitor:
    """Watches one fetch on a CPU thread until every group is READY, the deadline passes, or the decode
    peer is gone; on failure releases all pending groups as FAILED.

    `poll_ready` returns group indices newly reported complete (e.g. from NIXL notifications); `peer_alive`
    says whether the decode instance still answers."""

    def __init__(
        self,
        flags: LayerGroupFlags,
        timeout_s: float,
        poll_ready: Callable[[], Iterable[int]],
        peer_alive: Callable[[], bool] = lambda: True,
        interval_s: float = 0.001,
        refused: Callable[[], bool] = lambda: False,
    ):
        self.flags = flags
        self.timeout_s = timeout_s
        self.poll_ready = poll_ready
        self.peer_alive = peer_alive
        self.refused = refused
        self.interval_s = interval_s
        self.outcome: FetchOutcome | None = None
        self._thread = threading.Thread(target=self._run, name="basin-fetch-monitor", daemon=True)

    def start(self) -> FetchMonitor:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> FetchOutcome:
        self._thread.join(timeout)
        if self.outcome is None:
            raise TimeoutError("fetch monitor did not conclude")
        return self.outcome

    def _run(self) -> None:
        deadline = self._start + self.timeout_s
        n = len(self.flags.groups)
        reason = "complete"
        while True:
            for group in self.poll_ready():
                self.flags.mark(group, READY)
            state = self.flags.host_state()
            if all(v == READY for v in state):
                break
            if self.refused():
                reason = "refused"
                break
            if time.monotonic() >= deadline:
                reason = "timeout"
                break
            if not self.peer_alive():
                # Notices already delivered may still be queued: drain once more before giving up.
                for group in self.poll_ready():
                    self.flags.mark(group, READY)
                if all(v == READY for v in self.flags.host_state()):
                    break
                reason = "peer lost"
                break
            time.sleep(self.interval_s)
        if reason != "complete":
            self.flags.fail_pending()
        ready = sum(1 for v in self.flags.host_state() if v == READY)
        self.outcome = FetchOutcome(reason == "complete", reason, ready, time.monotonic() - self._start)
        assert ready == n or reason != "complete"
