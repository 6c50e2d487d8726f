"""A decode instance in its own process for the unit-fetch tests: real SGLang KV pool and allocator on
CPU, one lent unit with known bytes, a NIXL agent, and a control socket taking `FetchRequest`s.

Usage: python unit_peer.py PORT MODE   (MODE: serve | stall | die | released)
Prints one line `ready` when it listens. `serve` polls the unit service as a decode scheduler loop
would; `stall` never reads its requests; `die` exits as soon as a request arrives. `released` goes
through the plugin as SGLang would run it: plugins loaded by SGLang's loader, the unit made by SGLang's
release path (`release_kv_cache`) finishing a marked request, the service started and polled by the
plugin's decode hooks. Ends by itself after two minutes at most.
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


def unit_values(layer: int, kind: int, positions: torch.Tensor, heads: int = 2, dim: int = 8) -> torch.Tensor:
    """What the unit's token at each prompt position holds in layer `layer`, K (0) or V (1)."""
    base = ((layer * 7 + kind * 3 + positions) % 1000).to(torch.float16)
    return base[:, None, None] + torch.arange(heads * dim, dtype=torch.float16).reshape(heads, dim) / 64


def main() -> None:
    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "released":
        released(port)
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


if __name__ == "__main__":
    main()
