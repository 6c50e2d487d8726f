"""BASIN_ENGINE_* settings: parsed, checked, and typos refused."""

from __future__ import annotations

import pytest

from basin_engine_ext.config import EngineExtConfig

pytestmark = pytest.mark.engine


def test_settings_are_read_from_the_environment() -> None:
    cfg = EngineExtConfig.from_env(
        {
            "BASIN_ENGINE_LENDING": "off",
            "BASIN_ENGINE_LEND_CAP": "0.7",
            "BASIN_ENGINE_ADOPT_HEADROOM": "0.2",
            "BASIN_ENGINE_RECLAIM_HEADROOM": "0.1",
            "BASIN_ENGINE_UNIT_PORT": "7400",
            "BASIN_ENGINE_FETCH_TIMEOUT": "0.5",
            "BASIN_ENGINE_LAYER_OVERLAP": "on",
            "PATH": "/usr/bin",
        }
    )
    assert (cfg.lending, cfg.lend_cap, cfg.adopt_headroom, cfg.reclaim_headroom) == (False, 0.7, 0.2, 0.1)
    assert cfg.unit_port == 7400 and cfg.fetch_timeout_s == 0.5 and cfg.bootstrap_priority and cfg.metrics
    assert cfg.layer_overlap and not EngineExtConfig().layer_overlap  # off by default until run on a GPU
    assert EngineExtConfig.from_env({}) == EngineExtConfig()


@pytest.mark.parametrize(
    "env, message",
    [
        ({"BASIN_ENGINE_LEND_CAP": "1.5"}, "lend_cap"),
        ({"BASIN_ENGINE_RECLAIM_HEADROOM": "0.2"}, "lower margin"),  # above the adoption margin
        ({"BASIN_ENGINE_LENDING": "maybe"}, "not a boolean"),
        ({"BASIN_ENGINE_UNIT_PORT": "70000"}, "TCP port"),
        ({"BASIN_ENGINE_FETCH_TIMEOUT": "0"}, "fetch_timeout_s"),
        ({"BASIN_ENGINE_LAYER_WAIT_TIMEOUT_S": "2"}, "unknown setting"),
    ],
)
def test_bad_settings_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineExtConfig.from_env(env)
