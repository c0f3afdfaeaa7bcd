"""The `kvmerge` command.

Each subcommand lives in its own module, which provides
`add_arguments(parser)` and `run(args) -> int` (the exit code), and may
provide `check_arguments(args) -> str | None`: why options that each parse
do not fit together (an error, exit status 2, like argparse's). Those modules
import vLLM inside `run`, not at their top, so `kvmerge --help` and option
errors answer at once.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "example": ("kvmerge.cli.example", "a small encode / carry / merge example"),
    "demo": (
        "kvmerge.cli.demo",
        "run the whole pipeline live (TP worker processes, vLLM's transport and "
        "publisher) and check the published stream",
    ),
    "subscribe": (
        "kvmerge.cli.subscribe",
        "read a vLLM KV-event stream: rates, sequence gaps, replay, JSON lines",
    ),
}


def version_text() -> str:
    """``kvmerge 0.1.0 (vLLM 0.33.0)``: vLLM's version from its installed
    distribution's metadata, without importing vLLM."""
    import kvmerge

    try:
        vllm = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        vllm = "not installed"
    return f"kvmerge {kvmerge.__version__} (vLLM {vllm})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmerge",
        description="Merge vLLM KV-cache events from many workers, in Rust.",
    )
    parser.add_argument("--version", action="version", version=version_text())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        adder = getattr(_load(module), "add_arguments", None)
        if adder is not None:
            adder(p)
        p.set_defaults(command_parser=p)
    return parser


def _load(module: str):
    return importlib.import_module(module)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = _load(SUBCOMMANDS[args.command][0])
    check = getattr(module, "check_arguments", None)
    problem = check(args) if check is not None else None
    if problem:
        args.command_parser.error(problem)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
