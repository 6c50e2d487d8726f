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

    return tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)))).device_prefix_len


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


def prefill_request(kv, rid: str, prompt: list[int]):
    """A prefill request whose whole prompt has been computed into real slots, before decode reserved."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", prompt),
              sampling_params=SamplingParams(max_new_tokens=1))  # fmt: skip
    kv.req_to_token.alloc([req])
    slots = kv.allocator.alloc(-(-len(prompt) // kv.page) * kv.page)
    kv.req_to_token.write((req.kv.req_pool_idx, slice(0, len(prompt))), slots[: len(prompt)])
    req.kv.kv_committed_len = req.kv.kv_allocated_len = len(prompt)
    req.full_untruncated_fill_ids = array("q", prompt)  # set by SGLang's admission (init_next_round_input)
    req.extend_end = len(prompt)
    req.pending_bootstrap = True  # prefill_complete: decode reserves only after this prefill
    return req


def test_write_through_prefill_keeps_the_request_kv_until_the_transfer_succeeds(plugin_loaded) -> None:
    """The path the plugin's validator admits for L2 write-through, run on SGLang's own code: while decode
    has not reserved, the KV is the request's alone (not in the tree, so neither evictable nor shared nor
    backed up); once decode has reserved it is published under the request's lock right before the send;
    only the transfer's success makes it evictable."""
    from types import SimpleNamespace

    from conftest import DecodeKV
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin as Mixin
    from sglang.srt.disaggregation.prefill import _uses_write_through_cache
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.common import release_kv_cache

    kv = DecodeKV(radix=True)  # the enabled UnifiedRadixCache a prefill instance builds
    # HiCache's controller registers pinned host memory through CUDA; on CPU only its policy is set
    kv.tree.cache_controller = SimpleNamespace(write_policy="write_through", pp_prefetch_command_group=None)
    assert _uses_write_through_cache(kv.tree)
    scheduler = SimpleNamespace(tree_cache=kv.tree)
    prompt = list(range(200, 210))
    req = prefill_request(kv, "p1", prompt)
    free_before = kv.allocator.available_size()

    Mixin.checkpoint_disagg_prefill(scheduler, req)  # the last chunk's result, decode not reserved
    kv.tree.evict(EvictParams(num_tokens=kv.allocator.size))
    assert tree_holds(kv.tree, prompt) == 0 and kv.tree.evictable_size() == 0
    assert kv.allocator.available_size() == free_before  # nothing freed, nothing evicted

    req.pending_bootstrap = False  # finalize_bootstrap: decode has sent its destination
    Mixin.checkpoint_disagg_prefill(scheduler, req)  # handle_pending_bootstrap, right before the send
    kv.tree.evict(EvictParams(num_tokens=kv.allocator.size))
    assert tree_holds(kv.tree, prompt) == 8  # the whole pages, published
    assert kv.tree.protected_size() == 8 and kv.tree.evictable_size() == 0  # locked during the send
    assert kv.allocator.available_size() == free_before

    req.finished_reason = FINISH_LENGTH(length=0)  # the transfer succeeded
    release_kv_cache(req, kv.tree, checkpoint=True)
    assert kv.tree.protected_size() == 0 and kv.tree.evictable_size() == 8
    kv.tree.evict(EvictParams(num_tokens=kv.allocator.size))
    assert kv.allocator.available_size() == kv.allocator.size
