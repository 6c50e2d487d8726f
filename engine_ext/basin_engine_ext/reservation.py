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
Decode HiCache, prefill storage backends, write_through_selective and hybrid (Mamba) state stay
rejected.
"""

from __future__ import annotations

from typing import Any

MOONCAKE_ONLY = "transfer backends other than Mooncake"
DECODE_CACHES = "decode radix cache or decode HiCache"
PREFILL_HICACHE = "prefill HiCache other than L2 write_back"
PREFIX = "does not yet support "

TARGETS = {
    "validate": "sglang.srt.arg_groups.pd_disaggregation_hook._validate_prefill_complete",
    "nixl_bootstrap": "sglang.srt.disaggregation.nixl.conn.NixlKVManager._start_bootstrap_thread",
}


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGETS["validate"], validate_allowing_nixl, HookType.AROUND)
    HookRegistry.register(TARGETS["nixl_bootstrap"], start_nixl_bootstrap_with_deferral, HookType.AROUND)


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
