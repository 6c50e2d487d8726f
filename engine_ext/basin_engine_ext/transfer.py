"""Unit fetch over NIXL: decode writes a lent unit's KV pages into prefill's pages, layer group by layer
group, each group's WRITE carrying a notification that prefill turns into that group's READY flag.

Both sides describe their KV memory with SGLang's own `get_contiguous_buf_infos()` of the KV pool (K
buffers of every layer, then V buffers), so page p of buffer b lies at `ptrs[b] + p * item_lens[b]`.
Prefill allocates destination pages, sends a `FetchRequest`, and waits per layer (`layer_wait`);
decode's `service.UnitService` plans the fetch against its unit (`DecodeLender.plan_fetch`) and writes.
Memory kind is a parameter: "DRAM" here and in tests, "VRAM" on GPUs.

Hybrid (Mamba / gated-delta) models: the KV layout is the full-attention layers' MHA pool, and a unit's
recurrent state travels beside it. Both sides describe their Mamba pool with SGLang's own
`MambaPool.get_contiguous_buf_infos()` (one buffer per state tensor and linear layer, the buffers
SGLang's PD transfer sends the MAMBA state from), so slot s of buffer b lies at `ptrs[b] + s * item_lens[b]`.
The state is written with the last layer group's WRITE, so that group's notice (and so a complete fetch)
implies the state has landed too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KVLayout:
    """Addresses of a KV pool's per-layer buffers: K of layers 0..L-1, then V of layers 0..L-1."""

    ptrs: tuple[int, ...]
    lens: tuple[int, ...]
    item_lens: tuple[int, ...]  # bytes of one page in each buffer
    num_layers: int
    page_size: int

    @classmethod
    def from_pool(cls, pool) -> KVLayout:
        ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
        return cls(tuple(ptrs), tuple(lens), tuple(item_lens), int(pool.layer_num), int(pool.page_size))

    def buffers_of(self, layers: Iterable[int]) -> list[int]:
        layers = list(layers)
        if len(self.ptrs) != 2 * self.num_layers:
            raise ValueError("expected one K and one V buffer per layer (an MHA pool)")
        return layers + [self.num_layers + layer for layer in layers]

    def page_descs(self, buffers: list[int], pages: list[int]) -> np.ndarray:
        """Nx3 (address, length, device) rows, buffer-major then page order."""
        rows = [(self.ptrs[b] + p * self.item_lens[b], self.item_lens[b], 0) for b in buffers for p in pages]
        return np.array(rows, dtype=np.uint64).reshape(-1, 3)


@dataclass(frozen=True)
class StateLayout:
    """Addresses of a Mamba pool's per-slot state buffers (every conv and temporal tensor of every
    linear layer, SGLang's PD state-transfer order)."""

    ptrs: tuple[int, ...]
    lens: tuple[int, ...]
    item_lens: tuple[int, ...]  # bytes of one slot in each buffer

    @classmethod
    def from_pool(cls, mamba_pool) -> StateLayout:
        ptrs, lens, item_lens = mamba_pool.get_contiguous_buf_infos()
        return cls(tuple(ptrs), tuple(lens), tuple(item_lens))

    def slot_descs(self, slot: int) -> np.ndarray:
        """Nx3 (address, length, device) rows of one slot, in buffer order."""
        rows = [(p + slot * n, n, 0) for p, n in zip(self.ptrs, self.item_lens, strict=True)]
        return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def pages_of(slot_indices, page_size: int) -> list[int]:
    """Page ids of page-aligned slot indices (one per page, in order)."""
    slots = [int(s) for s in slot_indices]
    if len(slots) % page_size or any(slots[i] % page_size for i in range(0, len(slots), page_size)):
        raise ValueError("slots are not whole pages")
    return [slots[i] // page_size for i in range(0, len(slots), page_size)]


@dataclass
class FetchRequest:
    """Prefill → decode: write session `session`'s unit beyond `local_match` into these pages."""

    fetch_id: str
    session: str
    prompt_ids: list[int]
    local_match: int
    dst_pages: list[int]  # prefill pages for prompt tokens [start, end), start = local_match page
    agent_metadata: bytes
    agent_name: str
    layout: KVLayout
    layers_per_group: int
    # Wall-clock time (prefill's `time.time()`) after which prefill has given the pages up: decode writes
    # nothing after it (0: no deadline). Prefill keeps the pages of a timed-out fetch out of use for a
    # grace period beyond it, so a WRITE decode posted just before the deadline cannot land in pages
    # already handed to another request.
    deadline: float = 0.0
    # Hybrid models: prefill's Mamba slot that receives the unit's recurrent state, and prefill's state
    # layout (-1 / None: an MHA fetch, pages only). A hybrid fetch must end exactly where the unit's
    # state was taken (a recurrent state is valid at one token position only).
    dst_state: int = -1
    state_layout: StateLayout | None = None


MISS = -1  # the notice decode sends when it has no unit worth writing (or gave up): recompute now


def notice(fetch_id: str, group: int) -> bytes:
    return f"basin:{fetch_id}:{'miss' if group == MISS else group}".encode()


def parse_notice(msg: bytes, fetch_id: str) -> int | None:
    prefix = f"basin:{fetch_id}:".encode()
    if not msg.startswith(prefix):
        return None
    tail = msg[len(prefix) :]
    return MISS if tail == b"miss" else int(tail)


# Prefill -> decode control messages: two frames, a kind and a msgpack payload.
FETCH, HELD = b"fetch", b"held"


def encode_fetch(request: FetchRequest) -> list[bytes]:
    import msgspec

    return [FETCH, msgspec.msgpack.encode(request)]


def encode_held(sessions: Iterable[str]) -> list[bytes]:
    import msgspec

    return [HELD, msgspec.msgpack.encode(sorted(sessions))]


def make_agent(name: str, layout: KVLayout, mem_type: str = "DRAM", state: StateLayout | None = None):
    """A NIXL agent with the UCX backend and every KV buffer (and, on a hybrid model, every Mamba state
    buffer) registered (no progress thread: the owner polls, which keeps an idle agent from spinning a
    core)."""
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {})
    regions = [(p, n, 0, "") for p, n in zip(layout.ptrs, layout.lens, strict=True)]
    if state is not None:
        regions += [(p, n, 0, "") for p, n in zip(state.ptrs, state.lens, strict=True)]
    agent.register_memory(regions, mem_type)
    return agent


class NoticeReader:
    """Prefill side: turns NIXL notifications from decode into completed layer groups of one fetch;
    a miss notice sets `refused` (decode will not write: recompute without waiting for the deadline).
    With a `NoticeRouter` the agent's notices are shared between concurrent fetches; without one this
    reader consumes (and drops) every notice of the agent, which is right only for one fetch at a time."""

    def __init__(self, agent, fetch_id: str, router: NoticeRouter | None = None):
        self.agent = agent
        self.fetch_id = fetch_id
        self.router = router
        self.refused = False

    def __call__(self) -> list[int]:
        done = []
        msgs = self.router.take(self.fetch_id) if self.router is not None else self._drain()
        for msg in msgs:
            group = parse_notice(msg, self.fetch_id)
            if group == MISS:
                self.refused = True
            elif group is not None:
                done.append(group)
        return done

    def _drain(self) -> list[bytes]:
        return [msg for msgs in self.agent.get_new_notifs().values() for msg in msgs]


class NoticeRouter:
    """One reader of a prefill agent's NIXL notices for all its fetches: each call drains the agent
    (which also drives UCX progress) and files every `basin:<fetch id>:...` notice under its fetch, so
    fetches monitored from different threads never consume each other's completion notices."""

    def __init__(self, agent):
        self.agent = agent
        self._lock = threading.Lock()
        self._pending: dict[str, list[bytes]] = {}

    def open(self, fetch_id: str) -> None:
        with self._lock:
            self._pending.setdefault(fetch_id, [])

    def close(self, fetch_id: str) -> None:
        """Forget a concluded fetch; its late notices are dropped from then on."""
        with self._lock:
            self._pending.pop(fetch_id, None)

    def take(self, fetch_id: str) -> list[bytes]:
        with self._lock:
            for msgs in self.agent.get_new_notifs().values():
                for msg in msgs:
                    owner = _fetch_id_of(msg)
                    if owner is not None and owner in self._pending:
                        self._pending[owner].append(msg)
            mine = self._pending.get(fetch_id, [])
            if mine:
                self._pending[fetch_id] = []
            return mine


def _fetch_id_of(msg: bytes) -> str | None:
    if not msg.startswith(b"basin:"):
        return None
    head, _, _ = msg[len(b"basin:") :].rpartition(b":")
    return head.decode(errors="replace")


@dataclass
class IndexedUnit:
    decode: str  # the decode instance holding the unit (its agent name)
    token_ids: tuple[int, ...]  # the prompt the unit holds (whole pages)


class PrefillUnitIndex:
    """Prefill's per-session index of the latest unit: which decode instance holds it and what it covers.
    It decides whether a turn is worth a fetch and which units prefill itself still caches (decode
    reclaims those first)."""

    def __init__(self) -> None:
        self._units: dict[str, IndexedUnit] = {}

    def record(self, session: str, decode: str, token_ids: Iterable[int]) -> None:
        self._units[session] = IndexedUnit(decode, tuple(token_ids))

    def forget_decode(self, decode: str) -> list[str]:
        """Drop every unit held on `decode` (it stopped answering); returns their sessions."""
        gone = [session for session, unit in self._units.items() if unit.decode == decode]
        for session in gone:
            del self._units[session]
        return gone

    def decodes(self) -> set[str]:
        """Every decode instance holding one of the indexed units."""
        return {unit.decode for unit in self._units.values()}

    def forget(self, session: str) -> None:
        self._units.pop(session, None)

    def lookup(self, session: str) -> IndexedUnit | None:
        return self._units.get(session)

    def worth_fetching(self, session: str, prompt_ids: list[int], local_match: int) -> int:
        """Tokens of `prompt_ids` the unit covers beyond `local_match` (0: recompute or use the cache)."""
        unit = self._units.get(session)
        if unit is None:
            return 0
        n = 0
        for a, b in zip(unit.token_ids, prompt_ids, strict=False):
            if a != b:
                break
            n += 1
        return max(0, n - local_match)

    def held_sessions(self, local_match_len) -> dict[str, list[str]]:
        """Per decode instance, the sessions whose unit prefill's own cache covers in full
        (`local_match_len(token_ids) -> int` is prefill's radix match)."""
        held: dict[str, list[str]] = {}
        for session, unit in self._units.items():
            if local_match_len(list(unit.token_ids)) >= len(unit.token_ids):
                held.setdefault(unit.decode, []).append(session)
        return held


class UnitFetch:
    """One prefill-side fetch: allocates destination pages with SGLang's allocator, sends the request,
    runs the monitor; `wait_layer` is called before each layer executes; `finish` frees the pages and
    counts a fallback when the fetch did not complete (the batch then recomputes those tokens)."""

    def __init__(
        self,
        agent,
        agent_name: str,
        allocator,
        layout: KVLayout,
        send,
        peer_alive,
        timeout_s: float,
        layers_per_group: int,
        metrics=None,
        device: str = "cpu",
        router: NoticeRouter | None = None,
    ):
        from basin_engine_ext.layer_wait import FetchMonitor, LayerGroupFlags

        self._monitor_cls = FetchMonitor
        self.agent, self.agent_name, self.allocator, self.layout = agent, agent_name, allocator, layout
        self.send, self.peer_alive, self.timeout_s = send, peer_alive, timeout_s
        self.layers_per_group, self.metrics = layers_per_group, metrics
        self.router = router
        self.flags = LayerGroupFlags(layout.num_layers, layers_per_group, device)
        self.dst_slots = None
        self.fetch_id: str | None = None
        self.deadline = 0.0  # wall clock, sent to decode with the request
        self.start_token = self.end_token = 0
        self.monitor = None

    def start(
        self,
        fetch_id: str,
        session: str,
        prompt_ids: list[int],
        local_match: int,
        covered: int,
        dst_state: int = -1,
        state_layout: StateLayout | None = None,
    ) -> bool:
        """Allocate pages for prompt tokens [page(local_match), covered) and ask decode to write them
        (on a hybrid model also the unit's recurrent state into Mamba slot `dst_state`, which the caller
        allocated). False when the allocator has no room (then nothing was sent)."""
        ps = self.layout.page_size
        self.start_token = (local_match // ps) * ps
        self.end_token = (covered // ps) * ps
        n = self.end_token - self.start_token
        if n <= 0:
            return False
        slots = self.allocator.alloc(n)
        if slots is None:
            return False
        self.dst_slots = slots
        self.deadline = time.time() + self.timeout_s
        if self.router is not None:
            self.router.open(fetch_id)
        reader = NoticeReader(self.agent, fetch_id, self.router)
        self.monitor = self._monitor_cls(
            self.flags, self.timeout_s, reader, self.peer_alive, refused=lambda: reader.refused
        ).start()
        self.send(
            FetchRequest(
                fetch_id=fetch_id,
                session=session,
                prompt_ids=list(prompt_ids),
                local_match=local_match,
                dst_pages=pages_of(slots, ps),
                agent_metadata=self.agent.get_agent_metadata(),
                agent_name=self.agent_name,
                layout=self.layout,
                layers_per_group=self.layers_per_group,
                deadline=self.deadline,
                dst_state=dst_state,
                state_layout=state_layout,
            )
        )
        return True

    def wait_layer(self, layer: int) -> bool:
        """Before `layer` executes: wait for its group; False when the fetch failed (recompute)."""
        self.flags.wait_layer(layer)
        return not self.flags.layer_failed(layer)

    @property
    def concluded(self) -> bool:
        """The monitor has decided (every group READY, or the fetch failed): `finish` will not block."""
        return self.monitor is not None and self.monitor.outcome is not None

    def finish(self, free: bool = True):
        """Wait for the monitor's verdict; on failure free the destination pages (count a fallback),
        unless `free` is False: then the caller owns them still (to keep them from reuse while a late
        WRITE may land). On success the pages stay allocated: the caller hands them on (e.g. into the
        radix tree)."""
        outcome = self.monitor.join(self.timeout_s + 5)
        if self.router is not None:
            self.router.close(self.fetch_id)
        if not outcome.complete:
            if free:
                self.allocator.free(self.dst_slots)
                self.dst_slots = None
            if self.metrics is not None:
                self.metrics.fallbacks.inc()
        return outcome
