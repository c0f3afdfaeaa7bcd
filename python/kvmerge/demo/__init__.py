"""``kvmerge demo``: the whole pipeline, live, through vLLM's own machinery.

Worker processes (one per TP rank) run ``KVMergeMultiConnector``'s worker side
over the demo child connectors (``kvmerge.demo.connectors``), and send their
step outputs through vLLM's shm ``MessageQueue``; this process runs vLLM's
``KVOutputAggregator``, the connector's scheduler side and a real
``ZmqEventPublisher`` on an ipc:// endpoint, and a subscriber reads the stream
back and checks it. See ``kvmerge demo --help``.

This module only declares the options: vLLM is imported by ``run``.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from .workload import KINDS


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


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 60:
        raise argparse.ArgumentTypeError(f"must be between 0 and 60: {text!r}")
    return value


def _connectors(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip().lower() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(KINDS)}: {text!r}"
        )
    if len(set(kinds)) != len(kinds):
        raise argparse.ArgumentTypeError(f"a connector is listed twice: {text!r}")
    return kinds


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
        "Run kvmerge end to end: worker processes (one per TP rank) run "
        "KVMergeMultiConnector's worker side over demo child connectors that "
        "report KV events (stores with parent chains, evictions, a rank that is "
        "sometimes a step late, retries, lost reports, prefix-cache resets); "
        "their outputs travel through vLLM's shm MessageQueue; this process "
        "runs vLLM's KVOutputAggregator, the connector's scheduler side and a "
        "ZmqEventPublisher, and a subscriber reads the published stream back "
        "and checks it (sequence gaps, parents stored before children, no "
        "event published more often than every rank reported it)."
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
        type=_int_in(0, 10_000),
        default=12,
        metavar="N",
        help="average number of actions (stores, evictions, re-stores) each "
        "demo connector's store makes per step; every rank reports them "
        "(default 12)",
    )
    parser.add_argument(
        "--seed",
        type=_int_in(0),
        default=0,
        metavar="N",
        help="workload seed: the same seed gives the same events (default 0)",
    )
    parser.add_argument(
        "--connectors",
        type=_connectors,
        default=KINDS,
        metavar="LIST",
        help="demo child connectors, in order: any of lmcache (rule all), "
        "mooncake (rule quorum, two KV cache groups), umbp (rule any) "
        f"(default {','.join(KINDS)})",
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
        type=_seconds,
        default=0.01,
        metavar="SECONDS",
        help="shortest time per engine step, to watch it run; 0: as fast as "
        "possible (default 0.01)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="afterwards, run the same workload through vLLM's own path (each "
        "child alone: its container through KVOutputAggregator, its own "
        "update_connector_output/take_events) next to kvmerge's, in this "
        "process, and compare what they publish and the scheduler's time",
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
        help="also show vLLM's and torch's log messages, the worker processes' "
        "pids and the shared-memory segments",
    )


def run(args: argparse.Namespace) -> int:
    from .engine import run_demo

    return run_demo(args)
