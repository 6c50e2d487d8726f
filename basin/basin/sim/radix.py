"""A paged radix prefix cache with a GPU tier and an optional host tier (SGLang's RadixCache + HiCache).

Keys are sequences of page keys (one per `page_size` tokens; the simulator numbers pages, the emulator
hashes their token content). Nodes hold runs of pages. A node lives on the GPU, on the host, or both:
- GPU eviction takes least-recently-used *GPU leaves* (GPU nodes without GPU children) that no request
  has locked. A node backed up on the host becomes host-only; otherwise it is deleted.
- With write-through, every inserted node is copied to the host at once, if the host has room after
  evicting host-only leaves (LRU).
- A match walks GPU nodes then host-only nodes; the host part must be loaded back before use.
Locks propagate to the root, so an unlocked node never has a locked descendant: every unlocked GPU page
is evictable. Pages allocated for requests in flight count against GPU capacity until inserted or freed.
Accounting invariant (checked by `check`): free + evictable + locked + in-flight = GPU capacity.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass


class Node:
    __slots__ = ("children", "gpu", "host", "key", "last_access", "lock", "parent", "state", "state_access")

    def __init__(self, key: tuple[int, ...], parent: Node | None, now: float) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.gpu = True
        self.host = False
        self.lock = 0
        self.last_access = now
        self.state = False  # holds a recurrent-state slot: a prefix ending here is reusable (hybrid models)
        self.state_access = now  # last use of that state: only the deepest usable one on a match

    def __len__(self) -> int:
        return len(self.key)


class _LruHeap:
    """Candidate nodes by last access. An entry goes stale when its node changes after the push (new
    access time, evicted, locked); `pop` skips stale entries, and the heap is compacted when they pile up."""

    def __init__(self, valid: Callable[[Node, float], bool]) -> None:
        self._heap: list[tuple[float, int, Node]] = []
        self._valid = valid
        self._seq = itertools.count()

    def push(self, node: Node, live: int, stamp: float | None = None) -> None:
        heap = self._heap
        heapq.heappush(heap, (node.last_access if stamp is None else stamp, next(self._seq), node))
        size = len(heap)
        if size > 64 and size > 4 * (live + 16):
            self._heap = [e for e in self._heap if self._valid(e[2], e[0])]
            heapq.heapify(self._heap)

    def pop(self) -> Node | None:
        while self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if self._valid(node, stamp):
                return node
        return None


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs several times more, per match
class Match:
    """A matched prefix: `node` is its last node (the root for no match); `gpu_pages` are resident,
    `host_pages` follow them and need a load-back."""

    node: Node
    gpu_pages: int
    host_pages: int

    @property
    def pages(self) -> int:
        return self.gpu_pages + self.host_pages


class RadixCache:
    def __init__(
        self, gpu_pages: int, host_pages: int = 0, write_through: bool = True, state_slots: int | None = None
    ) -> None:
        if gpu_pages < 1 or host_pages < 0:
            raise ValueError("cache capacities must be positive")
        self.gpu_capacity = gpu_pages
        self.host_capacity = host_pages
        self.write_through = write_through and host_pages > 0
        self.root = Node((), None, 0.0)
        self.root.lock = 1  # never evicted
        self.gpu_used = 0  # pages of tree nodes on the GPU
        self.host_used = 0
        self.locked_gpu = 0  # pages of locked tree nodes on the GPU
        self.in_flight = 0  # pages allocated to requests, not yet in the tree
        self._gpu_lru = _LruHeap(_gpu_evictable)
        self._host_lru = _LruHeap(_host_evictable)
        # Hybrid models (paper §2): a prefix is reusable only where a recurrent-state snapshot was kept, at
        # the end of an inserted prompt, and the snapshots share a pool of `state_slots` (None: no limit, a
        # pure-attention model: every cached page is reusable).
        self.state_slots = state_slots
        self.states_used = 0
        self._state_lru = _LruHeap(_state_evictable)

    # ------------------------------------------------------------------ capacity
    @property
    def gpu_free(self) -> int:
        return self.gpu_capacity - self.gpu_used - self.in_flight

    @property
    def gpu_evictable(self) -> int:
        return self.gpu_used - self.locked_gpu

    def can_allocate(self, pages: int) -> bool:
        return pages <= self.gpu_free + self.gpu_evictable

    def allocate(self, pages: int) -> bool:
        """Reserve GPU pages for a request in flight, evicting as needed; False if they cannot fit."""
        if not self.can_allocate(pages):
            return False
        if pages > self.gpu_free:
            self.evict_gpu(pages - self.gpu_free)
        self.in_flight += pages
        return True

    def free(self, pages: int) -> None:
        """Return in-flight pages that will not be inserted (an aborted or duplicate request)."""
        if pages > self.in_flight:
            raise ValueError(f"freeing {pages} pages but only {self.in_flight} are in flight")
        self.in_flight -= pages

    # ------------------------------------------------------------------ lookups
    def peek(self, keys: tuple[int, ...]) -> int:
        """Pages of `keys` cached on either tier, without touching or splitting (for routers)."""
        node, i, n = self.root, 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            length = len(child.key)
            if keys[i : i + length] != child.key:
                return i + _common_prefix(child.key, keys, i)
            node = child
            i += length
        return i

    def match(self, keys: tuple[int, ...], now: float, reusable: bool = True) -> Match:
        """Longest cached prefix of `keys`; touches the path. May split a node at the match end. With
        recurrent-state slots a prefix is `reusable` only up to its last node holding a state; insertion
        asks for the whole cached path instead (`reusable=False`)."""
        node = self.root
        gpu = host = 0
        i, n = 0, len(keys)
        usable: Match | None = None
        states = self.state_slots is not None
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            length = len(child.key)
            if keys[i : i + length] != child.key:
                child = self._split(child, _common_prefix(child.key, keys, i))
                length = len(child.key)
            if child.gpu:
                gpu += length
            else:
                host += length
            child.last_access = now
            node = child
            i += length
            if states and child.state:
                usable = Match(child, gpu, host)
        self._push_if_leaf(node)
        if states and reusable:
            if usable is None:
                return Match(self.root, 0, 0)
            self._touch_state(usable.node, now)
            return usable
        return Match(node, gpu, host)

    def _push_if_leaf(self, node: Node) -> None:
        # Every node on a matched path now has a new last_access; only leaves sit in the heaps.
        if node is not self.root:
            if node.gpu and not _has_gpu_child(node):
                self._push_gpu(node)
            elif not node.gpu and not node.children:
                self._push_host(node)

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node` after `at` pages; returns the new upper part (which keeps the parent link)."""
        parent = node.parent
        assert parent is not None
        upper = Node(node.key[:at], parent, node.last_access)
        upper.gpu, upper.host, upper.lock = node.gpu, node.host, node.lock  # the state stays at the end
        parent.children[upper.key[0]] = upper
        node.key = node.key[at:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    # ------------------------------------------------------------------ locking
    def lock(self, node: Node) -> None:
        root = self.root
        while node is not root:
            if node.lock == 0 and node.gpu:
                self.locked_gpu += len(node.key)
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        if node.state:  # its own lock is gone: its snapshot may be given up again
            self._state_lru.push(node, self.states_used, node.state_access)
        root = self.root
        while node is not root:
            node.lock -= 1
            if node.lock < 0:
                raise ValueError("unlocking a node that is not locked")
            if node.lock == 0 and node.gpu:
                self.locked_gpu -= len(node.key)
                if not _has_gpu_child(node):
                    self._push_gpu(node)
            node = node.parent  # type: ignore[assignment]

    # ------------------------------------------------------------------ host tier
    def load_back(self, match: Match) -> int:
        """Bring the host-only part of a (locked) match onto the GPU; returns the pages loaded.

        The caller allocates the pages first (they arrive as in-flight pages and become tree pages).
        """
        path = self._host_only_path(match.node)
        loaded = sum(len(p.key) for p in path)
        if loaded > self.in_flight:
            raise ValueError("load_back needs its pages allocated first")
        self.in_flight -= loaded
        self._promote(path, loaded)
        if path and not _has_gpu_child(match.node):
            self._push_gpu(match.node)
        return loaded

    # ------------------------------------------------------------------ insertion
    def insert(self, keys: tuple[int, ...], now: float, in_flight_pages: int) -> Node:
        """Insert `keys`, whose uncached part was computed into `in_flight_pages` allocated pages.

        Pages another request inserted meanwhile are dropped as duplicates. Returns the last node of
        `keys` (lock it to keep the pages until the KV transfer ends).
        """
        match = self.match(keys, now, reusable=False)
        if match.host_pages:
            # Our own computed copy is on the GPU already: use it instead of loading the host copy.
            moved = min(match.host_pages, in_flight_pages)
            self.in_flight -= moved
            in_flight_pages -= moved
            self.in_flight += self._promote(self._host_only_path(match.node), moved)
        remaining = len(keys) - match.pages
        used = min(remaining, in_flight_pages)
        self.in_flight -= in_flight_pages  # leftovers were duplicates: free them
        node = match.node
        if remaining <= 0:
            self._keep_state(node, now)
            return node
        if used < remaining:
            raise ValueError(f"inserting {remaining} new pages with only {in_flight_pages} allocated")
        leaf = Node(tuple(keys[match.pages :]), node, now)
        node.children[leaf.key[0]] = leaf
        size = len(leaf.key)
        self.gpu_used += size
        # Host copies stay closed under ancestors, so a GPU eviction never orphans a host-only child.
        host_parent = node is self.root or node.host
        if self.write_through and host_parent and self._make_host_room(size):
            leaf.host = True
            self.host_used += size
        self._push_gpu(leaf)
        self._keep_state(leaf, now)
        return leaf

    def _keep_state(self, node: Node, now: float) -> None:
        """Snapshot the recurrent state at the end of an inserted prompt, taking a slot from the least
        recently used unlocked snapshot when the pool is full (its pages stay cached, unusable alone)."""
        if self.state_slots is None or node is self.root:
            return
        if not node.state:
            if self.states_used >= self.state_slots:
                victim = self._state_lru.pop()
                if victim is None:
                    return  # every snapshot belongs to a request in flight
                victim.state = False
                self.states_used -= 1
            node.state = True
            self.states_used += 1
        self._touch_state(node, now)

    def _touch_state(self, node: Node, now: float) -> None:
        node.state_access = now
        self._state_lru.push(node, self.states_used, now)

    def _host_only_path(self, node: Node) -> list[Node]:
        """`node` and its ancestors up to the first GPU-resident one, bottom-up."""
        path = []
        while node is not self.root and not node.gpu:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        return path

    def _promote(self, path: list[Node], pages: int) -> int:
        """Make host-only nodes GPU-resident top-down while `pages` covers them whole (GPU nodes stay
        closed under ancestors); returns the pages left over."""
        for p in reversed(path):
            size = len(p.key)
            if pages < size:
                break
            p.gpu = True
            self.gpu_used += size
            if p.lock:
                self.locked_gpu += size
            pages -= size
        return pages

    def _make_host_room(self, pages: int) -> bool:
        if pages > self.host_capacity:
            return False
        if self.host_capacity - self.host_used < pages:
            self.evict_host(pages - (self.host_capacity - self.host_used))
        return self.host_capacity - self.host_used >= pages

    # ------------------------------------------------------------------ eviction
    def _push_gpu(self, node: Node) -> None:
        self._gpu_lru.push(node, self.gpu_used)

    def _push_host(self, node: Node) -> None:
        self._host_lru.push(node, self.host_used)

    def evict_gpu(self, pages: int) -> int:
        """Evict at least `pages` GPU pages (whole nodes, LRU leaves first); returns pages evicted."""
        evicted = 0
        while evicted < pages and (node := self._gpu_lru.pop()) is not None:
            size = len(node.key)
            evicted += size
            self.gpu_used -= size
            node.gpu = False
            parent = node.parent
            assert parent is not None
            if not node.host:
                self._delete(node)
            elif not node.children:
                self._push_host(node)
            if parent is not self.root and parent.gpu and parent.lock == 0 and not _has_gpu_child(parent):
                self._push_gpu(parent)
        return evicted

    def evict_host(self, pages: int) -> int:
        """Evict at least `pages` host pages from host-only leaves, LRU first."""
        evicted = 0
        while evicted < pages and (node := self._host_lru.pop()) is not None:
            size = len(node.key)
            evicted += size
            self.host_used -= size
            node.host = False
            parent = node.parent
            self._delete(node)
            if parent is not None and parent is not self.root and not parent.gpu and not parent.children:
                self._push_host(parent)
        return evicted

    def _delete(self, node: Node) -> None:
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key[0]]
        node.parent = None
        if node.state:
            node.state = False
            self.states_used -= 1

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Recount everything from the tree and compare with the counters (tests call this)."""
        gpu = host = locked = states = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            assert node.gpu or node.host, "a node must live somewhere"
            if node.gpu:
                assert node.parent is self.root or node.parent.gpu, "GPU nodes are closed under ancestors"
                gpu += len(node)
                locked += len(node) if node.lock else 0
            host += len(node) if node.host else 0
            states += node.state
            for child in node.children.values():
                assert child.parent is node and child.lock <= node.lock
                assert node.host or not child.host, "host copies are closed under ancestors"
                stack.append(child)
        assert gpu == self.gpu_used, (gpu, self.gpu_used)
        assert host == self.host_used, (host, self.host_used)
        assert locked == self.locked_gpu, (locked, self.locked_gpu)
        assert states == self.states_used and (self.state_slots is None or states <= self.state_slots)
        assert self.in_flight >= 0
        assert self.gpu_free + self.gpu_evictable + self.locked_gpu + self.in_flight == self.gpu_capacity
        assert self.gpu_free >= 0 and self.host_used <= self.host_capacity


def _common_prefix(key: tuple[int, ...], keys: tuple[int, ...], start: int) -> int:
    n = 0
    for a, b in zip(key, keys[start:], strict=False):
        if a != b:
            break
        n += 1
    return n


def _has_gpu_child(node: Node) -> bool:
    for child in node.children.values():  # noqa: SIM110 (no generator: this runs on every unlock)
        if child.gpu:
            return True
    return False


def _gpu_evictable(node: Node, stamp: float) -> bool:
    return (
        node.parent is not None
        and node.gpu
        and node.lock == 0
        and node.last_access == stamp
        and not _has_gpu_child(node)
    )


def _state_evictable(node: Node, stamp: float) -> bool:
    # Only a request's own lock on this node holds its snapshot, not the locks its descendants pass up.
    return (
        node.parent is not None
        and node.state
        and node.state_access == stamp
        and node.lock == sum(child.lock for child in node.children.values())
    )


def _host_evictable(node: Node, stamp: float) -> bool:
    return (
        node.parent is not None
        and node.host
        and not node.gpu
        and node.lock == 0
        and not node.children
        and node.last_access == stamp
    )
