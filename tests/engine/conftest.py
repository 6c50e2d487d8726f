"""Engine-layer tests run in the SGLang CPU venv (`make test-engine`), never in the project's main venv.

Without SGLang installed nothing here is collected, so the main run stays clean whatever marker filter
it uses. In the SGLang venv, torchvision's op schemas are shimmed before anything imports sglang.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    # The tests' tensors live on the CPU: Triton kernels (ours and SGLang's) run in its interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # NIXL agents (this process's and the decode peers') talk over UCX on the loopback device.
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    import torchvision_shim  # noqa: F401  (must precede every sglang import)

PAGE = 4
REPO = Path(__file__).resolve().parents[2]


def checkout_env(**extra: str) -> dict[str, str]:
    """Environment for helper interpreters: this checkout's packages first on the path, whatever
    checkout the shared SGLang venv last installed."""
    roots = [str(REPO / name) for name in ("engine_ext", "basin")] + [str(Path(__file__).parent)]
    path = os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, **extra}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Peer:
    """A decode process serving (`serve`), stalling on (`stall`) or releasing (`released`) its lent unit
    over NIXL, started and stopped by the test (hard timeouts everywhere)."""

    def __init__(self, mode: str):
        import zmq

        self.port = free_port()
        env = checkout_env(UCX_NET_DEVICES="lo")
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).parent / "unit_peer.py"), str(self.port), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and "ready" not in line:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"decode peer died: {self.proc.stderr.read()[-3000:]}")
        assert "ready" in line, "decode peer did not start in time"
        self.ctx = zmq.Context()
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(f"tcp://127.0.0.1:{self.port}")

    def send(self, request) -> None:
        from basin_engine_ext.transfer import encode_fetch

        self.push.send_multipart(encode_fetch(request))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.push.close()
        self.ctx.term()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def serving_decode():
    """One serving decode process per module (its unit is read, never consumed, by a fetch)."""
    decode = Peer("serve")
    yield decode
    decode.close()


@pytest.fixture(scope="module")
def stalled_decode():
    """One decode process per module that never answers a fetch."""
    decode = Peer("stall")
    yield decode
    decode.close()


def admission_pass(scheduler, running_batch):
    """What SGLang's `_get_new_batch_prefill_raw` does with the waiting queue, minus batch building:
    match each request's prefix (a hybrid tree: with copy-on-write of the matched state) and admit it
    with SGLang's `PrefillAdder`, at the tree's page size."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    tree = scheduler.tree_cache
    adder = PrefillAdder(
        tree.page_size, tree, scheduler.token_to_kv_pool_allocator, running_batch, 0.5, 4096, None
    )
    for req in scheduler.waiting_queue:
        req.init_next_round_input(tree)
        if adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) != AddReqResult.CONTINUE:
            break
    admitted = list(adder.can_run_list)
    scheduler.waiting_queue = [r for r in scheduler.waiting_queue if r not in admitted]
    return admitted


@pytest.fixture(scope="session")
def plugin_loaded() -> None:
    """Load plugins through SGLang's own loader, as every engine process does (hooks stay applied for
    the rest of the session, as in an engine)."""
    import os

    os.environ["SGLANG_PLUGINS"] = "basin"
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.fixture(scope="session")
def single_rank_group() -> None:
    """SGLang all-reduces poll states over the attention groups (the default group when a scheduler has
    none); one gloo rank here."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


class DecodeKV:
    """A decode instance's real SGLang memory on CPU: KV pool, paged allocator, request rows and the
    UnifiedRadixCache SGLang builds when the decode radix cache is off (`radix=True`: the enabled tree
    a prefill instance builds by default)."""

    def __init__(self, tokens: int = 256, layers: int = 3, page: int = PAGE, radix: bool = False) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=page))
        self.page = page
        self.pool = MHATokenToKVPool(
            size=tokens, page_size=page, dtype=torch.float16, head_num=2, head_dim=8, layer_num=layers,
            device="cpu", enable_memory_saver=False,
        )  # fmt: skip
        self.allocator = PagedTokenToKVPoolAllocator(
            size=tokens, page_size=page, dtype=torch.float16, device="cpu", kvcache=self.pool, need_sort=False
        )
        self.req_to_token = ReqToTokenPool(
            size=8, max_context_len=512, device="cpu", enable_memory_saver=False
        )
        self.tree = UnifiedRadixCache(
            CacheInitParams(
                disable=not radix, req_to_token_pool=self.req_to_token,
                token_to_kv_pool_allocator=self.allocator, page_size=page,
                tree_components=(ComponentType.FULL,),
            )
        )  # fmt: skip

    def finished_request(self, rid: str, prompt: list[int], outputs: int, custom_params: dict | None = None):
        """A decode request that ran to its length limit, holding real slots for prompt + outputs."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(
            rid=rid, origin_input_text="", origin_input_ids=list(prompt),
            sampling_params=SamplingParams(max_new_tokens=outputs, custom_params=custom_params),
        )  # fmt: skip
        self.req_to_token.alloc([req])
        n = len(prompt) + outputs
        need = -(-n // self.page) * self.page
        slots = self.allocator.alloc(need)
        assert slots is not None, "test KV pool too small"
        self.req_to_token.write((req.kv.req_pool_idx, slice(0, n)), slots[:n])
        req.kv.kv_committed_len = n
        req.kv.kv_allocated_len = n
        req.output_ids = list(range(outputs))
        req.finished_reason = FINISH_LENGTH(outputs)
        return req


@pytest.fixture
def decode_kv() -> DecodeKV:
    return DecodeKV()


class HybridDecodeKV(DecodeKV):
    """A hybrid (Mamba / gated-delta) decode instance as SGLang's configurator builds it for PD decode:
    `HybridMambaDecodeReqToTokenPool` (request rows plus a `MambaPool` and its slot allocator), a
    `HybridLinearKVPool` over the same Mamba pool whose full-attention layers are an MHA pool, the paged
    allocator over that, and the disabled `UnifiedRadixCache` with the FULL and MAMBA components.

    `prefill=True` builds a hybrid prefill instance instead: SGLang's `HybridReqToTokenPool` and the
    enabled tree with both components (SGLang asserts page size 1 for it without the Mamba extra buffer)."""

    def __init__(
        self,
        tokens: int = 256,
        page: int = PAGE,
        requests: int = 6,
        linear_layers: tuple[int, ...] = (0, 1, 3),
        full_layers: tuple[int, ...] = (2,),
        prefill: bool = False,
    ) -> None:
        import torch
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
        from sglang.srt.disaggregation.decode import HybridMambaDecodeReqToTokenPool
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        args = ServerArgs(model_path="dummy", page_size=page)
        # SGLang derives the Mamba caching granularity from the model's config (there is none here) and
        # caches it on the arguments: set FLA's chunk size, the default for gated-delta models.
        args._mamba_cache_chunk_size = 64
        set_global_server_args_for_scheduler(args)
        self.page = page
        linear_layers, full_layers = list(linear_layers), list(full_layers)  # default: 3 gated-delta of 4
        shape = Mamba2StateShape.create(
            tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2, head_dim=8, state_size=4,
            conv_kernel=4,
        )  # fmt: skip
        params = Mamba2CacheParams(shape=shape, layers=linear_layers)
        if prefill:
            from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

            self.req_to_token = HybridReqToTokenPool(
                size=requests, mamba_size=requests * 2, mamba_spec_state_size=0, max_context_len=512,
                device="cpu", enable_memory_saver=False, cache_params=params, mamba_layer_ids=linear_layers,
                enable_mamba_extra_buffer=False, enable_overlap_schedule=False,
            )  # fmt: skip
        else:
            self.req_to_token = HybridMambaDecodeReqToTokenPool(
                size=requests, max_context_len=512, device="cpu", enable_memory_saver=False,
                cache_params=params, mamba_layer_ids=linear_layers,
                speculative_num_draft_tokens=None, enable_mamba_extra_buffer=False, pre_alloc_size=0,
                enable_overlap_schedule=False,
            )  # fmt: skip
        self.mamba = self.req_to_token.mamba_pool
        self.pool = HybridLinearKVPool(
            size=tokens, dtype=torch.float16, page_size=page, head_num=2, head_dim=8,
            full_attention_layer_ids=full_layers, device="cpu", mamba_pool=self.mamba,
        )  # fmt: skip
        self.allocator = PagedTokenToKVPoolAllocator(
            size=tokens, page_size=page, dtype=torch.float16, device="cpu", kvcache=self.pool, need_sort=False
        )
        self.tree = UnifiedRadixCache(
            CacheInitParams(
                disable=not prefill, req_to_token_pool=self.req_to_token,
                token_to_kv_pool_allocator=self.allocator, page_size=page,
                tree_components=(ComponentType.FULL, ComponentType.MAMBA),
            )
        )  # fmt: skip

    def state(self, slot) -> list:
        """The bytes of one Mamba slot (every conv and temporal tensor, every layer), cloned."""
        cache = self.mamba.mamba_cache
        idx = int(slot)
        return [c[:, idx].clone() for c in cache.conv] + [cache.temporal[:, idx].clone()]

    def expected_state(self, seed: int) -> list:
        """What `write_state(slot, seed)` writes, without touching the pool."""
        import torch

        gen = torch.Generator().manual_seed(seed)
        cache = self.mamba.mamba_cache
        out = [torch.randn(c[:, 0].shape, generator=gen).to(c.dtype) for c in cache.conv]
        t = cache.temporal
        return [*out, torch.randn(t[:, 0].shape, generator=gen).to(t.dtype)]

    def write_state(self, slot, seed: int) -> None:
        """What a transfer (or a decode step) writes into a request's Mamba slot."""
        cache = self.mamba.mamba_cache
        idx = int(slot)
        for buf, value in zip([*cache.conv, cache.temporal], self.expected_state(seed), strict=True):
            buf[:, idx] = value

    def transferred_request(self, rid: str, prompt: list[int], custom_params: dict | None = None):
        """A decode request whose prompt KV and prompt-end state prefill has delivered: row, KV slots and
        a Mamba slot allocated by SGLang's pools, prefill's first token in `output_ids`."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(
            rid=rid, origin_input_text="", origin_input_ids=list(prompt),
            sampling_params=SamplingParams(max_new_tokens=8, custom_params=custom_params),
        )  # fmt: skip
        self.req_to_token.alloc([req])
        n = len(prompt)
        slots = self.allocator.alloc(-(-(n + 8) // self.page) * self.page)
        assert slots is not None, "test KV pool too small"
        self.req_to_token.write((req.kv.req_pool_idx, slice(0, int(slots.numel()))), slots)
        req.kv.kv_committed_len = n
        req.kv.kv_allocated_len = int(slots.numel())
        req.output_ids = [7]  # prefill's token
        self.write_state(req.kv.mamba_pool_idx, seed=len(prompt))
        return req

    def decode_step(self, req, seed: int) -> None:
        """One decode step: a token appended, the request's recurrent state rewritten in place."""
        req.kv.kv_committed_len += 1
        req.output_ids.append(100 + seed)
        self.write_state(req.kv.mamba_pool_idx, seed=10_000 + seed)

    def finish(self, req) -> None:
        import torch
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        # SGLang's decode allocates as it goes: pages past the last written token were never taken.
        committed = req.kv.kv_committed_len
        keep = -(-committed // self.page) * self.page
        row = self.req_to_token.req_to_token[req.kv.req_pool_idx]
        if req.kv.kv_allocated_len > keep:
            self.allocator.free(row[keep : req.kv.kv_allocated_len].to(torch.int64))
        req.kv.kv_allocated_len = committed
        req.finished_reason = FINISH_LENGTH(len(req.output_ids))


@pytest.fixture
def hybrid_kv() -> HybridDecodeKV:
    return HybridDecodeKV()


# --- live: a real SGLang prefill–decode pair on CPU behind sglang-router (marker `live`) ---

LIVE_DIR = REPO / "engine_ext" / "live"


def tiny_model_dir() -> Path:
    """The live tests' tiny model, built once per machine and version of its script (about 15 s) into
    ~/.cache/basin, written to a temporary folder and renamed so a half-written model is never used."""
    import hashlib
    import shutil
    import tempfile

    script = LIVE_DIR / "tiny_model.py"
    digest = hashlib.sha256(script.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("BASIN_CACHE", Path.home() / ".cache" / "basin"))
    target = cache / f"tiny-llama-{digest}"
    if (target / "model.safetensors").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=cache, prefix=".tiny-llama-"))
    try:
        subprocess.run(
            [sys.executable, str(script), str(scratch)], check=True, capture_output=True, timeout=600
        )
        try:
            scratch.rename(target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise  # someone else's rename won the race otherwise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def live_pair(tmp_path_factory: pytest.TempPathFactory):
    """One live PD pair with Basin's plugin (`SGLANG_PLUGINS=basin`, `prefill_complete` on NIXL, priority
    scheduling, a unit port) and sglang-router, started once per test session and stopped at its end,
    also when starting fails (process groups killed). Logs stay in the session's temporary folder."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.fail("sglang-router is not installed in this venv: run `make test-live`")
    sys.path.insert(0, str(LIVE_DIR))
    from pair import LivePair

    # BASIN_LIVE_SGLANG_PLUGINS replaces the servers' SGLANG_PLUGINS=basin, to see the tests fail
    # without Basin's plugin (e.g. BASIN_LIVE_SGLANG_PLUGINS=none).
    plugins = os.environ.get("BASIN_LIVE_SGLANG_PLUGINS")
    env = {} if plugins is None else {"SGLANG_PLUGINS": plugins}
    pair = LivePair(sys.executable, tiny_model_dir(), tmp_path_factory.mktemp("live-pair"), env=env)
    pair.start()
    try:
        yield pair
    finally:
        pair.stop()
