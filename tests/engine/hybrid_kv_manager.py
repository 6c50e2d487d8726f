"""Builds SGLang's real NIXL KV manager for a hybrid model under prefill_complete, in a fresh interpreter
(the manager starts NIXL/UCX and socket threads), and prints one JSON line saying what came out.

Usage: hybrid_kv_manager.py [plugin] CASE...; `plugin` loads plugins through SGLang's loader first; a
CASE is ROLE[+OPTION...], ROLE prefill or decode, options: radix (decode radix cache), hicache,
extra_buffer, int8 (prefill settings), common (SGLang's base manager instead of NIXL's). One
`RESULT {json}` line per case, in order.
KV args come from SGLang's own `setup_state_kv_args` over real hybrid pools (tests' HybridDecodeKV).
Stand-ins: the bootstrap server (prefill registration is skipped) and NIXL's VRAM registration (made
DRAM: the CPU has no VRAM).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ["SGLANG_PLUGINS"] = "basin"
import torchvision_shim  # noqa: F401  (before sglang)


def build(role: str, options: set[str]) -> dict:
    import torch
    from conftest import HybridDecodeKV
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    kv = HybridDecodeKV()  # sets its own global arguments; the role's follow
    fields = {
        "model_path": "dummy", "page_size": 4, "disaggregation_mode": role,
        "disaggregation_transfer_backend": "nixl",
        "disaggregation_decode_allocation_policy": "prefill_complete",
    }  # fmt: skip
    if "radix" in options:
        fields["disaggregation_decode_enable_radix_cache"] = True
    if "hicache" in options:
        fields["enable_hierarchical_cache"] = True
    if "extra_buffer" in options:
        fields["mamba_radix_cache_strategy"] = "extra_buffer"
    if "int8" in options:
        fields["enable_int8_mamba_checkpoint"] = True
    args = ServerArgs(**fields)
    args._mamba_cache_chunk_size = 64
    set_global_server_args_for_scheduler(args)

    from sglang.srt.disaggregation.common.conn import CommonKVManager
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
        get_kv_transfer_buf_infos,
        get_pd_kv_layout,
        setup_state_kv_args,
    )
    from sglang.srt.runtime_context import get_exec, get_parallel

    kv_args = get_kv_class(TransferBackend.NIXL, KVClassType.KVARGS)()
    kv_args.engine_rank = kv_args.pp_rank = kv_args.system_dp_rank = 0
    kv_args.kv_cache_dtype_str = "float16"
    kv_args.kv_layout = get_pd_kv_layout(kv.pool)
    kv_args.kv_data_ptrs, kv_args.kv_data_lens, kv_args.kv_item_lens = get_kv_transfer_buf_infos(kv.pool)
    kv_args.kv_data_mem_kinds = ["DRAM"] * len(kv_args.kv_data_ptrs)
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = [2]
    kv_args.page_size = 4
    aux = torch.zeros(64, dtype=torch.uint8)
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = [aux.data_ptr()], [64], [8]
    setup_state_kv_args(kv_args, kv.pool, None, total_kv_layers=4, req_to_token_pool=kv.req_to_token)
    kv_args.ib_device = None
    kv_args.gpu_id = 0
    mode = DisaggregationMode.PREFILL if role == "prefill" else DisaggregationMode.DECODE
    out = {
        "state_types": [str(t.value) for t in kv_args.state_types],
        "extra_buffer": bool(get_exec().mamba.enable_mamba_extra_buffer),
    }
    manager_class = get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER)
    manager_class.register_to_bootstrap = lambda self: None  # no bootstrap server here
    ranks = {"attn_tp_rank": 0, "attn_cp_rank": 0, "attn_dp_rank": 0, "pp_group": None, "tp_rank": 0}
    try:
        with get_parallel().override(**ranks):
            if "common" in options:
                manager = object.__new__(CommonKVManager)
                CommonKVManager.__init__(manager, kv_args, mode, args, False)
            else:
                manager = manager_class(kv_args, mode, args, False)
    except ValueError as exc:
        return {**out, "built": False, "error": str(exc)}
    from basin_engine_ext.reservation import DeferredBootstrapSocket

    return {
        **out,
        "built": True,
        "error": None,
        "defer": manager.defer_decode_allocation,
        "deferred_bootstrap": manager.deferred_bootstrap is not None,
        "socket_consumes_deferral": isinstance(manager.server_socket, DeferredBootstrapSocket),
        "manager_state_types": [str(t.value) for t in manager.kv_args.state_types],
        "mamba_registered": getattr(manager, "state_descs", None) is not None,
    }


def main(argv: list[str]) -> None:
    import nixl._api as nixl_api

    register = nixl_api.nixl_agent.register_memory

    def register_on_dram(agent, descs, mem_type=None, *rest, **kwargs):
        return register(agent, descs, "DRAM" if mem_type == "VRAM" else mem_type, *rest, **kwargs)

    nixl_api.nixl_agent.register_memory = register_on_dram
    if argv[:1] == ["plugin"]:
        from sglang.srt.plugins import load_plugins

        load_plugins()
        argv = argv[1:]
    for case in argv:
        role, *options = case.split("+")
        print("RESULT " + json.dumps(build(role, set(options))), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
    os._exit(0)  # the managers' NIXL and socket threads are not ours to join
