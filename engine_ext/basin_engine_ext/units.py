"""The lent-unit store: which session prompts decode keeps in idle KV memory, and the rules for
adopting and reclaiming them (paper §6.2).

Pure bookkeeping in tokens; the SGLang binding (`lending.py`) owns the pages behind each unit. Rules:
- a session has at most one unit, its latest turn; adopting a newer turn replaces the older one;
- adoption needs lent + t ≤ φ·C and free room above decode demand of at least `adopt_headroom`·C after
  taking the unit;
- reclamation starts when free room above demand falls below `reclaim_headroom`·C (a lower margin, so
  one adoption never triggers its own reclaim), and frees units prefill also holds first, then the
  least recently used;
- a decode allocation that falls short reclaims units before SGLang retracts a running request.
On hybrid (linear-attention) models a unit also holds one recurrent-state slot; those slots come from
a second, separately sized pool, so they have their own cap (φ of the state slots) and headroom rules,
applied the same way beside the token rules. Such a state is valid at exactly one prompt position (the
prompt's end, `state_tokens`), which a fetch of the unit must end at.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P")  # what the binding keeps per unit (page indices); opaque here


@dataclass
class Unit(Generic[P]):
    session: str
    turn: int
    tokens: int  # prompt tokens the unit's pages cover (whole pages only)
    token_ids: tuple[int, ...]  # the prompt those pages hold, to compare against the next turn
    pages: P
    prefill_holds: bool = False  # prefill reported it still caches this prefix
    pinned: int = 0  # fetches reading the pages now: such a unit is neither reclaimed nor replaced
    state: object = None  # hybrid models: the state slot holding the prompt-end recurrent state
    states: int = 0  # state slots the unit holds (0 or 1)
    state_tokens: int = 0  # the prompt position the state was taken at (its prompt's full length)


@dataclass
class Decision:
    adopted: bool
    reason: str
    replaced: Unit | None = None


@dataclass
class UnitStore(Generic[P]):
    """Units by session, in least-recently-used order (oldest first)."""

    capacity: int  # C: decode KV tokens
    lend_cap: float = 0.5  # φ
    adopt_headroom: float = 0.10
    reclaim_headroom: float = 0.05
    state_capacity: int = 0  # S: recurrent-state slots (hybrid models; 0: units hold no state)
    _units: OrderedDict[str, Unit[P]] = field(default_factory=OrderedDict)
    lent: int = 0
    lent_states: int = 0

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError("capacity must be positive")
        if not 0.0 <= self.reclaim_headroom <= self.adopt_headroom < 1.0:
            raise ValueError("need 0 <= reclaim_headroom <= adopt_headroom < 1")

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._units)

    def __contains__(self, session: object) -> bool:
        return session in self._units

    def get(self, session: str) -> Unit[P] | None:
        return self._units.get(session)

    def units(self) -> list[Unit[P]]:
        """Units, least recently used first."""
        return list(self._units.values())

    def headroom(self, demand: int) -> int:
        """Free tokens above decode demand (running plus queued) and lent units."""
        return self.capacity - demand - self.lent

    def state_headroom(self, state_demand: int) -> int:
        """Free state slots above what running and queued requests hold or need, and lent units."""
        return self.state_capacity - state_demand - self.lent_states

    # ------------------------------------------------------------------ adopt
    def adopt(
        self,
        session: str,
        turn: int,
        token_ids: Iterable[int],
        tokens: int,
        pages: P,
        demand: int,
        state: object = None,
        state_demand: int = 0,
        state_tokens: int = 0,
    ) -> Decision:
        """Keep a finished call's prompt as the session's unit if the cap and the headroom allow.

        `demand` is decode's running and queued need, not counting these pages. A newer turn first
        drops the session's older unit (its pages come back in `Decision.replaced`, to free); an older
        or equal turn than the one held is refused. With a `state` slot (hybrid models) the state cap
        and headroom must hold too; `state_demand` counts state slots requests hold or need, not this one.
        """
        old = self._units.get(session)
        if old is not None and old.turn >= turn:
            return Decision(False, "stale turn")
        if old is not None and old.pinned:
            return Decision(False, "in transfer")
        replaced = None
        if old is not None:
            replaced = self._remove(session)
        if tokens <= 0:
            return Decision(False, "empty", replaced)
        if self.lent + tokens > self.lend_cap * self.capacity:
            return Decision(False, "lend cap", replaced)
        if self.headroom(demand) - tokens < self.adopt_headroom * self.capacity:
            return Decision(False, "headroom", replaced)
        states = 0 if state is None else 1
        if states:
            if self.lent_states + states > self.lend_cap * self.state_capacity:
                return Decision(False, "lend cap", replaced)
            if self.state_headroom(state_demand) - states < self.adopt_headroom * self.state_capacity:
                return Decision(False, "headroom", replaced)
        self._units[session] = Unit(
            session, turn, tokens, tuple(token_ids), pages, state=state, states=states,
            state_tokens=state_tokens if states else 0,
        )  # fmt: skip
        self.lent += tokens
        self.lent_states += states
        return Decision(True, "adopted", replaced)

    # ------------------------------------------------------------------ use
    def touch(self, session: str) -> None:
        """Mark a unit used (a fetch), moving it to the most recently used end."""
        if session in self._units:
            self._units.move_to_end(session)

    def pin(self, session: str) -> Unit[P]:
        """A fetch starts reading the unit's pages: keep them until `unpin`."""
        unit = self._units[session]
        unit.pinned += 1
        return unit

    def unpin(self, session: str) -> None:
        unit = self._units.get(session)
        if unit is not None and unit.pinned > 0:
            unit.pinned -= 1

    def set_prefill_holds(self, sessions: Iterable[str]) -> None:
        """Record prefill's report: exactly these sessions' units are also cached on prefill."""
        held = set(sessions)
        for unit in self._units.values():
            unit.prefill_holds = unit.session in held

    def discard(self, session: str) -> Unit[P] | None:
        """Drop a session's unit (session ended); returns it so its pages can be freed (None when absent
        or pinned by a fetch)."""
        unit = self._units.get(session)
        return self._remove(session) if unit is not None and not unit.pinned else None

    def forget_all(self) -> None:
        """The pages behind every unit were returned wholesale (SGLang cleared its allocator)."""
        self._units.clear()
        self.lent = 0
        self.lent_states = 0

    # ------------------------------------------------------------------ reclaim
    def reclaim_order(self) -> list[Unit[P]]:
        """Units prefill also holds (least recently used first), then the rest by LRU; pinned units
        (being fetched) are not reclaimable."""
        units = [u for u in self._units.values() if not u.pinned]
        return [u for u in units if u.prefill_holds] + [u for u in units if not u.prefill_holds]

    def reclaim(self, tokens: int, states: int = 0) -> list[Unit[P]]:
        """Remove units in reclaim order until at least `tokens` and `states` state slots are freed (or
        none is left); for state slots only units holding one are taken."""
        freed: list[Unit[P]] = []
        total = total_states = 0
        for unit in self.reclaim_order():
            need_tokens, need_states = total < tokens, total_states < states
            if not need_tokens and not (need_states and unit.states):
                if not need_states:
                    break
                continue
            freed.append(self._remove(unit.session))
            total += unit.tokens
            total_states += unit.states
        return freed

    def rebalance(self, demand: int, state_demand: int = 0) -> list[Unit[P]]:
        """Reclaim what the lower margins ask for: enough that free room above demand is back at
        `reclaim_headroom`·C (and, for state slots, at `reclaim_headroom`·S). Nothing while they hold."""
        short = self.reclaim_headroom * self.capacity - self.headroom(demand)
        short_states = 0.0
        if self.lent_states:
            short_states = self.reclaim_headroom * self.state_capacity - self.state_headroom(state_demand)
        if short <= 0 and short_states <= 0:
            return []
        return self.reclaim(max(0, math.ceil(short)), max(0, math.ceil(short_states)))

    def _remove(self, session: str) -> Unit[P]:
        unit = self._units.pop(session)
        self.lent -= unit.tokens
        self.lent_states -= unit.states
        return unit
