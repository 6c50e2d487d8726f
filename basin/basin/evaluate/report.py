"""The seed report (issue 15 item 6): every suite over several seeds as mean and range, beside the paper.

One seed can hide a coin-flip trap, so the claims in docs/policies.md are measured over seeds 0–4: each
cell's goodput as mean [min–max], its run states counted over seeds, and BASIN's margin over the
strongest baseline per scenario, each beside the paper's figure (`basin.evaluate.paper`). Runs go to
worker processes one scenario at a time (a worker profiles the scenario once for all its systems); the
per-seed rows are kept as JSON so the Markdown can be re-rendered without rerunning.
"""

from __future__ import annotations

import math
import shlex
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from basin.errors import BasinError
from basin.evaluate import paper
from basin.evaluate.suites import SUITES, Row, headline, scenario_rows, sensitivity_spread

SCHEMA = 1


def parse_seeds(text: str) -> list[int]:
    """`0-4`, `0,2,7` or `3` → seeds in order; a reversed range or a non-number is a user error."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        low, sep, high = part.partition("-")
        try:
            first, last = (int(low), int(high)) if sep else (int(part), int(part))
        except ValueError:
            raise BasinError(f"--seeds takes N, A-B or a comma list of them, got {text!r}") from None
        if first < 0 or last < first:
            raise BasinError(f"--seeds range {part!r} is empty or negative; write it low-high, e.g. 0-4")
        seeds += [s for s in range(first, last + 1) if s not in seeds]
    return seeds


def parse_suites(text: str) -> list[str]:
    """`all` or a comma list of suite names, in the order given."""
    if text.strip() == "all":
        return list(SUITES)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SUITES]
    if unknown or not names:
        raise BasinError(
            f"unknown suite {', '.join(unknown) or repr(text)}; choose all or a comma list of"
            f" {', '.join(SUITES)}"
        )
    return list(dict.fromkeys(names))


def plan(
    suites: list[str], scenarios: Iterable[str] = (), systems: Iterable[str] = ()
) -> list[tuple[str, int, tuple[str, ...]]]:
    """(suite, scenario index, system names) of every cell to run: all of each suite, or only the named
    scenarios and systems (`--scenario`, `--system`); a name no chosen suite has is a one-line error."""
    only_scenarios, only_systems = set(scenarios), set(systems)
    for kind, names, known in (
        ("scenario", only_scenarios, {sc.name for s in suites for sc in SUITES[s][0]}),
        ("system", only_systems, {sy.name for s in suites for sy in SUITES[s][1]}),
    ):
        unknown = sorted(names - known)
        if unknown:
            raise BasinError(
                f"no {kind} {', '.join(map(repr, unknown))} in suite {', '.join(suites)}; its {kind}s are"
                f" {', '.join(map(repr, sorted(known)))}"
            )
    cells = []
    for suite in suites:
        suite_scenarios, suite_systems = SUITES[suite]
        names = tuple(sy.name for sy in suite_systems if not only_systems or sy.name in only_systems)
        for index, scenario in enumerate(suite_scenarios):
            if names and (not only_scenarios or scenario.name in only_scenarios):
                cells.append((suite, index, names))
    if not cells:
        raise BasinError("no suite has both the chosen scenarios and the chosen systems; nothing to run")
    return cells


def _run_task(
    suite: str, index: int, system_names: tuple[str, ...], seed: int, shared_prefix: int | None = None
) -> list[dict]:
    """One scenario of a suite on one seed, the named systems (the unit a worker process runs)."""
    scenarios, systems = SUITES[suite]
    chosen = tuple(s for s in systems if s.name in system_names)
    rows = scenario_rows(scenarios[index], chosen, seed, shared_prefix=shared_prefix)
    return [{"suite": suite, "seed": seed, **r.to_dict()} for r in rows]


def run_report(
    suites: list[str],
    seeds: list[int],
    jobs: int = 1,
    advance: Callable[[int], None] | None = None,
    shared_prefix: int | None = None,
    scenarios: Iterable[str] = (),
    systems: Iterable[str] = (),
) -> list[dict]:
    """Per-seed rows of every suite (or of the named `scenarios` and `systems` only); `advance(n)` reports
    n more finished runs (scenario × system); `shared_prefix` opens every session with that many tokens
    all sessions share (`load_workload`)."""
    cells = plan(suites, scenarios, systems)
    tasks = [(s, i, names, seed) for suite in suites for seed in seeds for s, i, names in cells if s == suite]
    results: dict[tuple[str, int, tuple[str, ...], int], list[dict]] = {}
    if jobs <= 1:
        for task in tasks:
            results[task] = _run_task(*task, shared_prefix)
            if advance:
                advance(len(results[task]))
    else:
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks))) as pool:
            futures = {pool.submit(_run_task, *task, shared_prefix): task for task in tasks}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if advance:
                    advance(len(results[futures[future]]))
    return [row for task in tasks for row in results[task]]  # the same order whatever the jobs


def run_count(
    suites: list[str], seeds: list[int], scenarios: Iterable[str] = (), systems: Iterable[str] = ()
) -> int:
    return sum(len(names) for _, _, names in plan(suites, scenarios, systems)) * len(seeds)


def commit() -> str:
    """The commit of the checkout this package runs from, `+dirty` when its tree has changes: asked of
    the package's own folder, not the working directory, which may be any folder or another repository."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=here
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, cwd=here
        )
    except OSError:
        return "unknown"
    if head.returncode:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def payload(
    rows: list[dict],
    suites: list[str],
    seeds: list[int],
    measured_on: str | None = None,
    shared_prefix: int | None = None,
    scenarios: Iterable[str] = (),
    systems: Iterable[str] = (),
) -> dict:
    """The JSON of a report; `measured_on` is the commit taken before the runs (edits during a long run
    must not relabel it). `shared_prefix`, and the `scenarios` and `systems` a run was limited to, are
    kept only when given."""
    data = {
        "schema": SCHEMA,
        "commit": measured_on or commit(),
        "generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "suites": suites,
        "seeds": seeds,
        "rows": rows,
    }
    if shared_prefix is not None:
        data["shared_prefix"] = shared_prefix
    for key, names in (("only_scenarios", list(scenarios)), ("only_systems", list(systems))):
        if names:
            data[key] = names
    return data


def check_payload(data: object) -> dict:
    """A `--from-json` file as written by `--json`; anything else is a one-line user error."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("rows"), list):
        raise BasinError("--from-json needs a file written by `basin report --json`")
    shared = data.get("shared_prefix")
    if shared is not None and (not isinstance(shared, int) or isinstance(shared, bool) or shared < 0):
        raise BasinError(f"--from-json: shared_prefix must be a token count, got {shared!r}")
    for key in ("only_scenarios", "only_systems"):
        names = data.get(key, [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise BasinError(f"--from-json: {key} must be a list of names, got {names!r}")
    return data


def _number(v: object) -> float:
    return math.nan if v is None else float(v)  # type: ignore[arg-type]


def _span(values: Iterable[float], digits: int = 0) -> str:
    """`mean [min–max]` over the finite values; `n/a` when there are none."""
    finite = np.array([v for v in values if math.isfinite(v)])
    if not finite.size:
        return "n/a"
    mean, low, high = (f"{x:.{digits}f}" for x in (finite.mean(), finite.min(), finite.max()))
    return mean if finite.size == 1 or low == high else f"{mean} [{low}–{high}]"


def states(labels: Iterable[str]) -> str:
    """`trapped 5/5` or `healthy 3/5, recovering 2/5`: every run's state, most frequent first."""
    labels = list(labels)
    counts = Counter(labels).most_common()
    return ", ".join(f"{label} {n}/{len(labels)}" for label, n in counts)


def _ratios(group: dict[int, dict[str, dict]], system: str, kind: str) -> list[float]:
    """Per seed, the system's goodput in the paper figure's direction (share of BASIN, or BASIN over it)."""
    out = []
    for by_system in group.values():
        basin, other = by_system.get("BASIN"), by_system.get(system)
        if basin is None or other is None:
            continue
        b, o = _number(basin["goodput_sessions_per_h"]), _number(other["goodput_sessions_per_h"])
        num, den = (o, b) if kind == paper.OF_BASIN else (b, o)
        out.append(num / den if den else math.nan)
    return out


def _row(r: dict) -> Row:
    """A JSON row back as a Row (None was NaN)."""
    return Row(**{k: math.nan if v is None else v for k, v in r.items() if k not in ("suite", "seed")})


def _paper_cell(figure: paper.PaperFigure | None, ours: list[float] | None = None) -> str:
    if figure is None:
        return "—"
    text = figure.text()
    if ours is not None and figure.low is not None and figure.kind != paper.SESSIONS_PER_H:
        text += f" · ours {_span(ours, 2)}"
    detail = "; ".join(x for x in (figure.source, figure.note) if x)
    return f"{text} ({detail})" if detail else text


def render(data: dict) -> str:
    """The Markdown report from a payload: per suite, cells, margins and the paper's notes."""
    rows = data["rows"]
    seeds = data.get("seeds") or sorted({r["seed"] for r in rows})
    suites = data.get("suites") or list(dict.fromkeys(r["suite"] for r in rows))
    seed_text = (
        f"{min(seeds)}–{max(seeds)}"
        if len(seeds) > 1 and seeds == list(range(min(seeds), max(seeds) + 1))
        else ", ".join(map(str, seeds))
    )
    seed_arg = seed_text.replace("–", "-").replace(" ", "")
    shared = data.get("shared_prefix")
    shared_text = (
        []
        if shared is None
        else [
            f"Every session opens with the same {shared:,}-token prefix, shared across sessions in the prefix"
            " cache, in the profiles' ramps too (`--shared-prefix`).",
        ]
    )
    only = {
        flag: data.get(key, []) for flag, key in (("scenario", "only_scenarios"), ("system", "only_systems"))
    }
    only_args = "".join(f" --{flag} {shlex.quote(name)}" for flag, names in only.items() for name in names)
    only_text = [
        f"Only the {flag}{'s' * (len(names) > 1)} {', '.join(map(repr, names))} (`--{flag}`)."
        for flag, names in only.items()
        if names
    ]
    lines = [
        "# Evaluation over seeds",
        "",
        f"Seeds {seed_text} ({len(seeds)}); suites: {', '.join(suites)}. Measured on commit"
        f" `{data.get('commit', 'unknown')}`, {data.get('generated', '')}.",
        *shared_text,
        *only_text,
        f"Regenerate with `basin report --seeds {seed_arg} --suites {','.join(suites)}{only_args}"
        + (
            " --out docs/evaluation.md"
            if shared is None and not only_args
            else (f" --shared-prefix {shared}" if shared is not None else "") + " --out FILE"
        )
        + " --json FILE`; re-render from that JSON with `basin report --from-json FILE`.",
        "",
        *(
            [f"Not in this report: {', '.join(missing)} (`--suites all` runs every suite).", ""]
            if (missing := [s for s in SUITES if s not in suites])
            else []
        ),
        "Goodput is sessions/h, the mean over seeds with [min–max]; states count each run's label (§7.1)."
        " The paper column gives the paper's figure for the same cell, with its source: absolute goodput"
        " (`/h`), the system's share of BASIN (`of BASIN`) or BASIN's multiple of it (`BASIN n×`), followed"
        " by ours in the same direction; — where the paper gives none. ≈ marks a placement we infer.",
    ]
    for suite in suites:
        suite_rows = [r for r in rows if r["suite"] == suite]
        if not suite_rows:
            continue
        scenarios = list(dict.fromkeys(r["scenario"] for r in suite_rows))
        systems = list(dict.fromkeys(r["system"] for r in suite_rows))
        lines += [
            "",
            f"## {suite}",
            "",
            "| scenario | system | goodput/h | states | paper |",
            "|---|---|---|---|---|",
        ]
        for scenario in scenarios:
            group: dict[int, dict[str, dict]] = {}
            for r in suite_rows:
                if r["scenario"] == scenario:
                    group.setdefault(r["seed"], {})[r["system"]] = r
            for system in systems:
                cell = [by[system] for by in group.values() if system in by]
                if not cell:
                    continue
                figure = paper.CELLS.get((suite, scenario, system))
                ours = _ratios(group, system, figure.kind) if figure else None
                lines.append(
                    f"| {scenario} | {system} | {_span(_number(r['goodput_sessions_per_h']) for r in cell)}"
                    f" | {states(r['label'] for r in cell)} | {_paper_cell(figure, ours)} |"
                )
        margin_lines = []
        for scenario in scenarios:
            margins, strongest = [], []
            for seed in seeds:
                seed_rows = [_row(r) for r in suite_rows if r["scenario"] == scenario and r["seed"] == seed]
                if not seed_rows or "BASIN" not in {r.system for r in seed_rows}:
                    continue
                head = headline(seed_rows)[0]
                if not head["strongest_baseline"]:
                    continue  # a run limited by --system may leave every baseline out
                margins.append(_number(head["vs_strongest"]))
                strongest.append(str(head["strongest_baseline"]))
            if margins:
                figure = paper.MARGINS.get((suite, scenario))
                margin_lines.append(
                    f"| {scenario} | {_span(margins, 2)}× | {states(strongest)} | {_paper_cell(figure)} |"
                )
        if margin_lines:
            lines += [
                "",
                "BASIN over the strongest baseline (per seed, the best of this suite's other systems,"
                " BASIN variants excluded):",
                "",
                "| scenario | BASIN over strongest | strongest (seeds) | paper |",
                "|---|---|---|---|",
                *margin_lines,
            ]
        if spread := sensitivity_spread([_row(r) for r in suite_rows]):
            lines += ["", f"Spread: {spread.text()}."]
        notes = paper.NOTES.get(suite, ())
        if notes:
            lines += ["", *(f"- Paper: {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def write(path: str, text: str) -> None:
    Path(path).write_text(text)
