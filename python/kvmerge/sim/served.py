"""One run against the real ``vllm serve``: requests over HTTP, the stream
read back, and the same checks as the scheduler-loop run (``kvmerge.sim.run``).

``serve_run`` starts ``kvmerge.sim.server.Server`` (TP ``tp``, prefix caching,
a KV cache small enough to evict and preempt, KV events on ipc sockets with a
replay socket) with ``--kv-transfer-config`` naming ``connector``
(``KVMergeMultiConnector``, or vLLM's own ``MultiConnector`` to compare) over
the simulated children of ``kvmerge.sim.children`` (loaded by vLLM's worker
processes through ``kv_connector_module_path``, each rank recording its
reports: ``kvmerge.sim.record``) and vLLM's ``ExampleConnector`` (no events;
its saves and loads must keep working). The requests are the simulation's
prompts (shared prefixes) as text, sent ``concurrency`` at a time through the
OpenAI completions API in ``waves``, the prefix cache (and the connector's)
reset between waves. A ``StreamReader`` and, with one, Dynamo's KV indexer
read the stream as it is published.

The result is a ``kvmerge.sim.run.Result``: the same sequence, parents,
rules, router and lookups checks, the rules' reference replayed from the
ranks' records. ``ServedResult`` adds what only the server shows: the HTTP
statuses, the ``vllm:kvmerge_*`` series of its ``/metrics``, its log.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvmerge import DEFAULT_MAX_PENDING_STEPS

from .expect import ParentCheck
from .model import CONNECTOR, KV_ROLE, VOCAB, child_entry, served_model_dir, word
from .requests import Arrivals
from .routing import RouterCheck, RouterModel
from .run import Check, Options, Result
from .server import BLOCK_SIZE, Server, ServerOptions

SERVED_FAMILIES: Final = ("lmcache", "mooncake")
#: The family whose child damages reports when asked: its last rank reports
#: only removals, which the other rank reports too, so a refused report loses
#: no store and leaves no store of the stream without its parent.
DAMAGED: Final = "mooncake"
#: vLLM's own MultiConnector: the same children, their events not merged.
UPSTREAM: Final = "MultiConnector"
#: The ``vllm:kvmerge_*`` counters and the label naming the child.
_SERIES = re.compile(r"^vllm:kvmerge_(\w+)_total\{([^}]*)\}\s+(\S+)", re.M)
_CONNECTOR_LABEL = re.compile(r'connector="([^"]*)"')
_PREEMPTIONS = re.compile(r"^vllm:num_preemptions_total(?:\{[^}]*\})?\s+(\S+)", re.M)
#: vLLM's log line format, as its handler writes it in every process.
VLLM_LOG_LINE = re.compile(
    r"^\((?P<proc>[\w]+) pid=\d+\) (?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d "
    r"\[[\w.]+:\d+\] (?P<message>.*)$",
    re.M,
)


@dataclass
class ServedOptions:
    tp: int = 2
    #: ``KVMergeMultiConnector``, or ``MultiConnector`` (vLLM's own).
    connector: str = CONNECTOR
    #: The families vLLM 0.32, the release whose CPU build serves here, has.
    families: tuple[str, ...] = SERVED_FAMILIES
    requests: int = 48
    concurrency: int = 6
    waves: int = 3
    seed: int = 0
    #: The ``DAMAGED`` child's last rank damages its report every
    #: ``damage``-th step (0: never): the connector must refuse exactly those.
    damage: int = 0
    max_pending_steps: int = DEFAULT_MAX_PENDING_STEPS
    #: GPU KV cache blocks (of ``BLOCK_SIZE`` tokens): fewer than
    #: ``concurrency`` requests need, so that requests are preempted.
    num_blocks: int = 24
    #: Blocks each child's tier holds: few, so that it evicts.
    capacity: int = 16
    #: vLLM's ExampleConnector beside the simulated children.
    example: bool = True
    topic: str = "kv-events"
    #: Seconds without a new batch after which the stream is complete.
    settle_s: float = 3.0


@dataclass
class ServedResult:
    result: Result
    statuses: Counter[int]
    #: ``{connector label: {counter: value}}`` from ``/metrics``.
    metrics: dict[str, dict[str, float]]
    #: Per simulated child: its label and its replayed records.
    replayed: list[tuple[str, Any]]
    log: str
    ready_s: float
    run_s: float
    leaked: list[str]
    #: Whether the server had to be killed (it outlived SIGTERM's wait).
    killed: bool
    command: list[str]
    example_hits: int = 0
    #: Requests the scheduler preempted (vLLM's ``num_preemptions``).
    preemptions: int = 0

    def checks(self) -> list[Check]:
        out = [
            Check(
                set(self.statuses) == {200},
                "http",
                f"{sum(self.statuses.values())} requests, statuses "
                + ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items())),
            ),
            *self.result.checks(),
        ]
        if self.result.options.rule is not None:
            theirs = self.result.children_stream
            out.append(
                Check(
                    not theirs,
                    "upstream",
                    f"vLLM's MultiConnector published {len(theirs)} of its "
                    "children's events",
                )
            )
        else:
            want = {
                label: {
                    "reports": float(r.reports),
                    "published": float(len(r.events)),
                    "refused": float(r.refused),
                }
                for label, r in self.replayed
            }
            got = {
                label: {k: self.metrics.get(label, {}).get(k, 0.0) for k in v}
                for label, v in want.items()
            }
            out.append(
                Check(
                    got == want,
                    "metrics",
                    "vllm:kvmerge_{reports,published,refused}_total "
                    + ("equal" if got == want else f"{got}, not")
                    + " the stream's and the records' "
                    + str(
                        {k: {n: int(x) for n, x in v.items()} for k, v in want.items()}
                    ),
                )
            )
        return out


def connector_config(
    opts: ServedOptions, record: Path, example_store: Path
) -> dict[str, Any]:
    """``--kv-transfer-config``: ``opts.connector`` over the simulated
    children (recording into ``record``) and vLLM's ExampleConnector."""
    from .children import entry

    children: list[dict[str, Any]] = [
        entry(
            family,
            i,
            capacity=opts.capacity,
            seed=opts.seed,
            damage=opts.damage if family == DAMAGED else 0,
            record=str(record),
        )
        for i, family in enumerate(opts.families)
    ]
    if opts.example:
        children.append(
            child_entry(
                "ExampleConnector",
                None,
                {"shared_storage_path": str(example_store)},
            )
        )
    for c in children:
        if c.get("kv_connector_module_path") is None:
            c.pop("kv_connector_module_path", None)
    return {
        "kv_connector": opts.connector,
        "kv_role": KV_ROLE,
        "kv_connector_extra_config": {
            "max_pending_steps": opts.max_pending_steps,
            "connectors": children,
        },
    }


def prompts(opts: ServedOptions) -> list[tuple[str, int]]:
    """The simulation's prompts (shared prefixes), as the served tokenizer's
    words, with their output lengths."""
    arrivals = Arrivals(seed=opts.seed)
    words = VOCAB - 3
    out = []
    for _ in range(opts.requests):
        p = arrivals.prompt()
        out.append((" ".join(word(t % words) for t in p.token_ids), p.max_tokens))
    return out


def _metrics(text: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name, labels, value in _SERIES.findall(text):
        m = _CONNECTOR_LABEL.search(labels)
        if m is None:
            continue
        d = out.setdefault(m.group(1), {})
        d[name] = d.get(name, 0.0) + float(value)
    return out


class ServedRun:
    """A run against the real server (see the module's docstring);
    ``router``: a started ``DynamoIndexer``."""

    def __init__(self, opts: ServedOptions, router: Any = None) -> None:
        self.opts = opts
        self.router = router
        self.dir = Path(tempfile.mkdtemp(prefix="kvmerge-served-run-"))
        self.records = self.dir / "records"
        self.server: Server | None = None
        self.stream: list[Any] = []
        self._batches = 0
        self._last_batch = time.monotonic()
        self.preemptions = 0

    def _feed(self, events: list[Any]) -> None:
        self.stream.extend(events)
        self._batches += 1
        self._last_batch = time.monotonic()

    def run(self) -> ServedResult:
        from .stream import StreamReader

        o = self.opts
        model = served_model_dir(self.dir, o.tp)
        config = connector_config(o, self.records, self.dir / "example")
        server = self.server = Server(
            ServerOptions(
                model=model,
                tp=o.tp,
                num_blocks=o.num_blocks,
                kv_transfer=config,
                topic=o.topic,
            ),
            self.dir,
        )
        server.start()
        reader = StreamReader(
            server.endpoint, server.replay_endpoint, o.topic, self._feed
        )
        reader.start()
        check = None
        if self.router is not None:
            self.router.register(
                1, server.endpoint, server.replay_endpoint, block_size=BLOCK_SIZE
            )
            check = RouterCheck(self.router, 1, BLOCK_SIZE, o.seed)
        started = time.monotonic()
        statuses: Counter[int] = Counter()
        work = prompts(o)
        per_wave = -(-len(work) // max(1, o.waves))
        resets = 0
        with ThreadPoolExecutor(o.concurrency) as pool:
            for w in range(o.waves):
                wave = work[w * per_wave : (w + 1) * per_wave]
                statuses.update(pool.map(lambda p: server.complete(*p), wave))
                if w < o.waves - 1:
                    server.reset_prefix_cache()
                    resets += 1
        deadline = time.monotonic() + 120
        while (
            time.monotonic() - self._last_batch < o.settle_s
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)
        run_s = time.monotonic() - started
        expected_seq = reader.sub.expected
        reader.finish(-1 if expected_seq is None else expected_seq - 1, timeout=30)
        if reader.error is not None:
            raise reader.error
        metrics_text = server.metrics()
        metrics = _metrics(metrics_text)
        preempted = _PREEMPTIONS.findall(metrics_text)
        self.preemptions = int(sum(float(v) for v in preempted))
        model_router = RouterModel()
        model_router.apply(self.stream)
        lookups = router_applied = None
        if check is not None:
            check.learn(self.stream)
            check.sync(model_router)
            check.ask(model_router, 100)
            lookups = check.lookups
            router_applied = self.router.metrics()
        server.stop()
        return self._result(
            statuses,
            metrics,
            run_s,
            resets,
            reader.stats,
            lookups,
            router_applied,
            model_router,
        )

    def _result(
        self,
        statuses: Counter[int],
        metrics: dict[str, dict[str, float]],
        run_s: float,
        resets: int,
        reader_stats: Any,
        lookups: Any,
        router_applied: Any,
        model_router: RouterModel,
    ) -> ServedResult:
        from .children import FAMILY, mooncake_factors
        from .record import ChildRecord, expected_stream

        o = self.opts
        assert self.server is not None
        children = [
            ChildRecord(
                i,
                FAMILY[f].rule,
                mooncake_factors(o.tp) if FAMILY[f].rule == "quorum" else None,
            )
            for i, f in enumerate(o.families)
        ]
        # vLLM's MultiConnector never asks its children for their events:
        # then nothing was recorded.
        recorded = self.records.is_dir() and any(self.records.iterdir())
        expected, replayed = (
            expected_stream(self.records, children, o.tp, o.max_pending_steps)
            if recorded
            else ([], [])
        )
        labels = [
            f"connectors[{i}] ({FAMILY[f].cls.__name__})"
            for i, f in enumerate(o.families)
        ]
        by_medium: dict[str, int] = {}
        parents = ParentCheck()
        for e in self.stream:
            m = getattr(e, "medium", None)
            by_medium[m or "-"] = by_medium.get(m or "-", 0) + 1
            parents.apply(m, (e,))
        upstream = o.connector != CONNECTOR
        result = Result(
            options=Options(
                workers=o.tp,
                families=o.families,
                max_pending_steps=o.max_pending_steps,
                num_blocks=o.num_blocks,
                seed=o.seed,
                rule="native" if upstream else None,
                topic=o.topic,
            ),
            steps=len(replayed[0].steps) if replayed else 0,
            published=reader_stats.batches,
            stream=self.stream,
            expected=expected,
            reader_stats=reader_stats,
            merge_stats=[],
            reports=[r.reports for r in replayed],
            step_ns=[],
            merge_ns=[],
            finished=sum(statuses.values()),
            preempted=0,
            resets=resets,
            parents=parents,
            by_medium=by_medium,
            lookups=lookups,
            router_applied=router_applied,
            model_applied=dict(model_router.applied) if self.router else None,
        )
        log = self.server.log()
        return ServedResult(
            result=result,
            statuses=statuses,
            metrics=metrics,
            replayed=list(zip(labels, replayed, strict=False)),
            log=log,
            ready_s=self.server.ready_s,
            run_s=run_s,
            leaked=list(self.server.leaked),
            killed=self.server.killed,
            command=self.server.command(),
            example_hits=log.count("External Cache Hit"),
            preemptions=self.preemptions,
        )

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


def serve_run(opts: ServedOptions, router: Any = None) -> ServedResult:
    r = ServedRun(opts, router)
    try:
        return r.run()
    finally:
        r.close()
