"""What the README and docs/ show a user to type exists.

Every command line they show (in a code block, or in a code span) that runs
``kvmerge`` (also as ``python -m kvmerge`` or ``.ci/demo``, which runs
``kvmerge demo``) or ``python -m benches.compare`` is parsed by the real
parser, and each of its ``--options`` must be one of that (sub)command's.
So must every option named alone in a code span (``--history``) that the
text attributes to one of them: the last such command before it in the same
paragraph, or else the command in its section's heading. Options of other
programs (``vllm serve``'s, cargo's) are attributed to none and left alone.
And every ``.ci/`` script the README and docs name exists."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benches.compare import build_parser as bench_parser
from benches.compare.stats import build_parser as stats_bench_parser
from benches.serve import build_parser as serve_bench_parser
from kvmerge.cli import build_parser as cli_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: How each command is typed -> (program, arguments put before the rest).
PREFIXES: dict[tuple[str, ...], tuple[str, tuple[str, ...]]] = {
    ("kvmerge",): ("kvmerge", ()),
    ("python", "-m", "kvmerge"): ("kvmerge", ()),
    (".ci/demo",): ("kvmerge", ("demo",)),
    ("python", "-m", "benches.compare"): ("benches.compare", ()),
    ("python", "-m", "benches.serve"): ("benches.serve", ()),
    # The same options as benches.serve's (benches/serve/loop.py).
    ("python", "-m", "benches.serve.loop"): ("benches.serve", ()),
    ("python", "-m", "benches.compare.stats"): ("benches.compare.stats", ()),
}
#: Where a command line ends, in a shell.
SHELL_ENDS = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}
#: Options that print and exit: a line holding one is not parsed whole.
EXITING = {"--help", "-h", "--version"}
#: Options of other programs that a doc names in a paragraph after a command
#: of ours (so attributed to it): the program they belong to.
FOREIGN = {
    "--no-default-features": "maturin (docs/benchmarks.md, the allocator)",
    "--load-format": "vllm serve (docs/benchmarks.md, the real server's bench)",
}


@dataclass(frozen=True)
class Command:
    """A command line a doc shows: its program and arguments."""

    where: str
    program: str
    args: tuple[str, ...]


@dataclass(frozen=True)
class Mention:
    """Options a doc names alone, and the command it attributes them to."""

    where: str
    options: tuple[str, ...]
    command: Command | None


def command(text: str, where: str) -> Command | None:
    """The command ``text`` runs, if it runs one of ``PREFIXES``."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words.pop(0)  # an environment variable set for the command
    for prefix, (program, head) in PREFIXES.items():
        if tuple(words[: len(prefix)]) == prefix:
            rest = words[len(prefix) :]
            end = next((i for i, w in enumerate(rest) if w in SHELL_ENDS), len(rest))
            args = (*head, *rest[:end])
            if program == "kvmerge" and not args:
                return None  # the project's name, not a command
            return Command(where, program, args)
    return None


def options(words: list[str] | tuple[str, ...]) -> list[str]:
    return [
        w.split("=", 1)[0] for w in words if re.fullmatch(r"--[a-z][\w-]*(=.*)?", w)
    ]


def _blocks(text: str) -> Iterator[tuple[int, str, list[str]]]:
    """(first line, kind, lines): fenced code blocks (kind: their language)
    and paragraphs (kind "p": runs of lines between blank lines, a heading,
    a list item or a table row each starting one)."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"\s*```(\w*)", line)
        if fence:
            j = i + 1
            while j < len(lines) and not lines[j].strip().startswith("```"):
                j += 1
            yield i + 1, fence.group(1) or "text", lines[i + 1 : j]
            i = j + 1
            continue
        if not line.strip():
            i += 1
            continue
        j = i + 1
        while (
            j < len(lines)
            and lines[j].strip()
            and not re.match(r"\s*(```|#|[-*] |\d+\. |\|)", lines[j])
            and not line.startswith("#")
        ):
            j += 1
        yield i + 1, "p", lines[i:j]
        i = j


def _code_lines(kind: str, lines: list[str]) -> Iterator[tuple[int, str]]:
    """The command lines of a code block: in a shell block every line
    (continuations joined), in any other only those after a ``$`` prompt."""
    shell = kind in ("bash", "sh", "shell", "console")
    joined, start = "", 0
    for n, line in enumerate(lines):
        if not joined:
            start = n
        stripped = line.strip()
        if not shell:
            if stripped.startswith("$ "):
                yield n, stripped[2:]
            continue
        joined += stripped.removeprefix("$ ")
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        yield start, joined
        joined = ""


def scan(path: Path, root: Path = ROOT) -> tuple[list[Command], list[Mention]]:
    """The commands ``path`` shows and the options it names alone."""
    name = path.relative_to(root).as_posix()
    commands: list[Command] = []
    mentions: list[Mention] = []
    heading: Command | None = None
    for first, kind, lines in _blocks(path.read_text()):
        if kind != "p":
            for n, line in _code_lines(kind, lines):
                found = command(line, f"{name}:{first + n + 1}")
                if found:
                    commands.append(found)
            continue
        text = " ".join(line.strip() for line in lines)
        is_heading = text.startswith("#")
        if is_heading:
            heading = None
        last: Command | None = None
        for span in re.finditer(r"`([^`]+)`", text):
            where = f"{name}:{first}"
            found = command(span.group(1), where)
            if found:
                commands.append(found)
                last = found
                if is_heading:
                    heading = found
                continue
            words = span.group(1).split()
            if words and words[0].startswith("--"):
                named = tuple(o for o in options(words) if o not in FOREIGN)
                if named:
                    mentions.append(Mention(where, named, last or heading))
    return commands, mentions


def parser_of(cmd: Command) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser that reads ``cmd``'s options (a subcommand's, when it names
    one), and the words that parser reads."""
    if cmd.program == "benches.compare":
        return bench_parser(), list(cmd.args)
    if cmd.program == "benches.serve":
        return serve_bench_parser(), list(cmd.args)
    if cmd.program == "benches.compare.stats":
        return stats_bench_parser(), list(cmd.args)
    top = cli_parser()
    sub = next(
        a for a in top._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    words = list(cmd.args)
    if words and not words[0].startswith("-"):
        assert words[0] in sub, f"{cmd.where}: no subcommand kvmerge {words[0]}"
        return sub[words[0]], words[1:]
    return top, words


def unknown(cmd: Command, named: list[str] | tuple[str, ...]) -> list[str]:
    parser, _ = parser_of(cmd)
    return [o for o in named if o not in parser._option_string_actions]


def everything() -> tuple[list[Command], list[Mention]]:
    commands: list[Command] = []
    mentions: list[Mention] = []
    for doc in DOCS:
        c, m = scan(doc)
        commands += c
        mentions += m
    return commands, mentions


COMMANDS, MENTIONS = everything()


def test_the_docs_show_commands_and_options():
    """The scan finds what the README is known to show (if it found nothing,
    the checks below would pass on nothing)."""
    readme = [c for c in COMMANDS if c.where.startswith("README.md")]
    assert {c.args[0] for c in readme if c.program == "kvmerge"} >= {
        "demo",
        "subscribe",
        "example",
        "--version",
    }
    assert any(c.program == "benches.compare" for c in readme)
    demo = {o for m in MENTIONS if m.command for o in m.options}
    assert {"--steps", "--max-pending-steps", "--history", "--bind"} <= demo


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{c.where} {c.program}")
def test_each_command_parses(cmd: Command):
    assert unknown(cmd, options(cmd.args)) == [], cmd
    if EXITING & set(cmd.args):
        return
    if cmd.program == "kvmerge" and len(cmd.args) == 1:
        return  # a subcommand named (`kvmerge subscribe`), not a command line
    parser, words = parser_of(cmd)
    try:
        parser.parse_args(words)
    except SystemExit as exc:
        pytest.fail(f"{cmd.where}: {cmd.program} {' '.join(cmd.args)}: exit {exc}")


def test_each_option_named_alone_exists():
    wrong = [
        f"{m.where}: {m.command.program} {' '.join(m.command.args[:1])} {o}"
        for m in MENTIONS
        if m.command is not None
        for o in unknown(m.command, m.options)
    ]
    assert wrong == []


def tracked(folder: str) -> list[str]:
    """The files git tracks under ``folder`` (what a clone has; another
    session's work in progress is not yet the project's)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", folder],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of the project's files")
    return [f for f in out.decode().split("\0") if f]


def test_the_ci_scripts_named_exist():
    named = set()
    for doc in DOCS:
        named |= set(re.findall(r"\.ci/[\w.-]*\w", doc.read_text()))
    # The Layout table names .ci/'s files by their names alone.
    layout = next(
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("| `.ci/` |")
    )
    for span in re.findall(r"`([^`]+)`", layout.split("|")[2]):
        name = span.split()[0]
        named.add(name if name.startswith(".ci/") else f".ci/{name}")
    assert {".ci/test", ".ci/demo", ".ci/setup.sh"} <= named
    assert sorted(n for n in named if not any(ROOT.glob(n))) == []


def test_a_fake_option_fails(tmp_path):
    """The checks catch an option the parser does not have, shown in a
    command or named alone after one."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "## Watching: `kvmerge subscribe`\n\n"
        "`--history` reads, `--no-such-option` does not.\n\n"
        "```bash\nkvmerge demo --steps 5 --fake-flag\n```\n"
    )
    commands, mentions = scan(doc, tmp_path)
    heading, cmd = commands
    assert heading.args == ("subscribe",)
    assert unknown(cmd, options(cmd.args)) == ["--fake-flag"]
    assert [m.command.args for m in mentions if m.command] == [("subscribe",)] * 2
    assert [o for m in mentions for o in unknown(m.command, m.options)] == [
        "--no-such-option"
    ]


#: The Layout table's rows that name their folder's modules in code spans.
MODULE_ROWS = {
    "rust/kvmerge-core/": ("src/", ".rs"),
    "rust/kvmerge-py/": ("src/", ".rs"),
    "python/kvmerge/vllm/": ("", ".py"),
    "python/kvmerge/sim/": ("", ".py"),
}


def layout() -> dict[str, str]:
    """The README's Layout table: path -> what."""
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and re.fullmatch(r"`[^`]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1]
    return rows


def test_the_layout_names_what_exists():
    rows = layout()
    assert set(MODULE_ROWS) <= set(rows)
    assert [p for p in rows if not (ROOT / p).exists()] == []
    missing = []
    for path, (sub, suffix) in MODULE_ROWS.items():
        for name in re.findall(r"`([a-z_]+/?)`", rows[path]):
            stem = name.rstrip("/")
            # A module (a file or a folder), or a folder beside the sources.
            found = [
                ROOT / path / sub / stem,
                ROOT / path / sub / (stem + suffix),
                ROOT / path / stem,
            ]
            if not any(f.exists() for f in found):
                missing.append(f"{path}: `{name}`")
    assert missing == []


def test_the_layout_names_every_module_and_ci_file():
    """What a row names exists (above), and what exists is named: a module
    added to one of ``MODULE_ROWS``' folders, or a file to ``.ci/``, goes in
    the Layout table too."""
    rows = layout()
    unnamed = []
    for path, (sub, suffix) in MODULE_ROWS.items():
        names = set(re.findall(r"`([a-z_]+)/?`", rows[path]))
        for f in tracked(path + sub):
            rel = Path(f).relative_to(path + sub)
            stem = rel.parts[0].removesuffix(suffix)
            if len(rel.parts) == 1 and not f.endswith(suffix):
                continue
            if stem not in names and stem not in ("lib", "__init__"):
                unnamed.append(f)
    spans = [s.split()[0] for s in re.findall(r"`([^`]+)`", rows[".ci/"])]
    for f in tracked(".ci/"):
        name = f.removeprefix(".ci/")
        if not any(Path(name).match(s.removeprefix(".ci/")) for s in spans):
            unnamed.append(f)
    assert unnamed == []
