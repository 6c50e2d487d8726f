"""The fluid model of the session population (paper §5).

dN/dt = λ(t) − X(N)/K (Eq. 1): sessions arrive at λ and leave at call throughput over calls per session.
X(N) is the smooth minimum of three bounds:
- closed loop: N / (g + L(N)), each session has one call in flight or is running a tool; L(N) is the
  unloaded call time L0 plus the decode slowdown of the batch the population implies (the paper writes
  L0; on one decode instance the batch lengthens calls enough to move the crossover, docs/models.md);
- prefill: μ_p / u(N), with uncached work per call u(N) = max(n_new, (1 − h(W/C)) P) and W = N c̄;
- decode: requests whose KV fits decode memory, over their decode time.
The departure curve D(N) = X(N)/K rises, peaks at N*, and (when the cache limits first) falls toward the
low-reuse rate D_low. A base rate between D_low and D(N*) meets it twice: a stable equilibrium N_s and an
unstable one N_u past which the population keeps growing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from basin.errors import BasinError
from basin.hitcurve import KNEE, reference_hit_rate
from basin.sim.costs import decode_step_seconds, prefill_seconds, unloaded_call_times
from basin.sim.deployments import Deployment
from basin.workload.model import Session

SMOOTH_MIN_POWER = 8.0
CACHE_FIRST_TOLERANCE = 0.01  # §5: a 1 % tolerance at the crossover


@dataclass(frozen=True)
class FluidParameters:
    """Inputs of the model, in tokens and seconds; `from_workload` derives them."""

    calls_per_session: float  # K
    tool_gap_s: float  # g: mean gap between a response and the next call
    unloaded_call_s: float  # L0
    prompt_tokens: float  # P: mean prompt
    new_tokens: float  # n_new: uncached by construction (new suffix plus the previous output)
    context_tokens: float  # c̄: mean context of active sessions (time-weighted)
    output_tokens: float
    cache_tokens: float  # C = max(C_G, C_H), aggregate over prefill instances
    decode_kv_tokens: float  # D_KV, aggregate
    prefill_tokens_per_s: float  # μ_p, aggregate, at the mean prompt position
    decode_requests_fit: float  # requests whose reservation fits decode memory, aggregate
    decode_call_s: float  # decode time of one call at that batch
    decode_instances: float
    decode_slowdown_s: float  # how much longer one call's decode gets per extra request in its batch
    kappa: float = 1.0

    @property
    def service_fraction(self) -> float:
        """f = L0 / (L0 + g): the share of an unloaded session's time spent with a call in service."""
        return self.unloaded_call_s / (self.unloaded_call_s + self.tool_gap_s)

    @classmethod
    def from_workload(
        cls, deployment: Deployment, sessions: Sequence[Session], kappa: float = 1.0
    ) -> FluidParameters:
        if not sessions:
            raise BasinError("the workload holds no sessions")
        if kappa <= 0:
            raise BasinError(f"kappa must be positive, got {kappa}")
        gpu = deployment.gpu
        prompts, news, outputs, gaps, contexts, weights, services = [], [], [], [], [], [], []
        for session in sessions:
            times = unloaded_call_times(gpu, session)
            previous = None
            for index, call in enumerate(session.calls):
                prompts.append(call.prompt_tokens)
                outputs.append(call.output_tokens)
                carried = 0 if previous is None else min(call.carried_tokens, previous.prompt_tokens)
                news.append(call.prompt_tokens - carried)
                gaps.append(call.tool_gap_s)
                services.append(times[index] - call.tool_gap_s)
                contexts.append(call.context_tokens)
                weights.append(times[index])  # time the session spends at this context
                previous = call
        prompt = float(np.mean(prompts))
        output = float(np.mean(outputs))
        reservation = prompt + deployment.reserved_decode_tokens
        per_instance = max(gpu.decode_kv_tokens // reservation, 1)
        context = prompt + output / 2
        step = decode_step_seconds(gpu, int(per_instance), per_instance * context)
        extra_request_s = decode_step_seconds(gpu, 2, 2 * context) - decode_step_seconds(gpu, 1, context)
        per_token = prefill_seconds(gpu, 1, int(prompt / 2))
        calls = sum(len(s.calls) for s in sessions)
        return cls(
            calls_per_session=calls / len(sessions),
            tool_gap_s=float(np.sum(gaps) / calls),
            unloaded_call_s=float(np.mean(services)),
            prompt_tokens=prompt,
            new_tokens=float(np.mean(news)),
            context_tokens=float(np.average(contexts, weights=weights)),
            output_tokens=output,
            cache_tokens=float(deployment.cache_tokens),
            decode_kv_tokens=float(deployment.decode_kv_tokens),
            prefill_tokens_per_s=deployment.prefill_instances / per_token,
            decode_requests_fit=float(per_instance * deployment.decode_instances),
            decode_call_s=output * step,
            decode_instances=float(deployment.decode_instances),
            decode_slowdown_s=output * extra_request_s,
            kappa=kappa,
        )


class FluidModel:
    def __init__(self, params: FluidParameters) -> None:
        self.p = params

    # --------------------------------------------------------------- bounds (calls per second)
    def call_seconds(self, n: np.ndarray) -> np.ndarray:
        """L(N): the unloaded call time plus the decode slowdown at the batch N sessions keep on each decode
        instance (N·f over the instances, f the unloaded service share), up to the batch that fits memory."""
        p = self.p
        fit = p.decode_requests_fit / p.decode_instances
        batch = np.clip(n * p.service_fraction / p.decode_instances, 1.0, max(fit, 1.0))
        return p.unloaded_call_s + p.decode_slowdown_s * (batch - 1.0)

    def closed_loop(self, n: np.ndarray) -> np.ndarray:
        return n / (self.p.tool_gap_s + self.call_seconds(n))

    def hit_rate(self, n: np.ndarray) -> np.ndarray:
        return reference_hit_rate(n * self.p.context_tokens / self.p.cache_tokens, self.p.kappa)

    def uncached_per_call(self, n: np.ndarray) -> np.ndarray:
        return np.maximum(self.p.new_tokens, (1.0 - self.hit_rate(n)) * self.p.prompt_tokens)

    def prefill_bound(self, n: np.ndarray) -> np.ndarray:
        return self.p.prefill_tokens_per_s / self.uncached_per_call(n)

    def decode_bound(self) -> float:
        return self.p.decode_requests_fit / self.p.decode_call_s

    def throughput(self, n: np.ndarray) -> np.ndarray:
        """X(N): the smooth minimum (a power mean with a large negative exponent) of the three bounds."""
        n = np.maximum(np.asarray(n, dtype=float), 1e-9)
        bounds = np.stack([self.closed_loop(n), self.prefill_bound(n), np.full_like(n, self.decode_bound())])
        return np.sum(bounds**-SMOOTH_MIN_POWER, axis=0) ** (-1.0 / SMOOTH_MIN_POWER)

    def departures_per_min(self, n: np.ndarray) -> np.ndarray:
        """D(N) = X(N) / K, in sessions per minute."""
        return self.throughput(n) / self.p.calls_per_session * 60.0

    def population_grid(self) -> np.ndarray:
        """Populations from 0 to well past the cliff (four times the knee's working set)."""
        top = 4.0 * KNEE * self.p.kappa * self.p.cache_tokens / self.p.context_tokens
        return np.linspace(0.0, max(top, 10.0), 4001)[1:]


@dataclass(frozen=True)
class Analysis:
    first_limit: str  # "cache" or "decode"
    n_peak: float
    d_peak_per_min: float
    d_low_per_min: float
    vulnerable_range_per_min: tuple[float, float]
    base_rate_per_min: float
    n_stable: float | None
    n_unstable: float | None
    state: str  # below-low-reuse, vulnerable, overloaded, decode-limited
    cache_first_ratio: float  # peak of min(closed loop, prefill) over the decode bound
    cliff_population: float  # N_c ≈ κ x_k C / c̄
    decode_fill_population: float  # N_d ≈ D_KV / (f c̄)
    eq2_cache_first: bool  # Eq. 2: C ≲ D_KV / (2 f), with the knee's factor
    service_fraction: float  # f: share of a session's time in service
    backlog_sessions: float
    drain_minutes: float | None  # Eq. 4: S / (D(N*) − λ)
    parameters: FluidParameters

    def to_dict(self) -> dict:
        out = asdict(self)
        out["vulnerable_range_per_min"] = list(self.vulnerable_range_per_min)
        return out


def analyze(model: FluidModel, base_rate_per_min: float, backlog_sessions: float = 0.0) -> Analysis:
    if base_rate_per_min < 0:
        raise BasinError(f"base rate must not be negative, got {base_rate_per_min}")
    if backlog_sessions < 0:
        raise BasinError(f"backlog must not be negative, got {backlog_sessions}")
    p = model.p
    n = model.population_grid()
    d = model.departures_per_min(n)
    peak = int(np.argmax(d))
    n_peak, d_peak = float(n[peak]), float(d[peak])
    d_low = float(d[peak:].min())
    lam = base_rate_per_min
    rising, falling = d[: peak + 1], d[peak:]
    n_stable = float(n[int(np.argmax(rising >= lam))]) if lam <= d_peak else None
    n_unstable = None
    if lam <= d_peak and (falling < lam).any():
        n_unstable = float(n[peak + int(np.argmax(falling < lam))])
    # Which resource limits first: the peak throughput without decode against the decode bound.
    without_decode = np.minimum(model.closed_loop(n), model.prefill_bound(n))
    ratio = float(without_decode.max() / model.decode_bound())
    first_limit = "cache" if ratio < 1.0 + CACHE_FIRST_TOLERANCE else "decode"
    f = p.service_fraction
    cliff_n = p.kappa * KNEE * p.cache_tokens / p.context_tokens
    decode_n = p.decode_kv_tokens / (f * p.context_tokens)
    if lam > d_peak:
        state = "overloaded"
    elif first_limit == "decode" and n_unstable is None:
        state = "decode-limited"
    elif n_unstable is None:
        state = "below-low-reuse"
    else:
        state = "vulnerable"
    drain = backlog_sessions / (d_peak - lam) if d_peak > lam else None
    return Analysis(
        first_limit=first_limit,
        n_peak=n_peak,
        d_peak_per_min=d_peak,
        d_low_per_min=d_low,
        vulnerable_range_per_min=(d_low, d_peak),
        base_rate_per_min=lam,
        n_stable=n_stable,
        n_unstable=n_unstable,
        state=state,
        cache_first_ratio=ratio,
        cliff_population=cliff_n,
        decode_fill_population=decode_n,
        eq2_cache_first=cliff_n < decode_n,
        service_fraction=f,
        backlog_sessions=backlog_sessions,
        drain_minutes=drain,
        parameters=p,
    )


def plot_departures(model: FluidModel, analysis: Analysis, out: str, title: str = "") -> None:
    """D(N) against the base arrival rate with the equilibria marked (paper Fig. 9a)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = model.population_grid()
    fig, ax = plt.subplots(figsize=(6.4, 4.0), constrained_layout=True)
    ax.plot(n, model.departures_per_min(n), color="tab:blue", label="departures D(N)")
    ax.axhline(analysis.base_rate_per_min, color="tab:gray", linestyle="--", label="base arrivals λ")
    for value, marker, label in (
        (analysis.n_stable, "o", "stable N_s"),
        (analysis.n_unstable, "x", "unstable N_u"),
    ):
        if value is not None:
            ax.plot(
                [value],
                [analysis.base_rate_per_min],
                marker=marker,
                color="tab:red",
                markersize=9,
                linestyle="none",
                label=label,
            )
    ax.plot(
        [analysis.n_peak],
        [analysis.d_peak_per_min],
        marker="^",
        color="tab:green",
        linestyle="none",
        label="peak N*",
    )
    ax.set_xlabel("Active sessions N")
    ax.set_ylabel("Sessions per minute")
    ax.set_title(title or f"first limit: {analysis.first_limit}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(out, dpi=120)
    plt.close(fig)
