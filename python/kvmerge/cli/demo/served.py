"""``kvmerge demo --server``: kvmerge in the real ``vllm serve``, on this CPU.

1. With ``--router dynamo``, start NVIDIA Dynamo's KV indexer.
2. ``kvmerge.sim.served.ServedRun`` in a thread: ``vllm serve`` at TP 2
   (vLLM 0.32's CPU build, from ``--vllm-python``) with
   ``KVMergeMultiConnector`` over the simulated children and vLLM's
   ``ExampleConnector``; requests over HTTP in waves, the prefix cache reset
   between them; the stream read back by a subscriber and the indexer.
   Meanwhile this thread prints the command, the start-up and the progress
   (the server's own ``/metrics``).
3. The summary: the children's counters (``vllm:kvmerge_*``) beside what the
   ranks' records replay to, the stream by medium, the requests, the checks.
   With ``--compare``, the same run with vLLM's own ``MultiConnector``.

Ctrl-C (or SIGTERM) stops the server: its whole process group, and the
shared memory it left.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import threading
import time
from typing import Any

from .display import PlainDisplay, RichDisplay, published_text, show_checks
from .engine import (
    EXIT_FAILED,
    EXIT_OK,
    children_text,
    launch,
    router,
    rule_text,
)

#: How much of the server's log a failed run shows.
LOG_TAIL = 3000
#: Seconds between two progress lines.
PROGRESS_EVERY = 10.0
#: The server's own counters that the progress lines show.
_ANSWERED = "vllm:request_success_total"
_PREEMPTED = "vllm:num_preemptions_total"
CHILD_HEADERS = (
    "connector",
    "rule",
    "events in",
    "out",
    "expired",
    "cleared",
    "withheld",
    "refused",
    "replayed in",
    "replayed out",
)


def run_served(args: argparse.Namespace) -> int:
    from kvmerge.sim.server import PYTHON_ENV

    # The harness finds the server's interpreter there.
    os.environ[PYTHON_ENV] = args.vllm_python
    env = dict(os.environ)
    return launch(args, lambda a, d, i: _ServedDemo(a, d, i, env))


def served_options(args: argparse.Namespace) -> Any:
    """``ServedOptions`` from the options; those not given keep its defaults."""
    from kvmerge.sim.served import ServedOptions

    given = {
        name: getattr(args, name)
        for name in ("requests", "concurrency", "waves", "damage")
        if getattr(args, name) is not None
    }
    return ServedOptions(
        seed=args.seed,
        max_pending_steps=args.max_pending_steps,
        topic=args.topic,
        **given,
    )


def counter(metrics: str, name: str) -> int:
    """The sum of a Prometheus counter's series in ``/metrics``' text."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)", re.M)
    return int(sum(float(v) for v in pattern.findall(metrics)))


def command_text(command: list[str]) -> str:
    """The command, shell-quoted, an option per line."""
    lines = [shlex.join(command[:3])]
    i = 3
    while i < len(command):
        j = i + 1
        while j < len(command) and not command[j].startswith("--"):
            j += 1
        lines.append("  " + shlex.join(command[i:j]))
        i = j
    return " \\\n".join(lines)


class _Failed(Exception):
    """A run failed (and said why)."""


class _ServedDemo:
    def __init__(
        self,
        args: argparse.Namespace,
        display: PlainDisplay | RichDisplay,
        interrupt: Any,
        server_env: dict[str, str],
    ) -> None:
        self.args = args
        self.server_env = server_env
        self.display = display
        self.interrupt = interrupt
        self.started = time.monotonic()
        self.opts: Any = None

    def run(self) -> int:
        try:
            return self._run()
        except _Failed:
            self.display.print("result: FAILED (see above)")
            return EXIT_FAILED

    def _run(self) -> int:
        d, args = self.display, self.args
        d.status("importing vLLM ...")
        from kvmerge.sim.served import UPSTREAM
        from kvmerge.sim.server import BLOCK_SIZE

        # The server inherits this environment: vLLM's quiet logging was for
        # this process's import; the server's log is its own, and the checks
        # read it (ExampleConnector's cache hits).
        for name in set(os.environ) - set(self.server_env):
            del os.environ[name]
        os.environ.update(self.server_env)
        opts = self.opts = served_options(args)
        children = children_text(opts.families, lambda f: rule_text(f, opts.tp))
        d.print(
            f"kvmerge demo --server: vllm serve at TP {opts.tp} on this CPU, "
            f"{opts.requests} requests over HTTP, {opts.concurrency} at a time, "
            f"in {opts.waves} waves (the prefix cache reset between two), seed "
            f"{opts.seed}; KVMergeMultiConnector over {children} and vLLM's "
            "ExampleConnector"
            + (
                f"; the Mooncake child's rank {opts.tp - 1} damages its report "
                f"every {opts.damage} steps"
                if opts.damage
                else ""
            )
        )
        indexer = router(args, BLOCK_SIZE)
        try:
            ours = self._one(opts, indexer, "KVMergeMultiConnector")
        finally:
            if indexer is not None:
                indexer.close()
        if ours is None:
            return self.interrupt.exit_code
        ok = self._summary(ours)
        runs = [("KVMergeMultiConnector", ours)]
        if args.compare:
            upstream = dataclasses.replace(opts, connector=UPSTREAM)
            theirs = self._one(upstream, None, "vLLM's MultiConnector")
            if theirs is None:
                return self.interrupt.exit_code
            ok = self._compare(ours, theirs) and ok
            native = dataclasses.replace(opts, rule="native")
            own = self._one(native, None, "each child's own rule (vLLM's path)")
            if own is None:
                return self.interrupt.exit_code
            runs += [("MultiConnector", theirs), ("own rule", own)]
        self._accuracy(runs)
        d.print("result: every check passed" if ok else "result: FAILED (see above)")
        return EXIT_OK if ok else EXIT_FAILED

    # -- one server -----------------------------------------------------------

    def _one(self, opts: Any, indexer: Any, name: str) -> Any:
        """One ``ServedRun``, watched: its ``ServedResult``, or None when
        interrupted (the server stopped). A failed run prints why (and the
        server's log's end) and raises ``_Failed``."""
        from kvmerge.sim.served import ServedRun

        d = self.display
        run = ServedRun(opts, indexer)
        out: dict[str, Any] = {}

        def target() -> None:
            try:
                out["result"] = run.run()
            except BaseException as e:  # the main thread raises it
                out["error"] = e

        d.print("")
        d.print(f"{name}: starting vllm serve ...")
        thread = threading.Thread(target=target, name="kvmerge-served", daemon=True)
        thread.start()
        tail = ""
        try:
            self._watch(run, thread)
        finally:
            if thread.is_alive():
                self._stop(run, thread)
            if "error" in out and run.server is not None:
                tail = run.server.log_tail(LOG_TAIL)
            result = out.get("result")
            # An interrupted run is the user's stop, not a failure to keep.
            failed = not self.interrupt and (
                "error" in out
                or (result is not None and any(not c.ok for c in result.checks()))
            )
            run.close(keep=failed)
            if failed:
                if result is not None:
                    result.kept = run.dir
                d.print(f"the run's server log and records are kept in {run.dir}")
        if self.interrupt:
            d.print("interrupted: vllm serve stopped, shared memory released")
            return None
        if "error" in out:
            error = out["error"]
            if tail:
                d.print(f"the server's log ends:\n{tail}")
            d.print(f"error: {type(error).__name__}: {error}")
            raise _Failed from error
        return out["result"]

    def _stop(self, run: Any, thread: threading.Thread) -> None:
        """Stops the server under a running ``ServedRun`` and waits for the
        run to fail: its requests find no server. A server started meanwhile
        (the run was between its command and its process) is stopped too."""
        self.display.print("stopping vllm serve ...")
        self.interrupt.shield = True
        try:
            while thread.is_alive():
                if run.server is not None:
                    run.server.stop()
                thread.join(0.5)
        finally:
            self.interrupt.shield = False

    def _watch(self, run: Any, thread: threading.Thread) -> None:
        d = self.display
        shown_command = shown_ready = False
        t0 = time.monotonic()
        next_line = t0 + PROGRESS_EVERY
        while thread.is_alive() and not self.interrupt:
            thread.join(0.25)
            server = run.server
            if server is None:
                continue
            if not shown_command and server.port:
                shown_command = True
                d.print(command_text(server.command()))
            if not shown_ready and server.ready_s:
                shown_ready = True
                d.print(f"ready in {server.ready_s:.1f}s")
                d.print(
                    f"  watch it: kvmerge subscribe {server.endpoint} --replay "
                    f"{server.replay_endpoint} --topic {run.opts.topic} --history"
                )
                if run.router is not None:
                    d.print(f"  Dynamo's KV indexer follows it: {run.router.base_url}")
            if time.monotonic() >= next_line and thread.is_alive():
                next_line += PROGRESS_EVERY
                d.status(self._progress(run, time.monotonic() - t0))

    def _progress(self, run: Any, elapsed: float) -> str:
        server = run.server
        if not server.ready_s:
            return f"{elapsed:.0f}s: vllm serve starting"
        try:
            metrics = server.metrics()
        except OSError:
            metrics = None  # stopping
        except RuntimeError:
            metrics = None
        text = f"{elapsed:.0f}s: "
        if metrics is not None:
            text += (
                f"{counter(metrics, _ANSWERED)}/{run.opts.requests} requests "
                f"answered, {counter(metrics, _PREEMPTED)} preempted; "
            )
        events = sum(len(stream.events) for stream in run.streams)
        return text + f"subscriber {events:,} events"

    # -- the summary ------------------------------------------------------------

    def _summary(self, served: Any) -> bool:
        d, r = self.display, served.result
        d.print("")
        d.print(
            f"vllm serve ready in {served.ready_s:.1f}s; "
            f"{sum(served.statuses.values())} requests in "
            f"{served.run_s:.1f}s ({r.resets} prefix-cache resets), "
            f"{served.preemptions} preemptions; ExampleConnector: "
            f"{served.example_hits} external cache hits; "
            f"{time.monotonic() - self.started:.1f}s in all, start-up included"
        )
        d.table(
            CHILD_HEADERS, self._children(served), right=range(2, len(CHILD_HEADERS))
        )
        d.print(
            "  (events in, out, expired, cleared, withheld, refused: the server's "
            "vllm:kvmerge_*_total; replayed: the ranks' recorded reports "
            "through the reference model of the rules)"
        )
        d.print(published_text(r))
        return show_checks(d, served.checks(), final=False)

    def _accuracy(self, runs: list[tuple[str, Any]]) -> None:
        from kvmerge.sim.served import accuracy_rows

        d = self.display
        d.print("")
        d.print(
            "the router's view against the truth, after each wave: the share of "
            "blocks it has right in each child's tier (both hold them, of those "
            "either holds; right/held by the router)"
        )
        d.table(
            ("wave", "child", "tier", "truly held", *(name for name, _ in runs)),
            accuracy_rows(runs),
            right=range(3, 4 + len(runs)),
        )

    def _children(self, served: Any) -> list[list[str]]:
        from kvmerge.vllm.stats import COUNTERS

        rows = []
        for i, (label, replay) in enumerate(served.replayed):
            m = served.metrics.get(label, {})
            rows.append(
                [
                    label,
                    rule_text(self.opts.families[i], self.opts.tp),
                    *(f"{int(m.get(k, 0)):,}" for k in COUNTERS),
                    f"{replay.reports:,}",
                    f"{len(replay.events):,}",
                ]
            )
        return rows

    def _compare(self, ours: Any, theirs: Any) -> bool:
        d = self.display
        d.print("")
        d.print(
            "--compare: the same children, requests and server, with vLLM's own "
            "MultiConnector (which never asks its children for their events)"
        )
        a, b = ours.result, theirs.result
        media = sorted(set(a.by_medium) | set(b.by_medium))
        rows = [
            ["HTTP 200", _answered(ours), _answered(theirs)],
            [
                "events published",
                f"{len(a.stream):,}",
                f"{len(b.stream):,}",
            ],
            *(
                [
                    f"  {m}",
                    f"{a.by_medium.get(m, 0):,}",
                    f"{b.by_medium.get(m, 0):,}",
                ]
                for m in media
            ),
            [
                "the children's events",
                f"{len(a.children_stream):,}",
                f"{len(b.children_stream):,}",
            ],
            [
                "events a router cannot apply",
                f"{a.invalid:,}",
                f"{b.invalid:,}",
            ],
            ["preemptions", f"{ours.preemptions:,}", f"{theirs.preemptions:,}"],
            [
                "ExampleConnector cache hits",
                f"{ours.example_hits:,}",
                f"{theirs.example_hits:,}",
            ],
            ["ready in", f"{ours.ready_s:.1f}s", f"{theirs.ready_s:.1f}s"],
            ["requests took", f"{ours.run_s:.1f}s", f"{theirs.run_s:.1f}s"],
        ]
        d.table(("", "KVMergeMultiConnector", "MultiConnector"), rows, right=(1, 2))
        d.print("MultiConnector's run:")
        return show_checks(d, theirs.checks(), final=False)


def _answered(served: Any) -> str:
    return f"{served.statuses.get(200, 0)}/{sum(served.statuses.values())}"
