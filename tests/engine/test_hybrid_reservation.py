"""Reservation at prefill completion for hybrid (Mamba / gated-delta) models, on SGLang's real classes on
CPU: the KV manager constructor hook, SGLang's prefill result processing, inflight queue, bootstrap
finalisation, checkpoint, last-chunk send (its state payload) and release over a `HybridReqToTokenPool`,
`MambaPool`, `HybridLinearKVPool` and the enabled `UnifiedRadixCache` with the MAMBA component a
prefill instance builds; and SGLang's decode prealloc queue over the hybrid decode pools.

Stand-ins, where SGLang needs a GPU, a model or a peer: the model forward (the test writes the prompt-end
state into the request's slot), the KV sender (`ScriptedSender`: it reports the poll states a NIXL
sender would and records what SGLang hands it to send, reading the state bytes at that moment), the
batch result (`next_token_ids` only), the scheduler object (a bare subclass of SGLang's prefill mixin
holding the attributes the methods read), output streaming and metrics (no-ops), the decode receiver
(records the destination SGLang sends), and for the KV manager constructor the bootstrap server and
NIXL's VRAM registration (the CPU has only DRAM), in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from array import array
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.engine

HERE = Path(__file__).parent
SGLANG_RULE = "prefill_complete currently supports full-attention and DSA KV pools only"


# ------------------------------------------------------------------------------------------- prefill
class HybridPrefillKV:
    """A hybrid prefill instance's real SGLang memory: `HybridReqToTokenPool` with `slots_per_row`
    Mamba slots per request row (SGLang sizes a tree-backed hybrid pool at three per running request),
    the `HybridLinearKVPool` over it, a page-1 allocator (SGLang's MAMBA component without the extra
    buffer needs page 1) and the `UnifiedRadixCache` with FULL and MAMBA components (enabled, as by
    default, or disabled by --disable-radix-cache, where SGLang sizes one slot per request)."""

    def __init__(self, rows: int = 2, slots_per_row: int = 3, tokens: int = 256, radix: bool = True) -> None:
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        args = ServerArgs(
            model_path="dummy", page_size=1, disaggregation_mode="prefill",
            disaggregation_transfer_backend="nixl",
            disaggregation_decode_allocation_policy="prefill_complete",
        )  # fmt: skip
        args._mamba_cache_chunk_size = 64  # FLA's chunk size (SGLang reads it from the model config)
        set_global_server_args_for_scheduler(args)
        linear_layers = [0, 1, 3]
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2, head_dim=8, state_size=4,
            conv_kernel=4,
        )  # fmt: skip
        self.req_to_token = HybridReqToTokenPool(
            size=rows, mamba_size=rows * slots_per_row, mamba_spec_state_size=rows, max_context_len=512,
            device="cpu", enable_memory_saver=False,
            cache_params=Mamba2CacheParams(shape=shape, layers=linear_layers), mamba_layer_ids=linear_layers,
            enable_mamba_extra_buffer=False, enable_overlap_schedule=False,
        )  # fmt: skip
        self.mamba = self.req_to_token.mamba_pool
        self.slots = self.req_to_token.mamba_allocator
        self.pool = HybridLinearKVPool(
            size=tokens, dtype=torch.float16, page_size=1, head_num=2, head_dim=8,
            full_attention_layer_ids=[2], device="cpu", mamba_pool=self.mamba,
        )  # fmt: skip
        self.allocator = PagedTokenToKVPoolAllocator(
            size=tokens, page_size=1, dtype=torch.float16, device="cpu", kvcache=self.pool, need_sort=False
        )
        self.tree = UnifiedRadixCache(
            CacheInitParams(
                disable=not radix, req_to_token_pool=self.req_to_token,
                token_to_kv_pool_allocator=self.allocator,
                page_size=1, tree_components=(ComponentType.FULL, ComponentType.MAMBA),
            )
        )  # fmt: skip

    def state(self, slot) -> list[torch.Tensor]:
        cache = self.mamba.mamba_cache
        idx = int(slot)
        return [c[:, idx].clone() for c in cache.conv] + [cache.temporal[:, idx].clone()]

    def forward(self, req, seed: int) -> list[torch.Tensor]:
        """The model forward over the whole prompt: KV written (slots taken), the request's slot left
        holding the prompt-end state, which is returned."""
        gen = torch.Generator().manual_seed(seed)
        cache = self.mamba.mamba_cache
        idx = int(req.kv.mamba_pool_idx)
        for c in cache.conv:
            c[:, idx] = torch.randn(c[:, idx].shape, generator=gen).to(c.dtype)
        cache.temporal[:, idx] = torch.randn(cache.temporal[:, idx].shape, generator=gen).to(
            cache.temporal.dtype
        )
        return self.state(idx)

    def request(self, rid: str, prompt: list[int], seed: int):
        """A request SGLang admitted and ran whole (prefill_complete prefills before bootstrap)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", prompt),
                  sampling_params=SamplingParams(max_new_tokens=1))  # fmt: skip
        match = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt))))
        assert match.device_prefix_len == 0  # a fresh prompt
        req.last_node = match.last_device_node
        self.req_to_token.alloc([req])  # the request row and its Mamba slot
        slots = self.allocator.alloc(len(prompt))
        self.req_to_token.write((req.kv.req_pool_idx, slice(0, len(prompt))), slots)
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(prompt)
        req.full_untruncated_fill_ids = array("q", prompt)
        req.extend_end = len(prompt)
        req.pending_bootstrap = True  # set by create_sender; decode has not reserved
        req.metadata_buffer_index = -1
        return req, self.forward(req, seed)

    def used_slots(self) -> int:
        return self.slots.size - self.slots.available_size()


class ScriptedSender:
    """Stand-in for the NIXL KV sender: reports `state` when polled; records each send with the Mamba
    state bytes at the slot SGLang names in the payload, read when SGLang hands it over."""

    def __init__(self, kv: HybridPrefillKV, state) -> None:
        self.kv = kv
        self.state = state
        self.sends: list[dict] = []
        self.completed = 0
        self.supports_host_tensor_indices = False

    def poll(self):
        return self.state

    def mark_prefill_complete(self) -> None:
        self.completed += 1

    def pop_decode_prefix_len(self) -> int:
        return 0

    def init(self, num_pages: int, metadata_buffer_index: int) -> None:
        self.num_pages = num_pages

    def get_max_transfer_tokens(self):
        return None

    def should_send_kv_chunk(self, num_pages: int, is_last: bool) -> bool:
        return True

    def send(self, page_indices, state_indices=None, num_kv_tokens: int = 0, **kwargs) -> None:
        slot = None if state_indices is None else int(state_indices[0][0])
        state = None if slot is None else self.kv.state(slot)
        self.sends.append({"pages": len(page_indices), "slot": slot, "state": state})

    def failure_exception(self):
        raise RuntimeError("bootstrap timed out")

    def abort(self) -> None:
        pass

    def clear(self) -> None:
        pass

    def get_transfer_metric(self):
        from sglang.srt.disaggregation.base.conn import KVTransferMetric

        return KVTransferMetric()


def prefill_scheduler(kv: HybridPrefillKV):
    """SGLang's prefill scheduler methods (the mixin) over the real pools; attributes they read."""
    from sglang.srt.disaggregation.common.conn import StateType
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    class Scheduler(SchedulerDisaggregationPrefillMixin):
        pass

    s = Scheduler()
    s.tree_cache = kv.tree
    s.req_to_token_pool = kv.req_to_token
    s.token_to_kv_pool_allocator = kv.allocator
    s.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(4)
    s.disagg_prefill_inflight_queue = []
    s.disagg_prefill_pending_chunk_rids = set()
    s.attn_cp_cpu_group = s.attn_tp_cpu_group = None
    s.scheduler_stage_metrics = None
    s.kv_checksum_computer = None
    s.enable_staging = False
    s.enable_overlap = False
    s.spec_algorithm = SpeculativeAlgorithm.NONE
    s.disagg_metadata_buffers = SimpleNamespace(set_buf=lambda req: None)
    s.output_streamer = SimpleNamespace(stream_output=lambda *a, **k: None)
    s.metrics_reporter = SimpleNamespace(enable_metrics=False, report_prefill_stats=lambda **k: None)
    s.maybe_send_health_check_signal = lambda: None
    s.batch_result_processor = SimpleNamespace(
        snapshot_auxiliary_output_starts=lambda batch, result: None,
        move_logprobs_to_cpu=lambda **k: None,
    )
    queue = object.__new__(PrefillBootstrapQueue)  # SGLang's class; its constructor builds a KV manager
    queue.scheduler = s
    queue.req_to_metadata_buffer_idx_allocator = s.req_to_metadata_buffer_idx_allocator
    queue.kv_manager = SimpleNamespace(kv_args=SimpleNamespace(state_types=[StateType.MAMBA]))
    s.disagg_prefill_bootstrap_queue = queue
    return s


def last_chunk_result(s, reqs: list) -> None:
    """SGLang's processing of the batch whose forward ran the requests' last (only) chunk."""
    batch = SimpleNamespace(reqs=reqs, spec_info=None, prefill_stats=None, dp_cooperation_info=None)
    result = SimpleNamespace(
        logits_output=None, next_token_ids=torch.tensor([7] * len(reqs)), extend_input_len_per_req=None,
        extend_logprob_start_len_per_req=None, copy_done=None, auxiliary_host_output=None,
        routed_experts_output=None, indexer_topk_output=None, next_draft_input=None, can_run_cuda_graph=False,
    )  # fmt: skip
    for req in reqs:  # pop_bootstrapped reserved a metadata buffer before admission
        req.metadata_buffer_index = s.req_to_metadata_buffer_idx_allocator.alloc()
    s.process_batch_result_disagg_prefill(batch, result)


def tree_len(kv, prompt: list[int]) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return kv.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt)))).device_prefix_len


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def drain(kv) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    kv.tree.evict(EvictParams(num_tokens=kv.allocator.size, mamba_num=kv.slots.size))


@pytest.fixture
def prefill_kv(plugin_loaded) -> HybridPrefillKV:
    return HybridPrefillKV()


@pytest.mark.parametrize("radix", [True, False], ids=["tree", "no-tree"])
def test_parked_hybrid_request_sends_its_prompt_end_state_once_decode_reserves(
    single_rank_group, plugin_loaded, radix
) -> None:
    """Two requests prefilled before decode reserved: nothing is sent, each keeps its row, pages and
    Mamba slot (its state untouched; an enabled tree holds a locked copy) while parked; when decode's
    destination arrives SGLang checkpoints again and sends, and the state payload is the request's own
    slot holding the prompt-end state; at transfer success the release leaves one state per prompt in
    an enabled tree, frees the rest, and every slot is accounted for."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv = HybridPrefillKV(slots_per_row=3 if radix else 1, radix=radix)
    tree_states = 2 if radix else 0  # an enabled tree keeps a state per prompt
    s = prefill_scheduler(kv)
    prompts = [list(range(100, 110)), list(range(200, 213))]
    reqs, states = [], []
    for i, prompt in enumerate(prompts):
        req, state = kv.request(f"p{i}", prompt, seed=i)
        req.disagg_kv_sender = ScriptedSender(kv, KVPoll.Bootstrapping)
        reqs.append(req)
        states.append(state)
    own = [int(r.kv.mamba_pool_idx) for r in reqs]

    last_chunk_result(s, reqs)
    assert s.disagg_prefill_inflight_queue == reqs
    for req, state, slot, prompt in zip(reqs, states, own, prompts, strict=True):
        assert req.disagg_kv_sender.completed == 1  # decode told prefill is complete
        assert req.disagg_kv_sender.sends == []  # decode has not reserved: nothing sent
        assert int(req.kv.mamba_pool_idx) == slot and same(kv.state(slot), state)
        assert tree_len(kv, prompt) == (len(prompt) if radix else 0)  # the checkpoint's copy
    assert kv.used_slots() == 2 + tree_states  # each request's own slot (and the tree's locked copy)

    for _ in range(3):  # parked across scheduler iterations, under eviction pressure
        assert s.process_disagg_prefill_inflight_queue() == []
        drain(kv)
    assert kv.used_slots() == 2 + tree_states
    for req, state, slot in zip(reqs, states, own, strict=True):
        assert req.pending_bootstrap and same(kv.state(slot), state)

    for req in reqs:
        req.disagg_kv_sender.state = KVPoll.WaitingForInput  # decode reserved and sent its destination
    assert s.process_disagg_prefill_inflight_queue() == []
    for req, state, slot in zip(reqs, states, own, strict=True):
        (send,) = req.disagg_kv_sender.sends
        assert send["slot"] == slot and same(send["state"], state)  # the payload: the prompt-end state
        assert not req.pending_bootstrap
    assert kv.used_slots() == 2 + tree_states  # a second copy was not kept (the tree has the state)

    for req in reqs:
        req.disagg_kv_sender.state = KVPoll.Success
    assert s.process_disagg_prefill_inflight_queue() == reqs
    for req in reqs:
        assert req.kv.mamba_pool_idx is None and req.kv.is_kv_released
    assert kv.used_slots() == tree_states  # the tree's states, now unlocked
    drain(kv)
    assert kv.used_slots() == 0 and kv.allocator.available_size() == kv.allocator.size


def test_a_bootstrap_failure_while_parked_frees_the_hybrid_request(single_rank_group, prefill_kv) -> None:
    """Decode never reserves: the deferred bootstrap times out (the sender reports Failed) and SGLang's
    failure path releases the request without a checkpoint, freeing its own slot and unlocking the
    tree's copy."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.runtime_context import get_parallel

    kv = prefill_kv
    s = prefill_scheduler(kv)
    prompt = list(range(300, 311))
    req, _ = kv.request("p0", prompt, seed=5)
    req.disagg_kv_sender = ScriptedSender(kv, KVPoll.Bootstrapping)
    last_chunk_result(s, [req])
    assert kv.used_slots() == 2
    assert s.process_disagg_prefill_inflight_queue() == []

    req.disagg_kv_sender.state = KVPoll.Failed
    with get_parallel().override(tp_rank=0):  # named in SGLang's failure message
        assert s.process_disagg_prefill_inflight_queue() == []  # dropped, not sent
    assert s.disagg_prefill_inflight_queue == []
    assert req.disagg_kv_sender.sends == []
    assert req.kv.mamba_pool_idx is None and req.kv.is_kv_released
    assert s.req_to_metadata_buffer_idx_allocator.available_size() == 4
    assert kv.used_slots() == 1  # only the tree's copy, evictable
    drain(kv)
    assert kv.used_slots() == 0 and kv.allocator.available_size() == kv.allocator.size


# ------------------------------------------------------------------------------------ the KV manager
def build_managers(*cases: str, plugin: bool = True) -> list[dict]:
    """SGLang's NIXL KV manager built for each case in a fresh interpreter (hybrid_kv_manager.py)."""
    from conftest import checkout_env

    argv = [sys.executable, str(HERE / "hybrid_kv_manager.py"), *(["plugin"] if plugin else []), *cases]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=checkout_env())
    results = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(results) == len(cases), done.stderr[-3000:]
    return results


CASES = ("decode", "prefill", "prefill+hicache", "prefill+extra_buffer", "prefill+int8", "decode+radix",
         "decode+common")  # fmt: skip


@pytest.fixture(scope="module")
def managers() -> dict[str, dict]:
    return dict(zip(CASES, build_managers(*CASES), strict=True))


def test_sglang_alone_refuses_a_hybrid_kv_manager_under_prefill_complete() -> None:
    (decode,) = build_managers("decode", plugin=False)
    assert decode["state_types"] == ["mamba"]  # what SGLang's setup_state_kv_args gives hybrid pools
    assert not decode["built"] and decode["error"] == SGLANG_RULE


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_plugin_builds_the_nixl_manager_with_deferral_and_mamba_state(managers, role) -> None:
    got = managers[role]
    assert got["built"], got["error"]
    assert got["defer"]  # prefill_complete's deferral is on
    assert got["manager_state_types"] == ["mamba"]  # the state is still transferred
    assert got["mamba_registered"]  # NIXL registered the Mamba state buffers
    # prefill: SGLang's deferred-bootstrap table, and NIXL's socket consuming its messages (the plugin)
    assert got["deferred_bootstrap"] == got["socket_consumes_deferral"] == (role == "prefill")


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("prefill+hicache", "with HiCache on prefill"),
        ("prefill+extra_buffer", "with the Mamba extra buffer"),
        ("prefill+int8", "with int8 Mamba checkpoints"),
        ("decode+radix", "with the decode radix cache"),
    ],
)
def test_untraced_hybrid_configurations_stay_refused_with_the_reason(managers, case, why) -> None:
    got = managers[case]
    assert not got["built"]
    assert got["error"].startswith(SGLANG_RULE)
    assert why in got["error"]
    if case == "prefill+extra_buffer":
        assert got["extra_buffer"]  # SGLang derived the extra buffer from the strategy


def test_managers_of_other_backends_keep_sglang_rule(managers) -> None:
    got = managers["decode+common"]
    assert not got["built"] and got["error"] == SGLANG_RULE


def test_hybrid_state_beside_other_state_types_stays_refused(plugin_loaded) -> None:
    from sglang.srt.disaggregation.common.conn import StateType
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from basin_engine_ext.reservation import hybrid_refusal

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", disaggregation_mode="decode"))
    assert hybrid_refusal([StateType.MAMBA], DisaggregationMode.DECODE) is None
    why = hybrid_refusal([StateType.MAMBA, StateType.SWA], DisaggregationMode.DECODE)
    assert why is not None and "other state types" in why


# -------------------------------------------------------------------------------------------- decode
class ScriptedReceiver:
    """Stand-in for the NIXL KV receiver: reports `state` when polled (Bootstrapping until prefill has
    reported completion under prefill_complete); records the destination SGLang sends to prefill."""

    def __init__(self, state) -> None:
        self.state = state
        self.metadata: list[dict] = []
        self.require_staging = False

    def poll(self):
        return self.state

    def send_metadata(self, page_indices, metadata_buffer_index, state_indices=None, **kwargs) -> None:
        self.metadata.append({"pages": list(page_indices), "state": state_indices, **kwargs})

    def failure_exception(self):
        raise RuntimeError("bootstrap timed out")

    def clear(self) -> None:
        pass


def prealloc_queue(kv):
    """SGLang's decode prealloc queue (its constructor builds a KV manager) over the real hybrid pools."""
    from sglang.srt.disaggregation.common.conn import StateType
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator

    q = object.__new__(DecodePreallocQueue)
    q.req_to_token_pool = kv.req_to_token
    q.token_to_kv_pool_allocator = kv.allocator
    q.token_to_kv_pool = kv.pool
    q.tree_cache = kv.tree
    q.queue = []
    q.pending_reqs = []
    q.retracted_queue = []
    q._prefill_dp_rank_queries = {}
    q._num_published_destinations = 0
    q.pp_size = 1
    q.gloo_group = None
    q.num_reserved_decode_tokens = 8
    q.scheduler_stage_metrics = None
    q.req_to_metadata_buffer_idx_allocator = ReqToMetadataIdxAllocator(4)
    q.kv_manager = SimpleNamespace(kv_args=SimpleNamespace(state_types=[StateType.MAMBA]))
    q.transfer_queue = SimpleNamespace(queue=[], enable_staging=False)
    q.scheduler = SimpleNamespace(
        running_batch=SimpleNamespace(reqs=[]), waiting_queue=[], last_batch=None, enable_hisparse=False,
        enable_priority_scheduling=False, enable_lora=False, enable_decode_hicache=False,
        output_streamer=SimpleNamespace(stream_output=lambda *a, **k: None),
        metrics_reporter=SimpleNamespace(enable_metrics=False),
    )  # fmt: skip
    return q


@pytest.fixture
def decode_kv_hybrid(plugin_loaded):
    from conftest import HybridDecodeKV
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    kv = HybridDecodeKV(requests=2)
    args = ServerArgs(
        model_path="dummy", page_size=4, disaggregation_mode="decode",
        disaggregation_transfer_backend="nixl", disaggregation_decode_allocation_policy="prefill_complete",
    )  # fmt: skip
    args._mamba_cache_chunk_size = 64
    set_global_server_args_for_scheduler(args)
    return kv


def decode_request(rid: str, prompt: list[int], state):
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid=rid, origin_input_text="", origin_input_ids=array("q", prompt),
              sampling_params=SamplingParams(max_new_tokens=8))  # fmt: skip
    return DecodeRequest(req=req, kv_receiver=ScriptedReceiver(state))


def test_decode_reserves_a_hybrid_request_only_when_prefill_completes_and_a_slot_is_free(
    single_rank_group, decode_kv_hybrid
) -> None:
    """SGLang's real `pop_preallocated` under prefill_complete: while prefill computes, the request holds
    no row, page or Mamba slot; when prefill reports completion it is admitted only if
    `ensure_mamba_capacity` finds a slot; then row, pages and slot are taken together and the slot's
    index goes to prefill as the MAMBA destination."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    kv = decode_kv_hybrid
    q = prealloc_queue(kv)
    slots = kv.req_to_token.mamba_allocator
    free_slots, free_pages, free_rows = slots.available_size(), kv.allocator.available_size(), 2
    dreq = decode_request("d0", list(range(10)), KVPoll.Bootstrapping)
    q.queue = [dreq]

    assert q.pop_preallocated() == ([], [])  # prefill still computing: nothing reserved
    assert not dreq.waiting_for_input and not dreq.req.kv.holds_mamba
    assert slots.available_size() == free_slots and kv.allocator.available_size() == free_pages
    assert kv.req_to_token.available_size() == free_rows

    running = slots.alloc(free_slots)  # running requests hold every Mamba slot
    dreq.kv_receiver.state = KVPoll.WaitingForInput  # prefill reported completion
    assert q.pop_preallocated() == ([], [])  # ensure_mamba_capacity refuses: no slot
    assert dreq.waiting_for_input and q.queue == [dreq] and dreq.kv_receiver.metadata == []
    assert kv.req_to_token.available_size() == free_rows and kv.allocator.available_size() == free_pages

    slots.free(running[:1])  # one running request finished
    popped, failed = q.pop_preallocated()
    assert popped == [dreq] and failed == []
    (sent,) = dreq.kv_receiver.metadata
    slot = int(dreq.req.kv.mamba_pool_idx)
    assert [int(x) for x in sent["state"][0]] == [slot]  # the MAMBA destination: the request's slot
    assert sent["decode_prefix_len"] == 0 and len(sent["pages"]) == 3  # ten tokens: three pages of 4
    assert slots.available_size() == 0 and kv.req_to_token.available_size() == free_rows - 1


def test_a_deferred_decode_request_that_fails_before_reserving_holds_nothing(
    single_rank_group, decode_kv_hybrid
) -> None:
    """Prefill's deferred bootstrap timed out (decode's receiver reports Failed) before decode reserved:
    SGLang aborts the request and nothing, Mamba slot included, is held."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.runtime_context import get_parallel

    kv = decode_kv_hybrid
    q = prealloc_queue(kv)
    slots = kv.req_to_token.mamba_allocator
    free_slots, free_pages = slots.available_size(), kv.allocator.available_size()
    dreq = decode_request("d0", list(range(10)), KVPoll.Bootstrapping)
    q.queue = [dreq]
    assert q.pop_preallocated() == ([], [])
    dreq.kv_receiver.state = KVPoll.Failed
    with get_parallel().override(tp_rank=0):
        q.tp_rank = 0
        popped, failed = q.pop_preallocated()  # aborted by the handshake poll, dropped in the same pass
    assert popped == [] and failed == [dreq] and q.queue == []
    assert not dreq.req.kv.holds_mamba and not dreq.req.kv.holds_kv
    assert slots.available_size() == free_slots and kv.allocator.available_size() == free_pages


def test_a_lent_unit_state_makes_room_for_a_deferred_hybrid_request(
    single_rank_group, decode_kv_hybrid
) -> None:
    """With Basin's lending on: every Mamba slot is held, one by a lent unit; when prefill reports
    completion, SGLang's `ensure_mamba_capacity` (through the plugin's hook) reclaims the unit and the
    request is reserved in the same pass."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from test_hybrid_lending import hybrid_lender, lend

    kv = decode_kv_hybrid
    q = prealloc_queue(kv)
    lender, _ = hybrid_lender(kv, adopt_headroom=0.0, reclaim_headroom=0.0)
    lend(kv, "r0", list(range(8)), "s0")
    assert lender.store.lent_states == 1
    slots = kv.req_to_token.mamba_allocator
    slots.alloc(slots.available_size())  # running requests hold the rest
    assert slots.available_size() == 0

    dreq = decode_request("d0", list(range(10)), KVPoll.WaitingForInput)
    q.queue = [dreq]
    popped, _ = q.pop_preallocated()
    assert popped == [dreq] and len(lender.store) == 0
    (sent,) = dreq.kv_receiver.metadata
    assert [int(x) for x in sent["state"][0]] == [int(dreq.req.kv.mamba_pool_idx)]
