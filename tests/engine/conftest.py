"""Engine-layer tests run in the SGLang CPU venv (`make test-engine`), never in the project's main venv.

Without SGLang installed nothing here is collected, so the main run stays clean whatever marker filter
it uses. In the SGLang venv, torchvision's op schemas are shimmed before anything imports sglang.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    # The tests' tensors live on the CPU: Triton kernels (ours and SGLang's) run in its interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torchvision_shim  # noqa: F401  (must precede every sglang import)

PAGE = 4
REPO = Path(__file__).resolve().parents[2]


def checkout_env(**extra: str) -> dict[str, str]:
    """Environment for helper interpreters: this checkout's packages first on the path, whatever
    checkout the shared SGLang venv last installed."""
    roots = [str(REPO / name) for name in ("engine_ext", "basin")] + [str(Path(__file__).parent)]
    path = os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture(scope="session")
def plugin_loaded() -> None:
    """Load plugins through SGLang's own loader, as every engine process does (hooks stay applied for
    the rest of the session, as in an engine)."""
    import os

    os.environ["SGLANG_PLUGINS"] = "basin"
    from sglang.srt.plugins import load_plugins

    load_plugins()


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
