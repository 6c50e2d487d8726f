"""The paper's figures for the cells of our suites, so the seed report can set each measurement beside
its published target (issue 15 item 6).

Every number here is read from the prose of "When Cache Pressure Becomes a Trap" (/work/shared/paper),
with the figure it describes. The extracted figures themselves are unreadable (labels and columns
scrambled), so where the prose gives a range over several scenarios, the range is stored on each of
them and the note says so; where it gives only ratios, they are stored as ratios, in the paper's own
direction; nothing is read off a plot. A cell the paper does not give is absent (the report shows "—").
"""

from __future__ import annotations

from dataclasses import dataclass

# Kinds of figure: an absolute goodput, the system's goodput as a share of BASIN's, or BASIN's goodput as
# a multiple of the system's (the paper states both directions; we keep the one it uses).
SESSIONS_PER_H = "sessions/h"
OF_BASIN = "of BASIN"  # system / BASIN
BASIN_OVER = "BASIN over"  # BASIN / system


@dataclass(frozen=True)
class PaperFigure:
    """One published value or range; `approx` marks a value we place by inference (see `note`)."""

    low: float | None
    high: float | None = None
    kind: str = SESSIONS_PER_H
    source: str = ""
    note: str = ""
    state: str = ""  # the run state the paper reports for the cell, if it does
    approx: bool = False

    def text(self) -> str:
        """`1.64×`, `0.81–0.95 of BASIN`, `301.1/h`, `trapped`: the cell as the report prints it."""
        parts = []
        if self.low is not None:
            value = f"{self.low:g}" if self.high is None else f"{self.low:g}–{self.high:g}"
            if self.kind == SESSIONS_PER_H:
                parts.append(f"{value}/h")
            elif self.kind == OF_BASIN:
                parts.append(f"{value} of BASIN")
            else:
                parts.append(f"BASIN {value}×")
        if self.state:
            parts.append(self.state)
        return ("≈ " if self.approx else "") + " ".join(parts)


def _same(figure: PaperFigure, scenarios: tuple[str, ...], system: str) -> dict[tuple[str, str], PaperFigure]:
    return {(scenario, system): figure for scenario in scenarios}


_1P3D = ("1P3D x5 surge", "1P3D x5 surge, tools x3", "1P3D x5 surge, GPU-only")
_1P1D = ("1P1D x5 surge", "1P1D x5 surge, tools x3", "1P1D x5 surge, GPU-only")
_FIG14 = "Fig. 14, §7.3"
_MAIN_CELLS: dict[tuple[str, str], PaperFigure] = {
    # "On cache-first 1P3D, BASIN exceeds Continuum, the strongest baseline in all three cases, by 1.64×
    # under the default surge, 1.33× with longer tools and 2.05× with GPU-only caching."
    ("1P3D x5 surge", "Continuum"): PaperFigure(1.64, kind=BASIN_OVER, source=_FIG14),
    ("1P3D x5 surge, tools x3", "Continuum"): PaperFigure(1.33, kind=BASIN_OVER, source=_FIG14),
    ("1P3D x5 surge, GPU-only", "Continuum"): PaperFigure(2.05, kind=BASIN_OVER, source=_FIG14),
    # "Relative to HiCache, the gain is 3.13–4.17×" (over the three 1P3D scenarios).
    **_same(
        PaperFigure(3.13, 4.17, BASIN_OVER, _FIG14, "range over the three 1P3D scenarios"),
        _1P3D,
        "HiCache alone",
    ),
    # "CONCUR achieves 0.52 of BASIN's goodput under the default 1P3D surge and 0.24 with GPU-only caching."
    ("1P3D x5 surge", "CONCUR"): PaperFigure(0.52, kind=OF_BASIN, source="§7.5 (Fig. 14 scenario)"),
    ("1P3D x5 surge, GPU-only", "CONCUR"): PaperFigure(0.24, kind=OF_BASIN, source="§7.5 (Fig. 14 scenario)"),
    # "Across the 1P1D scenarios, Crossflow achieves 0.30–0.40 of the best system's goodput (Fig. 14)";
    # BASIN is the best in all six scenarios.
    **_same(
        PaperFigure(0.30, 0.40, OF_BASIN, "§7.5, Fig. 14", "range over the three 1P1D scenarios"),
        _1P1D,
        "Crossflow",
    ),
}
_MAIN_MARGINS: dict[str, PaperFigure] = {
    "1P3D x5 surge": PaperFigure(1.64, kind=BASIN_OVER, source=_FIG14, note="strongest: Continuum"),
    "1P3D x5 surge, tools x3": PaperFigure(1.33, kind=BASIN_OVER, source=_FIG14, note="strongest: Continuum"),
    "1P3D x5 surge, GPU-only": PaperFigure(2.05, kind=BASIN_OVER, source=_FIG14, note="strongest: Continuum"),
    **{s: PaperFigure(1.20, 1.48, BASIN_OVER, _FIG14, "range over the three 1P1D scenarios") for s in _1P1D},
}

_SWEEP = tuple(f"1P3D x{f} surge 20 min" for f in (3, 4, 5, 6)) + tuple(
    f"1P3D tools x3, x{f} surge 20 min" for f in (3, 4, 5, 6)
)
_FIG16 = "Fig. 16, §7.4"
_SWEEP_NOTE = "range over both panels, x3–x6"
_SWEEP_CELLS = {
    **_same(PaperFigure(2.71, 4.19, BASIN_OVER, _FIG16, _SWEEP_NOTE), _SWEEP, "HiCache alone"),
    # "Crossflow remains trapped throughout this range."
    **_same(PaperFigure(None, source=_FIG16, state="trapped"), _SWEEP, "Crossflow"),
}
_SWEEP_MARGINS = {s: PaperFigure(1.21, 1.63, BASIN_OVER, _FIG16, _SWEEP_NOTE) for s in _SWEEP}

_POST = tuple(f"1P3D GPU-only, +300 % surge, then {a:.1f} of λc" for a in (0.1, 0.3, 0.5))
_POST_CELLS = {
    # "BASIN achieves 1.00–1.38× Continuum's goodput after the +300% surge" (GPU-only and host tier).
    **_same(
        PaperFigure(
            1.00, 1.38, BASIN_OVER, "Fig. 22a, §7.8", "range over GPU-only and host tier, 0.1–0.5 λref"
        ),
        _POST,
        "Continuum",
    ),
    # §5.2: "After the +300% surge on GPU-only 1P3D, every seed recovers at 0.1 λref and remains trapped
    # at 0.2 λref" (HiCache alone, three seeds).
    (_POST[0], "HiCache alone"): PaperFigure(None, source="Fig. 10a, §5.2", state="recovers"),
    **_same(
        PaperFigure(
            None,
            source="Fig. 10a, §5.2",
            state="trapped",
            approx=True,
            note="the prose says trapped at 0.2 λref; 0.3 and 0.5 follow the figure's trend",
        ),
        _POST[1:],
        "HiCache alone",
    ),
}

_LATE = "1P3D x5 surge, systems on at minute 45"
_FIG21 = "Fig. 21b, §7.7 (five seeds)"
_LATE_CELLS = {
    (_LATE, "BASIN"): PaperFigure(301.1, source=_FIG21),
    (_LATE, "Continuum"): PaperFigure(167.8, source=_FIG21),
    (_LATE, "Composition"): PaperFigure(136.0, source=_FIG21),
    (_LATE, "HiCache alone"): PaperFigure(108.9, source=_FIG21, state="trapped"),
}

_HOST = ("1P3D host x2, x5 surge 20 min", "1P3D host x2, x3 surge 40 min")
_GPU = ("1P3D GPU-only, x5 surge 20 min",)
_SUSTAINED = ("1P3D host x2, sustained x4.5 60 min",)
_FIG23 = "Fig. 23, §7.9"
_HOST_NOTE = "range over the paper's host-tier triggers"
_GPU_NOTE = "range over the paper's GPU-only triggers"
_ABLATION_CELLS = {
    **_same(PaperFigure(0.81, 0.95, OF_BASIN, _FIG23, _HOST_NOTE), _HOST, "without priority order"),
    **_same(PaperFigure(0.31, 0.34, OF_BASIN, _FIG23, _GPU_NOTE), _GPU, "without priority order"),
    **_same(PaperFigure(0.62, 0.82, OF_BASIN, _FIG23, _HOST_NOTE), _HOST, "without admission"),
    **_same(
        PaperFigure(1.00, 1.03, OF_BASIN, _FIG23, "GPU-only, recovery and sustained overload"),
        _GPU,
        "without admission",
    ),
    # "... goodput falls to ... 0.55 under sustained overload" (without the order); "Under sustained overload
    # with the host tier, admission reduces the mean number of active sessions from 852 to 252 and the
    # prefill queue from 620 to 14 during minutes 60-75; it sheds 82 sessions and improves goodput by
    # 1.25x" (the same paragraph also counts sustained overload among runs within 1.00-1.03 without it).
    **_same(
        PaperFigure(0.55, None, OF_BASIN, _FIG23, "sustained overload"), _SUSTAINED, "without priority order"
    ),
    **_same(
        PaperFigure(1.25, None, BASIN_OVER, "§7.9", "sustained overload with the host tier"),
        _SUSTAINED,
        "without admission",
    ),
    **_same(PaperFigure(0.94, 1.03, OF_BASIN, _FIG23, _HOST_NOTE), _HOST + _SUSTAINED, "without lending"),
    **_same(
        PaperFigure(0.50, 0.89, OF_BASIN, _FIG23, "GPU-only and recovery cases"), _GPU, "without lending"
    ),
    **_same(
        PaperFigure(0.32, 0.56, OF_BASIN, _FIG23, "range over all triggers"),
        _HOST + _GPU + _SUSTAINED,
        "lending only",
    ),
    **_same(
        PaperFigure(0.67, 0.77, OF_BASIN, _FIG23, "large surges on 1P3D"),
        _HOST + _GPU,
        "arrival-time controller",
    ),
    # "The latter reaches ... 0.67-0.95 across ablation triggers" (Fig. 24b's text, §7.9).
    **_same(
        PaperFigure(0.67, 0.95, OF_BASIN, "Fig. 24b, §7.9", "range over all ablation triggers"),
        _SUSTAINED,
        "arrival-time controller",
    ),
}

# (suite, scenario, system) -> figure; the headline suite is main's first scenario.
CELLS: dict[tuple[str, str, str], PaperFigure] = {
    **{("main", sc, sy): f for (sc, sy), f in _MAIN_CELLS.items()},
    **{
        ("headline", sc, sy): f
        for (sc, sy), f in _MAIN_CELLS.items()
        if sc == "1P3D x5 surge" and sy in ("Continuum", "HiCache alone")  # the headline's systems
    },
    **{("surge-sweep", sc, sy): f for (sc, sy), f in _SWEEP_CELLS.items()},
    **{("post-surge", sc, sy): f for (sc, sy), f in _POST_CELLS.items()},
    **{("late", sc, sy): f for (sc, sy), f in _LATE_CELLS.items()},
    **{("ablation", sc, sy): f for (sc, sy), f in _ABLATION_CELLS.items()},
}
# (suite, scenario) -> BASIN over the strongest baseline.
MARGINS: dict[tuple[str, str], PaperFigure] = {
    **{("main", sc): f for sc, f in _MAIN_MARGINS.items()},
    ("headline", "1P3D x5 surge"): _MAIN_MARGINS["1P3D x5 surge"],
    **{("surge-sweep", sc): f for sc, f in _SWEEP_MARGINS.items()},
}
# What the paper says about a suite that belongs to no single cell.
NOTES: dict[str, tuple[str, ...]] = {
    "main": (
        "Fig. 14: BASIN has the highest goodput in all six scenarios; each baseline loses at least 51 % in"
        " one or more. Median slowdown 6.6 → 3.6 (default surge) and 6.6 → 3.0 (GPU-only) on 1P3D; on 1P1D"
        " BASIN completes 92 % of sessions under the default surge (§7.3).",
        "§7.3: in 15 healthy control scenarios BASIN retains at least 99.6 % of the best baseline's goodput.",
    ),
    "headline": ("The paper's 1P3D ×5 surge cell of Fig. 14 (see `main`).",),
    "surge-sweep": (
        "Fig. 16: under BASIN runs end healthy or recovering, ≥ 95 % of sessions complete (HiCache alone"
        " 32–48 %), at most 2.2 % are shed; Crossflow stays trapped throughout (§7.4).",
    ),
    "steady": (
        "Fig. 17 gives absolute offered rates, not fractions of λc: BASIN peaks at 948 sessions/h at"
        " 16.8/min and keeps 769 at 19.4/min, where Continuum, CONCUR and ThunderAgent reach 449, 312 and"
        " 84 and HiCache alone under 20 (§7.4; 1P3D's profiled λc is 18.5/min, §7.4 on Fig. 18). No cell"
        " is placed: our λc differs. The tools ×3 panel has no numbers in the prose.",
        "§7.3: in healthy controls BASIN keeps ≥ 99.6 % of the best baseline's goodput.",
    ),
    "post-surge": (
        "Fig. 22a (+300 % for 10 minutes, three seeds): ThunderAgent's p90 first-call wait is 275–467 s at"
        " post-surge rates up to 0.5 λref, BASIN's below 17 s. The paper's λref is 12.0/min GPU-only (§5.2);"
        " ours is the profiled λc.",
    ),
    "late": (
        "Fig. 21b: BASIN completes 99.9 % of measured sessions, HiCache alone 36.1 %. The paper gives no"
        " margin over the strongest baseline here (ThunderAgent, CONCUR and Crossflow are not in the prose).",
    ),
    "ablation": (
        "Fig. 23 gives each variant as a range over several triggers (×5, ×6, ×8, 40-minute, late, GPU-only);"
        " each range is shown on every scenario of that kind. Baselines are not in Fig. 23.",
    ),
    "sensitivity": (
        "Fig. 24a (§7.9, five ablation triggers and an hour of sustained overload, five seeds): m has no"
        " effect (the capacity term sets B0); each α changes goodput by at most 8 %; Δ 15 s up to 1.17×"
        " under sustained overload and −6 % under the ×8 surge, 60 s up to −4 %; φ 0.97–1.07×; T_s 7.5 min"
        " up to 1.07× under sustained overload, 30 min 0.93×; r 10 +7–33 % (p99 first-call wait +19–43 %),"
        " r 100 0.80–0.96×; the [0.25, 4] budget range up to −16 % under sustained overload, 90-minute"
        " context smoothing up to −12 % under the ×8 surge, doubled budget steps up to −7 % on 1P1D; the"
        " other implementation settings (cool-down, backlog persistence, reopening, lending headroom) stay"
        " within 0.96–1.03, values unpublished (ours: each of our settings lower and higher).",
    ),
}
