"""Building a policy for a simulation: BASIN gets its deployment profile and peak predictions here.

The profile defaults to κ = 1 and λc = the fluid model's departure peak (run `basin profile --simulate`
for measured values). Predictions of a session's peak context come from one of:
- `predictor`: the trained predictor, cross-fitted over the workload (each trajectory predicted by a model
  that never saw it, ten folds), as the paper evaluates it;
- `oracle`: the true peak;
- `noisy:SIGMA`: the true peak times a log-normal error of spread SIGMA (paper Fig. 24b).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from basin.errors import BasinError
from basin.policy import NEEDS_PREDICTOR, NEEDS_PROFILE, DeploymentProfile, Policy, SessionInfo, make_policy
from basin.sim.deployments import Deployment
from basin.workload.model import Session

PREDICTION_FOLDS = 10


def peak_predictions(pool: Sequence[Session], mode: str, seed: int) -> dict[str, float]:
    """Predicted peak context per trajectory id."""
    truth = {s.session_id: float(s.peak_context_tokens) for s in pool}
    if mode == "oracle":
        return truth
    if mode.startswith("noisy:"):
        try:
            sigma = float(mode.split(":", 1)[1])
        except ValueError:
            raise BasinError(f"--prediction noisy:SIGMA needs a number, got {mode!r}") from None
        if sigma < 0:
            raise BasinError(f"prediction noise must not be negative, got {sigma}")
        rng = np.random.default_rng(seed)
        return {sid: peak * float(np.exp(sigma * rng.standard_normal())) for sid, peak in truth.items()}
    if mode == "predictor":
        from basin.predictor import cross_fitted_log_predictions

        folds = min(PREDICTION_FOLDS, len(pool))
        logs, _ = cross_fitted_log_predictions(pool, folds=folds, seed=seed)
        return {s.session_id: float(np.exp(v)) for s, v in zip(pool, logs, strict=True)}
    raise BasinError(f"unknown prediction mode {mode!r}; choose predictor, oracle or noisy:SIGMA")


def default_profile(
    deployment: Deployment,
    pool: Sequence[Session],
    kappa: float | None = None,
    lambda_c_per_min: float | None = None,
) -> DeploymentProfile:
    from basin.fluid import FluidModel, FluidParameters, analyze

    params = FluidParameters.from_workload(deployment, pool, kappa or 1.0)
    if lambda_c_per_min is None:
        lambda_c_per_min = analyze(FluidModel(params), 0.0).d_peak_per_min
    return DeploymentProfile(
        kappa=1.0 if kappa is None else kappa,
        lambda_c_per_min=lambda_c_per_min,
        prefill_gpu_tokens=deployment.prefill_cache_tokens,
        host_tokens=deployment.host_cache_tokens,
        decode_kv_tokens=deployment.decode_kv_tokens,
        prefill_tokens_per_s=params.prefill_tokens_per_s,
    )


def build_policy(
    name: str,
    deployment: Deployment,
    pool: Sequence[Session],
    seed: int = 0,
    prediction: str = "predictor",
    kappa: float | None = None,
    lambda_c_per_min: float | None = None,
) -> Policy:
    if name not in NEEDS_PROFILE:
        return make_policy(name)
    profile = default_profile(deployment, pool, kappa, lambda_c_per_min)
    if name not in NEEDS_PREDICTOR:
        return make_policy(name, profile)
    predictions = peak_predictions(pool, prediction, seed)
    fallback = float(np.median(list(predictions.values())))

    def predict(info: SessionInfo) -> float:
        return predictions.get(info.source_id, fallback)

    lookup: Callable[[SessionInfo], float] = predict
    return make_policy(name, profile, lookup)
