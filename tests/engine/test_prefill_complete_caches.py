"""Reservation at prefill completion with a decode radix cache and with write-through HiCache on
prefill: SGLang's real validator, release path, `UnifiedRadixCache` and prefill checkpoint method."""

from __future__ import annotations

from array import array

import pytest

from basin_engine_ext import hooks

pytestmark = pytest.mark.engine

MARK = {"basin_lend": True, "basin_session": "s1"}


def tree_holds(tree, tokens: list[int]) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).device_prefix_len


@pytest.mark.parametrize("checkpoint", [False, True])
def test_with_a_decode_radix_tree_the_finished_prompt_has_one_owner(plugin_loaded, checkpoint) -> None:
    """SGLang's release inserts a decode request's KV into an enabled decode tree: a unit over the same
    pages would give them two owners (the tree evicts and reuses what the unit still lends)."""
    from conftest import DecodeKV
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.common import release_kv_cache

    kv = DecodeKV(radix=True)
    lender = hooks.make_lender(kv.allocator)
    prompt = list(range(100, 110))
    req = kv.finished_request("r1", prompt, outputs=4, custom_params=MARK)
    req.origin_input_ids = array("q", prompt)  # what an enabled tree's keys must be
    req.output_ids = array("q", req.output_ids)
    release_kv_cache(req, kv.tree, checkpoint=checkpoint)

    assert len(lender.store) == 0  # the tree, not a unit, keeps the prompt
    kv.tree.evict(EvictParams(num_tokens=kv.allocator.size))
    # every slot is back exactly once: free list plus lent plus tree == pool
    assert kv.allocator.available_size() + lender.store.lent + kv.tree.evictable_size() == kv.allocator.size
