import numpy as np
import pytest
from scipy.stats import spearmanr

from basin.workload import PUBLISHED, compute_stats
from basin.workload.synthetic import PROFILES, generate


@pytest.mark.parametrize("name", sorted(PROFILES))
@pytest.mark.parametrize("seed", [0, 1, 2, 7, 123])
def test_published_statistics_within_ten_percent(name: str, seed: int) -> None:
    stats = compute_stats(generate(name, seed)).to_dict()
    for key, target in PUBLISHED[name].items():
        assert stats[key] == pytest.approx(target, rel=0.10), (key, stats[key], target)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_sessions_are_valid_and_peak_is_reached(name: str) -> None:
    sessions = generate(name, seed=3)
    assert len({s.session_id for s in sessions}) == len(sessions)
    for session in sessions:
        session.validate()
        prompts = [c.prompt_tokens for c in session.calls]
        assert prompts == sorted(prompts), "synthetic prompts only grow"
        assert session.peak_context_tokens == session.calls[-1].context_tokens
        assert session.calls[-1].tool_gap_s == 0.0
        assert all(c.tool_gap_s > 0 for c in session.calls[:-1])


def test_same_seed_same_sessions_other_seed_differs() -> None:
    assert generate("terminal-bench", 5) == generate("terminal-bench", 5)
    assert generate("terminal-bench", 5) != generate("terminal-bench", 6)


def test_session_count_knob() -> None:
    assert len(generate("swe-pro", 0, sessions=12)) == 12
    with pytest.raises(ValueError):
        generate("swe-pro", 0, sessions=0)


def _cross_fitted_text_predictions(texts: list[str], target: np.ndarray) -> np.ndarray:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import Ridge
    from sklearn.model_selection import KFold, cross_val_predict
    from sklearn.pipeline import make_pipeline

    model = make_pipeline(TfidfVectorizer(), Ridge(alpha=1.0))
    return cross_val_predict(model, texts, target, cv=KFold(8, shuffle=True, random_state=0))


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_task_text_carries_real_but_imperfect_signal(name: str) -> None:
    sessions = generate(name, seed=11)
    peaks = np.log([s.peak_context_tokens for s in sessions])
    predicted = _cross_fitted_text_predictions([s.task for s in sessions], peaks)
    rho = spearmanr(predicted, peaks)[0]
    assert 0.3 < rho < 0.85, rho
    # No text names the size: there are no digits to read a label from.
    assert not any(ch.isdigit() for s in sessions for ch in s.task)
    # The same words are shared across sizes: texts of the smallest and largest sessions overlap.
    ordered = sorted(sessions, key=lambda s: s.peak_context_tokens)
    small = {w for s in ordered[: len(ordered) // 4] for w in s.task.split()}
    large = {w for s in ordered[-len(ordered) // 4 :] for w in s.task.split()}
    assert len(small & large) >= 10


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_tool_gaps_follow_their_mixture(name: str) -> None:
    """Each kind of tool run keeps its share of gaps: the calibration of reuse rests on the rare long ones."""
    kinds = PROFILES[name].tool_gaps
    assert sum(kind.share for kind in kinds) == pytest.approx(1.0)
    assert [kind.median_s for kind in kinds] == sorted(kind.median_s for kind in kinds)
    gaps = np.array([c.tool_gap_s for s in generate(name, seed=4) for c in s.calls[:-1]])
    slowest = kinds[-1]
    # Gaps above the slowest kind's 1st percentile are almost all of that kind.
    threshold = slowest.median_s * np.exp(-2.33 * slowest.sigma)
    assert np.mean(gaps >= threshold) == pytest.approx(slowest.share, rel=0.25)
