"""Decode-memory lending bound to SGLang's real KV allocator (paper §6.2).

A `DecodeLender` keeps the prompt pages of finished, gateway-marked calls out of the allocator's free
list as the session's unit, frees them again when decode needs the room, and answers prefill's question
"how much of this prompt does the session's unit cover?". The rules live in `units.UnitStore`; this
module only moves page indices between SGLang's allocator and the store.

On a hybrid (Mamba / gated-delta) decode instance the prompt's KV pages alone cannot resume a session:
the linear-attention layers carry a recurrent state instead. The lender then also takes one slot of
SGLang's own Mamba pool per marked request, copies the request's state into it while it is still the
prompt-end state (after the transfer landed, before the first decode step), and a unit made from that
request keeps the slot. Slots come from SGLang's `MambaSlotAllocator`, so SGLang's accounting sees them
in use; they are freed with the unit, or at release when no unit is made.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from basin.tokens import common_prefix
from basin_engine_ext.units import Unit, UnitStore

if TYPE_CHECKING:  # prometheus_client is imported only in the scheduler (see `engine_metrics`)
    from basin_engine_ext.metrics import EngineMetrics


@dataclass(frozen=True)
class FetchPlan:
    """What prefill should take from a session's unit: prompt tokens [start, end) from `src_indices`."""

    session: str
    start: int
    end: int
    src_indices: torch.Tensor  # decode KV slot indices of tokens [start, end)
    state: torch.Tensor | None = None  # hybrid units: the Mamba slot holding the state at `end`

    @property
    def tokens(self) -> int:
        return self.end - self.start


class DecodeLender:
    """Lent units on one decode instance, holding real slots of `allocator` (any SGLang
    `BaseTokenToKVPoolAllocator`: `alloc`, `free`, `available_size`, `page_size`, `size`)."""

    def __init__(
        self,
        allocator,
        store: UnitStore[torch.Tensor],
        metrics: EngineMetrics | None = None,
        state_pool=None,
    ):
        self.allocator = allocator
        self.store = store
        self.metrics = metrics
        self.page_size = int(allocator.page_size)
        # Hybrid models: SGLang's HybridReqToTokenPool (its `mamba_pool` and `mamba_allocator`).
        self.state_pool = state_pool
        # Prompt-end state copies taken for marked requests still running, by request id.
        self.state_copies: dict[str, torch.Tensor] = {}
        # What requests queued for decode memory will need; set by the decode hook to read SGLang's
        # prealloc queue, so adoption leaves their room free.
        self.queued_demand: Callable[[], int] = lambda: 0
        self.queued_state_demand: Callable[[], int] = lambda: 0

    # ------------------------------------------------------------------ demand
    def demand_tokens(self, queued_tokens: int | None = None) -> int:
        """Decode demand: slots in use by requests (not by units) plus what queued requests need
        (`queued_tokens`, or the queue the lender watches)."""
        in_use = self.allocator.size - self.allocator.available_size() - self.store.lent
        queued = self.queued_demand() if queued_tokens is None else queued_tokens
        return max(0, in_use) + queued

    def state_demand(self, releasing: int = 0) -> int:
        """State slots requests hold (the pending prompt-end copies included) or need from the queue,
        less `releasing` slots a finishing request is about to give back."""
        if self.state_pool is None:
            return 0
        slots = self.state_pool.mamba_allocator
        in_use = int(slots.size) - int(slots.available_size()) - self.store.lent_states
        return max(0, in_use - releasing) + self.queued_state_demand()

    # ------------------------------------------------------------------ prompt-end state (hybrid)
    def copy_prompt_state(self, rid: str, state_index: torch.Tensor) -> bool:
        """Copy a request's recurrent state (slot `state_index`, still the prompt-end state) into a slot
        of SGLang's Mamba pool kept for the request's unit. Skipped (False) when that slot would be one
        queued requests need."""
        if self.state_pool is None or rid in self.state_copies:
            return False
        slots = self.state_pool.mamba_allocator
        if slots.available_size() - 1 < self.queued_state_demand():
            return False
        dst = slots.alloc(1)
        if dst is None:
            return False
        src = state_index.reshape(1).to(dtype=torch.int64, device=dst.device)
        self.state_pool.mamba_pool.copy_from(src, dst)
        self.state_copies[rid] = dst
        return True

    def take_state_copy(self, rid: str) -> torch.Tensor | None:
        """The prompt-end copy of a request, now the caller's to adopt or free."""
        return self.state_copies.pop(rid, None)

    def free_state(self, slot: torch.Tensor | None) -> None:
        if slot is not None and self.state_pool is not None:
            self.state_pool.mamba_allocator.free(slot)

    def ensure_states(self, need: Callable[[], bool]) -> bool:
        """Free state slots until `need()` holds: units holding state first (reclaim order), then the
        copies of running requests (which then end without a unit). Returns need()."""
        while not need():
            units = self.store.reclaim(0, states=1)
            if units:
                self._free(units)
                continue
            if not self.state_copies:
                break
            rid = next(iter(self.state_copies))
            self.free_state(self.state_copies.pop(rid))
        return need()

    # ------------------------------------------------------------------ adopt
    def adopt(
        self,
        session: str,
        turn: int,
        token_ids: Sequence[int],
        kv_indices: torch.Tensor,
        queued_tokens: int | None = None,
        releasing: int | None = None,
        state: torch.Tensor | None = None,
        releasing_states: int = 0,
    ) -> int:
        """Try to keep the whole pages of a finished prompt as the session's unit.

        `kv_indices` are the decode slots of `token_ids`, still allocated to the finishing request, which
        gives back `releasing` slots in all (default: just these). Returns how many leading slots the
        unit now owns; the caller must not free those (0: nothing adopted, free everything as usual).
        On a hybrid pool `state` (a prompt-end copy) is required and goes with the unit when adopted; it
        is freed here otherwise. `releasing_states` are state slots the request gives back.
        """
        if self.state_pool is not None and state is None:
            return 0  # pages without the prompt-end state cannot resume a hybrid model
        whole = (min(len(token_ids), int(kv_indices.numel())) // self.page_size) * self.page_size
        pages = kv_indices[:whole].clone()
        # The finishing request's own slots are still counted as in use; they stop being demand now.
        gone = int(kv_indices.numel()) if releasing is None else releasing
        demand = max(0, self.demand_tokens(queued_tokens) - gone)
        state_demand = 0
        if state is not None:
            # the copy itself is counted in use until adopted
            state_demand = max(0, self.state_demand(releasing_states) - 1)
        decision = self.store.adopt(
            session, turn, token_ids[:whole], whole, pages, demand, state=state, state_demand=state_demand,
            state_tokens=len(token_ids),  # the copy is the state after the whole prompt
        )  # fmt: skip
        if decision.replaced is not None:
            self._free([decision.replaced], reclaimed=False)
        if not decision.adopted:
            self.free_state(state)
            if self.metrics is not None and whole > 0 and decision.reason in ("lend cap", "headroom"):
                self.metrics.adopt_refusals.inc()
            self._publish()
            return 0
        self._publish()
        return whole

    # ------------------------------------------------------------------ reclaim
    def reclaim(self, tokens: int) -> int:
        """Free at least `tokens` of lent slots (prefill-held units first, then LRU); returns freed."""
        return self._free(self.store.reclaim(tokens))

    def rebalance(self, queued_tokens: int | None = None) -> int:
        """Apply the lower reclaim margins against current demand; returns tokens freed."""
        return self._free(self.store.rebalance(self.demand_tokens(queued_tokens), self.state_demand()))

    def ensure_available(self, num_tokens: int) -> int:
        """Reclaim units until the allocator can serve `num_tokens` (or no unit is left)."""
        short = num_tokens - self.allocator.available_size()
        return self.reclaim(short) if short > 0 else 0

    def forget_all(self) -> None:
        """SGLang cleared the allocator (cache flush, role switch): every page is free again already.
        SGLang's flush clears the request pool first, which returns every Mamba slot as well."""
        self.store.forget_all()
        self.state_copies.clear()
        self._publish()

    def discard(self, session: str) -> int:
        unit = self.store.discard(session)
        return self._free([unit], reclaimed=False) if unit is not None else 0

    # ------------------------------------------------------------------ fetch
    def plan_fetch(self, session: str, prompt_ids: Sequence[int], local_match: int) -> FetchPlan | None:
        """Compare the session's unit with prefill's local radix match for the next prompt.

        A hit (the unit covers more whole pages of the prompt than prefill matched) returns the slots
        to write, starting at the page holding `local_match`; a miss returns None. A hybrid unit (with a
        state slot) is a hit only when the fetch ends exactly at the state's position: its pages cover
        the whole prompt the state was taken after, and `prompt_ids` (what prefill asks for) is that
        prompt, no more and no less.
        """
        unit = self.store.get(session)
        if unit is None:
            return None
        covered = common_prefix(unit.token_ids, prompt_ids)
        covered = (covered // self.page_size) * self.page_size
        start = (local_match // self.page_size) * self.page_size
        if unit.state is not None and not (covered == unit.tokens == unit.state_tokens == len(prompt_ids)):
            covered = 0  # the state would not match the prefix prefill resumes from
        if covered <= local_match:
            if self.metrics is not None:
                self.metrics.unit_misses.inc()
            return None
        self.store.touch(session)
        if self.metrics is not None:
            self.metrics.unit_hits.inc()
        return FetchPlan(session, start, covered, unit.pages[start:covered], unit.state)

    def record_fetched(self, tokens: int) -> None:
        if self.metrics is not None:
            self.metrics.fetched_tokens.inc(tokens)

    # ------------------------------------------------------------------ internals
    def _free(self, units: list[Unit[torch.Tensor]], reclaimed: bool = True) -> int:
        freed = 0
        for unit in units:
            self.allocator.free(unit.pages)
            self.free_state(unit.state)
            freed += unit.tokens
        if freed and reclaimed and self.metrics is not None:
            self.metrics.reclaimed_tokens.inc(freed)
        self._publish()
        return freed

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.lent_tokens.set(self.store.lent)
            self.metrics.lent_units.set(len(self.store))
