"""Reservation at prefill completion over NIXL (paper §6.6).

SGLang 0.5.23's `--disaggregation-decode-allocation-policy prefill_complete` defers decode KV
reservation until prefill finishes, but its validator admits only the Mooncake transfer backend. The
deferral itself lives in the backend-independent `CommonKVManager` (its `DeferredBootstrap` table and
the BOOTSTRAP/ABORT control messages decode's receiver sends); what NIXL lacks is on the prefill side:
its bootstrap thread reads the control socket raw, where Mooncake's goes through
`CommonKVManager._make_worker_recv`, which consumes the deferred-bootstrap messages first. So:
- the validator hook drops the Mooncake-only rule for NIXL and keeps every other rule SGLang enforces;
- the NIXL hook puts the same consuming step in front of NIXL's bootstrap socket.
Decode radix cache, decode HiCache, prefill write-through HiCache and hybrid (Mamba) state stay
rejected by SGLang's validator: this plugin does not extend those paths.
"""

from __future__ import annotations

from typing import Any

MOONCAKE_ONLY = "transfer backends other than Mooncake"
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
    """Run SGLang's validation; with the NIXL backend, forgive only the Mooncake-only rule."""
    try:
        original(server_args)
    except ValueError as exc:
        message = str(exc)
        if server_args.disaggregation_transfer_backend != "nixl" or PREFIX not in message:
            raise
        head, items = message.split(PREFIX, 1)
        rest = [item for item in items.split(", ") if item != MOONCAKE_ONLY]
        if rest:
            raise ValueError(head + PREFIX + ", ".join(rest)) from None


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
