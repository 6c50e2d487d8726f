"""The per-layer wait inside SGLang's forward pass (paper §6.6), for prefill batches that fetch a unit.

With `BASIN_ENGINE_LAYER_OVERLAP` on, a request whose unit is still being written into its pages is
admitted at once (prefill.py); its request id is registered here with the fetch's layer-group flags
while its batch runs. Before every attention call SGLang makes, the hook below launches `layer_wait`'s
kernel for each registered request of the current batch, on the layer's group: the layer's attention
then reads that group's pages only after decode's WRITE of them completed (or the monitor failed them).

Why the attention backend's `forward` and not `RadixAttention.forward`: every path of
`RadixAttention.forward` (plain eager, padded rows, and the eager break of SGLang's piecewise prefill
graphs, `_eager_attention`) ends in `get_attn_backend().forward(q, k, v, layer, forward_batch, ...)`,
resolved at call time. On graph replay `RadixAttention.forward` itself is not re-run (the captured
segments are), but the eager break is, with the live batch: the wait kernel therefore runs outside the
captured segments, which stay intact, and only batches that carry a fetching request launch it.
"""

from __future__ import annotations

import threading
from typing import Any

from basin_engine_ext.layer_wait import LayerGroupFlags

_lock = threading.Lock()
_active: dict[str, LayerGroupFlags] = {}  # request id -> flags of its fetch, while its batch runs


def register(rid: str, flags: LayerGroupFlags) -> None:
    with _lock:
        _active[rid] = flags


def unregister(rid: str) -> None:
    with _lock:
        _active.pop(rid, None)


def active() -> dict[str, LayerGroupFlags]:
    with _lock:
        return dict(_active)


def flags_for(forward_batch: Any) -> list[LayerGroupFlags]:
    """The fetch flags of the batch's requests (empty for a batch that fetches nothing)."""
    if not _active:  # the common case: no fetch anywhere, no lock, no scan
        return []
    rids = getattr(forward_batch, "rids", None) or ()
    with _lock:
        return [_active[rid] for rid in rids if rid in _active]


def wait_before_attention(original: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `AttentionBackend.forward(q, k, v, layer, forward_batch, ...)`: launch the wait kernel for
    the layer's group of every fetch in the batch, then run SGLang's attention."""
    layer = kwargs.get("layer", args[3] if len(args) > 3 else None)
    forward_batch = kwargs.get("forward_batch", args[4] if len(args) > 4 else None)
    if layer is not None and forward_batch is not None:
        layer_id = getattr(layer, "layer_id", None)
        for flags in flags_for(forward_batch):
            if layer_id is not None and 0 <= layer_id < flags.num_layers:
                flags.wait_layer(layer_id)
    return original(backend, *args, **kwargs)
