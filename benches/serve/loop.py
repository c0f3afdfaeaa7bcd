"""``python -m benches.serve.loop``: ``benches.serve``'s configurations in
vLLM's real scheduler loop, in one process: what each side of a step costs,
with the real server's children and settings, and no other process on the
cores.

The real server cannot time kvmerge apart from the children it drives (its
metrics time kvmerge's scheduler calls with the children's inside them),
and on a small shared host the cores' contention moves a step by more than
kvmerge's part. Here each configuration's engine
(``kvmerge.sim.engine.Engine``: vLLM's ``Scheduler`` with its
``ZmqEventPublisher``, the TP ranks' connectors in this process, each
output through the shm queue's pickling) runs ``benches.serve``'s children
(``runner.transfer_config``) on the same requests, and every step is timed
on both sides (``Engine.step``'s ``worker_ns``; ``unpickle_ns`` and ``merge_ns``):

* ``worker``: a rank's connector calls in the model runner's order
  (``kvmerge.sim.worker.Worker.execute``; no forward pass) and the pickling
  of its output (``kvmerge.sim.transport.enqueue``), per rank;
* ``scheduler``: the outputs' unpickling, vLLM's ``KVOutputAggregator``
  and ``Scheduler.update_from_output`` (the connector's calls, the
  children's, the publisher's enqueue).

A round runs every configuration once over the bursts' requests
(``bursts.prompt_ids``), ``--concurrency`` at a time; rounds alternate
their order. Printed per configuration: the median and mean microseconds of
each side, and their difference from ``drain``'s.

    python -m benches.serve.loop --configs kvmerge,drain --rounds 6
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import order, parse
from .bursts import prompt_ids
from .report import BASELINE

#: The real server's block (``kvmerge.sim.server``) is twice the simulated
#: model's: ``--num-blocks`` of the server are twice as many here.
_BLOCKS_PER_SERVER_BLOCK = 2


@dataclass
class Timings:
    """One configuration's steps: nanoseconds of each side."""

    scheduler: list[int] = field(default_factory=list)
    worker: list[int] = field(default_factory=list)


def build_engine(name: str, args: Any, dir: Path) -> Any:
    """``name``'s engine: the server's children and connector, KV events on a
    ``ZmqEventPublisher`` nobody reads."""
    from vllm.config import KVEventsConfig, KVTransferConfig

    from kvmerge.sim.engine import Engine
    from kvmerge.sim.model import engine_config, model_dir
    from kvmerge.vllm import register

    from .runner import CONFIGS, transfer_config

    register()
    dir.mkdir(parents=True)
    config = CONFIGS[name]
    num_blocks = args.num_blocks * _BLOCKS_PER_SERVER_BLOCK
    cfg = engine_config(
        model_dir(dir, args.tp),
        [],
        world_size=args.tp,
        num_blocks=num_blocks,
        kv_events=KVEventsConfig(
            enable_kv_cache_events=config.kv_events,
            publisher="zmq",
            endpoint=f"ipc://{dir}/events",
            replay_endpoint=None,
        ),
    )
    # What the server's --kv-transfer-config says.
    cfg.kv_transfer_config = KVTransferConfig(**transfer_config(config, args, dir))
    return Engine(cfg, num_blocks=num_blocks)


def run_once(engine: Any, prompts: list[list[int]], args: Any, into: Timings) -> None:
    """Every prompt through ``engine``, at most ``--concurrency`` at a time."""
    from kvmerge.sim.requests import Prompt

    # Request ids unique per run: a scheduler keeps finished ids for a while.
    tag = f"{id(into)}-{len(into.scheduler)}"
    waiting = [
        Prompt(f"{tag}-{i}", ids, args.output_len) for i, ids in enumerate(prompts)
    ]
    engine.add(waiting[: args.concurrency])
    waiting = waiting[args.concurrency :]
    while engine.scheduler.has_requests():
        step = engine.step()
        into.worker.extend(step.worker_ns)
        into.scheduler.append(step.unpickle_ns + step.merge_ns)
        if step.finished and waiting:
            engine.add(waiting[: len(step.finished)])
            waiting = waiting[len(step.finished) :]


def _us(ns: Sequence[int]) -> tuple[float, float]:
    return statistics.median(ns) / 1e3, statistics.fmean(ns) / 1e3


def render(timings: dict[str, Timings]) -> str:
    """Per configuration, each side's median and mean, and over ``drain``."""
    base = timings.get(BASELINE)
    lines = [
        "config     steps   scheduler us (median / mean)   worker us (median / mean)"
    ]
    for name, t in timings.items():
        cells = []
        for side in ("scheduler", "worker"):
            median, mean = _us(getattr(t, side))
            cell = f"{median:7.1f} / {mean:7.1f}"
            if base is not None and name != BASELINE:
                b_median, b_mean = _us(getattr(base, side))
                cell += f" ({median - b_median:+.1f} / {mean - b_mean:+.1f})"
            cells.append(f"{cell:30s}")
        lines.append(f"{name:10s} {len(t.scheduler):6d}   {cells[0]} {cells[1]}")
    if base is not None:
        lines.append(f"(in brackets: the difference from {BASELINE}'s)")
    return "\n".join(lines)


def measure(args: Any) -> dict[str, Timings]:
    """Every round of ``args``: each configuration's timings."""
    prompts = prompt_ids(args)
    timings = {n: Timings() for n in args.configs}
    with tempfile.TemporaryDirectory(prefix="kvl-") as tmp:
        engines: dict[str, Any] = {}
        try:
            for name in args.configs:
                engines[name] = build_engine(name, args, Path(tmp) / name)
            for round_, name in order(args.configs, args.rounds):
                run_once(engines[name], prompts, args, timings[name])
                print(f"   round {round_} {name}", file=sys.stderr, flush=True)
        finally:
            for engine in engines.values():
                engine.close()
    return timings


def main(argv: Sequence[str] | None = None) -> int:
    defaults = ["--configs", "kvmerge,drain", "--rounds", "4", "--num-prompts", "96"]
    print(render(measure(parse([*defaults, *(argv or [])]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
