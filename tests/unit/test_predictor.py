"""The peak-context predictor: cross-fitted accuracy, feature handling, persistence and bad input."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from basin.errors import BasinError
from basin.predictor import VERSION, PeakPredictor, evaluate, fit
from basin.workload import Call, Session, load_workload


def test_terminal_bench_rank_correlation_meets_the_target() -> None:
    result = evaluate(load_workload("terminal-bench", seed=0))  # leave-one-out, as the paper
    assert result.folds == 216
    assert result.spearman >= 0.6  # paper: 0.64
    assert 0.3 < result.log_error_sd < 0.8  # paper: 0.54


def test_swe_pro_and_lengths_only_mooncake(mooncake_slice: Path) -> None:
    assert evaluate(load_workload("swe-pro", seed=0)).spearman >= 0.45  # paper: 0.56
    mooncake = evaluate(load_workload(str(mooncake_slice)), folds=10)
    assert not mooncake.uses_text
    assert mooncake.spearman > 0.5


def test_held_out_words_cannot_leak_into_the_vocabulary() -> None:
    sessions = load_workload("terminal-bench", seed=1, sessions=60)
    model = fit(sessions[1:])
    task = sessions[0].task
    a = model.predict_log([task + " zyzzyva"], [sessions[0].first_prompt_tokens])
    b = model.predict_log([task + " quuxqux"], [sessions[0].first_prompt_tokens])
    # Unknown words of equal length carry no weight.
    assert a == pytest.approx(b)
    assert "zyzzyva" not in model.vocabulary


def test_length_coefficients_are_not_shrunk() -> None:
    sessions = load_workload("terminal-bench", seed=2, sessions=120)
    heavy = fit(sessions, alpha=1e9)  # text coefficients shrunk to ~0
    assert np.abs(heavy.text_coef).max() < 1e-5
    assert heavy.length_coef[1] > 0.1  # a longer first prompt still predicts a larger peak
    small = heavy.predict("Fix it.", 5_000)
    large = heavy.predict("Fix it.", 40_000)
    assert large > small


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    sessions = load_workload("swe-pro", seed=0)
    model = fit(sessions)
    path = tmp_path / "model.json"
    model.save(path)
    loaded = PeakPredictor.load(path)
    tasks, first = [s.task for s in sessions], [s.first_prompt_tokens for s in sessions]
    assert np.allclose(loaded.predict_log(tasks, first), model.predict_log(tasks, first))


def test_incompatible_or_foreign_files_are_refused(tmp_path: Path) -> None:
    model = fit(load_workload("swe-pro", seed=0, sessions=20))
    data = model.to_dict()
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**data, "version": VERSION + 1}))
    with pytest.raises(BasinError, match="retrain"):
        PeakPredictor.load(old)
    foreign = tmp_path / "foreign.json"
    foreign.write_text('{"weights": [1, 2]}')
    with pytest.raises(BasinError, match="not a Basin peak-predictor model"):
        PeakPredictor.load(foreign)
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(BasinError, match="cannot read"):
        PeakPredictor.load(broken)


def _session(sid: str, peak: int, task: str = "Fix the build.") -> Session:
    return Session(sid, task, (Call(1000, 1000, 10, 1.0), Call(peak - 20, peak - 1010, 20)))


def test_degenerate_training_sets_are_errors() -> None:
    with pytest.raises(BasinError, match="at least 3 sessions"):
        fit([_session("a", 5000), _session("b", 6000)])
    with pytest.raises(BasinError, match="same peak context"):
        fit([_session(str(i), 5000) for i in range(5)])
    mixed = [_session("a", 5000), _session("b", 7000, task=""), _session("c", 9000)]
    with pytest.raises(BasinError, match="1 of 3 sessions have no task text"):
        fit(mixed)
    with pytest.raises(BasinError, match="alpha"):
        fit([_session(str(i), 5000 + i) for i in range(5)], alpha=0)


def test_lengths_only_model_for_sessions_without_text() -> None:
    sessions = [replace(s, task="") for s in load_workload("terminal-bench", seed=0, sessions=50)]
    model = fit(sessions)
    assert not model.uses_text and model.vocabulary == ()
    assert model.predict("", 30_000) > model.predict("", 3_000)
