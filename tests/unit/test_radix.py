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


def test_with_state_slots_a_prefix_is_reusable_only_up_to_a_kept_snapshot() -> None:
    cache = RadixCache(gpu_pages=100, state_slots=8)
    fill(cache, keys(1, 2, 3, 4), 0.0)
    # The pages of (1, 2) are cached, but the state snapshot sits at the end of (1, 2, 3, 4).
    assert cache.match(keys(1, 2, 9), 1.0).pages == 0
    assert cache.match(keys(1, 2, 9), 1.0, reusable=False).pages == 2
    assert cache.match(keys(1, 2, 3, 4, 5), 2.0).gpu_pages == 4
    fill(cache, keys(1, 2, 3, 4, 5, 6), 3.0)
    assert cache.match(keys(1, 2, 3, 4, 5, 6, 7), 4.0).gpu_pages == 6
    assert cache.states_used == 2  # both prompt ends keep a snapshot while slots remain
    cache.check()


def test_the_least_recently_used_snapshot_gives_up_its_slot_but_not_its_pages() -> None:
    cache = RadixCache(gpu_pages=100, state_slots=2)
    fill(cache, keys(1, 2), 0.0)
    fill(cache, keys(3, 4), 1.0)
    cache.match(keys(1, 2, 5), 2.0)  # session 1 returns: its snapshot is now the most recent
    fill(cache, keys(6, 7), 3.0)  # a third prompt takes the slot of (3, 4)
    assert cache.states_used == 2
    assert cache.match(keys(3, 4, 8), 4.0).pages == 0
    assert cache.match(keys(3, 4, 8), 4.0, reusable=False).gpu_pages == 2  # the pages stay cached
    assert cache.match(keys(1, 2, 5), 4.0).gpu_pages == 2
    assert cache.match(keys(6, 7, 5), 4.0).gpu_pages == 2
    cache.check()


def test_a_sessions_older_snapshots_age_while_its_latest_is_used() -> None:
    cache = RadixCache(gpu_pages=100, state_slots=3)
    fill(cache, keys(1, 2), 0.0)
    fill(cache, keys(1, 2, 3, 4), 1.0)  # snapshots at (1, 2) and at (1, 2, 3, 4)
    fill(cache, keys(7, 8), 2.0)
    fill(cache, keys(1, 2, 3, 4, 5, 6), 3.0)  # matches through (1, 2) but uses only the deepest snapshot
    assert cache.match(keys(7, 8, 9), 4.0).gpu_pages == 2  # the other session keeps its snapshot
    assert cache.match(keys(1, 2, 9), 4.0).pages == 0  # the one given up was the session's oldest
    assert cache.match(keys(1, 2, 3, 4, 5, 6, 9), 4.0).gpu_pages == 6
    cache.check()


def test_a_locked_snapshot_keeps_its_slot_and_evicting_pages_frees_slots() -> None:
    cache = RadixCache(gpu_pages=4, state_slots=1)
    fill(cache, keys(1, 2), 0.0)
    held = cache.match(keys(1, 2, 3), 1.0)
    cache.lock(held.node)  # a request in flight uses the snapshot
    fill(cache, keys(5, 6), 2.0)  # no slot to take: this prompt is cached without a snapshot
    assert cache.match(keys(5, 6, 7), 3.0).pages == 0
    cache.unlock(held.node)
    fill(cache, keys(8, 9, 10, 11), 4.0)  # needs all four pages: (1, 2) and (5, 6) are evicted
    assert cache.states_used == 1 and cache.match(keys(8, 9, 10, 11), 5.0).gpu_pages == 4
    cache.check()


def test_random_workload_with_state_slots_keeps_accounting_consistent() -> None:
    rng = random.Random(3)
    cache = RadixCache(gpu_pages=60, host_pages=40, state_slots=5)
    sessions: list[list[int]] = [[s * 1000] for s in range(12)]
    for step in range(400):
        seq = sessions[rng.randrange(len(sessions))]
        seq.extend(seq[-1] + 1 for _ in range(rng.randint(1, 3)))
        if len(seq) > 20:
            del seq[1:]
        fill(cache, tuple(seq), float(step))
        assert cache.states_used <= 5
