"""kvmerge against vLLM 0.33.0's own KV-event path, side by side, in one run.

A development tool, run from the checkout (it is not in the wheel).

Path A is vLLM 0.33.0 as shipped (each child connector's native container,
pickled as the shm ``MessageQueue`` pickles it, ``KVOutputAggregator``, the
child's own ``update_connector_output`` / ``take_events``); path B is
``KVMergeMultiConnector`` with the same children, the same pickling and the
same aggregator. Per case (workload, TP, events per child per rank per step)
both paths run the same seeded steps, alternating which goes first. Reported
per step: scheduler-side time, worker-side time per rank, bytes per rank, the
ratios, and each path's output against the reference model
(``kvmerge.testing.reference``). Output: a table, a JSON file and a PNG plot.

    python -m benches.compare            # the full grid (minutes)
    python -m benches.compare --quick    # a few seconds
    python -m benches.compare --help

As a module::

    from benches.compare import run_bench
    doc = run_bench(grid=[Case("uniform", 8, 512)], steps=10)

vLLM is imported inside ``run`` (and the submodules), not here, so that
``--help`` and option errors answer at once.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .presets import OTHER_WORKLOADS, PRESETS

if TYPE_CHECKING:
    from .runner import Case

__all__ = ["add_arguments", "build_parser", "main", "run", "run_bench"]

DEFAULT_OUT = "bench-out"


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 2,4,8: {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers: {text!r}")
    return values


def _names(text: str) -> list[str]:
    return (
        []
        if text in ("", "none")
        else [x.strip() for x in text.split(",") if x.strip()]
    )


def _profile_case(text: str) -> tuple[str, int, int] | None:
    """``[WORKLOAD/]TPxEVENTS`` (the workload uniform unless named), or
    ``none``."""
    if text == "none":
        return None
    workload, _, size = text.rpartition("/")
    try:
        tp, n = (int(x) for x in size.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected [WORKLOAD/]TPxEVENTS like 8x512 or clears/8x32: {text!r}"
        ) from None
    return workload or "uniform", tp, n


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("grid")
    g.add_argument(
        "--tp",
        type=_ints,
        default=[2, 4, 8],
        help="TP sizes of the uniform workload (default 2,4,8)",
    )
    g.add_argument(
        "--events",
        type=_ints,
        default=[32, 128, 512, 2048],
        help="events per child per rank per step, uniform workload "
        "(default 32,128,512,2048)",
    )
    g.add_argument(
        "--workloads",
        type=_names,
        default=list(OTHER_WORKLOADS),
        help=f"other workloads to run ({', '.join(OTHER_WORKLOADS)}; 'none'; "
        "default all of them)",
    )
    g.add_argument(
        "--workload-tp",
        type=_ints,
        default=[8],
        help="TP sizes of the other workloads (default 8)",
    )
    g.add_argument(
        "--workload-events",
        type=_ints,
        default=[32, 512],
        help="their events per child per rank per step (default 32,512)",
    )
    g.add_argument(
        "--steps", type=int, default=12, help="measured steps per case (default 12)"
    )
    g.add_argument(
        "--warmup", type=int, default=2, help="unmeasured steps first (default 2)"
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--quick",
        action="store_true",
        help="a tiny grid (TP 2, 16 and 32 events, every workload, 3 steps): seconds",
    )
    g.add_argument(
        "--output",
        choices=("raw", "objects"),
        default="raw",
        help="KVMergeMultiConnector's kv_events_output for path B (default raw)",
    )
    c = parser.add_argument_group("checks")
    c.add_argument(
        "--check-limit",
        type=int,
        default=4096,
        help="check against the reference model when TP x events <= this "
        "(default 4096; the model is slow)",
    )
    c.add_argument(
        "--no-check", action="store_true", help="do not run the reference model"
    )
    o = parser.add_argument_group("output")
    o.add_argument(
        "--out",
        default=DEFAULT_OUT,
        help=f"directory for bench.json and bench.png (default {DEFAULT_OUT}/)",
    )
    o.add_argument("--json", help="JSON file (default OUT/bench.json)")
    o.add_argument("--png", help="plot file (default OUT/bench.png)")
    o.add_argument("--no-plot", action="store_true")
    o.add_argument(
        "--render",
        metavar="JSON",
        help="run nothing: print a JSON file's results as a Markdown table "
        "(and redraw its plot at --png, if given)",
    )
    o.add_argument(
        "--profile",
        type=_profile_case,
        default=("uniform", 8, 512),
        metavar="[WORKLOAD/]TPxEVENTS",
        help="profile one case phase by phase (default 8x512, uniform; "
        "clears/8x32 names the workload; 'none' to skip)",
    )


def _quiet_vllm() -> None:
    """vLLM logs every connector it builds at INFO; the bench builds many."""
    import logging
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    logging.getLogger("vllm").setLevel(logging.WARNING)


def run_bench(
    grid: Sequence[Case],
    *,
    steps: int = 12,
    warmup: int = 2,
    seed: int = 0,
    output: str = "raw",
    check: bool = True,
    check_limit: int = 4096,
    profile: tuple[str, int, int] | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Run ``grid``; returns the JSON document (see docs/benchmarks.md)."""
    _quiet_vllm()
    from . import runner

    ref_note = "kvmerge.testing.reference" if check else "disabled (--no-check)"
    doc: dict[str, Any] = {
        "machine": runner.machine(),
        "loadavg_start": runner.loadavg(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {
            "steps": steps,
            "warmup": warmup,
            "seed": seed,
            "output": output,
            "check_limit": check_limit,
            "reference": ref_note,
        },
        "cases": [],
    }
    t0 = time.perf_counter()
    for i, case in enumerate(grid):
        log(f"[{i + 1}/{len(grid)}] {case.key} ...")
        res = runner.run_case(
            case,
            steps=steps,
            warmup=warmup,
            seed=seed,
            check=check,
            check_limit=check_limit,
            output=output,
        )
        r = res["ratio"]
        a_ms = res["summary"]["A"]["scheduler_ms"]
        b_ms = res["summary"]["B"]["scheduler_ms"]
        log(
            f"    scheduler A {a_ms:.3f} ms, B {b_ms:.3f} ms "
            f"(A/B {r['scheduler_a_over_b']:.1f}x); worker A/B "
            f"{r['worker_a_over_b']:.2f}; bytes B/A {r['bytes_b_over_a']:.3f}"
        )
        doc["cases"].append(res)
    if profile is not None:
        from .profile import profile_case

        workload, tp, events = profile
        log(f"profile {workload}/tp{tp}/{events} ...")
        doc["profile"] = profile_case(
            tp,
            events,
            workload=workload,
            steps=max(4, min(steps, 10)),
            warmup=warmup,
            seed=seed,
            output=output,
        )
    doc["targets"] = runner.targets(doc["cases"])
    doc["loadavg_end"] = runner.loadavg()
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    return doc


def grid_from_args(args: argparse.Namespace) -> list[Case]:
    from .runner import Case, default_grid

    if args.quick:
        return [Case("uniform", 2, n) for n in (16, 32)] + [
            Case(w, 2, 16) for w in OTHER_WORKLOADS
        ]
    return default_grid(
        tps=args.tp,
        events=args.events,
        workloads=args.workloads,
        workload_tps=args.workload_tp,
        workload_events=args.workload_events,
    )


def render(path: str, png: str | None) -> int:
    import json

    from . import report

    doc = json.loads(Path(path).read_text())
    print(report.table(doc["cases"], markdown=True))
    print(f"\nload average: start {doc['loadavg_start']}, end {doc['loadavg_end']}")
    from .runner import targets

    for t in targets(doc["cases"]):  # recomputed: the current definitions
        print(f"- {t['target']}: {t['value']} ({'met' if t['met'] else 'MISSED'})")
    if png:
        report.plot(Path(png), doc["cases"])
    return 0


def run(args: argparse.Namespace) -> int:
    if args.render:
        return render(args.render, args.png)
    from . import report

    named = [*args.workloads, *(args.profile[:1] if args.profile else ())]
    unknown = [w for w in named if w not in PRESETS]
    if unknown:
        print(
            f"benches.compare: unknown workload(s) {', '.join(unknown)}; "
            f"one of {', '.join(PRESETS)}",
            file=sys.stderr,
        )
        return 2
    steps, warmup, profile = args.steps, args.warmup, args.profile
    if args.quick:
        steps, warmup = min(steps, 3), min(warmup, 1)
        profile = None if args.profile is None else ("uniform", 2, 32)
    out = Path(args.out)
    json_path = Path(args.json) if args.json else out / "bench.json"
    png_path = Path(args.png) if args.png else out / "bench.png"
    doc = run_bench(
        grid_from_args(args),
        steps=steps,
        warmup=warmup,
        seed=args.seed,
        output=args.output,
        check=not args.no_check,
        check_limit=args.check_limit,
        profile=profile,
    )
    cases = doc["cases"]
    print()
    print(report.table(cases))
    print()
    print(report.LEGEND)
    diffs = report.differences(cases)
    if diffs:
        print("\nwhere the outputs differ from the reference model:")
        for line in diffs:
            print(f"  {line}")
    if "profile" in doc:
        from .profile import format_profile

        print()
        print(format_profile(doc["profile"]))
    print("\ntargets:")
    for t in doc["targets"]:
        mark = {True: "met   ", False: "MISSED", None: "n/a   "}[t["met"]]
        print(f"  [{mark}] {t['target']}: {t['value']}")
    print(
        f"\nload average: start {doc['loadavg_start']}, "
        f"end {doc['loadavg_end']}; {doc['seconds']} s"
    )
    report.write_json(json_path, doc)
    print(f"wrote {json_path}")
    if not args.no_plot:
        if report.plot(png_path, cases):
            print(f"wrote {png_path}")
        else:
            print("no uniform or one-block cases to plot")
    b_differs = any(
        not d["equal"] for c in cases for d in (c.get("check") or {}).get("B", [])
    )
    return 1 if b_differs else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benches.compare", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))
