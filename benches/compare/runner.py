"""Runs the grid: per case, the same workload through path A and path B, step
by step, alternating which path goes first; times each side; checks both
outputs against the reference model.

Timing: wall clock (``time.perf_counter``, what the targets use) and, beside
it, the thread's CPU time (``time.thread_time``: what a loaded machine's
preemptions do not inflate); one measurement per step and rank:

* worker side, per rank: the rank's worker-side event call (path A: each
  child's ``get_kv_connector_kv_cache_events``, which builds its native
  container; path B: ``KVMergeMultiConnector.get_kv_connector_kv_cache_events``,
  which calls the same children then encodes) plus wrapping and pickling;
* scheduler side: unpickling every rank's message, ``KVOutputAggregator``,
  ``update_connector_output``, ``take_events`` drained into a list.

Garbage collection: as vLLM's engine core does after start-up
(``freeze_gc_heap``), the heap present once the connectors are built is frozen
(``gc.freeze()``); then a collection runs, untimed, before each timed section,
so that neither path pays for the other's garbage. Collections inside a timed
section stay in it.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from time import perf_counter, thread_time
from typing import Any

from .presets import OTHER_WORKLOADS
from .workload import Workload, WorkloadConfig, preset

#: The issue's targets.
TARGET_SCHED_512 = 100.0
TARGET_SCHED_32 = 10.0
#: Issue 14: path B's scheduler side with one rank one step late, and with one
#: rank silent (a full window pending), against every rank on time.
TARGET_STRAGGLER = 1.3
TARGET_SILENT = 2.0
#: Issue 14: 32-byte block hashes (the "bytes" workload), TP 8 x 512.
TARGET_BYTES_512 = 100.0
#: Issue 14: decode-size steps (the "clears" workload: three children), TP 8 x
#: 32: at most this many ms of path B's scheduler side, and this ratio.
TARGET_DECODE_MS = 0.2
TARGET_DECODE_RATIO = 40.0
#: Issue 14: the worker side per rank, every case of the default (uniform) grid.
TARGET_WORKER = 1.5


@dataclass(frozen=True)
class Case:
    workload: str
    world_size: int
    events: int

    @property
    def key(self) -> str:
        return f"{self.workload}/tp{self.world_size}/{self.events}"


def default_grid(
    tps: Sequence[int] = (2, 4, 8),
    events: Sequence[int] = (32, 128, 512, 2048),
    workloads: Sequence[str] = OTHER_WORKLOADS,
    workload_tps: Sequence[int] = (8,),
    workload_events: Sequence[int] = (32, 512),
) -> list[Case]:
    grid = [Case("uniform", tp, n) for tp in tps for n in events]
    grid += [
        Case(w, tp, n)
        for w in workloads
        for tp in workload_tps
        for n in workload_events
    ]
    return grid


def _ms(seconds: float) -> float:
    return seconds * 1e3


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception:  # pragma: no cover
        pass
    try:
        import torch

        info["torch"] = torch.__version__
    except Exception:  # pragma: no cover
        pass
    import kvmerge

    info["kvmerge"] = kvmerge.__version__
    try:
        # The commit, when this package is a kvmerge checkout's python/kvmerge
        # (an editable install); an installed wheel has none.
        here = os.path.dirname(os.path.realpath(kvmerge.__file__))
        git = ["git", "-C", here]
        top = subprocess.run(
            [*git, "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        checkout = (
            top.returncode == 0
            and os.path.realpath(os.path.join(top.stdout.strip(), "python", "kvmerge"))
            == here
        )
        if checkout:
            rev = subprocess.run(
                [*git, "describe", "--always", "--dirty"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            if rev.returncode == 0:
                info["kvmerge_commit"] = rev.stdout.strip()
    except Exception:  # pragma: no cover
        pass
    return info


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # pragma: no cover
        return None


def run_case(
    case: Case,
    *,
    steps: int,
    warmup: int,
    seed: int,
    check: bool = True,
    check_limit: int,
    output: str = "raw",
    config: WorkloadConfig | None = None,
) -> dict[str, Any]:
    """One case: ``warmup + steps`` steps through both paths. ``config``
    replaces the case's named workload (its sizes must match the case's)."""
    from .check import Checker
    from .paths import PathA, PathB
    from .workload import MIN_WARMUP

    cfg: WorkloadConfig = config or preset(
        case.workload, world_size=case.world_size, events=case.events, seed=seed
    )
    workload = Workload(cfg)
    paths = {
        "A": PathA(case.world_size, cfg.children),
        "B": PathB(case.world_size, cfg.children, output),
    }
    warmup = max(warmup, MIN_WARMUP.get(case.workload, 0))
    # The model is quadratic in what is pending: a silent rank keeps a
    # window of 32 steps pending.
    size = case.world_size * case.events * (32 if cfg.silent_rank else 1)
    checked = check and size <= check_limit
    checker = Checker(case.world_size, cfg.children) if checked else None
    records: dict[str, list[dict[str, Any]]] = {"A": [], "B": []}
    gc.collect()
    gc.freeze()
    try:
        _steps(case, paths, workload, warmup + steps, warmup, checker, records)
    finally:
        gc.unfreeze()
    summary = {name: summarise(rs) for name, rs in records.items()}
    a, b = summary["A"], summary["B"]
    result = {
        "case": case.key,
        "workload": case.workload,
        "world_size": case.world_size,
        "events": case.events,
        "children": list(cfg.children),
        "config": cfg.as_dict(),
        "steps": steps,
        "warmup": warmup,
        "summary": summary,
        "ratio": {
            "scheduler_a_over_b": a["scheduler_ms"] / b["scheduler_ms"],
            "scheduler_cpu_a_over_b": a["scheduler_cpu_ms"] / b["scheduler_cpu_ms"],
            "worker_a_over_b": a["worker_ms_per_rank"] / b["worker_ms_per_rank"],
            "worker_cpu_a_over_b": a["worker_cpu_ms_per_rank"]
            / b["worker_cpu_ms_per_rank"],
            "bytes_b_over_a": b["bytes_per_rank"] / a["bytes_per_rank"],
        },
        "records": records,
        "check": None,
    }
    if checker is not None:
        result["check"] = {
            name: [d.as_dict() for d in diffs] for name, diffs in checker.diffs.items()
        }
    elif check:
        result["check_skipped"] = (
            f"world_size x events (x 32 with a silent rank) = {size} > check limit "
            f"{check_limit}"
        )
    return result


def _steps(
    case: Case,
    paths: dict[str, Any],
    workload: Workload,
    n: int,
    warmup: int,
    checker: Any,
    records: dict[str, list[dict[str, Any]]],
) -> None:
    for step in workload.steps(n):
        order = ("A", "B") if step.index % 2 == 0 else ("B", "A")
        want = checker.expected(step) if checker is not None else None
        for name in order:
            path = paths[name]
            path.feed(step.events)
            worker_s: list[float] = []
            wire_bytes: list[int] = []
            wires = []
            worker_cpu: list[float] = []
            for rank in range(case.world_size):
                gc.collect()
                c0, t0 = thread_time(), perf_counter()
                wire = path.worker(rank)
                t1, c1 = perf_counter(), thread_time()
                worker_s.append(t1 - t0)
                worker_cpu.append(c1 - c0)
                wires.append(wire)
                wire_bytes.append(wire.nbytes)
            gc.collect()
            c0, t0 = thread_time(), perf_counter()
            result = path.scheduler(wires)
            t1, c1 = perf_counter(), thread_time()
            per_child = path.per_child(result)
            if checker is not None and want is not None:
                checker.compare(name, step.index, want, per_child)
            if step.index >= warmup:
                records[name].append(
                    {
                        "step": step.index,
                        "scheduler_s": t1 - t0,
                        "scheduler_cpu_s": c1 - c0,
                        "worker_s": worker_s,
                        "worker_cpu_s": worker_cpu,
                        "bytes": wire_bytes,
                        "events_in": step.count(),
                        "events_out": [len(c) for c in per_child],
                    }
                )


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    sched = [_ms(r["scheduler_s"]) for r in records]
    sched_cpu = [_ms(r["scheduler_cpu_s"]) for r in records]
    worker_mean = [_ms(statistics.fmean(r["worker_s"])) for r in records]
    worker_cpu = [_ms(statistics.fmean(r["worker_cpu_s"])) for r in records]
    worker_max = [_ms(max(r["worker_s"])) for r in records]
    nbytes = [statistics.fmean(r["bytes"]) for r in records]
    return {
        "scheduler_ms": _median(sched),
        "scheduler_ms_min": min(sched) if sched else float("nan"),
        "scheduler_ms_p90": _quantile(sched, 0.9),
        "scheduler_cpu_ms": _median(sched_cpu),
        "worker_ms_per_rank": _median(worker_mean),
        "worker_cpu_ms_per_rank": _median(worker_cpu),
        "worker_ms_max_rank": _median(worker_max),
        "bytes_per_rank": statistics.fmean(nbytes) if nbytes else float("nan"),
        "events_in_per_step": statistics.fmean(r["events_in"] for r in records)
        if records
        else 0,
        "events_out_per_step": statistics.fmean(sum(r["events_out"]) for r in records)
        if records
        else 0,
    }


def targets(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, evaluated on this run's cases."""
    by_key = {c["case"]: c for c in cases}
    out: list[dict[str, Any]] = []

    def sched(case: str, name: str, need: float) -> None:
        c = by_key.get(case)
        name = f"{name}: A/B >= {need:g}x"
        if c is None:
            out.append({"target": name, "met": None, "value": "not measured"})
            return
        r = c["ratio"]["scheduler_a_over_b"]
        cpu = c["ratio"]["scheduler_cpu_a_over_b"]
        out.append(
            {
                "target": name,
                "met": r >= need,
                "value": f"{r:.0f}x (CPU time {cpu:.0f}x)",
            }
        )

    for events, need in ((512, TARGET_SCHED_512), (32, TARGET_SCHED_32)):
        name = f"scheduler side, TP=8, {events} events/child/rank"
        sched(f"uniform/tp8/{events}", name, need)

    def straggler(workload: str, what: str, need: float) -> None:
        for events in (512, 32):
            c = by_key.get(f"{workload}/tp8/{events}")
            base = by_key.get(f"uniform/tp8/{events}")
            name = (
                f"B scheduler side, TP=8, {events} events, {what}: "
                f"<= {need:g}x every rank on time"
            )
            if c is None or base is None:
                if c is not None or base is not None:
                    out.append({"target": name, "met": None, "value": "not measured"})
                continue
            b, b0 = c["summary"]["B"], base["summary"]["B"]
            r = b["scheduler_ms"] / b0["scheduler_ms"]
            cpu = b["scheduler_cpu_ms"] / b0["scheduler_cpu_ms"]
            out.append(
                {
                    "target": name,
                    "met": r <= need,
                    "value": f"{r:.2f}x (CPU time {cpu:.2f}x; "
                    f"{b['scheduler_ms']:.3f} vs {b0['scheduler_ms']:.3f} ms)",
                }
            )

    straggler("straggler", "last rank one step late", TARGET_STRAGGLER)
    straggler("silent", "last rank silent (full window pending)", TARGET_SILENT)

    sched(
        "bytes/tp8/512",
        "scheduler side, TP=8, 512 events, 32-byte hashes",
        TARGET_BYTES_512,
    )
    c = by_key.get("clears/tp8/32")
    name = (
        f"B scheduler side, TP=8, 32 events, three children: <= {TARGET_DECODE_MS:g} "
        f"ms and A/B >= {TARGET_DECODE_RATIO:g}x"
    )
    if c is None:
        out.append({"target": name, "met": None, "value": "not measured"})
    else:
        ms, r = c["summary"]["B"]["scheduler_ms"], c["ratio"]["scheduler_a_over_b"]
        out.append(
            {
                "target": name,
                "met": ms <= TARGET_DECODE_MS and r >= TARGET_DECODE_RATIO,
                "value": f"{ms:.3f} ms, {r:.0f}x",
            }
        )
    grid = [c for c in cases if c["workload"] == "uniform"]
    worst = min(grid, key=lambda c: c["ratio"]["worker_a_over_b"], default=None)
    if worst is not None:
        r = worst["ratio"]["worker_a_over_b"]
        out.append(
            {
                "target": f"worker side per rank: A/B >= {TARGET_WORKER:g} "
                "(every uniform case)",
                "met": r >= TARGET_WORKER,
                "value": f"worst A/B {r:.2f} ({worst['case']})",
            }
        )
    worst_w = min(cases, key=lambda c: c["ratio"]["worker_a_over_b"], default=None)
    if worst_w is not None:
        r = worst_w["ratio"]["worker_a_over_b"]
        worst_cpu = min(cases, key=lambda c: c["ratio"]["worker_cpu_a_over_b"])
        rc = worst_cpu["ratio"]["worker_cpu_a_over_b"]
        out.append(
            {
                "target": "worker side per rank: B no slower than A (every case)",
                "met": r >= 1.0,
                "value": f"worst A/B {r:.2f} ({worst_w['case']}); in CPU time "
                f"{rc:.2f} ({worst_cpu['case']})",
            }
        )
    worst_b = max(cases, key=lambda c: c["ratio"]["bytes_b_over_a"], default=None)
    if worst_b is not None:
        r = worst_b["ratio"]["bytes_b_over_a"]
        out.append(
            {
                "target": "bytes per rank: B no more than A (every case)",
                "met": r <= 1.0,
                "value": f"worst B/A {r:.3f} ({worst_b['case']})",
            }
        )
    checked = [c for c in cases if c.get("check")]
    if checked:
        bad = [
            c["case"]
            for c in checked
            if not all(d["equal"] for d in c["check"].get("B", []))
        ]
        out.append(
            {
                "target": "path B output identical to the reference model",
                "met": not bad,
                "value": f"{len(checked) - len(bad)}/{len(checked)} checked cases"
                + (f"; differs: {', '.join(bad)}" if bad else ""),
            }
        )
    else:
        out.append(
            {
                "target": "path B output identical to the reference model",
                "met": None,
                "value": "not checked",
            }
        )
    return out
