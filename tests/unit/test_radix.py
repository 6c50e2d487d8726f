"""The paged radix cache: matching, LRU eviction of unlocked leaves, the host tier, and accounting."""

import random

import pytest

from basin.sim.radix import RadixCache


def keys(*pages: int) -> tuple[int, ...]:
    return tuple(pages)


def fill(cache: RadixCache, seq: tuple[int, ...], now: float) -> None:
    """Run one request: match, lock, allocate the uncached pages, insert, unlock."""
    match = cache.match(seq, now)
    cache.lock(match.node)
    need = len(seq) - match.gpu_pages
    assert cache.allocate(need)
    if match.host_pages:
        cache.load_back(match)
        need -= match.host_pages
    leaf = cache.insert(seq, now, need)
    cache.unlock(match.node)
    cache.lock(leaf)
    cache.unlock(leaf)
    cache.check()


def test_match_returns_longest_prefix_and_splits() -> None:
    cache = RadixCache(gpu_pages=100)
    fill(cache, keys(1, 2, 3, 4), 0.0)
    m = cache.match(keys(1, 2, 9), 1.0)
    assert (m.gpu_pages, m.host_pages) == (2, 0)
    assert m.node.key == (1, 2)  # the node was split at the match end
    cache.check()
    assert cache.match(keys(1, 2, 3, 4, 5), 2.0).gpu_pages == 4
    assert cache.match(keys(7), 2.0).pages == 0


def test_lru_evicts_least_recent_session_tail_first() -> None:
    cache = RadixCache(gpu_pages=10)
    fill(cache, keys(1, 2, 3), 0.0)  # session A, first call
    fill(cache, keys(1, 2, 3, 4, 5), 1.0)  # session A, second call (a child node)
    fill(cache, keys(10, 11, 12), 2.0)  # session B
    cache.match(keys(1, 2, 3, 4, 5), 3.0)  # A is touched: B is now least recent
    assert cache.allocate(4)  # needs 2 more pages than are free: B's leaf goes
    assert cache.match(keys(10, 11, 12), 4.0).pages == 0
    assert cache.match(keys(1, 2, 3, 4, 5), 4.0).gpu_pages == 5
    cache.free(4)
    cache.check()
    # Session A's tail goes before its head.
    fill(cache, keys(20, 21, 22, 23, 24, 25), 5.0)
    m = cache.match(keys(1, 2, 3, 4, 5), 6.0)
    assert m.gpu_pages == 3
    cache.check()


def test_locked_nodes_are_never_evicted() -> None:
    cache = RadixCache(gpu_pages=6)
    fill(cache, keys(1, 2, 3), 0.0)
    m = cache.match(keys(1, 2, 3), 1.0)
    cache.lock(m.node)
    assert cache.gpu_evictable == 0
    assert not cache.can_allocate(4)
    assert not cache.allocate(4)
    assert cache.allocate(3)
    cache.check()
    cache.free(3)
    cache.unlock(m.node)
    assert cache.gpu_evictable == 3
    cache.check()


def test_host_tier_keeps_evicted_prefixes_for_load_back() -> None:
    cache = RadixCache(gpu_pages=4, host_pages=8)
    fill(cache, keys(1, 2, 3), 0.0)
    assert cache.host_used == 3  # written through
    fill(cache, keys(5, 6, 7), 1.0)  # evicts (1, 2, 3) from the GPU to host-only
    m = cache.match(keys(1, 2, 3), 2.0)
    assert (m.gpu_pages, m.host_pages) == (0, 3)
    fill(cache, keys(1, 2, 3, 4), 3.0)  # loads back 3 pages and computes 1
    assert cache.match(keys(1, 2, 3, 4), 4.0).gpu_pages == 4
    cache.check()


def test_host_eviction_is_lru_over_host_only_leaves() -> None:
    cache = RadixCache(gpu_pages=2, host_pages=4)
    for t, start in enumerate((10, 20, 30)):
        fill(cache, keys(start, start + 1), float(t))
    # Host holds 4 pages: the oldest host-only prefix (10, 11) was dropped for (30, 31).
    assert cache.match(keys(10, 11), 5.0).pages == 0
    assert cache.match(keys(20, 21), 5.0).host_pages == 2
    cache.check()


def test_insert_drops_duplicate_pages_computed_twice() -> None:
    cache = RadixCache(gpu_pages=20)
    seq = keys(1, 2, 3, 4)
    assert cache.allocate(4) and cache.allocate(4)  # two requests computed the same prompt
    cache.insert(seq, 0.0, 4)
    cache.insert(seq, 0.1, 4)
    assert cache.gpu_used == 4 and cache.in_flight == 0
    cache.check()


@pytest.mark.parametrize("host_pages", [0, 60])
def test_random_sessions_keep_accounting_invariants(host_pages: int) -> None:
    rng = random.Random(7)
    cache = RadixCache(gpu_pages=40, host_pages=host_pages)
    sessions: dict[int, list[int]] = {}
    next_page = 1000
    locked = []
    for step in range(3000):
        sid = rng.randrange(12)
        pages = sessions.setdefault(sid, [])
        grow = rng.randint(0, 4)
        pages.extend(range(next_page, next_page + grow))
        next_page += grow
        if not pages:
            continue
        seq = tuple(pages)
        now = float(step)
        match = cache.match(seq, now)
        cache.lock(match.node)
        need = len(seq) - match.gpu_pages
        if not cache.allocate(need):
            cache.unlock(match.node)
            cache.check()
            continue
        if match.host_pages:
            cache.load_back(match)
            need -= match.host_pages
        leaf = cache.insert(seq, now, need)
        cache.unlock(match.node)
        cache.lock(leaf)
        locked.append(leaf)
        if len(locked) > 3:  # a few requests hold their pages across steps (awaiting transfer)
            cache.unlock(locked.pop(0))
        cache.check()
        if rng.random() < 0.05:
            sessions[sid] = []  # the session ended; a new one starts under the same slot
    for leaf in locked:
        cache.unlock(leaf)
    cache.check()
    assert cache.locked_gpu == 0
