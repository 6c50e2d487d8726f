"""Deployment shapes beyond the named presets: the calibration is per instance, the shape counts them."""

from __future__ import annotations

import pytest

from basin.errors import BasinError
from basin.sim import PRESETS, get_deployment


def test_any_shape_of_a_calibrated_gpu_scales_its_capacities_by_instance() -> None:
    one = get_deployment("h200-1p3d")
    two = get_deployment("h200-2p3d")
    assert (two.prefill_instances, two.decode_instances) == (2, 3)
    assert two.prefill_cache_tokens == 2 * one.prefill_cache_tokens
    assert two.decode_kv_tokens == one.decode_kv_tokens
    assert two.host_tier == 2.0 and get_deployment("h100-2p2d", host_tier=0).host_tier == 0
    assert get_deployment("h200-2p6d") == PRESETS["h200-2p6d"]  # a preset keeps its own settings


@pytest.mark.parametrize("name", ["h300-1p1d", "h200-0p1d", "h200-1p", "h200-1p3d-x", "H200-1p3d"])
def test_an_unknown_shape_is_a_one_line_error_naming_the_choices(name: str) -> None:
    with pytest.raises(BasinError, match=r"choose one of h100-1p1d.*<gpu>-<P>p<D>d"):
        get_deployment(name)
