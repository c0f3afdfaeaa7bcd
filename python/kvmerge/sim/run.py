"""One simulated serving run: engine, requests, the stream read back, the checks.

``Run`` builds an ``Engine`` whose scheduler publishes on a real
``ZmqEventPublisher`` (ipc://, with a replay socket), reads the stream back
with a ``StreamReader``, and follows the run with ``Expected``. ``step()``
adds the step's arrivals, steps the engine, and resets the prefix cache every
``clear_every`` steps on average. ``finish()`` waits for the stream and
returns a ``Result`` whose ``checks()`` are what a KV-aware router relies on.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from vllm.distributed.kv_events import MEDIUM_GPU

from kvmerge import DEFAULT_MAX_PENDING_STEPS
from kvmerge.streamcheck import StreamCheck, Summary, Violation
from kvmerge.vllm.config import MAX_PENDING_KEY, ChildRule

from . import FAMILY_NAMES
from .expect import Expected, same_events
from .requests import Arrivals
from .routing import Lookups, RouterCheck, RouterModel


@dataclass
class Options:
    workers: int = 4
    steps: int = 500
    rate: float = 1.0
    seed: int = 0
    families: tuple[str, ...] = FAMILY_NAMES
    clear_every: int = 150
    max_pending_steps: int = DEFAULT_MAX_PENDING_STEPS
    #: GPU KV cache blocks: small, so that blocks are evicted and requests
    #: preempted.
    num_blocks: int = 64
    #: Blocks each child's tier holds (None: each family's own default).
    capacity: int | None = None
    #: None: kvmerge's rule per child; "native": vLLM's own path.
    rule: ChildRule | None = None
    processes: bool = True
    start_method: str = "fork"
    topic: str = "kv-events"
    endpoint: str | None = None
    replay_endpoint: str | None = None
    interval: float = 0.0
    #: With a router: steps between lookups (and lookups each time).
    lookup_every: int = 100
    lookups: int = 100


@dataclass
class Check:
    ok: bool
    name: str
    text: str


@dataclass
class Result:
    options: Options
    steps: int
    published: int  # batches the scheduler published
    stream: list[Any]  # every event read back, in order
    expected: list[Any]  # the children's expected events, in order
    reader_stats: Any
    merge_stats: list[dict[str, int] | None]
    reports: list[int]  # per child, every rank's reports
    step_ns: list[int]
    #: The scheduler side of the KV events per step (``Step.merge_ns``).
    merge_ns: list[int]
    finished: int
    preempted: int
    resets: int
    #: The router's answers against the rules' (None: no router).
    lookups: Lookups | None = None
    #: The router's applied-event counters, and what the rules imply.
    router_applied: dict[tuple[str, str], float] | None = None
    model_applied: dict[tuple[str, str], int] | None = None

    @property
    def by_medium(self) -> dict[str, int]:
        """Events per medium ("-": none, a clear), read from the stream."""
        out: dict[str, int] = {}
        for e in self.stream:
            m = getattr(e, "medium", None) or "-"
            out[m] = out.get(m, 0) + 1
        return out

    @property
    def stream_check(self) -> Summary:
        """The stream as a router reads it (``kvmerge.streamcheck``): per
        medium since the last clear, every store after its parent's, none of
        a block held, every removal of a block held."""
        check = StreamCheck()
        check.feed_events(self.stream)
        return check.summary()

    @property
    def invalid(self) -> int:
        """The children's events a router could not apply
        (``stream_check``'s violations outside the GPU block pool's)."""
        return sum(v.count for v in _children_violations(self.stream_check))

    @property
    def children_stream(self) -> list[Any]:
        """The children's events: the stream without the GPU pool's (its
        stores and removals, and its clears, which have no medium)."""
        return [
            e
            for e in self.stream
            if getattr(e, "medium", None) not in (MEDIUM_GPU, None)
        ]

    def checks(self) -> list[Check]:
        st = self.reader_stats
        out = [
            Check(
                st.missing == 0
                and st.decode_errors == 0
                and st.batches == self.published > 0,
                "sequence",
                f"{st.batches:,} of {self.published:,} batches, "
                + ("no gaps" if not st.gaps else f"{st.gaps} gaps filled by replay")
                + (f", {st.missing} missing" if st.missing else "")
                + (f", {st.decode_errors} undecodable" if st.decode_errors else ""),
            ),
            _stream_check(self.stream_check),
        ]
        if self.options.rule is None:
            diff = same_events(self.children_stream, self.expected)
            out.append(
                Check(
                    diff is None,
                    "rules",
                    f"the children's {len(self.expected):,} events are exactly what "
                    "the reference model of the rules publishes"
                    if diff is None
                    else diff,
                )
            )
        if self.lookups is not None and self.router_applied is not None:
            lk = self.lookups
            stores = {
                status: n
                for (kind, status), n in self.router_applied.items()
                if kind == "stored"
            }
            applied = {k: n for k, n in self.router_applied.items() if n}
            same = applied == {
                k: float(v) for k, v in (self.model_applied or {}).items() if v
            }
            # Dynamo counts the device tier alone: the GPU block pool's
            # events, vLLM's own. Where the pool publishes events no router
            # can apply (it does after preemption: a block stored twice, a
            # store under an evicted parent), Dynamo counts them its own way
            # (a node per parent and tokens), which the model does not copy:
            # then the tiers check (its /dump against the model, every tier)
            # is the comparison, and this one says so.
            pool = sum(self.stream_check.counts.values()) - self.invalid
            out.append(
                Check(
                    bool(applied) and (same or pool > 0),
                    "router",
                    f"Dynamo applied {int(stores.get('ok', 0)):,} GPU stores, "
                    f"{int(stores.get('parent_block_not_found', 0))} with an unknown "
                    "parent; its counters "
                    + ("equal" if same else "differ from")
                    + " the rules' ("
                    + _counts(applied)
                    + ")"
                    + (
                        f"; vLLM's GPU block pool published {pool} events no "
                        "router can apply, which Dynamo counts its own way"
                        if pool
                        else ""
                    ),
                )
            )
            out.append(
                Check(
                    lk.ok,
                    "lookups",
                    f"{lk.asked - lk.wrong:,} of {lk.asked:,} lookups of stored "
                    "prefixes return the overlap the rules imply (the indexer's "
                    f"gpu, cpu and disk columns; {lk.wanted:,} meant)"
                    + "".join(f"; {x}" for x in lk.examples),
                )
            )
        return out


def _children_violations(summary: Summary) -> list[Violation]:
    """The violations in the children's media: the GPU block pool's events
    are vLLM's own, published beside the connector's, never through it."""
    return [v for v in summary.violations if v.medium not in (MEDIUM_GPU, None)]


def _stream_check(summary: Summary) -> Check:
    ours = _children_violations(summary)
    count = {k: sum(v.count for v in ours if v.kind == k) for k in summary.counts}
    pool = sum(summary.counts.values()) - sum(count.values())
    return Check(
        not ours,
        "stream",
        f"the children's events, a router can apply each: {count['orphan']} "
        f"stores before their parent's, {count['duplicate']} of a block held, "
        f"{count['unknown_removal']} removals of a block not held (per medium, "
        f"since the last clear); vLLM's GPU block pool's own: {pool}"
        + "".join(f"; e.g. {v.kind} {e.event}" for v in ours for e in v.examples),
    )


def _counts(applied: dict[tuple[str, str], float]) -> str:
    return ", ".join(
        f"{kind} {status} {int(n):,}" for (kind, status), n in sorted(applied.items())
    )


def _pool_events(events: list[Any]) -> list[Any]:
    """The GPU block pool's events in a published batch (the connector's are
    ``msgspec.Raw`` or another medium)."""
    return [
        e
        for e in events
        if not isinstance(e, msgspec.Raw)
        and (type(e).__name__ == "AllBlocksCleared" or e.medium == MEDIUM_GPU)
    ]


class Run:
    """``router``: a started ``DynamoIndexer`` to register on the stream."""

    def __init__(self, opts: Options, router: Any = None) -> None:
        self.opts = opts
        self._tmpdir = tempfile.mkdtemp(prefix="kvmerge-sim-")
        self.endpoint = opts.endpoint or f"ipc://{os.path.join(self._tmpdir, 'kv')}"
        self.replay = opts.replay_endpoint or f"{self.endpoint}-replay"
        self.engine: Any = None
        self.reader: Any = None
        self.stream: list[Any] = []
        self.expected_events: list[Any] = []
        self.published = 0
        self.step_ns: list[int] = []
        self.merge_ns: list[int] = []
        self.finished = self.preempted = self.resets = 0
        self.steps = 0
        self._rng = random.Random(f"kvmerge-sim/resets/{opts.seed}")
        self.arrivals = Arrivals(seed=opts.seed, rate=opts.rate)
        self.router = router
        self.router_check: RouterCheck | None = None
        self.rules_model = RouterModel()
        self._pool: list[Any] = []

    def config(self) -> Any:
        from vllm.config import KVEventsConfig

        from .children import entry
        from .model import engine_config, model_dir

        o = self.opts
        return engine_config(
            model_dir(self._tmpdir, o.workers),
            [
                entry(k, i, capacity=o.capacity, seed=o.seed, rule=o.rule)
                for i, k in enumerate(o.families)
            ],
            world_size=o.workers,
            num_blocks=o.num_blocks,
            connector_extra={MAX_PENDING_KEY: o.max_pending_steps},
            kv_events=KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self.endpoint,
                replay_endpoint=self.replay,
                topic=o.topic,
            ),
        )

    def start(self) -> None:
        from kvmerge.vllm import register

        from .engine import Engine
        from .stream import StreamReader

        register()
        cfg = self.config()
        self.expected = Expected(cfg)
        self.engine = Engine(
            cfg,
            num_blocks=self.opts.num_blocks,
            processes=self.opts.processes,
            start_method=self.opts.start_method,
        )
        publisher = self.engine.scheduler.kv_event_publisher
        publish = publisher.publish

        def counted(batch: Any) -> None:
            self.published += 1
            self._pool.extend(_pool_events(batch.events))
            publish(batch)

        publisher.publish = counted
        self.reader = StreamReader(
            self.endpoint, self.replay, self.opts.topic, self.stream.extend
        )
        self.reader.start()
        if self.router is not None:
            from .model import BLOCK_SIZE

            self.router.register(1, self.endpoint, self.replay)
            self.router_check = RouterCheck(self.router, 1, BLOCK_SIZE, self.opts.seed)

    def step(self) -> Any:
        eng = self.engine
        t = time.monotonic()
        eng.add(self.arrivals.step())
        t0 = time.perf_counter_ns()
        st = eng.step()
        self.step_ns.append(time.perf_counter_ns() - t0)
        self.merge_ns.append(st.merge_ns)
        pool, self._pool = self._pool, []
        self.rules_model.apply(pool)
        for events in self.expected.on_step(st.output):
            self.expected_events.extend(events)
            self.rules_model.apply(events)
            if self.router_check is not None:
                self.router_check.learn(events)
        if self.router_check is not None:
            self.router_check.learn(pool)
        self.finished += len(st.finished)
        self.preempted += st.preempted
        self.steps += 1
        every = self.opts.clear_every
        if every > 0 and self._rng.random() < 1.0 / every:
            eng.reset_prefix_cache()
            self.expected.reset()
            self.resets += 1
        if self.router_check is not None and self.steps % self.opts.lookup_every == 0:
            self.lookup()
        if self.opts.interval:
            time.sleep(max(0.0, self.opts.interval - (time.monotonic() - t)))
        return st

    def lookup(self) -> None:
        """Ask the router about random prefixes of stored chains, now."""
        assert self.router_check is not None
        self.router_check.sync(self.rules_model)
        self.router_check.ask(self.rules_model, self.opts.lookups)

    def merge_stats(self) -> list[dict[str, int] | None]:
        conn = self.engine.connector if self.engine is not None else None
        stats = getattr(conn, "merge_stats", None)
        return stats() if stats is not None else []

    def finish(self, timeout: float = 10.0) -> Result:
        merge_stats = self.merge_stats()
        router_applied = None
        if self.router_check is not None:
            self.lookup()
            router_applied = self.router.metrics()
        # The reader first: what it missed on the live socket it asks the
        # publisher's replay socket for, which the engine's close shuts.
        if self.reader is not None:
            self.reader.finish(self.published - 1, timeout=timeout)
        if self.engine is not None:
            self.engine.close()
        if self.reader is not None and self.reader.error is not None:
            raise self.reader.error
        return Result(
            options=self.opts,
            steps=self.steps,
            published=self.published,
            stream=self.stream,
            expected=self.expected_events,
            reader_stats=self.reader.stats if self.reader else None,
            merge_stats=merge_stats,
            reports=[self.expected.reports[i] for i in range(len(self.opts.families))],
            step_ns=self.step_ns,
            merge_ns=self.merge_ns,
            finished=self.finished,
            preempted=self.preempted,
            resets=self.resets,
            lookups=self.router_check.lookups if self.router_check else None,
            router_applied=router_applied,
            model_applied=dict(self.rules_model.applied) if self.router else None,
        )

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def run(opts: Options, router: Any = None) -> Result:
    """A whole run, start to finish."""
    r = Run(opts, router)
    try:
        r.start()
        for _ in range(opts.steps):
            r.step()
        return r.finish()
    finally:
        r.close()


def compare(opts: Options, routers: Sequence[Any] = ()) -> tuple[Result, Result]:
    """The same requests and children through kvmerge and through vLLM's own
    path (every child ``"native"``), workers in this process, stepped in turn,
    the first of each step alternating (so that the machine's load weighs on
    both alike); ``routers``: none, or one started indexer for each. Each
    publishes on endpoints of its own, never ``opts``': two engines bound to
    one ipc path take it from each other, and a router or subscriber on it
    would read either stream."""
    rules: tuple[ChildRule | None, ...] = (None, "native")
    both = [
        Run(
            replace(
                opts,
                rule=rule,
                processes=False,
                interval=0.0,
                endpoint=None,
                replay_endpoint=None,
            ),
            router=router,
        )
        for rule, router in zip(rules, routers or (None, None), strict=True)
    ]
    try:
        for r in both:
            r.start()
        for i in range(opts.steps):
            # Which one goes first alternates: neither always gets warm caches.
            for r in both if i % 2 else both[::-1]:
                r.step()
        ours, theirs = (r.finish() for r in both)
        return ours, theirs
    finally:
        for r in both:
            r.close()
