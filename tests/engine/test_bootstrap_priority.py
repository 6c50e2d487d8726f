"""Priority in SGLang's prefill bootstrap queue: the real `PrefillBootstrapQueue.pop_bootstrapped`,
real requests with SGLang's fake-backend KV senders, a real metadata-buffer allocator that runs out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.engine


def make_queue(priorities: list[int | None], buffers: int, low_values_first: bool):
    from sglang.srt.disaggregation.fake.conn import FakeKVSender
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    queue = object.__new__(PrefillBootstrapQueue)  # SGLang's class; its constructor needs a KV manager
    queue.queue = []
    queue.pp_size = 1
    queue.scheduler_stage_metrics = None
    queue.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(buffers)
    queue.scheduler = SimpleNamespace(
        attn_cp_cpu_group=None,
        attn_tp_cpu_group=None,
        processed_tokens_counter=0,
        schedule_low_priority_values_first=low_values_first,
        token_to_kv_pool_allocator=SimpleNamespace(page_size=1),
    )
    for i, p in enumerate(priorities):
        req = Req(
            rid=f"r{i}",
            origin_input_text="",
            origin_input_ids=[1, 2, 3],
            sampling_params=SamplingParams(max_new_tokens=1),
            priority=p,
        )
        req.disagg_kv_sender = FakeKVSender(mgr=None, bootstrap_addr="fake:0", bootstrap_room=i)
        req.pending_bootstrap = True
        queue.queue.append(req)
    return queue


def test_sglang_alone_pops_the_bootstrap_queue_fifo(single_rank_group, plugin_loaded) -> None:
    """The fact the hook changes: with two metadata buffers, SGLang serves arrival order."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    queue = make_queue([5, 1, 3, 0], buffers=2, low_values_first=True)
    popped = PrefillBootstrapQueue.pop_bootstrapped.__wrapped__(queue)
    assert [r.rid for r in popped] == ["r0", "r1"]


def test_with_the_plugin_the_highest_priorities_take_the_buffers_first(
    single_rank_group, plugin_loaded
) -> None:
    queue = make_queue([5, 1, 3, 0], buffers=2, low_values_first=True)
    popped = queue.pop_bootstrapped()
    assert [r.rid for r in popped] == ["r3", "r1"]
    assert [r.rid for r in queue.queue] == ["r2", "r0"]  # still waiting, in priority order


def test_high_values_first_when_sglang_is_configured_so(single_rank_group, plugin_loaded) -> None:
    queue = make_queue([5, 1, None, 9], buffers=3, low_values_first=False)
    popped = queue.pop_bootstrapped()
    assert [r.rid for r in popped] == ["r3", "r0", "r1"]  # unprioritised requests keep FIFO, last


def test_equal_priorities_keep_arrival_order(single_rank_group, plugin_loaded) -> None:
    queue = make_queue([2, 2, 1, 2], buffers=4, low_values_first=True)
    assert [r.rid for r in queue.pop_bootstrapped()] == ["r2", "r0", "r1", "r3"]
