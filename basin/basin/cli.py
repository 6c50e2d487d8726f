"""The `basin` command: the one place that knows every component.

Components are imported inside their subcommands, so `basin workload` needs neither kopf nor aiohttp.
User errors (BasinError) print one line and exit with status 2; they never show a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from basin import __version__
from basin.errors import BasinError

EXIT_USER_ERROR = 2

_WORKLOAD_HELP = (
    "terminal-bench or swe-pro (synthetic, shaped like the paper's traces), or the path"
    " of a session file (JSONL) or a Mooncake trace."
)


def workload_options(command):  # type: ignore[no-untyped-def]
    """The options every command that reads a workload shares."""
    for option in reversed(
        [
            click.option("--workload", "workload", required=True, metavar="NAME|FILE", help=_WORKLOAD_HELP),
            click.option(
                "--seed", type=int, default=0, show_default=True, help="Seed of a synthetic workload."
            ),
            click.option(
                "--sessions",
                type=int,
                default=None,
                help="Generate this many sessions (synthetic) or read only the first ones (file).",
            ),
            click.option(
                "--tool-time-scale",
                type=float,
                default=1.0,
                show_default=True,
                help="Multiply every tool gap.",
            ),
            click.option(
                "--output-scale",
                type=float,
                default=1.0,
                show_default=True,
                help="Multiply output lengths (later prompts grow by the extra tokens).",
            ),
        ]
    ):
        command = option(command)
    return command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="basin")
def cli() -> None:
    """Basin keeps SGLang prefill-decode deployments serving LLM agents out of the cache trap."""


@cli.group()
def workload() -> None:
    """Agent workloads: statistics and the session file."""


@workload.command("stats")
@workload_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def workload_stats(
    workload: str, seed: int, sessions: int | None, tool_time_scale: float, output_scale: float, as_json: bool
) -> None:
    """Print a workload's statistics beside the paper's published values."""
    from basin.workload import PUBLISHED, compute_stats, load_workload

    loaded = load_workload(workload, seed, tool_time_scale, output_scale, sessions)
    stats = compute_stats(loaded).to_dict()
    names = {s.workload for s in loaded}
    source = names.pop() if len(names) == 1 else ""
    # Targets hold for the unscaled trajectories only.
    published = PUBLISHED.get(source, {}) if tool_time_scale == output_scale == 1 else {}
    if as_json:
        click.echo(json.dumps({"workload": workload, "seed": seed, **stats, "published": published}))
        return

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{workload} (seed {seed})" if workload in PUBLISHED else workload)
    for column in ("statistic", "value", "paper", "ratio"):
        table.add_column(column, justify="left" if column == "statistic" else "right")
    for key, value in stats.items():
        target = published.get(key)
        shown = _format_number(value)
        paper = "" if target is None else _format_number(target)
        ratio = "" if target is None else f"{value / target:.3f}"
        table.add_row(key, shown, paper, ratio)
    Console().print(table)


def _format_number(value: float) -> str:
    if isinstance(value, int):
        return f"{value:,d}"
    if abs(value) < 10:
        return f"{value:.3f}"
    return f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"


@workload.command("export")
@workload_options
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, writable=True, allow_dash=True),
    default="-",
    show_default=True,
    help="Session file to write (JSONL); - for stdout.",
)
def workload_export(
    workload: str, seed: int, sessions: int | None, tool_time_scale: float, output_scale: float, out: str
) -> None:
    """Write a workload as a session file (one JSON session per line, see docs/session-file.md)."""
    from basin.workload import load_workload, write_sessions

    loaded = load_workload(workload, seed, tool_time_scale, output_scale, sessions)
    if out == "-":
        write_sessions(loaded, sys.stdout)
        return
    path = Path(out)
    if not path.parent.is_dir():
        raise BasinError(f"cannot write {path}: the folder {path.parent} does not exist")
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        count = write_sessions(loaded, handle)
    tmp.replace(path)  # never leave a half-written session file behind
    click.echo(f"wrote {count} sessions to {path}", err=True)


def main() -> None:
    try:
        code = cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except BasinError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_USER_ERROR)
    except OSError as exc:
        click.echo(f"error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), err=True)
        sys.exit(EXIT_USER_ERROR)
    if isinstance(code, int) and code:
        sys.exit(code)


if __name__ == "__main__":
    main()
