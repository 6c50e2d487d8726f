"""A decode instance in its own process for the unit-fetch tests: real SGLang KV pool and allocator on
CPU, one lent unit with known bytes, a NIXL agent, and a control socket taking `FetchRequest`s.

Usage: python unit_peer.py PORT MODE   (MODE: serve | stall | die)
Prints one line `ready` when it listens. `stall` takes a request and never writes; `die` exits on it.
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Listener

import torch
import torchvision_shim  # noqa: F401

from basin_engine_ext.hooks import make_lender
from basin_engine_ext.transfer import KVLayout, UnitWriter, make_agent

AUTH = b"basin-unit-test"
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
    writer = UnitWriter(make_agent("decode-0", layout), layout)
    with Listener(("127.0.0.1", port), authkey=AUTH) as listener:
        print("ready", flush=True)
        with listener.accept() as conn:
            while True:
                try:
                    request = conn.recv()
                except EOFError:
                    return
                if mode == "die":
                    os._exit(3)
                if mode == "stall":
                    time.sleep(3600)
                conn.send(writer.serve(request, lender))


if __name__ == "__main__":
    main()
