"""What a report costs: a connector's stats on vLLM's stats path, per step.

One command (from the repository root, in the project's environment)::

    python -m benches.compare.stats                 # TP 2, 3 events a child
    python -m benches.compare.stats --tp 8 --events 512 --steps 400

Every engine step vLLM's scheduler asks its connector for stats
(``get_kv_connector_stats``, in ``update_from_output``); a non-empty answer
goes, as ``to_dict()``, into the step's ``SchedulerStats``, msgpack-encoded
with the step's outputs to the front end, where ``PrometheusStatLogger`` and
``LoggingStatLogger`` rebuild and record it. Per step, side by side, the
cases in turn (their order rotating):

* ``multi``: vLLM's ``MultiConnector`` over the benchmark's children
  (``benches.compare``'s; their own stats are none);
* ``kvmerge, every step``: ``KVMergeMultiConnector`` over the same children
  with no request running: it reports at every step (what it did at every
  step before reports were limited, and what it does now at the steps that
  leave no request running);
* ``kvmerge``: the same with a request running (a real vLLM ``Request``,
  through the connector's ``get_num_new_matched_tokens``): at most one report
  a second.

Both kvmerge connectors merge the same steps of the ``skewed`` workload
(``benches.compare``) first, untimed, so that their counters move every
step as under load. Timed: **engine core**, the connector's call, the
``to_dict``, the ``SchedulerStats`` and the encode of ``EngineCoreOutputs``
holding it; **front end**, the decode and both loggers' ``record``. Printed:
microseconds per step (median and mean over ``--steps``), the steps whose
stats carried anything, and each case over ``multi``'s in the same run.
The workers' own entries (at most one a second each) are left out.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import tempfile
from time import perf_counter_ns
from typing import Any

from vllm.config import ModelConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.request import Request
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from kvmerge.sim.model import CONNECTOR, model_dir
from kvmerge.vllm import register
from kvmerge.vllm.log import ROOT

from .paths import PathA, PathB, path_config
from .workload import Workload, preset

CASES = ("multi", "kvmerge, every step", "kvmerge")


class Case:
    """One connector and the loggers of a front end that reads it."""

    def __init__(self, name: str, connector: Any, cfg: Any) -> None:
        self.name = name
        self.connector = connector
        self.prom = PrometheusStatLogger(cfg)
        self.log = LoggingStatLogger(cfg)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.engine_ns: list[int] = []
        self.front_ns: list[int] = []
        self.reports = 0

    def step(self) -> None:
        t0 = perf_counter_ns()
        stats = self.connector.get_kv_connector_stats()
        data = stats.to_dict() if stats is not None and not stats.is_empty() else None
        wire = self.encoder.encode(
            EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=data))
        )
        t1 = perf_counter_ns()
        got = self.decoder.decode(wire).scheduler_stats
        self.prom.record(scheduler_stats=got, iteration_stats=None, engine_idx=0)
        self.log.record(scheduler_stats=got, iteration_stats=None)
        t2 = perf_counter_ns()
        self.engine_ns.append(t1 - t0)
        self.front_ns.append(t2 - t1)
        self.reports += data is not None

    def total_us(self) -> float:
        """Mean microseconds per step, both processes."""
        return (statistics.mean(self.engine_ns) + statistics.mean(self.front_ns)) / 1e3


def _running(connector: Any) -> None:
    """A request the scheduler has begun, as vLLM's scheduler begins one."""
    request = Request("bench-0", [1] * 64, SamplingParams(max_tokens=8), None)
    connector.get_num_new_matched_tokens(request, 0)


def run(tp: int, events: int, steps: int, warmup: int) -> list[Case]:
    """The cases, each having run ``steps`` measured steps after ``warmup``."""
    register()
    # The skewed workload's expiries are logged as incidents: not measured.
    logger = logging.getLogger(ROOT)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return _run(tp, events, steps, warmup)
    finally:
        logger.setLevel(level)


def _run(tp: int, events: int, steps: int, warmup: int) -> list[Case]:
    work = preset("skewed", world_size=tp, events=events)
    families = work.children
    every, limited = PathB(tp, families), PathB(tp, families)
    _running(limited.connector)
    # The loggers' config: the path's, with a model for their labels.
    cfg = copy.copy(path_config(CONNECTOR, tp, families))
    cfg.model_config = ModelConfig(
        model=str(model_dir(tempfile.mkdtemp(prefix="kvmerge-stats-"))),
        skip_tokenizer_init=True,
        served_model_name="tiny",
    )
    cases = [
        Case(CASES[0], PathA(tp, families).multi, cfg),
        Case(CASES[1], every.connector, cfg),
        Case(CASES[2], limited.connector, cfg),
    ]
    workload = Workload(work)
    for i in range(warmup + steps):
        if i == warmup:
            for case in cases:
                case.engine_ns.clear()
                case.front_ns.clear()
                case.reports = 0
        step = workload.next_step()
        for path in (every, limited):
            path.feed(step.events)
            path.scheduler([path.worker(r) for r in range(tp)])
        for case in cases[i % 3 :] + cases[: i % 3]:
            case.step()
    return cases


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benches.compare.stats",
        description=__doc__.split("\n", 1)[0],
    )
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--events", type=int, default=3, help="events a child a step")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=200)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cases = run(args.tp, args.events, args.steps, args.warmup)
    base = cases[0]
    print(
        f"TP {args.tp}, {args.events} events a child and step "
        f"({', '.join(preset('skewed').children)}, skewed), {args.steps} steps"
    )
    print(
        f"{'case':<22}{'engine core us':>16}{'front end us':>16}{'total us':>10}"
        f"{'over multi':>12}{'reports':>9}"
    )
    for case in cases:
        print(
            f"{case.name:<22}"
            f"{_us(case.engine_ns):>16}{_us(case.front_ns):>16}"
            f"{case.total_us():>10.1f}{case.total_us() / base.total_us():>11.2f}x"
            f"{case.reports:>9}"
        )
    print("(engine core and front end: median / mean microseconds per step)")


def _us(ns: list[int]) -> str:
    return f"{statistics.median(ns) / 1e3:.1f} / {statistics.mean(ns) / 1e3:.1f}"


if __name__ == "__main__":
    main()
