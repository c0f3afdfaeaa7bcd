"""The demo's main process: what vLLM's engine core and executor do for KV events.

1. Import vLLM once, then start the workers (``fork``, vLLM's default worker
   start method, shares that import; with ``spawn`` they import it again, in
   parallel with this process's set-up).
2. Meanwhile: the scheduler side of ``KVMergeMultiConnector``, a
   ``KVOutputAggregator``, a ``ZmqEventPublisher`` on ipc:// (with a replay
   socket) and a subscriber thread reading it back.
3. Every step: broadcast the step to the workers (``MessageQueue``), read each
   worker's ``ModelRunnerOutput`` from its response ``MessageQueue``, aggregate,
   ``update_connector_output``, ``take_events``, publish (as
   ``Scheduler.update_from_output``: the GPU prefix cache's own events first,
   then the connector's, and nothing when there are none). Every
   ``--clear-every`` steps on average the prefix cache is reset
   (``AllBlocksCleared``, then ``reset_cache()`` on the connector).
4. Stop the workers, release the shared memory, let the subscriber catch up,
   check the stream, print the summary (and with ``--compare``, vLLM's own
   path on the same workload).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .display import (
    LANE_HEADERS,
    LaneRow,
    PlainDisplay,
    RichDisplay,
    Snapshot,
    fmt_ms,
    lane_cells,
    make_display,
    percentile,
)
from .workload import CONNECTOR_NAMES, RULES, Settings

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
#: How long to wait for a worker's step output before checking on it.
POLL_S = 0.5
#: Worker start-up limit (fork: building the connectors; spawn: importing vLLM).
START_TIMEOUT_S = 300


class WorkerFailed(RuntimeError):
    pass


def _quiet_logs() -> None:
    """vLLM and torch log set-up chatter at WARNING on import; the demo's output
    is its own. (``--verbose`` keeps them.) Inherited by the workers."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_LOGS", "-torch")
    for name in ("vllm", "torch"):
        logging.getLogger(name).setLevel(logging.ERROR)


class _Interrupt:
    """SIGINT (Ctrl-C) or SIGTERM: the first one asks the demo to stop cleanly
    (workers stopped, shared memory released); a second SIGINT raises
    KeyboardInterrupt (the clean-up still runs)."""

    def __init__(self, display: Any) -> None:
        self.event = threading.Event()
        self.display = display
        self.signum: int = signal.SIGINT
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
            if signum == signal.SIGINT:
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


# --- the subscriber thread ------------------------------------------------------------
class StreamReader(threading.Thread):
    """Reads the published stream (``kvmerge.subscribe.EventSubscriber``) and
    feeds the checker, until told how far the stream goes."""

    def __init__(self, endpoint: str, replay: str, topic: str, checker: Any) -> None:
        super().__init__(name="kvmerge-demo-subscriber", daemon=True)
        from kvmerge.subscribe import EventSubscriber

        # Connected now, on this thread; used only by the reader thread after.
        # The stream starts at 0 after this: whatever is published before the
        # subscription takes effect comes from the replay socket.
        self.sub = EventSubscriber(
            endpoint, topic=topic, replay_endpoint=replay, from_seq=0
        )
        self.sub.load_decoder()
        self.checker = checker
        self._last: int | None = None
        self._deadline = 0.0
        self._quit = threading.Event()
        self.error: BaseException | None = None

    @property
    def stats(self) -> Any:
        return self.sub.stats

    def run(self) -> None:
        sub = self.sub
        try:
            while not self._quit.is_set():
                for received in sub.receive(50):
                    self.checker.feed(received.batch.events)
                last = self._last
                if last is not None:
                    if sub.expected is not None and sub.expected > last:
                        break
                    if last < 0 or time.monotonic() > self._deadline:
                        # Not all of it came on the live socket: ask the replay.
                        for received in sub.catch_up(last):
                            self.checker.feed(received.batch.events)
                        break
        except BaseException as e:  # reported by the main thread
            self.error = e
        finally:
            sub.close()

    def finish(self, last_seq: int, timeout: float = 5.0) -> None:
        self._deadline = time.monotonic() + timeout
        self._last = last_seq
        self.join(timeout + self.sub.replay_timeout + 5)
        if self.is_alive():
            self._quit.set()
            self.join(5)

    def abort(self) -> None:
        self._quit.set()
        self.join(5)


# --- the run ---------------------------------------------------------------------
@dataclass
class Worker:
    rank: int
    proc: Any
    conn: Any
    pid: int | None = None
    queue: Any = None  # the response MessageQueue's reader end
    shm_name: str | None = None
    state: str = "starting"  # starting, handle, go, subscribed


@dataclass
class RunState:
    steps_done: int = 0
    resets: int = 0
    batches: int = 0
    events: int = 0
    merge_ns: list[int] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    steps_started: float | None = None
    steps_ended: float | None = None
    interrupted: bool = False
    failure: str | None = None


def _endpoints(args: argparse.Namespace) -> tuple[str, str, str | None]:
    tmpdir = None
    endpoint, replay = args.endpoint, args.replay_endpoint
    if endpoint is None or replay is None:
        tmpdir = tempfile.mkdtemp(prefix="kvmerge-demo-")
    if endpoint is None:
        endpoint = f"ipc://{os.path.join(tmpdir, 'kv-events')}"  # type: ignore[arg-type]
    if replay is None:
        base = endpoint[len("ipc://") :]
        if tmpdir is not None and args.endpoint is None:
            replay = f"ipc://{os.path.join(tmpdir, 'kv-events-replay')}"
        else:
            replay = f"ipc://{base}-replay"
    return endpoint, replay, tmpdir


def run_demo(args: argparse.Namespace) -> int:
    if not args.verbose:
        _quiet_logs()
    display = make_display(args.plain)
    settings = Settings(
        workers=args.workers,
        rate=args.rate,
        seed=args.seed,
        clear_every=args.clear_every,
        kinds=tuple(args.connectors),
    )
    with _Interrupt(display) as interrupt:
        try:
            return _Demo(args, settings, display, interrupt).run()
        except KeyboardInterrupt:
            display.print("interrupted")
            return EXIT_INTERRUPTED
        finally:
            _stop_resource_tracker()


def _stop_resource_tracker() -> None:
    """Stop (and reap) multiprocessing's resource tracker, which the shared
    memory started: it would otherwise outlive this process for a moment,
    as an orphan. Every segment is unlinked by now; it only checks that."""
    from multiprocessing import resource_tracker

    stop = getattr(getattr(resource_tracker, "_resource_tracker", None), "_stop", None)
    if stop is not None:
        with contextlib.suppress(Exception):
            stop()


class _Demo:
    def __init__(
        self,
        args: argparse.Namespace,
        settings: Settings,
        display: PlainDisplay | RichDisplay,
        interrupt: _Interrupt,
    ) -> None:
        self.args = args
        self.settings = settings
        self.display = display
        self.interrupt = interrupt
        self.state = RunState()
        self.workers: list[Worker] = []
        self.broadcast: Any = None
        self.publisher: Any = None
        self.reader: StreamReader | None = None
        self.scheduler: Any = None
        self.tmpdir: str | None = None
        self.checker: Any = None
        self.config: Any = None

    # --- top level ---------------------------------------------------------------
    def run(self) -> int:
        args, settings, d = self.args, self.settings, self.display
        children = ", ".join(
            f"{CONNECTOR_NAMES[k]} ({RULES[k]})" for k in settings.kinds
        )
        d.print(
            f"kvmerge demo: {settings.workers} workers (TP ranks), {args.steps} "
            f"steps, seed {settings.seed}; KVMergeMultiConnector over {children}"
        )
        endpoint, replay, self.tmpdir = _endpoints(args)
        spawn = args.start_method == "spawn"
        try:
            if spawn:
                # Each spawned worker imports vLLM itself: start them first, so
                # that they do it while this process does too.
                self._start_workers()
            d.status("importing vLLM ...")
            self._import_vllm()
            if self.interrupt and not self.workers:
                return self._interrupted()
            if not self.interrupt:
                if not spawn:
                    # Forked workers share this process's import (vLLM's
                    # default start method).
                    self._start_workers()
                self._setup(endpoint, replay)
                self._handshake()
            if not self.interrupt:
                self._steps()
        except WorkerFailed as e:
            self.state.failure = str(e)
        finally:
            self._shutdown()
        return self._finish(endpoint, replay)

    def _interrupted(self) -> int:
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        self.display.print("interrupted before the workers started")
        return self.interrupt.exit_code

    def _import_vllm(self) -> None:
        t = time.monotonic()
        from vllm.distributed.device_communicators.shm_broadcast import (  # noqa: F401
            MessageQueue,
        )
        from vllm.distributed.kv_events import ZmqEventPublisher  # noqa: F401
        from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: F401
            KVOutputAggregator,
        )

        from . import config, connectors  # noqa: F401

        self.import_s = time.monotonic() - t

    # --- workers -------------------------------------------------------------------
    def _start_workers(self) -> None:
        import multiprocessing as mp
        from multiprocessing import resource_tracker

        from .worker import main as worker_main

        # One resource tracker for everyone: it removes shared memory a killed
        # worker could not (forked workers inherit it).
        resource_tracker.ensure_running()
        ctx = mp.get_context(self.args.start_method)
        base_config = None
        if self.args.start_method == "fork":
            from .config import kvmerge_config

            # Built once, shared with the forked workers (each copies it and
            # sets its rank, as WorkerBase does).
            base_config = self.config = kvmerge_config(
                self.settings, max_pending_steps=self.args.max_pending_steps
            )
            # Objects that survive the fork are not traversed by the workers'
            # GC, so their pages stay shared instead of being copied.
            gc.collect()
            gc.freeze()
        for rank in range(self.settings.workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(
                    rank,
                    self.settings.to_extra(),
                    self.args.max_pending_steps,
                    child,
                    base_config,
                ),
                name=f"kvmerge-demo-worker-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.workers.append(Worker(rank, proc, parent))
        self.display.status(
            f"started {len(self.workers)} worker processes "
            f"({self.args.start_method}); setting up the scheduler side ..."
            if self.args.start_method == "fork"
            else f"started {len(self.workers)} worker processes (spawn)"
        )

    def _recv(self, w: Worker, deadline: float) -> Any:
        """The next pipe message from a worker; watches for Ctrl-C and death."""
        while not w.conn.poll(0.1):
            if self.interrupt:
                raise _Stop
            if not w.proc.is_alive():
                raise WorkerFailed(
                    f"worker {w.rank} exited with code {w.proc.exitcode} while starting"
                )
            if time.monotonic() > deadline:
                raise WorkerFailed(f"worker {w.rank} did not start in time")
        try:
            msg = w.conn.recv()
        except EOFError:
            raise WorkerFailed(f"worker {w.rank} exited while starting") from None
        if msg[0] == "error":
            if self.args.verbose:
                sys.stderr.write(msg[2])
            raise WorkerFailed(f"worker {w.rank} failed: {msg[1]}")
        return msg

    def _handshake(self) -> None:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            for w in self.workers:
                _tag, w.pid, handle, w.shm_name = self._recv(w, deadline)
                w.queue = MessageQueue.create_from_handle(handle, 0)
                w.state = "handle"
            handle = self.broadcast.export_handle()
            for w in self.workers:
                w.conn.send(("go", handle))
                w.state = "go"
            for w in self.workers:
                self._recv(w, deadline)  # subscribed; its response queue is ready
                w.state = "subscribed"
            self.broadcast.wait_until_ready()
            for w in self.workers:
                w.queue.wait_until_ready()
        except _Stop:
            return
        if self.args.verbose:
            for w in self.workers:
                self.display.print(
                    f"  worker {w.rank}: pid {w.pid}, response queue shm {w.shm_name}"
                )
            self.display.print(
                f"  broadcast queue shm {self.broadcast.buffer.handle()[3]}"
            )
        self.display.status(
            f"workers ready in {time.monotonic() - self.state.started:.1f}s "
            f"(vLLM import {self.import_s:.1f}s)"
        )

    # --- scheduler side ------------------------------------------------------------
    def _setup(self, endpoint: str, replay: str) -> None:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
        from vllm.distributed.kv_events import ZmqEventPublisher
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from kvmerge.vllm import register

        from .checks import StreamChecker
        from .config import build, kvmerge_config

        register()
        if self.config is None:
            self.config = kvmerge_config(
                self.settings, max_pending_steps=self.args.max_pending_steps
            )
        self.scheduler = build(self.config, KVConnectorRole.SCHEDULER)
        self.aggregator = KVOutputAggregator.from_connector(
            self.scheduler, self.settings.workers
        )
        self.publisher = ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=endpoint,
            replay_endpoint=replay,
            topic=self.args.topic,
        )
        self.checker = StreamChecker()
        self.reader = StreamReader(endpoint, replay, self.args.topic, self.checker)
        self.reader.start()
        # The executor's rpc_broadcast_mq: this process writes, every worker reads.
        n = self.settings.workers
        self.broadcast = MessageQueue(n, n)
        self.display.print(
            f"publishing on {endpoint} (topic {self.args.topic!r}, replay {replay})"
        )
        self.display.print(
            f"  watch it: kvmerge subscribe {endpoint} --replay {replay} "
            f"--topic {self.args.topic} --history"
        )

    def _lanes(self) -> list[LaneRow]:
        rows = []
        stats = self.scheduler.merge_stats() if self.scheduler is not None else []
        for lane, kind in enumerate(self.settings.kinds):
            st = stats[lane] if lane < len(stats) else None
            row = LaneRow(CONNECTOR_NAMES[kind], _rule_text(self.settings, kind))
            if st:
                row.reports = st["reports"]
                row.published = st["published"]
                row.pending = st["pending"]
                row.expired = st["expired"]
                row.cleared = st["cleared"]
            rows.append(row)
        return rows

    def snapshot(self) -> Snapshot:
        st = self.state
        ns = sorted(st.merge_ns)
        sub = self.reader.stats if self.reader is not None else None
        start = st.steps_started or time.monotonic()
        return Snapshot(
            step=st.steps_done,
            total=self.args.steps,
            elapsed=time.monotonic() - start,
            lanes=self._lanes(),
            p50_ms=None if not ns else percentile(ns, 0.50) / 1e6,  # type: ignore[operator]
            p99_ms=None if not ns else percentile(ns, 0.99) / 1e6,  # type: ignore[operator]
            batches=sub.batches if sub else 0,
            events=sub.events if sub else 0,
            gaps=sub.gaps if sub else 0,
            replayed=sub.replayed if sub else 0,
            missing=sub.missing if sub else 0,
            orphans=self.checker.orphans if self.checker is not None else 0,
            resets=st.resets,
        )

    def _dequeue(self, w: Worker) -> Any:
        while True:
            try:
                return w.queue.dequeue(timeout=POLL_S)
            except TimeoutError:
                if self.interrupt:
                    raise _Stop from None
                if not w.proc.is_alive():
                    raise WorkerFailed(
                        f"worker {w.rank} exited with code {w.proc.exitcode}"
                    ) from None

    def _steps(self) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

        st, d = self.state, self.display
        interval = self.args.interval
        d.start_steps(self.args.steps)
        st.steps_started = time.monotonic()
        try:
            for s in range(self.args.steps):
                t_step = time.monotonic()
                if self.interrupt:
                    raise _Stop
                events: list[Any] = []
                if self.settings.resets_at(s):
                    # Scheduler.reset_prefix_cache(reset_connector=True): the
                    # GPU block pool queues AllBlocksCleared; the connector drops
                    # what it holds.
                    events.append(AllBlocksCleared())
                    self.scheduler.reset_cache()
                    st.resets += 1
                self.broadcast.enqueue(("step", s))
                outputs = [self._dequeue(w) for w in self.workers]
                t0 = time.perf_counter_ns()
                out = self.aggregator.aggregate(outputs, output_rank=0)
                kv_out = out.kv_connector_output if out is not None else None
                if kv_out:
                    self.scheduler.update_connector_output(kv_out)
                events.extend(self.scheduler.take_events())
                st.merge_ns.append(time.perf_counter_ns() - t0)
                if events:
                    self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
                    st.batches += 1
                    st.events += len(events)
                st.steps_done = s + 1
                # (The last step is shown once the subscriber has caught up.)
                if st.steps_done < self.args.steps and d.due(st.steps_done):
                    d.update(self.snapshot())
                if interval:
                    left = interval - (time.monotonic() - t_step)
                    if left > 0:
                        self.interrupt.event.wait(left)
        except _Stop:
            st.interrupted = True
        finally:
            st.steps_ended = time.monotonic()
            if not st.interrupted and self.reader is not None:
                # Let the live view show the subscriber caught up.
                deadline = time.monotonic() + 2.0
                while (
                    self.reader.stats.batches < st.batches
                    and time.monotonic() < deadline
                    and not self.interrupt
                ):
                    time.sleep(0.02)
            d.update(self.snapshot(), force=True)
            d.stop_steps()

    # --- shutdown ----------------------------------------------------------------
    def _shutdown(self) -> None:
        from .worker import STOP, release_queue

        if self.interrupt:
            self.state.interrupted = True
        everyone_ready = bool(self.workers) and all(
            w.state == "subscribed" for w in self.workers
        )
        if everyone_ready:
            # The normal way: a stop command, as the executor's shutdown.
            with contextlib.suppress(TimeoutError, RuntimeError):
                self.broadcast.enqueue(STOP, timeout=2.0)
        for w in self.workers:
            if w.state in ("starting", "handle"):
                # Still waiting for "go": it stops on the pipe.
                with contextlib.suppress(OSError):
                    w.conn.send(STOP)
        deadline = time.monotonic() + 5.0
        for w in self.workers:
            if everyone_ready or w.state in ("starting", "handle"):
                w.proc.join(max(0.1, deadline - time.monotonic()))
        for w in self.workers:
            if w.proc.is_alive():
                # Stuck in a queue's start-up: SIGTERM, the worker unlinks its shm.
                w.proc.terminate()
                w.proc.join(3.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(3.0)
            w.conn.close()
            if w.queue is not None:
                release_queue(w.queue)
        if self.broadcast is not None:
            release_queue(self.broadcast)
        self.exit_codes = [w.proc.exitcode for w in self.workers]

    # --- results -------------------------------------------------------------------
    def _finish(self, endpoint: str, replay: str) -> int:
        st, d, args = self.state, self.display, self.args
        reader = self.reader
        if reader is not None:
            if st.interrupted:
                reader.finish(st.batches - 1, timeout=1.0)
            else:
                reader.finish(st.batches - 1)
        if self.publisher is not None:
            self.publisher.shutdown()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        if st.failure is not None:
            d.print(f"error: {st.failure}")
            return EXIT_FAILED
        if st.interrupted:
            d.print(
                f"interrupted after {st.steps_done} of {args.steps} steps: workers "
                f"stopped (exit codes {self.exit_codes}), shared memory released"
            )
            if st.steps_done:
                self._summary(endpoint, final=False)
            return self.interrupt.exit_code
        ok = self._summary(endpoint, final=True)
        if args.compare and not self.interrupt:
            self._compare()
        if self.interrupt:
            return self.interrupt.exit_code
        return EXIT_OK if ok else EXIT_FAILED

    def _summary(self, endpoint: str, final: bool) -> bool:
        from .checks import check_duplicates, report_counts

        st, d, s = self.state, self.display, self.settings
        checker = self.checker
        sub = self.reader.stats if self.reader is not None else None
        lanes = self._lanes()
        steps_s = (st.steps_ended or time.monotonic()) - (
            st.steps_started or time.monotonic()
        )
        total = time.monotonic() - st.started
        d.print("")
        d.print(
            f"{st.steps_done} steps in {steps_s:.1f}s "
            f"({st.steps_done / steps_s if steps_s > 0 else 0:,.0f} steps/s); "
            f"{total:.1f}s in all, start-up included"
        )
        tot = LaneRow("total", "")
        for lane in lanes:
            tot.reports += lane.reports
            tot.published += lane.published
            tot.pending += lane.pending
            tot.expired += lane.expired
            tot.cleared += lane.cleared
        d.table(
            LANE_HEADERS,
            [lane_cells(lane) for lane in [*lanes, tot]],
            right=(2, 3, 4, 5, 6),
        )
        ns = sorted(st.merge_ns)
        p50, p99 = percentile(ns, 0.5), percentile(ns, 0.99)
        d.print(
            "merge time per step (KVOutputAggregator + update_connector_output + "
            f"take_events): p50 {fmt_ms(p50 / 1e6 if p50 else None)}, "
            f"p99 {fmt_ms(p99 / 1e6 if p99 else None)}"
        )
        d.print(
            f"published {st.batches:,} batches, {st.events:,} events "
            f"({st.resets} AllBlocksCleared from prefix-cache resets)"
        )
        if sub is None or checker is None:
            return False
        seq = "-" if sub.first_seq is None else f"{sub.first_seq}..{sub.last_seq}"
        d.print(
            f"subscriber read {sub.batches:,} batches (seq {seq}), "
            f"{sub.events:,} events"
        )
        t = time.monotonic()
        reports = report_counts(s, st.steps_done)
        dups = check_duplicates(checker, reports)
        merged_out = sum(lane.published for lane in lanes)
        checks: list[tuple[bool, str, str]] = []
        complete = (
            sub.missing == 0
            and sub.decode_errors == 0
            and sub.batches == st.batches
            and (sub.first_seq == 0 or st.batches == 0)
        )
        checks.append(
            (
                complete,
                "sequence",
                f"{sub.batches:,} of {st.batches:,} batches, "
                + ("no gaps" if not sub.gaps else f"{sub.gaps} gaps")
                + (
                    f", {sub.replayed} batches from the replay socket"
                    if sub.replayed
                    else ""
                )
                + (f", {sub.missing} missing" if sub.missing else ""),
            )
        )
        checks.append(
            (
                checker.orphans == 0,
                "parents",
                f"{checker.stores_with_parent:,} stores with a parent, "
                + (
                    "each after its parent's store"
                    if not checker.orphans
                    else f"{checker.orphans:,} published before any store of "
                    "their parent"
                ),
            )
        )
        checks.append(
            (
                dups.ok,
                "duplicates",
                f"{dups.repeated:,} events published more than once, each "
                "reported that often by every rank"
                + (
                    ""
                    if dups.ok
                    else f"; {dups.excess} publications beyond that, "
                    f"{dups.unknown} never reported"
                ),
            )
        )
        made = sum(reports.per_lane.values())
        got = sum(lane.reports for lane in lanes)
        in_ok = got == made
        out_ok = checker.events - checker.clears == merged_out and (
            checker.clears == st.resets
        )
        text = f"the mergers got the {made:,} reports the workers made"
        if not in_ok:
            text += f" (NOT: they got {got:,})"
        text += (
            f"; the stream has the {merged_out:,} events they put out and "
            f"{st.resets} clears"
        )
        if not out_ok:
            text += f" (NOT: {checker.events:,} events, {checker.clears} clears)"
        checks.append((in_ok and out_ok, "counts", text))
        if not final:
            # An interrupted run: the tail of the stream may be cut off.
            checks = [c for c in checks if c[1] in ("parents", "duplicates")]
        d.print("checks:")
        for ok, name, text in checks:
            d.print(f"  {'ok  ' if ok else 'FAIL'} {name}: {text}")
        for example in [*checker.examples, *dups.examples]:
            d.print(f"       e.g. {example}")
        if self.args.verbose:
            d.print(f"  (checks took {time.monotonic() - t:.2f}s)")
        all_ok = all(ok for ok, _n, _t in checks)
        if final:
            d.print(
                "result: every check passed"
                if all_ok
                else "result: FAILED (see the checks above)"
            )
        return all_ok

    def _compare(self) -> None:
        from .compare import compare

        d, s, st = self.display, self.settings, self.state
        d.print("")
        d.print(
            "--compare: the same workload through vLLM's own path, next to "
            "kvmerge's, in this process"
        )
        t = time.monotonic()
        last = [0.0]

        def progress(step: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 2.0 or step == st.steps_done:
                last[0] = now
                d.status(f"  compare: step {step}/{st.steps_done}")

        result = compare(
            s,
            st.steps_done,
            self.args.max_pending_steps,
            progress=progress,
            stop=lambda: bool(self.interrupt),
        )
        from .checks import check_duplicates, report_counts

        reports = report_counts(s, result.steps)
        rows = []
        for lane, kind in enumerate(s.kinds):
            rows.append(
                [
                    CONNECTOR_NAMES[kind],
                    _rule_text(s, kind),
                    f"{result.kvmerge.out[lane]:,}",
                    f"{result.vllm.out[lane]:,}",
                ]
            )
        d.table(
            ("connector", "kvmerge rule", "kvmerge out", "vLLM out"),
            rows,
            right=(2, 3),
        )
        for name, path in (("kvmerge", result.kvmerge), ("vLLM", result.vllm)):
            dups = check_duplicates(path.checker, reports)
            ns = sorted(path.ns)
            p50, p99 = percentile(ns, 0.5), percentile(ns, 0.99)
            d.print(
                f"  {name:<7}: {path.checker.events - path.checker.clears:,} "
                f"events, {path.checker.orphans:,} stores published before their "
                "parent's, "
                f"{dups.excess + dups.unknown:,} published more often than every "
                f"rank reported them; scheduler time per step p50 "
                f"{fmt_ms(p50 / 1e6 if p50 else None)}, p99 "
                f"{fmt_ms(p99 / 1e6 if p99 else None)}"
            )
        kv, up = sorted(result.kvmerge.ns), sorted(result.vllm.ns)
        if kv and up:
            ratios = []
            for q in (0.5, 0.9):
                a, b = percentile(up, q), percentile(kv, q)
                ratios.append(f"{a / b:.2f}x" if a and b else "-")
            d.print(
                f"  vLLM / kvmerge scheduler time per step: {ratios[0]} at p50, "
                f"{ratios[1]} at p90 ({result.steps} steps, interleaved)"
            )
        if result.errors:
            d.print(
                f"  vLLM's path failed {len(result.errors)} times: {result.errors[0]}"
            )
        d.print(
            "  (vLLM 0.33.0's MultiConnector itself publishes none of its "
            "children's events; 'vLLM' is each child run alone)"
        )
        if self.args.verbose:
            d.print(f"  (compare took {time.monotonic() - t:.1f}s)")


class _Stop(Exception):
    """Ctrl-C was pressed: stop at the next safe point."""


def _rule_text(settings: Settings, kind: str) -> str:
    rule = RULES[kind]
    factors = settings.factors(kind)
    return f"{rule} {list(factors)}" if factors else rule
