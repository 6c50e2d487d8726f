"""A decode instance in its own process for the unit-fetch tests: real SGLang KV pool and allocator on
CPU, one lent unit with known bytes, a NIXL agent, and a control socket taking `FetchRequest`s.

Usage: python unit_peer.py PORT MODE   (MODE: serve | stall | die | released | hybrid | hybrid-stall)
Prints one line `ready` when it listens. `serve` polls the unit service as a decode scheduler loop
would; `stall` never reads its requests; `die` exits as soon as a request arrives. `released` goes
through the plugin as SGLang would run it: plugins loaded by SGLang's loader, the unit made by SGLang's
release path (`release_kv_cache`) finishing a marked request, the service started and polled by the
plugin's decode hooks. `hybrid` is a hybrid (Mamba / gated-delta) decode instance through the plugin:
SGLang's hybrid decode pools (page size 1, two full-attention layers, four gated-delta layers), the
lender and unit service started by the plugin's `DecodePreallocQueue` hook with a unit port, a marked
request whose prompt-end state the plugin copies at `process_prebuilt`, two decode steps rewriting the
request's own slot, and SGLang's release making the unit (pages plus state slot); the service is polled
by the decode hooks. `hybrid-stall` builds the same and never polls. Ends by itself after two minutes.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torchvision_shim  # noqa: F401  (before any sglang import)
import zmq

from basin_engine_ext.hooks import make_lender
from basin_engine_ext.service import UnitService
from basin_engine_ext.transfer import KVLayout, make_agent

LIFETIME_S = 120
SESSION = "sess-1"
UNIT_TOKENS = 48  # 12 pages of 4
PROMPT = [7000 + i for i in range(UNIT_TOKENS)]
LAYERS = 6
# Hybrid decode instance: the unit's prompt (page size 1: every prompt is whole pages) and layers.
HYBRID_SESSION = "hsess-1"
HYBRID_PROMPT = [9000 + i for i in range(40)]
HYBRID_LINEAR = (0, 1, 3, 4)
HYBRID_FULL = (2, 5)
HYBRID_STATE_SEED = len(HYBRID_PROMPT)  # what HybridDecodeKV.transferred_request writes as prefill's state


def unit_values(layer: int, kind: int, positions: torch.Tensor, heads: int = 2, dim: int = 8) -> torch.Tensor:
    """What the unit's token at each prompt position holds in layer `layer`, K (0) or V (1)."""
    base = ((layer * 7 + kind * 3 + positions) % 1000).to(torch.float16)
    return base[:, None, None] + torch.arange(heads * dim, dtype=torch.float16).reshape(heads, dim) / 64


def main() -> None:
    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "released":
        released(port)
        return
    if mode.startswith("hybrid"):
        hybrid(port, serve=mode == "hybrid")
        return
    from conftest import DecodeKV

    kv = DecodeKV(tokens=512, layers=LAYERS)
    kv.allocator.alloc(64)  # shift the unit away from the start so addresses differ from prefill's
    slots = kv.allocator.alloc(UNIT_TOKENS)
    positions = torch.arange(UNIT_TOKENS)
    for layer in range(LAYERS):
        kv.pool.k_buffer[layer][slots] = unit_values(layer, 0, positions)
        kv.pool.v_buffer[layer][slots] = unit_values(layer, 1, positions)
    lender = make_lender(kv.allocator)
    assert lender.adopt(SESSION, 1, PROMPT, slots) == UNIT_TOKENS
    layout = KVLayout.from_pool(kv.pool)
    socket = zmq.Context().socket(zmq.PULL)
    socket.setsockopt(zmq.LINGER, 0)
    socket.bind(f"tcp://127.0.0.1:{port}")
    service = UnitService(lender, layout, make_agent("decode-0", layout), socket)
    print("ready", flush=True)
    end = time.monotonic() + LIFETIME_S
    if mode == "die" and socket.poll(LIFETIME_S * 1000):
        os._exit(3)
    while time.monotonic() < end:
        if mode == "serve":
            service.poll()  # what the decode scheduler does once per loop iteration
        time.sleep(0.0005)


def released(port: int) -> None:
    from types import SimpleNamespace

    os.environ["SGLANG_PLUGINS"] = "basin"
    from conftest import DecodeKV
    from sglang.srt.plugins import load_plugins

    from basin_engine_ext import hooks

    load_plugins()
    from sglang.srt.mem_cache.common import release_kv_cache  # after the loader patched it

    kv = DecodeKV(tokens=512, layers=LAYERS)
    kv.allocator.alloc(64)
    lender = hooks.make_lender(kv.allocator)  # what the plugin attaches to SGLang's prealloc queue
    req = kv.finished_request(
        "turn-1", PROMPT, outputs=2, custom_params={"basin_lend": True, "basin_session": SESSION}
    )
    row = kv.req_to_token.req_to_token[req.kv.req_pool_idx, :UNIT_TOKENS]
    for layer in range(LAYERS):
        kv.pool.k_buffer[layer][row] = unit_values(layer, 0, torch.arange(UNIT_TOKENS))
        kv.pool.v_buffer[layer][row] = unit_values(layer, 1, torch.arange(UNIT_TOKENS))
    release_kv_cache(req, kv.tree, checkpoint=False)  # the plugin's hook keeps the prompt as the unit
    assert lender.store.get(SESSION).tokens == UNIT_TOKENS
    hooks.start_unit_service(lender, kv.allocator, port)
    queue = SimpleNamespace(token_to_kv_pool_allocator=kv.allocator, queue=[], retracted_queue=[])
    print("ready", flush=True)
    end = time.monotonic() + LIFETIME_S
    while time.monotonic() < end:
        hooks.rebalance_before_prealloc(queue)  # what SGLang's pop_preallocated runs first, per iteration
        time.sleep(0.0005)


def hybrid(port: int, serve: bool) -> None:
    from types import SimpleNamespace

    os.environ["SGLANG_PLUGINS"] = "basin"
    from conftest import HybridDecodeKV
    from sglang.srt.plugins import load_plugins

    from basin_engine_ext import hooks
    from basin_engine_ext.config import EngineExtConfig

    load_plugins()
    from sglang.srt.mem_cache.common import release_kv_cache  # after the loader patched it
    from test_hybrid_lending import prebuild

    kv = HybridDecodeKV(tokens=512, page=1, linear_layers=HYBRID_LINEAR, full_layers=HYBRID_FULL)
    kv.allocator.alloc(64)  # shift the unit away from the start so addresses differ from prefill's
    kv.req_to_token.mamba_allocator.alloc(2)  # and its state slot too
    queue = SimpleNamespace(
        token_to_kv_pool_allocator=kv.allocator,
        req_to_token_pool=kv.req_to_token,
        queue=[],
        retracted_queue=[],
    )
    hooks.configure(EngineExtConfig(unit_port=port))
    hooks.attach_lender(None, queue)  # SGLang's DecodePreallocQueue hook: lender and unit service
    lender = hooks.lender_for(kv.allocator)
    n = len(HYBRID_PROMPT)
    req = kv.transferred_request(
        "turn-1", HYBRID_PROMPT, custom_params={"basin_lend": True, "basin_session": HYBRID_SESSION}
    )
    row = kv.req_to_token.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    full = kv.pool.full_kv_pool
    for layer in range(len(HYBRID_FULL)):
        full.k_buffer[layer][row] = unit_values(layer, 0, torch.arange(n))
        full.v_buffer[layer][row] = unit_values(layer, 1, torch.arange(n))
    prebuild(kv, [req])  # the plugin copies the prompt-end state here
    for step in range(2):
        kv.decode_step(req, step)  # decode rewrites the request's own slot
    kv.finish(req)
    release_kv_cache(req, kv.tree, checkpoint=False)
    unit = lender.store.get(HYBRID_SESSION)
    assert unit is not None and unit.tokens == n and unit.states == 1 and unit.state_tokens == n
    print("ready", flush=True)
    end = time.monotonic() + LIFETIME_S
    while time.monotonic() < end:
        if serve:
            hooks.rebalance_before_prealloc(queue)  # what SGLang's pop_preallocated runs first
        time.sleep(0.0005)


if __name__ == "__main__":
    main()
