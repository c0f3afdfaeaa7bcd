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
from dataclasses import dataclass, field
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
_ENGINE_LABEL = re.compile(r'engine="([^"]*)"')
#: kvmerge's own steps and seconds in the engine core.
_STEP = re.compile(r"^vllm:kvmerge_(steps|step_seconds)_total\{[^}]*\}\s+(\S+)", re.M)
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
    #: Data-parallel replicas, each with its own scheduler, merger and
    #: publisher (the endpoint's port plus its rank).
    dp: int = 1
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
    #: ``concurrency`` requests need, so that requests are preempted, and
    #: enough for one request of the model's length (16 blocks, and vLLM's
    #: null block).
    num_blocks: int = 20
    #: Blocks each child's tier holds: few, so that it evicts.
    capacity: int = 16
    #: The children's scripted disagreements between ranks (a late last
    #: rank, a lost eviction report, a repeated store): off by default. With
    #: tiers this small, the rules themselves can then publish a store after
    #: its parent's removal (a late rank's second removal under "quorum"),
    #: which the parents check would count, depending on the engine's timing;
    #: the scheduler-loop run, deterministic, is where they are checked.
    #: ``damage`` is a disagreement that stays on.
    faults: bool = False
    #: vLLM's ExampleConnector beside the simulated children.
    example: bool = True
    topic: str = "kv-events"
    #: Seconds without a new batch after which the stream is complete.
    settle_s: float = 3.0


@dataclass
class Replica:
    """What one data-parallel replica (its own scheduler, merger and
    publisher) published, and what the rules say it must have."""

    dp_rank: int
    result: Result
    #: The ``data_parallel_rank`` its batches carried.
    batch_dp_ranks: set[int | None]
    #: ``{connector label: {counter: value}}`` from ``/metrics``.
    metrics: dict[str, dict[str, float]]
    #: Per simulated child: its label and its replayed records.
    replayed: list[tuple[str, Any]]


@dataclass
class ServedResult:
    replicas: list[Replica]
    statuses: Counter[int]
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
    #: kvmerge's own steps and seconds in the engine cores
    #: (``vllm:kvmerge_steps_total``, ``vllm:kvmerge_step_seconds_total``).
    step: dict[str, float] = field(default_factory=dict)

    @property
    def result(self) -> Result:
        """The first replica's (the only one without data parallelism)."""
        return self.replicas[0].result

    @property
    def metrics(self) -> dict[str, dict[str, float]]:
        return self.replicas[0].metrics

    @property
    def replayed(self) -> list[tuple[str, Any]]:
        return self.replicas[0].replayed

    def checks(self) -> list[Check]:
        out = [
            Check(
                set(self.statuses) == {200},
                "http",
                f"{sum(self.statuses.values())} requests, statuses "
                + ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses.items())),
            )
        ]
        for replica in self.replicas:
            suffix = f" dp{replica.dp_rank}" if len(self.replicas) > 1 else ""
            out += [
                Check(c.ok, c.name + suffix, c.text) for c in _replica_checks(replica)
            ]
        return out


def _replica_checks(replica: Replica) -> list[Check]:
    out = replica.result.checks()
    if replica.result.options.rule is not None:
        theirs = replica.result.children_stream
        out.append(
            Check(
                not theirs,
                "upstream",
                f"vLLM's MultiConnector published {len(theirs)} of its "
                "children's events",
            )
        )
        return out
    want = {
        label: {
            "reports": float(r.reports),
            "published": float(len(r.events)),
            "expired": float(r.counters["expired"]),
            "cleared": float(r.counters["cleared"]),
            "refused": float(r.refused),
        }
        for label, r in replica.replayed
    }
    got = {
        label: {k: replica.metrics.get(label, {}).get(k, 0.0) for k in v}
        for label, v in want.items()
    }
    counts = {k: {n: int(x) for n, x in v.items()} for k, v in want.items()}
    out.append(
        Check(
            got == want,
            "metrics",
            "vllm:kvmerge_{reports,published,expired,cleared,refused}_total "
            + ("equal" if got == want else f"{got}, not")
            + f" the stream's and the records' {counts}",
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
            faults=opts.faults,
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


def _metrics(text: str) -> dict[str, dict[str, dict[str, float]]]:
    """``{engine: {connector label: {counter: value}}}``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, labels, value in _SERIES.findall(text):
        m = _CONNECTOR_LABEL.search(labels)
        if m is None:
            continue
        e = _ENGINE_LABEL.search(labels)
        d = out.setdefault(e.group(1) if e else "0", {}).setdefault(m.group(1), {})
        d[name] = d.get(name, 0.0) + float(value)
    return out


def _step(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in _STEP.findall(text):
        out[name] = out.get(name, 0.0) + float(value)
    return out


@dataclass
class _Stream:
    """One replica's stream, as a reader thread feeds it."""

    events: list[Any] = field(default_factory=list)
    reader: Any = None


class ServedRun:
    """A run against the real server (see the module's docstring);
    ``router``: a started ``DynamoIndexer``."""

    def __init__(self, opts: ServedOptions, router: Any = None) -> None:
        self.opts = opts
        self.router = router
        self.dir = Path(tempfile.mkdtemp(prefix="kvmerge-served-run-"))
        self.records = self.dir / "records"
        self.server: Server | None = None
        self.streams = [_Stream() for _ in range(opts.dp)]
        self._last_batch = time.monotonic()

    def _feeder(self, stream: _Stream) -> Any:
        def feed(events: list[Any]) -> None:
            stream.events.extend(events)
            self._last_batch = time.monotonic()

        return feed

    def run(self) -> ServedResult:
        from .stream import StreamReader

        o = self.opts
        model = served_model_dir(self.dir, o.tp)
        config = connector_config(o, self.records, self.dir / "example")
        server = self.server = Server(
            ServerOptions(
                model=model,
                tp=o.tp,
                dp=o.dp,
                num_blocks=o.num_blocks,
                kv_transfer=config,
                topic=o.topic,
            ),
            self.dir,
        )
        server.start()
        checks: list[RouterCheck | None] = []
        for d, stream in enumerate(self.streams):
            endpoint, replay = server.subscriber_endpoints(d)
            stream.reader = StreamReader(
                endpoint, replay, o.topic, self._feeder(stream)
            )
            stream.reader.start()
            if self.router is None:
                checks.append(None)
                continue
            # One instance a replica: each has its own cache.
            self.router.register(
                1 + d, endpoint, replay, dp_rank=d, block_size=BLOCK_SIZE
            )
            checks.append(RouterCheck(self.router, 1 + d, BLOCK_SIZE, o.seed + d))
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
        for stream in self.streams:
            expected_seq = stream.reader.sub.expected
            stream.reader.finish(
                -1 if expected_seq is None else expected_seq - 1, timeout=30
            )
            if stream.reader.error is not None:
                raise stream.reader.error
        metrics_text = server.metrics()
        models = [RouterModel() for _ in self.streams]
        for model_router, stream in zip(models, self.streams, strict=True):
            model_router.apply(stream.events)
        router_applied = None
        for check, model_router, stream in zip(
            checks, models, self.streams, strict=True
        ):
            if check is not None:
                check.learn(stream.events)
                check.sync(model_router)
                check.ask(model_router, 100)
        if self.router is not None:
            router_applied = self.router.metrics()
        server.stop()
        # Dynamo's counters are the process's, over every replica's stream.
        applied: Counter[tuple[str, str]] = Counter()
        for model_router in models:
            applied.update(model_router.applied)
        metrics = _metrics(metrics_text)
        replicas = [
            self._replica(
                d,
                metrics.get(str(d), {}),
                resets,
                checks[d],
                router_applied,
                dict(applied) if self.router is not None else None,
            )
            for d in range(o.dp)
        ]
        log = server.log()
        preempted = _PREEMPTIONS.findall(metrics_text)
        return ServedResult(
            replicas=replicas,
            statuses=statuses,
            log=log,
            ready_s=server.ready_s,
            run_s=run_s,
            leaked=list(server.leaked),
            killed=server.killed,
            command=server.command(),
            example_hits=log.count("External Cache Hit"),
            preemptions=int(sum(float(v) for v in preempted)),
            step=_step(metrics_text),
        )

    def _replica(
        self,
        d: int,
        metrics: dict[str, dict[str, float]],
        resets: int,
        check: RouterCheck | None,
        router_applied: Any,
        model_applied: dict[tuple[str, str], int] | None,
    ) -> Replica:
        from .children import FAMILY, mooncake_factors
        from .record import ChildRecord, expected_stream, replica_folder

        o = self.opts
        stream = self.streams[d].events
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
        folder = replica_folder(self.records, d)
        recorded = folder.is_dir() and any(folder.iterdir())
        expected, replayed = (
            expected_stream(folder, children, o.tp, o.max_pending_steps)
            if recorded
            else ([], [])
        )
        labels = [
            f"connectors[{i}] ({FAMILY[f].cls.__name__})"
            for i, f in enumerate(o.families)
        ]
        by_medium: dict[str, int] = {}
        parents = ParentCheck()
        for e in stream:
            m = getattr(e, "medium", None)
            by_medium[m or "-"] = by_medium.get(m or "-", 0) + 1
            parents.apply(m, (e,))
        reader_stats = self.streams[d].reader.stats
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
            stream=stream,
            expected=expected,
            reader_stats=reader_stats,
            merge_stats=[],
            reports=[r.reports for r in replayed],
            step_ns=[],
            merge_ns=[],
            finished=0,
            preempted=0,
            resets=resets,
            parents=parents,
            by_medium=by_medium,
            lookups=check.lookups if check is not None else None,
            router_applied=router_applied,
            model_applied=model_applied,
        )
        return Replica(
            d,
            result,
            set(self.streams[d].reader.dp_ranks),
            metrics,
            list(zip(labels, replayed, strict=False)),
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
