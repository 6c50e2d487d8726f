"""The profile gauges the dashboards and alerts read: κ, λc, the cliff, the profile's age and its ramps,
exported under every policy (the cliff alert watches HiCache alone too)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from basin.hitcurve import KNEE
from basin_gateway.build import preset_profile, read_profile
from basin_gateway.coordinator import Coordinator


def rows_by_name(rows: list[tuple[str, str, dict[str, str], float]]) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for name, _, labels, value in rows:
        out.setdefault(name, []).append((labels, value))
    return out


def test_a_measured_profile_exports_kappa_lambda_cliff_age_and_ramps(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {
                "kappa": 0.8,
                "lambda_c_per_min": 12.5,
                "prefill_gpu_tokens": 1_000_000,
                "host_tokens": 2_000_000,
                "decode_kv_tokens": 3_000_000,
                "profiled_at": "2026-12-01T10:00:00Z",
                "ramps": [
                    [
                        {"working_set_over_cache": 0.5, "hit_rate": 0.95, "departures_per_min": 3.0},
                        {"working_set_over_cache": None, "hit_rate": None, "departures_per_min": 1.0},
                        {"working_set_over_cache": 2.1, "hit_rate": 0.4, "departures_per_min": 6.0},
                    ]
                ],
            }
        )
    )
    loaded = read_profile(str(path))
    assert loaded is not None
    rows = rows_by_name(Coordinator.profile_rows(loaded))
    assert rows["cliff_tokens"] == [({}, 0.8 * KNEE * 2_000_000)]
    assert rows["profile_kappa"] == [({}, 0.8)]
    assert rows["profile_lambda_c_per_min"] == [({}, 12.5)]
    assert rows["profile_cache_tokens"] == [({}, 2_000_000)]
    assert rows["profile_timestamp_seconds"] == [({}, 1_796_119_200.0)]
    # The step without a measured hit rate is left out; the others are numbered in order.
    assert rows["profile_ramp_hit_rate"] == [
        ({"ramp": "0", "step": "0"}, 0.95),
        ({"ramp": "0", "step": "1"}, 0.4),
    ]
    assert [v for _, v in rows["profile_ramp_working_set_ratio"]] == [0.5, 2.1]


def test_a_preset_profile_has_no_measurement_time() -> None:
    rows = rows_by_name(Coordinator.profile_rows(preset_profile("h200-1p3d")))
    assert math.isnan(rows["profile_timestamp_seconds"][0][1])
    assert "profile_ramp_hit_rate" not in rows
    assert rows["cliff_tokens"][0][1] > 0
