"""Reservation at prefill completion over NIXL: SGLang's real validator and NIXL manager class, real zmq
sockets and SGLang's `DeferredBootstrap` table."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.engine


def server_args(**fields):
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy")
    base = {
        "disaggregation_mode": "prefill",
        "disaggregation_transfer_backend": "nixl",
        "disaggregation_decode_allocation_policy": "prefill_complete",
    }
    for key, value in {**base, **fields}.items():
        setattr(args, key, value)
    return args


def test_sglang_alone_rejects_prefill_complete_on_nixl(plugin_loaded) -> None:
    from sglang.srt.arg_groups import pd_disaggregation_hook as hook

    with pytest.raises(ValueError, match="transfer backends other than Mooncake"):
        hook._validate_prefill_complete.__wrapped__(server_args())


def test_plugin_admits_nixl_and_keeps_every_other_rule(plugin_loaded) -> None:
    from sglang.srt.arg_groups import pd_disaggregation_hook as hook

    hook._validate_prefill_complete(server_args())  # no error
    hook._validate_prefill_complete(server_args(disaggregation_transfer_backend="mooncake"))
    with pytest.raises(ValueError, match="transfer backends other than Mooncake"):
        hook._validate_prefill_complete(server_args(disaggregation_transfer_backend="mori"))
    with pytest.raises(ValueError) as err:
        hook._validate_prefill_complete(
            server_args(enable_hierarchical_cache=True, hicache_write_policy="write_through_selective")
        )
    assert "prefill HiCache other than L2 write_back" in str(err.value)
    assert "Mooncake" not in str(err.value)
    with pytest.raises(ValueError, match="decode radix cache or decode HiCache"):
        hook._validate_prefill_complete(
            server_args(disaggregation_mode="decode", enable_hierarchical_cache=True)
        )
    with pytest.raises(ValueError, match="attention tensor parallelism"):
        hook._validate_prefill_complete(server_args(tp_size=2))


def test_sglang_alone_rejects_the_decode_radix_cache_and_prefill_write_through(plugin_loaded) -> None:
    from sglang.srt.arg_groups import pd_disaggregation_hook as hook

    with pytest.raises(ValueError, match="decode radix cache or decode HiCache"):
        hook._validate_prefill_complete.__wrapped__(
            server_args(disaggregation_mode="decode", disaggregation_decode_enable_radix_cache=True)
        )
    with pytest.raises(ValueError, match="prefill HiCache other than L2 write_back"):
        hook._validate_prefill_complete.__wrapped__(
            server_args(enable_hierarchical_cache=True, hicache_write_policy="write_through")
        )


def test_plugin_admits_the_decode_radix_cache_and_l2_write_through_on_nixl_only(plugin_loaded) -> None:
    from sglang.srt.arg_groups import pd_disaggregation_hook as hook

    radix = {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True}
    hook._validate_prefill_complete(server_args(**radix))
    through = {"enable_hierarchical_cache": True, "hicache_write_policy": "write_through"}
    hook._validate_prefill_complete(server_args(**through))
    # the same caches with decode HiCache, an L3 storage backend or another backend stay rejected
    with pytest.raises(ValueError, match="decode radix cache or decode HiCache"):
        hook._validate_prefill_complete(server_args(**radix, enable_hierarchical_cache=True))
    with pytest.raises(ValueError, match="prefill HiCache other than L2 write_back"):
        hook._validate_prefill_complete(server_args(**through, hicache_storage_backend="file"))
    with pytest.raises(ValueError, match="decode radix cache or decode HiCache"):
        hook._validate_prefill_complete(server_args(**radix, disaggregation_transfer_backend="mori"))


@pytest.fixture
def pull_push():
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVTIMEO, 5000)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    yield pull, push
    push.close()
    pull.close()
    ctx.term()


def nixl_manager(server_socket):
    from sglang.srt.disaggregation.common.bootstrap import DeferredBootstrap
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    manager = object.__new__(NixlKVManager)  # SGLang's class; its constructor needs GPUs and a model
    manager.deferred_bootstrap = DeferredBootstrap(timeout=30)
    manager.request_status = {}
    manager.server_socket = server_socket
    return manager


def test_nixl_bootstrap_thread_gets_a_socket_that_consumes_deferred_bootstrap(
    plugin_loaded, pull_push
) -> None:
    from sglang.srt.disaggregation.nixl.conn import GUARD, NixlKVManager

    from basin_engine_ext.reservation import DeferredBootstrapSocket, start_nixl_bootstrap_with_deferral

    assert hasattr(NixlKVManager._start_bootstrap_thread, "__wrapped__")
    pull, push = pull_push
    manager = nixl_manager(pull)
    seen = start_nixl_bootstrap_with_deferral(lambda m: m.server_socket, manager)
    assert isinstance(seen, DeferredBootstrapSocket)

    push.send_multipart([b"BOOTSTRAP", b"41", b"10.1.2.3", b"7001"])  # decode's control message
    push.send_multipart([b"ABORT", b"42", b"10.1.2.3", b"7001"])
    push.send_multipart([GUARD, b"None", b"x"])
    # NIXL's own loop sees ABORT (it drains and acknowledges) and its GUARD traffic, never BOOTSTRAP
    assert manager.server_socket.recv_multipart()[0] == b"ABORT"
    assert manager.server_socket.recv_multipart()[0] == GUARD
    rooms = manager.deferred_bootstrap.rooms
    assert rooms[41].endpoint == ("10.1.2.3", 7001)
    assert rooms[42].failed


def test_without_deferral_the_socket_is_left_alone(plugin_loaded, pull_push) -> None:
    from basin_engine_ext.reservation import start_nixl_bootstrap_with_deferral

    pull, _ = pull_push
    manager = nixl_manager(pull)
    manager.deferred_bootstrap = None
    assert start_nixl_bootstrap_with_deferral(lambda m: m.server_socket, manager) is pull
