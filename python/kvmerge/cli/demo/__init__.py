"""``kvmerge demo``: kvmerge inside vLLM's own scheduler loop, live, on a CPU.

vLLM's real ``Scheduler`` serves a stream of requests with shared prefixes
(prefix caching and KV events on); worker processes (one per TP rank) get
each step through vLLM's shm ``MessageQueue``, run ``KVMergeMultiConnector``'s
worker side over simulated offloading children (``kvmerge.sim.children``),
sample tokens and send their outputs back; the scheduler publishes on its own
``ZmqEventPublisher``; a subscriber (and with ``--router dynamo``, NVIDIA
Dynamo's KV indexer) reads the stream back and it is checked against the
reference model of the merge rules. See ``kvmerge demo --help``.

This module only declares the options: vLLM is imported by ``run``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from kvmerge.sim import FAMILIES


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
    unknown = [k for k in families if k not in FAMILIES]
    if unknown or not families:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(FAMILIES)}: {text!r}"
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run kvmerge inside vLLM's own scheduler loop, on this CPU: vLLM's "
        "Scheduler (prefix caching, KV events on) serves requests with shared "
        "prefixes; worker processes (one per TP rank) get each step through "
        "vLLM's shm MessageQueue and run KVMergeMultiConnector's worker side "
        "over simulated offloading children (LRU tiers that store what the "
        "scheduler computed; a rank sometimes late, retrying or losing an "
        "eviction report); the scheduler publishes on its ZmqEventPublisher, "
        "and the stream read back is checked: no gaps, parents before "
        "children, and exactly what the reference model of the merge rules "
        "publishes. With --router dynamo, NVIDIA Dynamo's KV indexer follows "
        "the stream and its lookups are checked too."
    )
    parser.epilog = (
        "exit status: 0 every check passed, 1 a check failed or a worker "
        "failed, 2 bad options, 130 interrupted by Ctrl-C (143 by SIGTERM): "
        "workers are stopped and shared memory released"
    )
    parser.add_argument(
        "--steps",
        type=_int_in(1, 20_000),
        default=500,
        metavar="N",
        help="engine steps to run, up to 20000 (default 500)",
    )
    parser.add_argument(
        "--workers",
        type=_int_in(1, 64),
        default=4,
        metavar="N",
        help="worker processes, one per TP rank: the merge's world size (default 4)",
    )
    parser.add_argument(
        "--rate",
        type=_float_in(0, 64),
        default=1.0,
        metavar="R",
        help="requests arriving per step, on average (Poisson; default 1)",
    )
    parser.add_argument(
        "--blocks",
        type=_int_in(16, 100_000),
        default=64,
        metavar="N",
        help="GPU KV cache blocks of 16 tokens: small, so that blocks are "
        "evicted and requests preempted (default 64)",
    )
    parser.add_argument(
        "--seed",
        type=_int_in(0),
        default=0,
        metavar="N",
        help="seed of the requests, the resets and the ranks' faults: the same "
        "seed gives the same stream (default 0)",
    )
    parser.add_argument(
        "--connectors",
        type=_connectors,
        default=FAMILIES,
        metavar="LIST",
        help="simulated child connectors, in order: any of lmcache (rule all, "
        "medium CPU), mooncake (rule quorum, group 0 replicated on 2 ranks, "
        f"medium STORAGE), umbp (rule any, medium EXTERNAL) "
        f"(default {','.join(FAMILIES)})",
    )
    parser.add_argument(
        "--clear-every",
        type=_int_in(0),
        default=150,
        metavar="STEPS",
        help="mean number of steps between prefix-cache resets "
        "(AllBlocksCleared, connectors reset); 0: never (default 150)",
    )
    parser.add_argument(
        "--max-pending-steps",
        type=_int_in(0),
        default=32,
        metavar="N",
        help="KVMergeMultiConnector's max_pending_steps: how long a report "
        "waits for the other ranks before it expires (default 32)",
    )
    parser.add_argument(
        "--interval",
        type=_float_in(0, 60),
        default=0.01,
        metavar="SECONDS",
        help="shortest time per engine step, to watch it run; 0: as fast as "
        "possible (default 0.01)",
    )
    parser.add_argument(
        "--router",
        choices=("auto", "none", "dynamo"),
        default="auto",
        help="dynamo: NVIDIA Dynamo's KV indexer (ai-dynamo-runtime) subscribes "
        "to the stream; its counters and lookups of random stored prefixes are "
        "checked against what the rules imply; auto: dynamo when "
        "--dynamo-python names an interpreter (default auto)",
    )
    parser.add_argument(
        "--dynamo-python",
        default=os.environ.get("KVMERGE_DYNAMO_PYTHON"),
        metavar="PATH",
        help="the interpreter of a venv with ai-dynamo-runtime 1.6.1, for "
        "--router dynamo (default $KVMERGE_DYNAMO_PYTHON; .ci/setup-dynamo.sh "
        "makes one)",
    )
    parser.add_argument(
        "--lookups",
        type=_int_in(1, 10_000),
        default=100,
        metavar="N",
        help="with --router: lookups every 100 steps and at the end (default 100)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="afterwards, run the same requests and children through vLLM's own "
        "path (each child's container merged by its own connector's rule) and "
        "compare what they publish (and, with --router, the lookups)",
    )
    parser.add_argument(
        "--endpoint",
        type=_ipc_endpoint,
        default=None,
        metavar="ipc://PATH",
        help="the publisher's endpoint (default: a fresh ipc:// path in a "
        "temporary directory; it is printed, for kvmerge subscribe)",
    )
    parser.add_argument(
        "--replay-endpoint",
        type=_ipc_endpoint,
        default=None,
        metavar="ipc://PATH",
        help="the publisher's replay endpoint (default: next to --endpoint)",
    )
    parser.add_argument(
        "--topic",
        default="kv-events",
        help="the publisher's topic (default kv-events)",
    )
    parser.add_argument(
        "--start-method",
        choices=("fork", "spawn"),
        default="fork",
        help="how worker processes start: fork (vLLM's default, "
        "VLLM_WORKER_MULTIPROC_METHOD) shares this process's vLLM import; "
        "spawn imports vLLM again in each (default fork)",
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="plain progress lines instead of the live view (the default when "
        "stdout is not a terminal)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also show vLLM's and torch's log messages",
    )


def run(args: argparse.Namespace) -> int:
    from .engine import run_demo

    return run_demo(args)
