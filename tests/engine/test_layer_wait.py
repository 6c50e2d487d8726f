"""The layer-wait Triton kernel (under TRITON_INTERPRET=1 on CPU tensors) and the fetch monitor."""

from __future__ import annotations

import threading
import time

import pytest

from basin_engine_ext.layer_wait import FAILED, READY, FetchMonitor, LayerGroupFlags, layer_groups

pytestmark = pytest.mark.engine


def test_layer_groups_cover_every_layer_once_in_order() -> None:
    groups = layer_groups(10, 4)
    assert [list(g) for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(ValueError):
        layer_groups(4, 0)


def test_kernel_waits_until_another_thread_sets_the_flag() -> None:
    flags = LayerGroupFlags(num_layers=8, layers_per_group=2)
    released_at: list[float] = []

    def publish() -> None:
        time.sleep(0.3)
        released_at.append(time.monotonic())
        flags.mark(2, READY)

    t0 = time.monotonic()
    threading.Thread(target=publish).start()
    flags.wait_layer(5)  # layer 5 is in group 2
    assert released_at and time.monotonic() >= released_at[0]
    assert time.monotonic() - t0 >= 0.29
    assert not flags.layer_failed(5)
    assert int(flags.status[2]) == READY


def test_a_ready_group_does_not_wait() -> None:
    flags = LayerGroupFlags(num_layers=4, layers_per_group=2)
    flags.mark(0, READY)
    t0 = time.monotonic()
    flags.wait_layer(1, max_spins=10)
    assert time.monotonic() - t0 < 5
    assert not flags.layer_failed(1)


def test_spin_bound_reports_failure_rather_than_reading_unconfirmed_pages() -> None:
    flags = LayerGroupFlags(num_layers=4, layers_per_group=2)
    flags.wait_layer(3, max_spins=50)
    assert flags.layer_failed(3)


def test_monitor_timeout_releases_the_waiting_kernel_and_falls_back() -> None:
    flags = LayerGroupFlags(num_layers=6, layers_per_group=2)
    delivered = iter([[0]])  # group 0 arrives, the rest never does

    monitor = FetchMonitor(flags, timeout_s=0.4, poll_ready=lambda: next(delivered, [])).start()
    t0 = time.monotonic()
    flags.wait_layer(0)
    assert not flags.layer_failed(0)
    flags.wait_layer(2)  # blocks until the monitor gives up
    waited = time.monotonic() - t0
    outcome = monitor.join(5)
    assert flags.layer_failed(2)
    assert outcome.reason == "timeout" and not outcome.complete and outcome.groups_ready == 1
    assert 0.35 <= waited < 5.0
    assert flags.host_state() == [READY, FAILED, FAILED]


def test_monitor_sees_a_lost_peer_before_the_deadline() -> None:
    flags = LayerGroupFlags(num_layers=4, layers_per_group=2)
    alive = threading.Event()
    alive.set()
    monitor = FetchMonitor(flags, timeout_s=30, poll_ready=lambda: [], peer_alive=alive.is_set).start()
    threading.Timer(0.2, alive.clear).start()
    flags.wait_layer(0)
    outcome = monitor.join(5)
    assert outcome.reason == "peer lost" and outcome.seconds < 5
    assert flags.layer_failed(0)


def test_monitor_completes_when_every_group_is_delivered() -> None:
    flags = LayerGroupFlags(num_layers=4, layers_per_group=1)
    batches = iter([[1], [0, 2], [3]])
    outcome = FetchMonitor(flags, timeout_s=5, poll_ready=lambda: next(batches, [])).start().join(5)
    assert outcome.complete and outcome.groups_ready == 4
    for layer in range(4):
        flags.wait_layer(layer)
        assert not flags.layer_failed(layer)
