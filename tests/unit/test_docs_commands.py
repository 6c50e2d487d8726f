"""Every `basin …` command the docs and the README show exists as written: each subcommand in click's command
tree, each flag an option of that subcommand, each listed choice (`--policy a|b`, `evaluate main|late`) one
the command accepts. The lines come from the docs' code blocks (with their continuation lines) and inline
code spans; the option tables of docs/cli.md are checked the same way, and every option a command has is
documented there. A doc naming a removed flag or subcommand fails here."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from basin.cli import cli

REPO = Path(__file__).resolve().parents[2]
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
# `basin`, `.venv/bin/basin`, `$(BIN)/basin` at the start of a shell line or an inline span.
START = re.compile(r"^(?:\$\s+)?(?:\S*(?:bin|BIN\))/)?basin(?=\s|$)")
FENCE = re.compile(r"^\s*```")


@dataclass(frozen=True)
class Mention:
    doc: str
    line: int
    text: str


def _code_block_commands(doc: Path) -> list[Mention]:
    """`basin …` lines of fenced blocks, joined with their continuations (a trailing backslash, or the
    indented lines of a synopsis that follow)."""
    out: list[Mention] = []
    inside = False
    current: list[str] = []
    start = 0

    def flush() -> None:
        if current:
            out.append(Mention(doc.name, start, " ".join(current)))
            current.clear()

    for number, raw in enumerate(doc.read_text().splitlines(), 1):
        if FENCE.match(raw):
            flush()
            inside = not inside
            continue
        if not inside:
            continue
        line = re.sub(r"\s+#\s.*$", "", raw).rstrip()  # shell comments
        continues = bool(current) and (current[-1].endswith("\\") or raw.startswith((" ", "\t")))
        if continues and not START.match(line.strip()):
            current[-1] = current[-1].rstrip("\\").rstrip()
            current.append(line.strip())
            continue
        flush()
        if START.match(line.strip()):
            start = number
            current.append(line.strip())
    flush()
    return out


def _inline_commands(doc: Path) -> list[Mention]:
    out = []
    inside = False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if inside:
            continue
        for span in re.findall(r"`([^`]+)`", line.replace("\\|", "|")):
            if START.match(span):
                out.append(Mention(doc.name, number, span))
    return out


def mentions() -> list[Mention]:
    return [m for doc in DOCS for m in _code_block_commands(doc) + _inline_commands(doc)]


def _tokens(text: str) -> list[str]:
    text = re.sub(r"[\[\]{}()]", " ", text.replace("\\|", "|"))
    tokens = [
        t.rstrip(",;.") if t.startswith("--") else t for t in text.split() if t not in ("|", "…", "...")
    ]
    return tokens[1:] if tokens[:1] == ["$"] else tokens


def _resolve(tokens: list[str]) -> tuple[list[click.Command], list[str], list[str]]:
    """The commands a line names (`predictor train|evaluate` names two), the tokens after them, and
    problems with the path."""
    commands: list[click.Command] = [cli]
    rest = tokens[1:]
    while rest and all(isinstance(c, click.Group) for c in commands):
        names = rest[0].split("|")
        if not all(re.fullmatch(r"[a-z][a-z-]*", n) for n in names):
            break
        unknown = [n for c in commands for n in names if n not in c.commands]  # type: ignore[attr-defined]
        if unknown:
            return commands, rest, [f"no subcommand {' '.join(tokens[: len(tokens) - len(rest)])} {unknown}"]
        commands = [c.commands[n] for c in commands for n in names]  # type: ignore[attr-defined]
        rest = rest[1:]
    return commands, rest, []


def _options(command: click.Command) -> dict[str, click.Parameter]:
    out: dict[str, click.Parameter] = {name: click.Option([name], is_flag=True) for name in ("--help", "-h")}
    for param in command.params:
        if isinstance(param, click.Option):
            for name in [*param.opts, *param.secondary_opts]:
                out[name] = param
    return out


def _choices_wrong(param: click.Parameter, value: str) -> list[str]:
    """Listed lower-case choices (`a|b`) that a Choice parameter does not accept; placeholders (FILE, N,
    `h100-1p1d`-like values of free options) are not checked."""
    if not isinstance(param.type, click.Choice) or value.startswith("-"):
        return []
    parts = [p for p in value.split("|") if re.fullmatch(r"[a-z][a-z0-9_-]*", p)]
    return [p for p in parts if p not in param.type.choices]


def problems(text: str) -> list[str]:
    tokens = _tokens(text)
    commands, rest, found = _resolve(tokens)
    if found:
        return found
    if any(isinstance(c, click.Group) for c in commands):
        return [f"{text!r} names a command group and options" for t in rest if t.startswith("-")][:1]
    for command in commands:
        options = _options(command)
        arguments = [p for p in command.params if isinstance(p, click.Argument)]
        i = 0
        while i < len(rest):
            token = rest[i]
            if re.match(r"^--?[A-Za-z]", token):
                name, _, inline = token.partition("=")
                param = options.get(name)
                if param is None:
                    found.append(f"{command.name}: no option {name}")
                elif not getattr(param, "is_flag", False) and not getattr(param, "count", False):
                    value = inline or (rest[i + 1] if i + 1 < len(rest) else "")
                    found += [f"{command.name} {name}: no choice {c!r}" for c in _choices_wrong(param, value)]
                    i += 0 if inline else 1
            elif arguments:
                found += [f"{command.name}: no choice {c!r}" for c in _choices_wrong(arguments.pop(0), token)]
            i += 1
    return found


def test_the_docs_show_many_commands() -> None:
    found = mentions()
    assert len(found) > 80
    shown = {tuple(t for t in _tokens(m.text)[1:3] if not t.startswith("-")) for m in found}
    for path in [("simulate",), ("up",), ("gateway", "run"), ("operator", "docs"), ("emulate",)]:
        assert any(s[: len(path)] == path for s in shown), path


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_in_the_docs_exists_as_written(doc: Path) -> None:
    bad = [
        f"{m.doc}:{m.line}: {p}"
        for m in _code_block_commands(doc) + _inline_commands(doc)
        for p in problems(m.text)
    ]
    assert bad == []


def test_the_check_notices_stale_commands() -> None:
    assert problems("basin simulate --deployment h200-1p3d --base-rate 3") == []
    assert problems("basin simulate --base-rate 3 --surge-factr 2") == ["simulate: no option --surge-factr"]
    assert problems("basin gateway serve --port 1") == ["no subcommand basin gateway ['serve']"]
    assert problems("basin plan --gpus 8 --policy hicache|fifo") == ["plan --policy: no choice 'fifo'"]
    assert problems("basin evaluate headline|sprint") == ["evaluate: no choice 'sprint'"]
    assert problems("basin predictor train|evaluate --workload W --folds 3") == ["train: no option --folds"]
    assert problems("basin operator crd --out=x.yaml") == []


def test_continuation_lines_belong_to_their_command(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text(
        "```\nbasin replay --target URL\n             [--quiet] [--gone]\nkubectl get bd\n"
        "basin up \\\n  --policy basin   # comment --nope\n```\n"
    )
    found = [m.text for m in _code_block_commands(doc)]
    assert found == ["basin replay --target URL [--quiet] [--gone]", "basin up --policy basin"]
    assert problems(found[0]) == ["replay: no option --gone"]


# docs/cli.md: per `## \`basin …\`` section, the options its tables name exist, and every option exists there.
def _cli_sections() -> dict[str, str]:
    text = (REPO / "docs" / "cli.md").read_text()
    out = {}
    for section in text.split("\n## ")[1:]:
        title, _, body = section.partition("\n")
        out[title] = body
    return out


def _section_commands(title: str) -> list[click.Command]:
    commands = []
    for name in re.findall(r"`(basin [^`]+)`", title):
        resolved, _, bad = _resolve(_tokens(name))
        assert not bad, bad
        commands += resolved
    return commands


def test_docs_cli_md_documents_every_command_and_option() -> None:
    sections = _cli_sections()
    documented: dict[int, set[str]] = {}  # by id(command): `run` and `evaluate` name two commands each
    for title, body in sections.items():
        for command in _section_commands(title):
            flags = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", body))
            documented.setdefault(id(command), set()).update(flags)
            table = [line.split(" | ")[0] for line in body.splitlines() if line.startswith("| `-")]
            named = {f for cell in table for f in re.findall(r"`(--[\w-]+)", cell)}
            options = set(_options(command))
            # `--surge-*` in a table cell: some option has that prefix
            unknown = [
                f
                for f in named
                if f not in options and not (f.endswith("-") and any(o.startswith(f) for o in options))
            ]
            assert unknown == [], (title, unknown)

    def leaves(group: click.Group, path: str = "basin") -> list[tuple[str, click.Command]]:
        out = []
        for name, command in group.commands.items():
            if isinstance(command, click.Group):
                out += leaves(command, f"{path} {name}")
            else:
                out.append((f"{path} {name}", command))
        return out

    missing = []
    for path, command in leaves(cli):
        if id(command) not in documented:
            missing.append(path)
            continue
        for param in command.params:
            if isinstance(param, click.Option) and not set(param.opts) & documented[id(command)]:
                missing.append(f"{path} {param.opts[0]}")
    assert missing == [], "\n".join(missing)
