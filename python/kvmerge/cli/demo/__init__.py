"""``kvmerge demo``: kvmerge live on a CPU, its published stream checked.

Two demos. ``--sim`` (the default): kvmerge inside vLLM's own scheduler loop.
vLLM's real ``Scheduler`` serves a stream of requests with shared prefixes
(prefix caching and KV events on); worker processes (one per TP rank) get
each step through vLLM's shm ``MessageQueue``, run ``KVMergeMultiConnector``'s
worker side over simulated offloading children (``kvmerge.sim.children``),
sample tokens and send their outputs back; the scheduler publishes on its own
``ZmqEventPublisher``; a subscriber (and with ``--router dynamo``, NVIDIA
Dynamo's KV indexer) reads the stream back and it is checked against the
reference model of the merge rules (``engine``). ``--server``: kvmerge in
the real ``vllm serve`` at TP 2, driven over HTTP (``served``). See
``kvmerge demo --help``.

This module only declares the options: vLLM is imported by ``run``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, Final

from kvmerge.sim import FAMILY_NAMES
from kvmerge.sim.server import PYTHON_ENV
from kvmerge.vllm import families


def _int_in(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise argparse.ArgumentTypeError(f"must be {bound}: {text!r}")
        return value

    return parse


def _float_in(lo: float, hi: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(
                f"must be between {lo:g} and {hi:g}: {text!r}"
            )
        return value

    return parse


def _connectors(text: str) -> tuple[str, ...]:
    families = tuple(k.strip().lower() for k in text.split(",") if k.strip())
    unknown = [k for k in families if k not in FAMILY_NAMES]
    if unknown or not families:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(FAMILY_NAMES)}: {text!r}"
        )
    if len(set(families)) != len(families):
        raise argparse.ArgumentTypeError(f"a connector is listed twice: {text!r}")
    return families


def _ipc_endpoint(text: str) -> str:
    if not text.startswith("ipc://") or len(text) <= len("ipc://"):
        raise argparse.ArgumentTypeError(
            f"the demo publishes on this machine only: expected ipc://PATH: {text!r}"
        )
    directory = os.path.dirname(os.path.abspath(text[len("ipc://") :]))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"no such directory: {directory}")
    return text


#: Where an option's value is recorded as given on the command line: the
#: options of one demo are refused with the other (``explicit``).
_GIVEN = "explicit_options"


class _Given(argparse.Action):
    """Stores the value, and records that the option was given."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        given = set(getattr(namespace, _GIVEN, ()))
        given.add(option_string or self.dest)
        setattr(namespace, _GIVEN, given)


def explicit(args: argparse.Namespace) -> set[str]:
    """The options of one demo only that the command line gave."""
    return set(getattr(args, _GIVEN, ()))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run kvmerge live on this CPU and check the KV-event stream it "
        "publishes: no gaps, parents before children, and exactly what the "
        "reference model of the merge rules publishes; with --router dynamo, "
        "NVIDIA Dynamo's KV indexer follows the stream and its counters and "
        "lookups are checked too. Two demos: --sim (the default) re-enacts "
        "vLLM's engine: its own Scheduler, worker processes (one per TP rank) "
        "behind vLLM's shm MessageQueue running KVMergeMultiConnector's worker "
        "side over simulated offloading children (LRU tiers; a rank sometimes "
        "late, retrying or losing an eviction report), the scheduler's "
        "ZmqEventPublisher; deterministic for a seed. --server runs the real "
        "`vllm serve` (vLLM 0.32's CPU build) at TP 2 with "
        "KVMergeMultiConnector over simulated children and vLLM's "
        "ExampleConnector, and sends it requests with shared prefixes over "
        "HTTP; its /metrics (vllm:kvmerge_*) are checked against the stream."
    )
    parser.epilog = (
        "exit status: 0 every check passed, 1 a check failed (or a worker, or "
        "the server, failed), 2 bad options, 130 interrupted by Ctrl-C (143 by "
        "SIGTERM): workers or the server are stopped and shared memory released"
    )
    which = parser.add_argument_group("which demo")
    mode = which.add_mutually_exclusive_group()
    mode.add_argument(
        "--sim",
        dest="server",
        action="store_false",
        default=False,
        help="vLLM's scheduler loop re-enacted here, with scripted faults and "
        "a deterministic stream (the default)",
    )
    mode.add_argument(
        "--server",
        dest="server",
        action="store_true",
        help=f"the real `vllm serve` at TP 2 on this CPU (needs ${PYTHON_ENV} "
        "or --vllm-python; .ci/demo sets it up)",
    )
    both = parser.add_argument_group("both demos")
    both.add_argument(
        "--seed",
        type=_int_in(0),
        default=0,
        metavar="N",
        help="seed of the requests, the resets and the ranks' faults: the same "
        "seed gives the same stream with --sim (default 0)",
    )
    both.add_argument(
        "--max-pending-steps",
        type=_int_in(0),
        default=32,
        metavar="N",
        help="KVMergeMultiConnector's max_pending_steps: how long a report "
        "waits for the other ranks before it expires (default 32)",
    )
    both.add_argument(
        "--router",
        choices=("auto", "none", "dynamo"),
        default="auto",
        help="dynamo: NVIDIA Dynamo's KV indexer (ai-dynamo-runtime) subscribes "
        "to the stream; its counters and lookups of random stored prefixes are "
        "checked against what the rules imply; auto: dynamo when "
        "--dynamo-python names an interpreter (default auto)",
    )
    both.add_argument(
        "--dynamo-python",
        default=os.environ.get("KVMERGE_DYNAMO_PYTHON"),
        metavar="PATH",
        help="the interpreter of a venv with ai-dynamo-runtime 1.6.1, for "
        "--router dynamo (default $KVMERGE_DYNAMO_PYTHON; .ci/setup-dynamo.sh "
        "makes one)",
    )
    both.add_argument(
        "--compare",
        action="store_true",
        help="afterwards, the same requests and children through vLLM's own "
        "path, side by side: with --sim each child's container merged by its "
        "own connector's rule (and, with --router, the lookups); with "
        "--server vLLM's MultiConnector, which publishes none of the "
        "children's events",
    )
    both.add_argument(
        "--topic",
        default="kv-events",
        help="the publisher's topic (default kv-events)",
    )
    both.add_argument(
        "--plain",
        action="store_true",
        help="plain progress lines instead of the live view (the default when "
        "stdout is not a terminal)",
    )
    both.add_argument(
        "--verbose",
        action="store_true",
        help="also show vLLM's and torch's log messages (with --server, the "
        "server's log's tail on a failure)",
    )
    sim = parser.add_argument_group("the scheduler-loop demo (--sim)")
    sim.add_argument(
        "--steps",
        action=_Given,
        type=_int_in(1, 20_000),
        default=500,
        metavar="N",
        help="engine steps to run, up to 20000 (default 500)",
    )
    sim.add_argument(
        "--workers",
        action=_Given,
        type=_int_in(1, 64),
        default=4,
        metavar="N",
        help="worker processes, one per TP rank: the merge's world size (default 4)",
    )
    sim.add_argument(
        "--rate",
        action=_Given,
        type=_float_in(0, 64),
        default=1.0,
        metavar="R",
        help="requests arriving per step, on average (Poisson; default 1)",
    )
    sim.add_argument(
        "--blocks",
        action=_Given,
        type=_int_in(16, 100_000),
        default=64,
        metavar="N",
        help="GPU KV cache blocks of 16 tokens: small, so that blocks are "
        "evicted and requests preempted (default 64)",
    )
    sim.add_argument(
        "--connectors",
        action=_Given,
        type=_connectors,
        default=FAMILY_NAMES,
        metavar="LIST",
        help="simulated child connectors, in order: any of "
        + ", ".join(
            f"{f.name} (rule {f.rule}, medium {f.medium})" for f in families.available()
        )
        + f" (default {','.join(FAMILY_NAMES)}; mooncake's group 0 is replicated "
        "on 2 ranks)",
    )
    sim.add_argument(
        "--clear-every",
        action=_Given,
        type=_int_in(0),
        default=150,
        metavar="STEPS",
        help="mean number of steps between prefix-cache resets "
        "(AllBlocksCleared, connectors reset); 0: never (default 150)",
    )
    sim.add_argument(
        "--interval",
        action=_Given,
        type=_float_in(0, 60),
        default=0.01,
        metavar="SECONDS",
        help="shortest time per engine step, to watch it run; 0: as fast as "
        "possible (default 0.01)",
    )
    sim.add_argument(
        "--lookups",
        action=_Given,
        type=_int_in(1, 10_000),
        default=100,
        metavar="N",
        help="with --router: lookups every 100 steps and at the end (default 100)",
    )
    sim.add_argument(
        "--endpoint",
        action=_Given,
        type=_ipc_endpoint,
        default=None,
        metavar="ipc://PATH",
        help="the publisher's endpoint (default: a fresh ipc:// path in a "
        "temporary directory; it is printed, for kvmerge subscribe)",
    )
    sim.add_argument(
        "--replay-endpoint",
        action=_Given,
        type=_ipc_endpoint,
        default=None,
        metavar="ipc://PATH",
        help="the publisher's replay endpoint (default: next to --endpoint)",
    )
    sim.add_argument(
        "--start-method",
        action=_Given,
        choices=("fork", "spawn"),
        default="fork",
        help="how worker processes start: fork (vLLM's default, "
        "VLLM_WORKER_MULTIPROC_METHOD) shares this process's vLLM import; "
        "spawn imports vLLM again in each (default fork)",
    )
    # The server demo's defaults are kvmerge.sim.served.ServedOptions's
    # (None here: that module imports vLLM); the help names them.
    server = parser.add_argument_group("the real server (--server)")
    for flag, parse, help_ in (
        (
            "--requests",
            _int_in(1, 10_000),
            "completions to request over HTTP, with shared prefixes (default 48)",
        ),
        (
            "--concurrency",
            _int_in(1, 256),
            "requests in flight at once: more than the small KV cache holds, "
            "so that requests are preempted (default 6)",
        ),
        (
            "--waves",
            _int_in(1, 100),
            "the requests in N waves, the prefix cache (and the connectors') "
            "reset between two (default 3)",
        ),
        (
            "--damage",
            _int_in(0),
            "the Mooncake child's last rank damages its report every N-th "
            "step: kvmerge must refuse exactly those (vllm:kvmerge_refused_total) "
            "and publish everything else; 0: never (default 3)",
        ),
    ):
        server.add_argument(
            flag, action=_Given, type=parse, default=None, metavar="N", help=help_
        )
    server.add_argument(
        "--vllm-python",
        action=_Given,
        default=os.environ.get(PYTHON_ENV),
        metavar="PATH",
        help="the interpreter of a venv whose vLLM runs on this CPU, with "
        f"kvmerge installed (default ${PYTHON_ENV}; `.ci/setup.sh 0.32.0` "
        "makes one)",
    )


#: The options that belong to one demo only.
SIM_ONLY: Final = (
    "--steps",
    "--workers",
    "--rate",
    "--blocks",
    "--connectors",
    "--clear-every",
    "--interval",
    "--lookups",
    "--endpoint",
    "--replay-endpoint",
    "--start-method",
)
SERVER_ONLY: Final = (
    "--requests",
    "--concurrency",
    "--waves",
    "--damage",
    "--vllm-python",
)


def check_arguments(args: argparse.Namespace) -> str | None:
    """Why the options given do not fit the demo chosen (None: they do)."""
    wrong, demo = (SIM_ONLY, "--sim") if args.server else (SERVER_ONLY, "--server")
    given = sorted(explicit(args) & set(wrong))
    if given:
        return f"{', '.join(given)}: an option of {demo} only"
    if args.server and not (args.vllm_python and os.path.exists(args.vllm_python)):
        return (
            f"--server needs the interpreter of a venv whose vLLM runs on this "
            f"CPU (--vllm-python, or ${PYTHON_ENV}; `.ci/setup.sh 0.32.0` makes "
            f"one): {args.vllm_python or 'not set'}"
        )
    return None


def run(args: argparse.Namespace) -> int:
    if args.server:
        from .served import run_served

        return run_served(args)
    from .engine import run_demo

    return run_demo(args)
