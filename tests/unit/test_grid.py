"""The fluid model against the simulator on deployments at both ends of the grid."""

from basin.grid import GridPoint, agreement, run_grid


def test_model_and_simulator_agree_on_a_cache_first_and_a_decode_first_deployment() -> None:
    cache_first, decode_first = run_grid(points=[("h200-1p3d", 0.0, 1.0), ("h200-1p1d", 2.0, 1.0)])
    assert (cache_first.model_first_limit, cache_first.simulated_first_limit) == ("cache", "cache")
    assert (decode_first.model_first_limit, decode_first.simulated_first_limit) == ("decode", "decode")
    assert cache_first.model_ratio < 1 < decode_first.model_ratio


def test_agreement_counts() -> None:
    points = [
        GridPoint("a", 0, 1, "cache", 0.5, "cache", 5.0),
        GridPoint("b", 0, 1, "cache", 0.5, "decode", 5.0),
        GridPoint("c", 0, 1, "decode", 1.5, "cache", 5.0),
        GridPoint("d", 0, 1, "decode", 1.5, "none", None),
    ]
    summary = agreement(points)
    assert summary["simulated_cache_first"] == 2
    assert summary["flagged_of_simulated_cache_first"] == 1
    assert summary["agreement"] == 0.5
