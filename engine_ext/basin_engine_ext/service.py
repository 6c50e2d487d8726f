"""Decode's unit service: answers prefill's fetch requests and held-unit reports from inside the decode
scheduler process, polled from the scheduler thread so it never races the lender (adoption, reclaim).

`poll()` never blocks: it drains the control socket, starts fetches (plan against the session's unit,
pin it, post the first layer group's NIXL WRITE) and advances running ones one group at a time, so a
transfer overlaps decode steps instead of stalling them. A unit stays pinned (not reclaimable) while a
fetch reads it. When there is no unit worth writing, or a WRITE fails, decode sends a miss notice and
prefill recomputes at once.

On a hybrid (Mamba / gated-delta) decode instance the service also writes the unit's recurrent state
(its Mamba slot, every state buffer) into the Mamba slot prefill names, with the last layer group's
WRITE, and only for a fetch that ends exactly at the state's prompt position; any other fetch of a
hybrid unit, a state-less fetch from prefill, or a state layout that differs from decode's is a miss.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from basin_engine_ext.layer_wait import layer_groups
from basin_engine_ext.lending import DecodeLender, FetchPlan
from basin_engine_ext.transfer import (
    FETCH,
    HELD,
    MISS,
    FetchRequest,
    KVLayout,
    StateLayout,
    notice,
    pages_of,
)

logger = logging.getLogger(__name__)


@dataclass
class _Active:
    request: FetchRequest
    plan: FetchPlan
    src_pages: list[int]
    groups: list[range]
    next_group: int = 0
    handle: Any = None


class UnitService:
    def __init__(
        self,
        lender: DecodeLender,
        layout: KVLayout,
        agent: Any,
        socket: Any,
        mem_type: str = "DRAM",
        state_layout: StateLayout | None = None,
    ):
        self.lender = lender
        self.layout = layout
        self.state_layout = state_layout  # hybrid models: decode's Mamba pool (registered with `agent`)
        self.agent = agent
        self.socket = socket  # zmq PULL, bound; prefill PUSHes `transfer.encode_fetch` / `encode_held`
        self.mem_type = mem_type
        self.active: list[_Active] = []
        self._peers: set[str] = set()
        self._fetch_decoder = msgspec.msgpack.Decoder(FetchRequest)
        self._held_decoder = msgspec.msgpack.Decoder(list[str])

    def poll(self) -> None:
        import zmq

        while True:
            try:
                kind, payload = self.socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if kind == FETCH:
                self._start(self._fetch_decoder.decode(payload))
            elif kind == HELD:
                self.lender.store.set_prefill_holds(self._held_decoder.decode(payload))
        for fetch in list(self.active):
            self._advance(fetch)
        # The agent runs without a progress thread (an idle one spins a core): reading notifications
        # is what drives UCX here, and it carries standalone notices such as a miss to prefill.
        self.agent.get_new_notifs()

    # ------------------------------------------------------------------ internals
    def _start(self, request: FetchRequest) -> None:
        if request.agent_name not in self._peers:
            self.agent.add_remote_agent(request.agent_metadata)
            self._peers.add(request.agent_name)
        if request.deadline and time.time() >= request.deadline:
            self._miss(request)  # prefill has given these pages up already
            return
        if not self._compatible(request.layout):
            logger.warning("basin unit fetch %s: prefill's KV layout differs from decode's", request.fetch_id)
            self._miss(request)
            return
        if not self._state_compatible(request):
            logger.warning("basin unit fetch %s: recurrent state cannot be served as asked", request.fetch_id)
            self._miss(request)
            return
        plan = self.lender.plan_fetch(request.session, request.prompt_ids, request.local_match)
        if plan is None or plan.tokens != len(request.dst_pages) * self.layout.page_size:
            self._miss(request)
            return
        if (plan.state is None) != (self.state_layout is None):
            self._miss(request)  # a hybrid unit without its state (or a state on an MHA instance)
            return
        self.lender.store.pin(request.session)
        fetch = _Active(
            request,
            plan,
            pages_of(plan.src_indices, self.layout.page_size),
            layer_groups(self.layout.num_layers, request.layers_per_group),
        )
        self.active.append(fetch)
        self._post(fetch)

    def _compatible(self, remote: KVLayout) -> bool:
        """Pages are copied as raw bytes: both pools need the same layers, page size and page bytes."""
        return (
            remote.num_layers == self.layout.num_layers
            and remote.page_size == self.layout.page_size
            and tuple(remote.item_lens) == tuple(self.layout.item_lens)
        )

    def _state_compatible(self, request: FetchRequest) -> bool:
        """A hybrid decode serves only fetches that take the state, into a pool of the same shape; an MHA
        decode serves only fetches without one."""
        if self.state_layout is None:
            return request.dst_state < 0 and request.state_layout is None
        remote, slot = request.state_layout, request.dst_state
        return (
            slot >= 0
            and remote is not None
            and tuple(remote.item_lens) == tuple(self.state_layout.item_lens)
            and len(remote.lens) == len(remote.item_lens)
            and all((slot + 1) * n <= m for n, m in zip(remote.item_lens, remote.lens, strict=True))
        )

    def _post(self, fetch: _Active) -> None:
        g = fetch.next_group
        layers = fetch.groups[g]
        req = fetch.request
        local_rows = self.layout.page_descs(self.layout.buffers_of(layers), fetch.src_pages)
        remote_rows = req.layout.page_descs(req.layout.buffers_of(layers), req.dst_pages)
        if fetch.plan.state is not None and g == len(fetch.groups) - 1:
            # The recurrent state rides with the last group: its notice then means pages and state landed.
            local_rows = np.concatenate([local_rows, self.state_layout.slot_descs(int(fetch.plan.state))])
            remote_rows = np.concatenate([remote_rows, req.state_layout.slot_descs(req.dst_state)])
        local = self.agent.get_xfer_descs(local_rows, self.mem_type)
        remote = self.agent.get_xfer_descs(remote_rows, self.mem_type)
        fetch.handle = self.agent.initialize_xfer(
            "WRITE", local, remote, req.agent_name, notice(req.fetch_id, g)
        )
        if self.agent.transfer(fetch.handle) == "ERR":
            self._fail(fetch)

    def _advance(self, fetch: _Active) -> None:
        if fetch not in self.active:
            return
        state = self.agent.check_xfer_state(fetch.handle)
        if state == "PROC":
            return
        self.agent.release_xfer_handle(fetch.handle)
        fetch.handle = None
        if state != "DONE":
            self._fail(fetch)
            return
        fetch.next_group += 1
        if fetch.next_group < len(fetch.groups):
            if fetch.request.deadline and time.time() >= fetch.request.deadline:
                self._fail(fetch)  # past prefill's deadline: post no further WRITE
                return
            self._post(fetch)
            return
        self.active.remove(fetch)
        self.lender.store.unpin(fetch.request.session)
        self.lender.record_fetched(fetch.plan.tokens)

    def _fail(self, fetch: _Active) -> None:
        logger.warning(
            "basin unit fetch %s failed at layer group %d", fetch.request.fetch_id, fetch.next_group
        )
        if fetch in self.active:
            self.active.remove(fetch)
        self.lender.store.unpin(fetch.request.session)
        self._miss(fetch.request)

    def _miss(self, request: FetchRequest) -> None:
        self.agent.send_notif(request.agent_name, notice(request.fetch_id, MISS))
