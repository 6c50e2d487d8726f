"""Peak-context predictor (paper §6.5): log peak context of a session from what its first call shows.

Features: TF-IDF of the task text, plus the log lengths of the task text and of the first prompt. Ridge
regression regularizes the text coefficients only; the two length coefficients are fitted freely (we
partial the lengths out of the text features and the target, fit ridge on the residuals, then fit the
length coefficients by least squares on what the text explains). Evaluation is cross-fitted: each session
is scored by a model trained on the others, whose vocabulary, IDF weights and centering come from that
training fold alone.

A trained model is saved as versioned JSON (no pickle): the gateway loads it without running code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from basin.errors import BasinError
from basin.workload.model import Session

FORMAT = "basin-peak-predictor"
VERSION = 1
DEFAULT_ALPHA = 1.0


@dataclass(frozen=True)
class PeakPredictor:
    vocabulary: tuple[str, ...]
    idf: np.ndarray
    text_coef: np.ndarray
    length_coef: np.ndarray  # for (log task characters + 1, log first-prompt tokens)
    feature_mean: np.ndarray  # centering of [tfidf..., lengths...] from the training set
    intercept: float
    alpha: float
    uses_text: bool
    trained_sessions: int

    # -------------------------------------------------------------- prediction
    def _features(self, tasks: Sequence[str], first_prompts: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        lengths = _length_features(tasks, first_prompts)
        if not self.uses_text:
            return np.zeros((len(tasks), 0)), lengths
        from sklearn.feature_extraction.text import TfidfVectorizer

        vectorizer = TfidfVectorizer(vocabulary={w: i for i, w in enumerate(self.vocabulary)})
        vectorizer.idf_ = self.idf
        return vectorizer.transform(tasks).toarray(), lengths

    def predict_log(self, tasks: Sequence[str], first_prompts: Sequence[int]) -> np.ndarray:
        text, lengths = self._features(tasks, first_prompts)
        n_text = text.shape[1]
        text = text - self.feature_mean[:n_text]
        lengths = lengths - self.feature_mean[n_text:]
        return self.intercept + text @ self.text_coef + lengths @ self.length_coef

    def predict(self, task: str, first_prompt_tokens: int) -> int:
        """Predicted peak context in tokens (prompt plus output) for one session."""
        return round(math.exp(float(self.predict_log([task], [first_prompt_tokens])[0])))

    # -------------------------------------------------------------- persistence
    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "vocabulary": list(self.vocabulary),
            "idf": self.idf.tolist(),
            "text_coef": self.text_coef.tolist(),
            "length_coef": self.length_coef.tolist(),
            "feature_mean": self.feature_mean.tolist(),
            "intercept": self.intercept,
            "alpha": self.alpha,
            "uses_text": self.uses_text,
            "trained_sessions": self.trained_sessions,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> PeakPredictor:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BasinError(f"cannot read predictor model {path}: {exc}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BasinError(f"{path} is not a Basin peak-predictor model")
        if data.get("version") != VERSION:
            raise BasinError(
                f"{path} is a version {data.get('version')!r} predictor model; this Basin reads"
                f" version {VERSION}: retrain it with `basin predictor train`"
            )
        try:
            return cls(
                vocabulary=tuple(data["vocabulary"]),
                idf=np.asarray(data["idf"], dtype=float),
                text_coef=np.asarray(data["text_coef"], dtype=float),
                length_coef=np.asarray(data["length_coef"], dtype=float),
                feature_mean=np.asarray(data["feature_mean"], dtype=float),
                intercept=float(data["intercept"]),
                alpha=float(data["alpha"]),
                uses_text=bool(data["uses_text"]),
                trained_sessions=int(data["trained_sessions"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise BasinError(f"{path}: malformed predictor model ({exc})") from None


def _length_features(tasks: Sequence[str], first_prompts: Sequence[int]) -> np.ndarray:
    return np.column_stack(
        [
            np.log1p([len(t) for t in tasks]),
            np.log(np.maximum(np.asarray(first_prompts, dtype=float), 1.0)),
        ]
    )


def _check_training_set(sessions: Sequence[Session]) -> bool:
    """Validate a training set; returns whether it has task texts to learn from."""
    if len(sessions) < 3:
        raise BasinError(f"need at least 3 sessions to train the predictor, got {len(sessions)}")
    peaks = {s.peak_context_tokens for s in sessions}
    if len(peaks) == 1:
        raise BasinError("every session has the same peak context: there is nothing to learn")
    with_text = sum(1 for s in sessions if s.task.strip())
    if 0 < with_text < len(sessions):
        missing = next(s.session_id for s in sessions if not s.task.strip())
        raise BasinError(
            f"{len(sessions) - with_text} of {len(sessions)} sessions have no task text (first:"
            f" {missing!r}); give every session a task, or none for a lengths-only model"
        )
    return with_text > 0


def fit(sessions: Sequence[Session], alpha: float = DEFAULT_ALPHA) -> PeakPredictor:
    """Train on `sessions` (all of them: vocabulary, IDF and centering come from this set alone)."""
    if alpha <= 0:
        raise BasinError(f"alpha must be positive, got {alpha}")
    uses_text = _check_training_set(sessions)
    tasks = [s.task for s in sessions]
    first = [s.first_prompt_tokens for s in sessions]
    y = np.log([s.peak_context_tokens for s in sessions])
    lengths = _length_features(tasks, first)
    if uses_text:
        from sklearn.feature_extraction.text import TfidfVectorizer

        vectorizer = TfidfVectorizer()
        try:
            text = vectorizer.fit_transform(tasks).toarray()
        except ValueError as exc:  # e.g. only stop words
            raise BasinError(f"cannot build a vocabulary from the task texts: {exc}") from None
        vocabulary = tuple(sorted(vectorizer.vocabulary_, key=vectorizer.vocabulary_.__getitem__))
        idf = vectorizer.idf_
    else:
        text, vocabulary, idf = np.zeros((len(sessions), 0)), (), np.zeros(0)  # lengths-only model
    mean = np.concatenate([text.mean(axis=0), lengths.mean(axis=0)])
    text_c = text - mean[: text.shape[1]]
    lengths_c = lengths - mean[text.shape[1] :]
    y_mean = float(y.mean())
    y_c = y - y_mean
    # Partial the (unpenalized) length features out of the target and the text features.
    free = lengths_c[:, np.ptp(lengths_c, axis=0) > 0]
    if free.shape[1]:
        projector = free @ np.linalg.pinv(free)
        y_res, text_res = y_c - projector @ y_c, text_c - projector @ text_c
    else:
        y_res, text_res = y_c, text_c
    if text.shape[1]:
        from sklearn.linear_model import Ridge

        text_coef = Ridge(alpha=alpha, fit_intercept=False).fit(text_res, y_res).coef_
    else:
        text_coef = np.zeros(0)
    remainder = y_c - text_c @ text_coef
    length_coef = np.zeros(2)
    keep = np.ptp(lengths_c, axis=0) > 0
    if keep.any():
        length_coef[keep] = np.linalg.lstsq(lengths_c[:, keep], remainder, rcond=None)[0]
    return PeakPredictor(
        vocabulary,
        np.asarray(idf),
        np.asarray(text_coef),
        length_coef,
        mean,
        y_mean,
        alpha,
        uses_text,
        len(sessions),
    )


@dataclass(frozen=True)
class Evaluation:
    sessions: int
    folds: int
    spearman: float
    log_error_sd: float
    median_abs_log_error: float
    uses_text: bool

    def to_dict(self) -> dict:
        return {
            "sessions": self.sessions,
            "folds": self.folds,
            "spearman": self.spearman,
            "log_error_sd": self.log_error_sd,
            "median_abs_log_error": self.median_abs_log_error,
            "uses_text": self.uses_text,
        }


def cross_fitted_log_predictions(
    sessions: Sequence[Session], folds: int | None = None, seed: int = 0, alpha: float = DEFAULT_ALPHA
) -> tuple[np.ndarray, int]:
    """Each session's prediction from a model trained without it: leave-one-out up to 300 sessions
    (as the paper), else `folds` (default 10) shuffled folds. Returns (log predictions, folds used)."""
    _check_training_set(sessions)
    n = len(sessions)
    k = folds if folds is not None else (n if n <= 300 else 10)
    if not 2 <= k <= n:
        raise BasinError(f"folds must be between 2 and the number of sessions ({n}), got {k}")
    order = np.random.default_rng(seed).permutation(n)
    predictions = np.empty(n)
    for fold in np.array_split(order, k):
        held = set(fold.tolist())
        training = [s for i, s in enumerate(sessions) if i not in held]
        model = fit(training, alpha)
        chosen = [sessions[i] for i in fold]
        predictions[fold] = model.predict_log(
            [s.task for s in chosen], [s.first_prompt_tokens for s in chosen]
        )
    return predictions, k


def evaluate(
    sessions: Sequence[Session], folds: int | None = None, seed: int = 0, alpha: float = DEFAULT_ALPHA
) -> Evaluation:
    from scipy.stats import spearmanr

    predictions, k = cross_fitted_log_predictions(sessions, folds, seed, alpha)
    truth = np.log([s.peak_context_tokens for s in sessions])
    error = predictions - truth
    return Evaluation(
        sessions=len(sessions),
        folds=k,
        spearman=float(spearmanr(predictions, truth)[0]),
        log_error_sd=float(np.std(error)),
        median_abs_log_error=float(np.median(np.abs(error))),
        uses_text=bool(any(s.task.strip() for s in sessions)),
    )
