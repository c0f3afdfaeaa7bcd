"""``kvmerge demo``: vLLM's real scheduler loop, read back by a subscriber and a router.

1. Import vLLM; with ``--router dynamo`` start NVIDIA Dynamo's KV indexer.
2. ``kvmerge.sim.run.Run``: vLLM's ``Scheduler`` (prefix caching, KV events on
   its own ``ZmqEventPublisher``, ``KVMergeMultiConnector`` over the simulated
   children), vLLM's ``MultiprocExecutor`` with one worker process per TP rank
   (``kvmerge.sim.executor.NoForwardWorker``), a subscriber thread, and the
   reference model of the rules following every step.
3. Step: requests arrive, the scheduler schedules, the workers run their
   connectors and sample tokens, ``update_from_output`` publishes; now and
   then the prefix cache is reset.
4. Stop the workers, let the subscriber catch up, check the stream, print the
   summary; with ``--compare``, the same run through vLLM's own path.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from .display import (
    CHILD_HEADERS,
    ChildRow,
    PlainDisplay,
    RichDisplay,
    Snapshot,
    child_cells,
    fmt_ms,
    make_display,
    percentile,
    published_text,
    show_checks,
    total,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def _quiet_logs() -> None:
    """vLLM and torch log set-up chatter on import; the demo's output is its
    own (``--verbose`` keeps them). Inherited by the workers."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_LOGS", "-torch")
    for name in ("vllm", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


class _Interrupt:
    """SIGINT (Ctrl-C) or SIGTERM: the first one asks the demo to stop at the
    next step (workers stopped, shared memory released); a second SIGINT
    raises KeyboardInterrupt (the clean-up still runs)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int = signal.SIGINT
        #: While set, a second SIGINT is ignored too: what runs must not be
        #: cut short (the server's stop).
        self.shield = False
        self._old: dict[int, Any] = {}

    def __enter__(self) -> _Interrupt:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._old[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, old in self._old.items():
            signal.signal(signum, old)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            if signum == signal.SIGINT and not self.shield:
                raise KeyboardInterrupt
            return
        self.signum = signum
        self.event.set()

    @property
    def exit_code(self) -> int:
        """130 for Ctrl-C, 143 for SIGTERM (128 + the signal)."""
        return 128 + int(self.signum)

    def __bool__(self) -> bool:
        return self.event.is_set()


def options(args: argparse.Namespace) -> Any:
    from kvmerge.sim.run import Options

    return Options(
        workers=args.workers,
        steps=args.steps,
        rate=args.rate,
        seed=args.seed,
        families=tuple(args.connectors),
        clear_every=args.clear_every,
        max_pending_steps=args.max_pending_steps,
        num_blocks=args.blocks,
        start_method=args.start_method,
        topic=args.topic,
        endpoint=args.endpoint,
        replay_endpoint=args.replay_endpoint,
        interval=args.interval,
        lookups=args.lookups,
    )


def router(args: argparse.Namespace, block_size: int) -> Any:
    """A started Dynamo indexer for blocks of ``block_size`` tokens, or None."""
    if args.router != "dynamo":
        return None
    from kvmerge.sim.dynamo import DynamoIndexer

    return DynamoIndexer(args.dynamo_python, block_size).start()


def _router(args: argparse.Namespace) -> Any:
    from kvmerge.sim.model import BLOCK_SIZE

    return router(args, BLOCK_SIZE)


def run_demo(args: argparse.Namespace) -> int:
    return launch(args, _Demo)


def launch(
    args: argparse.Namespace,
    demo: Callable[[argparse.Namespace, PlainDisplay | RichDisplay, _Interrupt], Any],
) -> int:
    """Runs ``demo(args, display, interrupt).run()``: vLLM's logs quietened,
    the router resolved, Ctrl-C and SIGTERM caught; its exit status."""
    if not args.verbose:
        _quiet_logs()
    if args.router == "auto":
        found = bool(args.dynamo_python and os.path.exists(args.dynamo_python))
        args.router = "dynamo" if found else "none"
    if args.router == "dynamo" and not (
        args.dynamo_python and os.path.exists(args.dynamo_python)
    ):
        print(
            "kvmerge demo: --router dynamo needs the interpreter of a venv with "
            "ai-dynamo-runtime (--dynamo-python, or KVMERGE_DYNAMO_PYTHON; "
            ".ci/setup-dynamo.sh makes one)"
        )
        return EXIT_USAGE
    display = make_display(args.plain)
    with _Interrupt() as interrupt:
        try:
            return int(demo(args, display, interrupt).run())
        except KeyboardInterrupt:
            display.print("interrupted")
            return interrupt.exit_code


class _Demo:
    def __init__(
        self,
        args: argparse.Namespace,
        display: PlainDisplay | RichDisplay,
        interrupt: _Interrupt,
    ) -> None:
        self.args = args
        self.display = display
        self.interrupt = interrupt
        self.started = time.monotonic()
        self.compare_failed = False

    def run(self) -> int:
        args, d = self.args, self.display
        d.status("importing vLLM ...")
        t = time.monotonic()
        from kvmerge.sim.children import FAMILY
        from kvmerge.sim.run import Run

        import_s = time.monotonic() - t
        children = children_text(args.connectors, lambda k: FAMILY[k].rule)
        d.print(
            f"kvmerge demo: vLLM's scheduler, {args.workers} worker processes (TP "
            f"ranks), {args.steps} steps, {args.rate:g} requests per step on "
            f"average, seed {args.seed}; KVMergeMultiConnector over {children}"
        )
        router = _router(args)
        run = Run(options(self.args), router=router)
        try:
            run.start()
            if args.verbose:
                for line in run.engine.describe():
                    d.print(f"  {line}")
            d.print(
                f"publishing on {run.endpoint} (topic {args.topic!r}, replay "
                f"{run.replay})"
            )
            d.print(
                f"  watch it: kvmerge subscribe {run.endpoint} --replay "
                f"{run.replay} --topic {args.topic} --history"
            )
            if router is not None:
                d.print(f"  Dynamo's KV indexer follows it: {router.base_url}")
            d.status(
                f"ready in {time.monotonic() - self.started:.1f}s (vLLM import "
                f"{import_s:.1f}s)"
            )
            done = self._steps(run)
            result = run.finish()
        except Exception as e:
            if self.interrupt:
                # Ctrl-C on a terminal reaches vLLM's worker processes too:
                # they stop, and the step in flight fails.
                d.print(
                    "interrupted: workers stopped, shared memory released (the "
                    f"run in flight failed: {type(e).__name__}: {e})"
                )
                return self.interrupt.exit_code
            if args.verbose:
                import traceback

                traceback.print_exc()
            d.print(f"error: {type(e).__name__}: {e}")
            return EXIT_FAILED
        finally:
            run.close()
            if router is not None:
                router.close()
        ok = self._summary(result, final=done == args.steps)
        if done < args.steps:
            d.print(
                f"interrupted after {done} of {args.steps} steps: workers stopped, "
                "shared memory released"
            )
            return self.interrupt.exit_code
        if args.compare:
            self._compare(result)
        if self.interrupt:
            return self.interrupt.exit_code
        return EXIT_OK if ok and not self.compare_failed else EXIT_FAILED

    def _steps(self, run: Any) -> int:
        d, total = self.display, self.args.steps
        t0 = time.monotonic()
        d.start_steps(total)
        step = 0
        try:
            for step in range(1, total + 1):
                if self.interrupt:
                    return step - 1
                run.step()
                if d.due(step) or step == total:
                    d.update(self._snapshot(run, step, t0), force=step == total)
        finally:
            d.stop_steps()
        self.steps_s = time.monotonic() - t0
        return step

    def _children(self, merge_stats: list[Any], reports: list[int]) -> list[ChildRow]:
        from kvmerge.sim.children import FAMILY

        rows = []
        for index, family in enumerate(self.args.connectors):
            row = ChildRow(
                FAMILY[family].cls.__name__, rule_text(family, self.args.workers)
            )
            st = merge_stats[index] if index < len(merge_stats) else None
            if st:
                row.reports = st["reports"]
                row.published = st["published"]
                row.pending = st["pending"]
                row.expired = st["expired"]
                row.cleared = st["cleared"]
                row.withheld = st["withheld"]
            elif index < len(reports):
                row.reports = reports[index]
            rows.append(row)
        return rows

    def _snapshot(self, run: Any, step: int, t0: float) -> Snapshot:
        ns = sorted(run.step_ns)
        p50, p99 = percentile(ns, 0.5), percentile(ns, 0.99)
        sub = run.reader.stats
        return Snapshot(
            step=step,
            total=self.args.steps,
            elapsed=time.monotonic() - t0,
            children=self._children(run.merge_stats(), []),
            p50_ms=None if p50 is None else p50 / 1e6,
            p99_ms=None if p99 is None else p99 / 1e6,
            batches=sub.batches,
            events=sub.events,
            gaps=sub.gaps,
            replayed=sub.replayed,
            missing=sub.missing,
            resets=run.resets,
        )

    def _summary(self, r: Any, final: bool) -> bool:
        d = self.display
        d.print("")
        steps_s = getattr(self, "steps_s", 0.0)
        d.print(
            f"{r.steps} steps in {steps_s:.1f}s: {r.finished:,} requests finished, "
            f"{r.preempted:,} preempted, {r.resets} prefix-cache resets; "
            f"{time.monotonic() - self.started:.1f}s in all, start-up included"
        )
        children = self._children(r.merge_stats, r.reports)
        d.table(
            CHILD_HEADERS,
            [child_cells(row) for row in [*children, total(children)]],
            right=range(2, len(CHILD_HEADERS)),
        )
        ns = sorted(r.step_ns)
        p50, p99 = percentile(ns, 0.5), percentile(ns, 0.99)
        d.print(
            "engine step (schedule, workers, KVOutputAggregator, update_from_output):"
            f" p50 {fmt_ms(p50 / 1e6 if p50 else None)}, "
            f"p99 {fmt_ms(p99 / 1e6 if p99 else None)}"
        )
        d.print(published_text(r))
        checks = r.checks()
        if not final:
            # An interrupted run: the tail of the stream may be cut off.
            checks = [c for c in checks if c.name == "stream"]
        return show_checks(d, checks, final=final)

    def _compare(self, processes: Any) -> None:
        from kvmerge.sim.children import FAMILY
        from kvmerge.sim.expect import same_events
        from kvmerge.sim.run import compare

        d, args = self.display, self.args
        d.print("")
        d.print(
            "--compare: the same requests and children through kvmerge and through "
            "vLLM's own path (each child's container merged by its own "
            "connector's rule), workers in this process, stepped in turn"
        )
        routers = [_router(args), _router(args)] if args.router == "dynamo" else []
        try:
            ours, theirs = compare(options(args), [r for r in routers if r])
        finally:
            for router in routers:
                if router is not None:
                    router.close()
        same = same_events(ours.stream, processes.stream) is None
        d.print(
            "  kvmerge in this process publishes "
            + ("the same stream as" if same else "ANOTHER stream than")
            + " with worker processes"
        )
        rows = []
        for family in args.connectors:
            m = FAMILY[family].cls.MEDIUM
            rows.append(
                [
                    FAMILY[family].cls.__name__,
                    rule_text(family, args.workers),
                    f"{ours.by_medium.get(m, 0):,}",
                    f"{theirs.by_medium.get(m, 0):,}",
                ]
            )
        d.table(
            ("connector", "kvmerge rule", "kvmerge out", "vLLM out"),
            rows,
            right=(2, 3),
        )
        for name, r in (("kvmerge", ours), ("vLLM", theirs)):
            ns = sorted(r.merge_ns)
            p50, p99 = percentile(ns, 0.5), percentile(ns, 0.99)
            line = (
                f"  {name:<7}: {len(r.children_stream):,} children's events, "
                f"{r.invalid:,} events a router cannot apply"
            )
            if r.lookups is not None:
                line += (
                    f"; Dynamo: {r.lookups.wrong:,} of {r.lookups.asked:,} lookups "
                    "differ from what the rules imply"
                )
            line += (
                f"; scheduler side per step p50 {fmt_ms(p50 / 1e6 if p50 else None)}"
                f", p99 {fmt_ms(p99 / 1e6 if p99 else None)}"
            )
            d.print(line)
        d.print(
            "  (scheduler side: KVOutputAggregator and Scheduler.update_from_output, "
            "which runs the connector; vLLM's own MultiConnector publishes none of "
            "its children's events: 'vLLM' is what each child's own connector "
            "publishes)"
        )
        if not same:
            self.compare_failed = True


def children_text(families: Iterable[str], rule: Callable[[str], str]) -> str:
    """``SimLMCache (all), ...``: each child's class and ``rule(family)``."""
    from kvmerge.sim.children import FAMILY

    return ", ".join(f"{FAMILY[k].cls.__name__} ({rule(k)})" for k in families)


def rule_text(family: str, workers: int) -> str:
    from kvmerge.sim.children import FAMILY

    rule = FAMILY[family].rule
    if rule == "quorum":
        return f"{rule} {list(FAMILY[family].cls.factors(workers) or ())}"
    return rule
