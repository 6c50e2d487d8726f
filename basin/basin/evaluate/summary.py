"""Metrics of a run: windows, goodput, slowdown, the run label (paper §7.1) and L_late (§4).

Definitions (docs/metrics.md):
- A call belongs to the window holding its first token (TTFT) or its prefill start (hit rate);
  uncached prefill tokens count at prefill completion; state (active sessions, working set, decode KV)
  is the mean of the samples in the window.
- Session metrics cover non-warm sessions arriving in the measurement period (the run minus its last
  30 minutes, as the paper's 2 h runs measure arrivals of the first 90 minutes).
- Goodput: such sessions that completed with slowdown <= 4 and >= 95 % of decode steps within the ITL
  SLO, per hour of the measurement period.
- First-call wait: arrival to first token, whatever held the session (gateway or engine queues); a
  session still waiting at the end of the run counts with its wait so far (a lower bound).
- A 20-minute window is degraded if its median TTFT > 5 s, its arrivals' median first-call wait > 5 min,
  or >= 25 % of its arrivals never start (no first token by the end of the run). Its severity is the
  largest of those three ratios to their thresholds.
- The final two 20-minute windows decide the label: neither degraded -> healthy; the last improves on
  the previous (severity down by >= 25 %, or the last not degraded) -> recovering; both degraded, not
  improving, hit rate >= 0.10 below the pre-trigger rate in both -> trapped; otherwise overloaded.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from basin.evaluate.records import RunRecords

SHORT_WINDOW_S = 120.0
LONG_WINDOW_S = 1200.0
LATE_S = 1800.0  # L_late and the "late" figures look at the final 30 minutes
SLOWDOWN_SLO = 4.0
ITL_SHARE_SLO = 0.05
DEGRADED_TTFT_S = 5.0
DEGRADED_WAIT_S = 300.0
DEGRADED_NEVER_START = 0.25
HIT_DROP = 0.10  # reuse counts as lost this far below its healthy level (trapped label; grid cache limit)
IMPROVING = 0.25


def _quantile(values: list[float], q: float) -> float:
    return float(np.quantile(values, q)) if values else math.nan


def _nan_to_none(value: float) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


@dataclass
class Window:
    start_s: float
    end_s: float
    calls_first_token: int
    median_ttft_s: float
    p90_ttft_s: float
    hit_rate: float
    uncached_prefill_tokens_per_s: float
    active_sessions: float
    parked_sessions: float
    working_set_tokens: float
    working_set_over_cache: float
    decode_kv_decoding_tokens: float
    decode_kv_waiting_tokens: float
    completed_calls_per_min: float
    arrivals: int
    median_first_call_wait_s: float
    never_start_fraction: float

    @property
    def degraded(self) -> bool:
        return self.severity > 1.0

    @property
    def severity(self) -> float:
        ratios = [
            self.median_ttft_s / DEGRADED_TTFT_S if not math.isnan(self.median_ttft_s) else 0.0,
            self.median_first_call_wait_s / DEGRADED_WAIT_S
            if not math.isnan(self.median_first_call_wait_s)
            else 0.0,
            self.never_start_fraction / DEGRADED_NEVER_START if self.arrivals else 0.0,
        ]
        # Exactly at a threshold counts as degraded for the never-start rule (">= 25 %").
        if self.arrivals and self.never_start_fraction >= DEGRADED_NEVER_START:
            ratios[2] = max(ratios[2], 1.0 + 1e-9)
        return max(ratios)

    def to_dict(self) -> dict[str, float | int | bool | None]:
        out: dict[str, float | int | bool | None] = {k: _nan_to_none(v) for k, v in asdict(self).items()}
        out["degraded"] = self.degraded
        return out


def windows(records: RunRecords, size_s: float) -> list[Window]:
    """Per-window metrics over [0, duration) in steps of `size_s` (a partial last window is dropped)."""
    count = int(records.duration_s // size_s)
    ttft: list[list[float]] = [[] for _ in range(count)]
    # Plain float lists, not numpy arrays: one scalar update per call is several times cheaper, and
    # the sums are the same float64 additions in the same order.
    cached = [0.0] * count
    prompt = [0.0] * count
    uncached = [0.0] * count
    completed = [0.0] * count
    end = count * size_s
    for call in records.calls:
        if call.first_token_s is not None and call.first_token_s < end:
            ttft[int(call.first_token_s // size_s)].append(call.first_token_s - call.released_s)
        if call.prefill_start_s is not None and call.prefill_start_s < end:
            k = int(call.prefill_start_s // size_s)
            cached[k] += call.cached_tokens
            prompt[k] += call.prompt_tokens
        if call.prefill_done_s is not None and call.prefill_done_s < end:
            uncached[int(call.prefill_done_s // size_s)] += call.uncached_tokens
        if call.done_s is not None and call.done_s < end:
            completed[int(call.done_s // size_s)] += 1
    waits: list[list[float]] = [[] for _ in range(count)]
    arrivals = np.zeros(count, dtype=int)
    never = np.zeros(count, dtype=int)
    for session in records.sessions:
        if session.warm or session.arrival_s >= count * size_s:
            continue
        k = int(session.arrival_s // size_s)
        arrivals[k] += 1
        if not session.started:
            never[k] += 1
        wait = session.first_call_wait_until_s(records.duration_s)
        if wait is not None:
            waits[k].append(wait)
    sample_sums: dict[int, list] = {}
    for sample in records.samples:
        k = int(sample.t // size_s)
        if k < count:
            sample_sums.setdefault(k, []).append(sample)
    result = []
    for k in range(count):
        samples = sample_sums.get(k, [])

        def mean(attr: str, samples: list = samples) -> float:
            values = [v for s in samples if (v := getattr(s, attr)) is not None]
            return float(np.mean(values)) if values else math.nan

        working_set = mean("working_set_tokens")
        result.append(
            Window(
                start_s=k * size_s,
                end_s=(k + 1) * size_s,
                calls_first_token=len(ttft[k]),
                median_ttft_s=_quantile(ttft[k], 0.5),
                p90_ttft_s=_quantile(ttft[k], 0.9),
                hit_rate=float(cached[k] / prompt[k]) if prompt[k] else math.nan,
                uncached_prefill_tokens_per_s=float(uncached[k] / size_s),
                active_sessions=mean("active_sessions"),
                parked_sessions=mean("parked_sessions"),
                working_set_tokens=working_set,
                working_set_over_cache=working_set / records.cache_tokens
                if records.cache_tokens
                else math.nan,
                decode_kv_decoding_tokens=mean("decode_kv_decoding_tokens"),
                decode_kv_waiting_tokens=mean("decode_kv_waiting_tokens"),
                completed_calls_per_min=float(completed[k] / (size_s / 60)),
                arrivals=int(arrivals[k]),
                median_first_call_wait_s=_quantile(waits[k], 0.5),
                never_start_fraction=float(never[k] / arrivals[k]) if arrivals[k] else 0.0,
            )
        )
    return result


def hit_rate_between(records: RunRecords, start_s: float, end_s: float) -> float:
    cached = prompt = 0
    for call in records.calls:
        if call.prefill_start_s is not None and start_s <= call.prefill_start_s < end_s:
            cached += call.cached_tokens
            prompt += call.prompt_tokens
    return cached / prompt if prompt else math.nan


def label_run(records: RunRecords, long_windows: list[Window]) -> tuple[str, str]:
    """The run's state from its final two 20-minute windows (§7.1); returns (label, reason)."""
    if len(long_windows) < 2:
        return "unknown", "the run is shorter than two 20-minute windows"
    previous, last = long_windows[-2], long_windows[-1]
    trigger = records.trigger_s if records.trigger_s is not None else LONG_WINDOW_S
    pre_hit = hit_rate_between(records, 0.0, trigger)
    if not previous.degraded and not last.degraded:
        return "healthy", "neither final window is degraded"
    improving = not last.degraded or last.severity <= (1 - IMPROVING) * previous.severity
    if improving:
        return "recovering", (f"final-window severity {last.severity:.2f} after {previous.severity:.2f}")
    hits_low = all(
        not math.isnan(w.hit_rate) and not math.isnan(pre_hit) and w.hit_rate <= pre_hit - HIT_DROP
        for w in (previous, last)
    )
    if previous.degraded and last.degraded and hits_low:
        return "trapped", (
            f"both final windows degraded without improvement; hit rate "
            f"{previous.hit_rate:.2f}, {last.hit_rate:.2f} vs {pre_hit:.2f} before the trigger"
        )
    return "overloaded", "degraded without improvement while keeping cache reuse"


@dataclass
class Summary:
    goodput_sessions_per_h: float
    completed_fraction: float
    shed_fraction: float
    rejected_fraction: float
    measured_sessions: int
    label: str
    label_reason: str
    hit_rate_pre: float
    hit_rate_late: float
    median_ttft_late_s: float
    l_late_s: float
    late_window_s: float  # what the late figures cover: the final 30 minutes, or the whole of a shorter run
    median_slowdown: float
    median_first_call_wait_s: float
    p90_first_call_wait_s: float
    itl_violating_session_fraction: float
    windows: list[Window]
    windows_20min: list[Window]

    def to_dict(self) -> dict:
        out = {k: _nan_to_none(v) for k, v in asdict(self).items() if k not in ("windows", "windows_20min")}
        out["windows"] = [w.to_dict() for w in self.windows]
        out["windows_20min"] = [w.to_dict() for w in self.windows_20min]
        return out


def summarize(records: RunRecords, measure_until_s: float | None = None) -> Summary:
    duration = records.duration_s
    until = measure_until_s if measure_until_s is not None else max(duration - LATE_S, duration / 2)
    measured = [s for s in records.sessions if not s.warm and s.arrival_s < until]
    good = [
        s
        for s in measured
        if s.outcome == "completed"
        and (s.slowdown or math.inf) <= SLOWDOWN_SLO
        and s.itl_violation_share <= ITL_SHARE_SLO
    ]
    completed = [s for s in measured if s.outcome == "completed"]
    short, long = windows(records, SHORT_WINDOW_S), windows(records, LONG_WINDOW_S)
    label, reason = label_run(records, long)
    late_start = max(duration - LATE_S, 0.0)
    late_short = [w for w in short if w.start_s >= late_start]
    late_ttft = [
        c.ttft_s for c in records.calls if c.first_token_s is not None and c.first_token_s >= late_start
    ]
    waits = [w for s in measured if (w := s.first_call_wait_until_s(duration)) is not None]
    n = len(measured)
    trigger = records.trigger_s if records.trigger_s is not None else min(LONG_WINDOW_S, duration)
    return Summary(
        goodput_sessions_per_h=len(good) / (until / 3600) if until > 0 else 0.0,
        completed_fraction=len(completed) / n if n else math.nan,
        shed_fraction=sum(s.outcome == "shed" for s in measured) / n if n else math.nan,
        rejected_fraction=sum(s.outcome == "rejected" for s in measured) / n if n else math.nan,
        measured_sessions=n,
        label=label,
        label_reason=reason,
        hit_rate_pre=hit_rate_between(records, 0.0, trigger),
        hit_rate_late=hit_rate_between(records, late_start, duration),
        median_ttft_late_s=_quantile([t for t in late_ttft if t is not None], 0.5),
        l_late_s=max(
            (w.median_ttft_s for w in late_short if not math.isnan(w.median_ttft_s)), default=math.nan
        ),
        late_window_s=duration - late_start,
        median_slowdown=_quantile([s.slowdown for s in completed if s.slowdown is not None], 0.5),
        median_first_call_wait_s=_quantile(waits, 0.5),
        p90_first_call_wait_s=_quantile(waits, 0.9),
        itl_violating_session_fraction=(
            sum(s.itl_violation_share > ITL_SHARE_SLO for s in completed) / len(completed)
            if completed
            else math.nan
        ),
        windows=short,
        windows_20min=long,
    )
