"""The per-layer overlap (paper §6.6) on SGLang's real classes on CPU: the wait kernel (TRITON_INTERPRET)
launched from SGLang's attention call of a real `RadixAttention` layer over a real MHA pool with the
torch-native backend, only for batches that carry a fetching request; and a request admitted while its
unit arrives, through SGLang's match and `PrefillAdder`, settled after its batch: recomputed (fetched
pages never in the tree) when the fetch failed, its pages handed to SGLang's own release when it
completed. Stand-ins: the model runner fields the backend reads (`SimpleNamespace`), the scheduler
object, and SGLang's result processing (a function recording what it would process)."""

from __future__ import annotations

import threading
import time
from array import array
from types import SimpleNamespace

import pytest
import torch
from conftest import admission_pass

from basin_engine_ext import hooks, overlap
from basin_engine_ext.layer_wait import READY, LayerGroupFlags

pytestmark = pytest.mark.engine

LAYERS, GROUP, HEADS, DIM, PAGE = 4, 2, 2, 8, 4


@pytest.fixture(scope="module")
def overlap_hooks() -> None:
    """Place the overlap hooks on SGLang's classes as the plugin does with the setting on (they stay for
    the session, inert for requests and batches without a fetch)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks.register_overlap_hooks()
    HookRegistry.apply_hooks()


class Attention:
    """A real MHA pool, request rows, the torch-native attention backend and RadixAttention layers."""

    def __init__(self) -> None:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.pool = MHATokenToKVPool(
            size=128, page_size=PAGE, dtype=torch.float32, head_num=HEADS, head_dim=DIM, layer_num=LAYERS,
            device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        self.rows = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.rows, token_to_kv_pool=self.pool)
        self.backend = TorchNativeAttnBackend(runner)
        self.layers = [RadixAttention(HEADS, DIM, DIM**-0.5, HEADS, layer_id=i) for i in range(LAYERS)]

    def batch(self, rid: str, prefix: int, extend: int):
        """A one-request extend batch: prefix slots 4.., new tokens after them."""
        from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

        n = prefix + extend
        slots = torch.arange(PAGE, PAGE + n, dtype=torch.int32)
        self.rows.req_to_token[0, :n] = slots
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.zeros(extend, dtype=torch.int64),
            req_pool_indices=torch.tensor([0]), seq_lens=torch.tensor([n]),
            out_cache_loc=slots[prefix:].to(torch.int64), seq_lens_sum=n,
            extend_prefix_lens=torch.tensor([prefix]), extend_seq_lens=torch.tensor([extend]),
            rids=[rid],
        )  # fmt: skip

    def run(self, layer: int, fb, q, k, v):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        with forward_context(ForwardContext(attn_backend=self.backend), forward_batch=fb):
            return self.layers[layer](q, k, v, fb)


def prefix_kv(layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(layer)
    return torch.randn(n, HEADS, DIM, generator=g), torch.randn(n, HEADS, DIM, generator=g)


def test_attention_of_a_fetching_batch_waits_for_each_layer_group(overlap_hooks) -> None:
    """Layer k's attention starts only once group(k)'s flag is set by another thread, and then reads the
    prefix pages written just before: its output equals attention over the full prefix."""
    att, prefix, extend = Attention(), 8, 2
    fb = att.batch("fetching", prefix, extend)
    slots = torch.arange(PAGE, PAGE + prefix)
    flags = LayerGroupFlags(LAYERS, GROUP)
    published: dict[int, float] = {}

    def decode_writes() -> None:  # decode's WRITEs, one layer group at a time, each then flagged
        for g, layers in enumerate(flags.groups):
            time.sleep(0.5)
            for layer in layers:
                k, v = prefix_kv(layer, prefix)
                att.pool.k_buffer[layer][slots], att.pool.v_buffer[layer][slots] = k, v
            published[g] = time.monotonic()
            flags.mark(g, READY)

    q, k, v = (torch.randn(extend, HEADS * DIM) for _ in range(3))
    for layer in range(LAYERS):  # warm up (first calls compile and import), no fetch registered yet
        att.run(layer, fb, q, k, v)
    flags.wait_layer(0, max_spins=1)  # and the kernel (its status is overwritten by the real waits)
    overlap.register("fetching", flags)
    try:
        writer = threading.Thread(target=decode_writes)
        writer.start()
        outputs, done = [], []
        for layer in range(LAYERS):
            outputs.append(att.run(layer, fb, q, k, v))
            done.append(time.monotonic())
        writer.join(10)
    finally:
        overlap.unregister("fetching")
    for layer in range(LAYERS):
        assert done[layer] >= published[flags.group_of(layer)]  # never ahead of its group's flag
    assert done[1] < published[1]  # ...and not held for later groups: the transfer overlaps
    assert flags.all_seen_ready()
    # the same attention with the whole prefix in place from the start
    reference = Attention()
    ref_fb = reference.batch("plain", prefix, extend)
    for layer in range(LAYERS):
        pk, pv = prefix_kv(layer, prefix)
        reference.pool.k_buffer[layer][slots], reference.pool.v_buffer[layer][slots] = pk, pv
        assert torch.allclose(outputs[layer], reference.run(layer, ref_fb, q, k, v), atol=1e-5)


def test_a_batch_without_fetching_requests_launches_no_wait(overlap_hooks) -> None:
    att = Attention()
    flags = LayerGroupFlags(LAYERS, GROUP)
    for g in range(len(flags.groups)):
        flags.mark(g, READY)
    q, k, v = (torch.randn(2, HEADS * DIM) for _ in range(3))
    overlap.register("fetching", flags)
    try:
        for layer in range(LAYERS):
            att.run(layer, att.batch("plain", 4, 2), q, k, v)
        assert flags.status.tolist() == [0, 0]  # the kernel writes what it saw: it never ran
        att.run(2, att.batch("fetching", 4, 2), q, k, v)
        assert flags.status.tolist() == [0, READY]  # launched for the fetching batch, on layer 2's group
    finally:
        overlap.unregister("fetching")
    assert overlap.active() == {}


# ---------------------------------------------------------------------- admission and settlement
def overlap_prefill(decode, timeout_s: float):
    from test_prefill_fetch import Prefill

    prefill = Prefill(decode, timeout_s=timeout_s)
    prefill.fetcher.overlap = True
    return prefill


def allocate_extend(prefill, req) -> torch.Tensor:
    """What SGLang's `alloc_for_extend` does for an admitted request: a row holding its prefix (read with
    `prefix_device_indices`, hooked) and new slots for the rest."""
    kv = prefill.kv
    prefix = kv.tree.prefix_device_indices(req)
    n = len(req.origin_input_ids)
    kv.req_to_token.alloc([req])
    new = kv.allocator.alloc(-(-(n - len(prefix)) // PAGE) * PAGE)
    row = torch.cat([prefix.to(torch.int64), new[: n - len(prefix)].to(torch.int64)])
    kv.req_to_token.write((req.kv.req_pool_idx, slice(0, n)), row.to(torch.int32))
    req.kv.kv_committed_len = req.kv.kv_allocated_len = n
    return prefix


def test_a_fetch_failing_mid_forward_sends_the_request_to_recompute(overlap_hooks, stalled_decode) -> None:
    from test_prefill_fetch import LOCAL, MARK, prefill_request
    from unit_peer import PROMPT

    prefill = overlap_prefill(stalled_decode, timeout_s=1.0)
    try:
        prefill.previous_turn_sent(PROMPT)
        nxt = prefill_request("turn-2", [*PROMPT, 1, 2, 3], MARK)
        other = prefill_request("other", [5, 6, 7, 8, 9, 10, 11, 12, 13])
        prefill.scheduler.waiting_queue = [nxt, other]
        admitted = hooks.admit_with_unit_fetch(admission_pass, prefill.scheduler, None)
        # admitted at once, with the unit's pages as prefix: only the three new tokens to compute
        assert admitted == [nxt, other] and nxt.prefix_len == len(PROMPT) and nxt.extend_len == 3
        assert nxt.kv.cache_protected_len == LOCAL  # the fetched pages are the request's, not the tree's
        fetch = prefill.fetcher.fetching["turn-2"].fetch
        fetched = fetch.dst_slots.clone()
        prefix = allocate_extend(prefill, nxt)
        allocate_extend(prefill, other)
        assert torch.equal(prefix[:LOCAL], prefill.local) and torch.equal(prefix[LOCAL:], fetched)
        assert set(overlap.active()) == {"turn-2"}
        for layer in range(6):  # the forward: the stalled decode never writes; the monitor fails it
            fetch.flags.wait_layer(layer)
        processed = []
        batch = SimpleNamespace(reqs=[nxt, other])
        result = SimpleNamespace(next_token_ids=torch.tensor([101, 202]), copy_done=None)

        def sglang_result_processing(scheduler, batch, result):
            processed.append((list(batch.reqs), result.next_token_ids.tolist()))

        hooks.settle_fetched_batch(sglang_result_processing, prefill.scheduler, batch, result)
        assert processed == [([other], [202])]  # no token, checkpoint or send for the failed request
        assert batch.reqs == [nxt, other] and overlap.active() == {}
        assert prefill.scheduler.waiting_queue[0] is nxt and not nxt.kv.holds_kv
        assert prefill.fetcher.outcomes[-1] == ("turn-2", "timeout", 0)
        # the fetched pages never became reusable prefix: the tree still matches the local part only
        probe = prefill_request("probe", [*PROMPT, 9], MARK)
        probe.init_next_round_input(prefill.kv.tree)
        assert probe.prefix_len == LOCAL
        # ...and stay out of the free list for the grace period, then go back
        assert prefill.fetcher.inflight_tokens() == len(PROMPT) - LOCAL
        free = (
            set(prefill.kv.allocator.free_pages.tolist())
            if hasattr(prefill.kv.allocator, "free_pages")
            else set()
        )
        assert not free & {int(s) // PAGE for s in fetched}
        # recomputed from the local match in the next pass, without a second fetch
        prefill.scheduler.waiting_queue = [nxt]
        assert hooks.admit_with_unit_fetch(admission_pass, prefill.scheduler, None) == [nxt]
        assert nxt.prefix_len == LOCAL and nxt.extend_len == len(PROMPT) + 3 - LOCAL
        assert prefill.fetcher.fetching == {}
    finally:
        prefill.close()


def test_a_completed_fetch_leaves_its_pages_to_sglangs_own_release(overlap_hooks, serving_decode) -> None:
    """The request ran with the fetched pages; after its batch SGLang's release (with checkpoint) puts
    the whole prompt in the tree with exactly those pages."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH
    from sglang.srt.mem_cache.common import release_kv_cache
    from test_prefill_fetch import MARK, prefill_request
    from unit_peer import PROMPT

    prefill = overlap_prefill(serving_decode, timeout_s=20)
    try:
        prefill.previous_turn_sent(PROMPT)
        nxt = prefill_request("turn-2", [*PROMPT, 1, 2, 3], MARK)
        prefill.scheduler.waiting_queue = [nxt]
        assert hooks.admit_with_unit_fetch(admission_pass, prefill.scheduler, None) == [nxt]
        fetch = prefill.fetcher.fetching["turn-2"].fetch
        prefix = allocate_extend(prefill, nxt)
        for layer in range(6):
            fetch.flags.wait_layer(layer)
        processed = []
        hooks.settle_fetched_batch(
            lambda s, b, r: processed.append(list(b.reqs)), prefill.scheduler,
            SimpleNamespace(reqs=[nxt]), SimpleNamespace(next_token_ids=torch.tensor([7]), copy_done=None),
        )  # fmt: skip
        assert processed == [[nxt]] and prefill.fetcher.outcomes[-1] == ("turn-2", "complete", 36)
        assert prefill.fetcher.inflight_tokens() == 0
        nxt.output_ids = array("q", [7])
        nxt.finished_reason = FINISH_LENGTH(1)
        release_kv_cache(nxt, prefill.kv.tree, checkpoint=True)
        probe = prefill_request("probe", [*PROMPT, 9], MARK)
        probe.init_next_round_input(prefill.kv.tree)
        assert probe.prefix_len == len(PROMPT)
        assert torch.equal(prefill.kv.tree.prefix_device_indices(probe), prefix.to(torch.int64))
        assert prefill.conserved()
    finally:
        prefill.close()
