"""Reservation at prefill completion over NIXL (paper §6.6).

SGLang 0.5.23's `--disaggregation-decode-allocation-policy prefill_complete` defers decode KV
reservation until prefill finishes, but its validator admits only the Mooncake transfer backend. The
deferral itself lives in the backend-independent `CommonKVManager` (its `DeferredBootstrap` table and
the BOOTSTRAP/ABORT control messages decode's receiver sends); what NIXL lacks is on the prefill side:
its bootstrap thread reads the control socket raw, where Mooncake's goes through
`CommonKVManager._make_worker_recv`, which consumes the deferred-bootstrap messages first. So:
- the validator hook drops the Mooncake-only rule for NIXL and keeps every other rule SGLang enforces;
- the NIXL hook puts the same consuming step in front of NIXL's bootstrap socket.
With NIXL the validator also forgives, each only in the configuration traced in SGLang's source:
- the decode radix cache without decode HiCache: decode matches and locks its tree at allocation time
  (after prefill completes), allocates only the rest and sends that prefix length to prefill, which
  starts its send there; the plugin's lender stays off an enabled tree (`hooks.tree_caches_requests`);
- L2 write-through HiCache on prefill without a storage backend: SGLang keeps a pending-bootstrap
  request's KV request-owned and unpublished (`advance_unpublished_req`) until decode has reserved,
  publishes it under the request's lock right before the send, and releases it at transfer success;
  prefill_complete never takes the optimistic retry path that made eager write-through unsafe.
With NIXL the KV manager hook also accepts hybrid (Mamba / gated-delta) state, in the configuration
traced in SGLang's source (`HYBRID_TRACED`): SGLang's `CommonKVManager.__init__` refuses any state type
but DSA under prefill_complete; the deferral itself treats a Mamba slot as it treats a KV page:
- prefill: the request's whole prompt runs while `pending_bootstrap`; its last-chunk checkpoint, on a
  tree with the MAMBA component and no extra buffer, copies the slot's state into a fresh slot for the
  tree (`MambaComponent.prepare_for_caching_req`, unfinished) and leaves the request's own slot as it
  is; the request stays in the inflight queue holding row, pages and slot; when decode's destination
  arrives, `handle_pending_bootstrap` checkpoints again (the state is already in the tree: the new copy
  is freed) and the last-chunk send reads the state payload from the request's own slot
  (`req_index_to_mamba_index_mapping`), still the prompt-end state; at transfer success the finished
  request's release leaves one state for the prompt in the tree and frees the other slot; a bootstrap
  failure or timeout (`handle_bootstrap_failure`) releases without a checkpoint, which frees the
  request's slot and unlocks the tree's copy. Prefill rows are capped at a third of the Mamba slots
  with a tree (SGLang's ratio 3), so parked requests (own slot plus a locked copy each) leave the
  slot a checkpoint's copy needs;
- decode: nothing is allocated until prefill reports completion; then `pop_preallocated` runs the same
  allocation as without deferral (`ensure_mamba_capacity`, then the row and its slot together, the slot
  index sent as the MAMBA destination).
Still refused with hybrid state, each named in the error: state types beside MAMBA, the decode radix
cache, and on prefill the Mamba extra buffer, int8 Mamba checkpoints and HiCache.
Decode HiCache, prefill storage backends and write_through_selective stay rejected.
"""

from __future__ import annotations

from typing import Any

MOONCAKE_ONLY = "transfer backends other than Mooncake"
DECODE_CACHES = "decode radix cache or decode HiCache"
PREFILL_HICACHE = "prefill HiCache other than L2 write_back"
PREFIX = "does not yet support "

HYBRID_REJECTED = "prefill_complete currently supports full-attention and DSA KV pools only"

TARGETS = {
    "validate": "sglang.srt.arg_groups.pd_disaggregation_hook._validate_prefill_complete",
    "nixl_bootstrap": "sglang.srt.disaggregation.nixl.conn.NixlKVManager._start_bootstrap_thread",
    "kv_manager": "sglang.srt.disaggregation.common.conn.CommonKVManager.__init__",
}


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGETS["validate"], validate_allowing_nixl, HookType.AROUND)
    HookRegistry.register(TARGETS["nixl_bootstrap"], start_nixl_bootstrap_with_deferral, HookType.AROUND)
    HookRegistry.register(TARGETS["kv_manager"], init_kv_manager_allowing_hybrid, HookType.AROUND)


def validate_allowing_nixl(original: Any, server_args: Any) -> None:
    """Run SGLang's validation; with the NIXL backend, forgive the Mooncake-only rule, and the cache
    rules only for the configurations this plugin has made or checked safe (see `forgiven`)."""
    try:
        original(server_args)
    except ValueError as exc:
        message = str(exc)
        if server_args.disaggregation_transfer_backend != "nixl" or PREFIX not in message:
            raise
        head, items = message.split(PREFIX, 1)
        allowed = forgiven(server_args)
        rest = [item for item in items.split(", ") if item not in allowed]
        if rest:
            raise ValueError(head + PREFIX + ", ".join(rest)) from None


def forgiven(server_args: Any) -> set[str]:
    """The rules of SGLang's prefill_complete validator this plugin lifts for these arguments."""
    allowed = {MOONCAKE_ONLY}
    hicache = bool(getattr(server_args, "enable_hierarchical_cache", False))
    mode = server_args.disaggregation_mode
    if (
        mode == "decode"
        and getattr(server_args, "disaggregation_decode_enable_radix_cache", False)
        and not hicache  # decode HiCache is SGLang's HiCache flag on a decode instance
    ):
        allowed.add(DECODE_CACHES)
    if (
        mode == "prefill"
        and hicache
        and getattr(server_args, "hicache_storage_backend", None) is None
        and getattr(server_args, "hicache_write_policy", None) == "write_through"
    ):
        allowed.add(PREFILL_HICACHE)
    return allowed


class DeferredBootstrapSocket:
    """NIXL's prefill control socket, with deferred-bootstrap messages consumed before NIXL sees them
    (ABORT is both recorded for the deferral and passed on, as SGLang does for Mooncake)."""

    def __init__(self, socket: Any, manager: Any):
        self._socket = socket
        self._manager = manager

    def recv_multipart(self, *args: Any, **kwargs: Any) -> list[bytes]:
        while True:
            msg = self._socket.recv_multipart(*args, **kwargs)
            if not self._manager._handle_bootstrap_message(msg):
                return msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def start_nixl_bootstrap_with_deferral(original: Any, manager: Any, *args: Any, **kwargs: Any) -> Any:
    if getattr(manager, "deferred_bootstrap", None) is not None and not isinstance(
        manager.server_socket, DeferredBootstrapSocket
    ):
        manager.server_socket = DeferredBootstrapSocket(manager.server_socket, manager)
    return original(manager, *args, **kwargs)


def init_kv_manager_allowing_hybrid(
    original: Any, manager: Any, args: Any, disaggregation_mode: Any, *rest: Any, **kwargs: Any
) -> None:
    """SGLang's KV manager constructor; under prefill_complete a NIXL manager whose KV args carry Mamba
    state is built when `hybrid_refusal` finds nothing untraced. The constructor reads `state_types`
    only in its prefill_complete check, so the Mamba entry is hidden from that check alone and put back
    before the NIXL subclass registers the state buffers."""
    from sglang.srt.disaggregation.common.conn import StateType

    types = getattr(args, "state_types", None)
    if not _hybrid_deferral(manager, types):
        return original(manager, args, disaggregation_mode, *rest, **kwargs)
    refusal = hybrid_refusal(types, disaggregation_mode)
    if refusal:
        raise ValueError(f"{HYBRID_REJECTED}; basin_engine_ext accepts hybrid (Mamba) state except {refusal}")
    args.state_types = [state for state in types if state != StateType.MAMBA]
    try:
        return original(manager, args, disaggregation_mode, *rest, **kwargs)
    finally:
        args.state_types = types


def _hybrid_deferral(manager: Any, types: Any) -> bool:
    """A NIXL manager under prefill_complete whose KV args carry Mamba state (NIXL's module is imported
    only then, so other backends' deployments never load it)."""
    from sglang.srt.disaggregation.common.conn import StateType
    from sglang.srt.runtime_context import get_disagg

    if get_disagg().disaggregation_decode_allocation_policy != "prefill_complete":
        return False
    if not types or StateType.MAMBA not in types:
        return False
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    return isinstance(manager, NixlKVManager)


def hybrid_refusal(types: Any, disaggregation_mode: Any) -> str | None:
    """Why a hybrid configuration stays rejected under prefill_complete (None: it is accepted)."""
    from sglang.srt.disaggregation.common.conn import StateType
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.runtime_context import get_disagg, get_exec, get_memory

    others = sorted(str(state) for state in set(types) if state != StateType.MAMBA)
    if others:
        return f"beside other state types ({', '.join(others)}): only plain Mamba state was traced"
    if (
        disaggregation_mode == DisaggregationMode.DECODE
        and get_disagg().disaggregation_decode_enable_radix_cache
    ):
        return (
            "with the decode radix cache: decode's copy-on-write Mamba match at allocation "
            "(cow_mamba in pop_preallocated) was not traced"
        )
    if disaggregation_mode != DisaggregationMode.PREFILL:
        return None
    mamba = get_exec().mamba
    if mamba.enable_mamba_extra_buffer:
        return (
            "with the Mamba extra buffer (--mamba-radix-cache-strategy extra_buffer*): the pending "
            "checkpoint donates the request's ping-pong tracking slot to the tree and the parked request "
            "keeps 1 + tracking slots until decode reserves; not traced"
        )
    if getattr(mamba, "enable_int8_mamba_checkpoint", False):
        return "with int8 Mamba checkpoints: the tree's int8 checkpoint pool was not traced"
    if get_memory().enable_hierarchical_cache:
        return (
            "with HiCache on prefill: write-through keeps pending KV unpublished through "
            "advance_unpublished_req, which asserts a tree without Mamba; write-back's Mamba host pool "
            "was not traced"
        )
    return None
