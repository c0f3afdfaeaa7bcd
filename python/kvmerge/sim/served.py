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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from kvmerge import DEFAULT_MAX_PENDING_STEPS
from kvmerge.vllm.config import ChildRule

from .dynamo import as_i64
from .model import CONNECTOR, KV_ROLE, WORDS, child_entry, served_model_dir, word
from .requests import Arrivals
from .routing import TIER_OF_MEDIUM, RouterCheck, RouterModel, tier_differences
from .run import Check, Options, Result
from .server import BLOCK_SIZE, Server, ServerOptions

if TYPE_CHECKING:
    from kvmerge.vllm.config import ChildRule

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
#: Every how many requests one has a one-block prompt and a long output
#: (``prompts``), and that output's length.
LONG_EVERY: Final = 4
LONG_TOKENS: Final = 160
#: Lookups of the router after the run.
LOOKUPS: Final = 100
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
    #: Pipeline-parallel stages: a replica's workers are ``tp * pp``.
    pp: int = 1
    #: The nodes of vLLM's multi-node executor the workers are spread over
    #: (``kvmerge.sim.server``: each other node in namespaces of its own).
    nodes: int = 1
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
    damage: int = 3
    max_pending_steps: int = DEFAULT_MAX_PENDING_STEPS
    #: GPU KV cache blocks (of ``BLOCK_SIZE`` tokens): fewer than
    #: ``concurrency`` requests need, so that requests are preempted, and
    #: enough for one request of the model's length (16 blocks, and vLLM's
    #: null block).
    num_blocks: int = 20
    #: Blocks each child's tier holds: few, so that it evicts.
    capacity: int = 16
    #: The children's scripted disagreements between ranks (a late last
    #: rank, a lost eviction report, a repeated store), beside ``damage``.
    #: The connector's guard (docs/merge-rules.md) keeps the stream valid
    #: whatever they make the rules publish.
    faults: bool = True
    #: vLLM's ExampleConnector beside the simulated children.
    example: bool = True
    #: Every simulated child's rule (None: kvmerge's own for its family;
    #: "native": vLLM's own path, under ``KVMergeMultiConnector``).
    rule: ChildRule | None = None
    topic: str = "kv-events"
    #: Seconds without a new batch after which the stream is complete.
    settle_s: float = 3.0

    @property
    def world(self) -> int:
        """The workers of a replica: kvmerge's world (TP x PP)."""
        return self.tp * self.pp


@dataclass(frozen=True)
class Accuracy:
    """After one wave, how one child's tier as the router holds it compares
    with what the ranks' tiers really hold (``kvmerge.sim.record.held``), in
    blocks."""

    wave: int
    dp_rank: int
    child: str
    #: The router's tier the child's medium falls in.
    tier: str
    truth: int
    router: int
    #: Blocks both hold.
    right: int

    @property
    def share(self) -> float:
        """The blocks the router has right among those either holds (1.0
        when both are empty): a stale block and a missing one count alike."""
        union = self.truth + self.router - self.right
        return 1.0 if union == 0 else self.right / union


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
    #: What Dynamo's ``/dump`` holds at the end, per tier (None: no router).
    router_tiers: dict[str, set[int]] | None = None
    #: The ``AllBlocksCleared`` the stream must hold: the GPU block pool's,
    #: one a successful reset, and the children's, as the rules publish them
    #: (None: children under vLLM's own path, whose clears no rule says).
    clears_expected: int | None = 0
    #: Whether vLLM's own MultiConnector served it.
    upstream: bool = False


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
    #: The server's exit status after SIGTERM (0: a clean stop).
    returncode: int | None = None
    #: ``/reset_prefix_cache`` calls, and those that answered ``success``.
    resets: int = 0
    resets_ok: int = 0
    #: Where the run's server log and records were kept (a failed run's, or
    #: every run's with ``serve_run(keep=True)``); None: removed.
    kept: Path | None = None
    #: After each wave, each child's tier as the router holds it against the
    #: truth.
    accuracy: list[Accuracy] = field(default_factory=list)
    #: The nodes of vLLM's multi-node executor, and each other node's exit
    #: status once the first was stopped.
    nodes: int = 1
    node_returncodes: list[int] = field(default_factory=list)
    #: The TCP addresses node 1's workers answered the engine core on
    #: (``Server.remote_queues``): empty on one node.
    remote_queues: list[str] = field(default_factory=list)

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
            ),
            Check(
                self.returncode == 0 and not self.killed,
                "stop",
                f"vllm serve exited with {self.returncode} after SIGTERM"
                + (", killed after the wait" if self.killed else ""),
            ),
            Check(
                self.resets_ok == self.resets,
                "resets",
                f"{self.resets_ok} of {self.resets} prefix-cache resets succeeded",
            ),
        ]
        if self.nodes > 1:
            out += [
                Check(
                    len(self.node_returncodes) == self.nodes - 1
                    and all(c == 0 for c in self.node_returncodes),
                    "nodes",
                    f"the other nodes' vllm serve exited with {self.node_returncodes}",
                ),
                Check(
                    bool(self.remote_queues),
                    "tcp",
                    "node 1's workers answered on vLLM's remote message queue at "
                    + (", ".join(sorted(set(self.remote_queues))) or "no address"),
                ),
            ]
        for replica in self.replicas:
            suffix = f" dp{replica.dp_rank}" if len(self.replicas) > 1 else ""
            out += [
                Check(c.ok, c.name + suffix, c.text) for c in _replica_checks(replica)
            ]
        return out


def _replica_checks(replica: Replica) -> list[Check]:
    out = replica.result.checks()
    clears = replica.result.by_medium.get("-", 0)
    if replica.clears_expected is not None:
        out.append(
            Check(
                clears == replica.clears_expected,
                "clears",
                f"{clears} AllBlocksCleared published, {replica.clears_expected} "
                "expected (the block pool's resets and the children's clears)",
            )
        )
    if replica.router_tiers is not None:
        model = RouterModel()
        model.apply(replica.result.stream)
        held = model.held()
        diff = tier_differences(replica.router_tiers, held)
        out.append(
            Check(
                not diff,
                "tiers",
                "Dynamo's /dump holds each tier's blocks as the stream says ("
                + ", ".join(f"{t} {len(b)}" for t, b in held.items())
                + ")"
                if not diff
                else "Dynamo's /dump differs from the stream (tier: only Dynamo's, "
                f"only the stream's): {diff}",
            )
        )
    if replica.result.options.rule is not None:
        if not replica.upstream:
            return out
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
            "withheld": float(r.counters["withheld"]),
            "refused": float(r.refused),
        }
        for label, r in replica.replayed
    }
    # A series the server does not show is missing, not 0.
    got = {
        label: {
            k: replica.metrics[label][k]
            for k in v
            if k in replica.metrics.get(label, {})
        }
        for label, v in want.items()
    }
    counts = {k: {n: int(x) for n, x in v.items()} for k, v in want.items()}
    out.append(
        Check(
            got == want,
            "metrics",
            "vllm:kvmerge_{reports,published,expired,cleared,withheld,refused}_total "
            + ("equal" if got == want else f"{got}, not")
            + f" the stream's and the records' {counts}",
        )
    )
    return out


def accuracy_rows(runs: Sequence[tuple[str, ServedResult]]) -> list[list[str]]:
    """One row per wave and child: its tier, the blocks it really holds, and
    per run the share of blocks the router has right (first replica's)."""
    first = runs[0][1].accuracy
    rows = []
    for k, a in enumerate(first):
        if a.dp_rank != 0:
            continue
        row = [str(a.wave), a.child, a.tier, f"{a.truth:,}"]
        for _, r in runs:
            b = r.accuracy[k] if k < len(r.accuracy) else None
            row.append(
                "-" if b is None else f"{100 * b.share:.0f}% ({b.right}/{b.router})"
            )
        rows.append(row)
    return rows


def child_label(index: int, family: str) -> str:
    """A simulated child's label in the connector's log lines and metrics."""
    from .children import FAMILY

    return f"connectors[{index}] ({FAMILY[family].cls.__name__})"


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
            rule=opts.rule,
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
    words (a token each), with their output lengths.

    They are shaped so that vLLM's ExampleConnector loads exactly what it
    saved, preempted or not (``example_connector.py``, vLLM 0.32 to 0.34,
    where ``align_to_block_size(t)`` is the last multiple of the block size
    below ``t``). It looks a prompt up under its tokens up to
    ``align_to_block_size(len - 1)``, saves and loads it under
    ``align_to_block_size(len)``, and loads a request resumed after
    preemption under ``align_to_block_size`` of its tokens so far, output
    included. For other lengths these differ: the lookup finds a folder
    another prompt saved, the load opens one never written, and its
    ``FileNotFoundError`` kills the engine (seeds 2 and 4 did, uncut).

    * Most prompts are cut to ``BLOCK_SIZE * n + 2`` tokens and ask for at
      most ``BLOCK_SIZE - 2``: the three are then the same ``n`` blocks.
    * Every ``LONG_EVERY``-th is a single block asking for ``LONG_TOKENS``:
      its lookup covers no block, so it is never loaded, and its output
      needs new blocks as it grows, which makes the scheduler preempt (the
      others never outgrow the blocks their prompt took)."""
    arrivals = Arrivals(seed=opts.seed)
    out = []
    for i in range(opts.requests):
        p = arrivals.prompt()
        if p.max_tokens > BLOCK_SIZE - 2:
            raise ValueError(f"a request asks for {p.max_tokens} tokens")
        n = len(p.token_ids)
        if i % LONG_EVERY == LONG_EVERY - 1:
            tokens, max_tokens = p.token_ids[:BLOCK_SIZE], LONG_TOKENS
        else:
            tokens, max_tokens = p.token_ids[: n - (n - 2) % BLOCK_SIZE], p.max_tokens
        out.append((" ".join(word(t % WORDS) for t in tokens), max_tokens))
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
                pp=o.pp,
                nodes=o.nodes,
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
        resets = resets_ok = 0
        accuracy: list[Accuracy] = []
        with ThreadPoolExecutor(o.concurrency) as pool:
            for w in range(o.waves):
                wave = work[w * per_wave : (w + 1) * per_wave]
                statuses.update(pool.map(lambda p: server.complete(*p), wave))
                accuracy += self._accuracy(w, checks)
                if w < o.waves - 1:
                    resets_ok += server.reset_prefix_cache()
                    resets += 1
        self._settle()
        run_s = time.monotonic() - started
        # How far each stream goes, as its publisher's replay buffer says:
        # not the reader's own count, so that batches it lost at the end
        # show.
        published = [
            last_published_seq(*server.subscriber_endpoints(d), o.topic)
            for d in range(o.dp)
        ]
        for stream, last in zip(self.streams, published, strict=True):
            stream.reader.finish(-1 if last is None else last, timeout=30)
            if stream.reader.error is not None:
                raise stream.reader.error
        metrics_text = server.metrics()
        models = [RouterModel() for _ in self.streams]
        for model_router, stream in zip(models, self.streams, strict=True):
            model_router.apply(stream.events)
        router_applied = None
        tiers: list[dict[str, set[int]] | None] = []
        for d, (check, model_router, stream) in enumerate(
            zip(checks, models, self.streams, strict=True)
        ):
            if check is None:
                tiers.append(None)
                continue
            check.learn(stream.events)
            check.sync(model_router)
            tiers.append(check.settled_tiers(model_router, d))
            check.ask(model_router, LOOKUPS)
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
        for d, replica in enumerate(replicas):
            replica.router_tiers = tiers[d]
            n = published[d]
            replica.result.published = 0 if n is None else n + 1
            # Each successful reset clears the GPU block pool once, beside
            # the children's own clears, which the rules publish.
            replica.clears_expected = (
                None
                if o.rule == "native" and not replica.upstream
                else resets_ok
                + sum(
                    1
                    for e in replica.result.expected
                    if type(e).__name__ == "AllBlocksCleared"
                )
            )
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
            returncode=server.returncode,
            nodes=o.nodes,
            node_returncodes=list(server.node_returncodes),
            remote_queues=server.remote_queues(),
            accuracy=accuracy,
            resets=resets,
            resets_ok=resets_ok,
        )

    def _settle(self) -> None:
        """Waits until no batch came for ``settle_s`` (120 s at most)."""
        deadline = time.monotonic() + 120
        while (
            time.monotonic() - self._last_batch < self.opts.settle_s
            and time.monotonic() < deadline
        ):
            time.sleep(0.2)

    def _accuracy(
        self, wave: int, checks: Sequence[RouterCheck | None]
    ) -> list[Accuracy]:
        """Each child's tier, as the router (Dynamo's ``/dump``, or without
        one the model of the stream) holds it once the stream is quiet,
        against what the tier really holds."""
        from .children import FAMILY
        from .record import held, replica_folder

        self._settle()
        out = []
        for d, (stream, check) in enumerate(zip(self.streams, checks, strict=True)):
            model = RouterModel()
            model.apply(list(stream.events))
            view = model.held() if check is None else check.settled_tiers(model, d)
            folder = replica_folder(self.records, d)
            for i, f in enumerate(self.opts.families):
                tier = TIER_OF_MEDIUM[FAMILY[f].cls.MEDIUM]
                truth = {as_i64(int(h)) for h in held(folder, i)}
                have = view.get(tier, set())
                out.append(
                    Accuracy(
                        wave,
                        d,
                        child_label(i, f),
                        tier,
                        len(truth),
                        len(have),
                        len(truth & have),
                    )
                )
        return out

    def _replica(
        self,
        d: int,
        metrics: dict[str, dict[str, float]],
        resets: int,
        check: RouterCheck | None,
        router_applied: Any,
        model_applied: dict[tuple[str, str], int] | None,
    ) -> Replica:
        from .children import FAMILY
        from .record import ChildRecord, expected_stream, recorded, replica_folder

        o = self.opts
        stream = self.streams[d].events
        children = [
            ChildRecord(
                i,
                FAMILY[f].rule,
                FAMILY[f].cls.factors(o.world) if FAMILY[f].rule == "quorum" else None,
            )
            for i, f in enumerate(o.families)
        ]
        # vLLM's MultiConnector never asks its children for their events:
        # then nothing was recorded.
        # Under vLLM's own path for every child, the rules say nothing.
        folder = replica_folder(self.records, d)
        upstream = o.connector != CONNECTOR
        merged = not upstream and o.rule != "native"
        expected, replayed = (
            expected_stream(folder, children, o.world, o.max_pending_steps)
            if merged and recorded(folder)
            else ([], [])
        )
        labels = [child_label(i, f) for i, f in enumerate(o.families)]
        reader_stats = self.streams[d].reader.stats
        result = Result(
            options=Options(
                workers=o.world,
                families=o.families,
                max_pending_steps=o.max_pending_steps,
                num_blocks=o.num_blocks,
                seed=o.seed,
                rule=None if merged else "native",
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
            upstream=upstream,
        )

    def close(self, keep: bool = False) -> None:
        """Stops the server; removes the run's folder (its server log and
        records) unless ``keep``."""
        if self.server is not None:
            self.server.stop()
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def serve_run(
    opts: ServedOptions, router: Any = None, keep: bool = False
) -> ServedResult:
    """One run; a run that raises or fails a check keeps its folder (the
    server's log, the ranks' records) and names it (``ServedResult.kept``).
    ``keep``: keep it whatever the checks say, for a caller that judges the
    result further (and removes the folder when that passes too)."""
    r = ServedRun(opts, router)
    try:
        result = r.run()
    except BaseException as e:
        r.close(keep=True)
        e.add_note(f"the run's server log and records are kept in {r.dir}")
        raise
    kept = keep or any(not c.ok for c in result.checks())
    r.close(keep=kept)
    if kept:
        result.kept = r.dir
    return result


def last_published_seq(endpoint: str, replay: str, topic: str) -> int | None:
    """The last sequence number a publisher's replay socket holds (None:
    none), asked on a socket of its own."""
    from kvmerge.subscriber import EventSubscriber

    sub = EventSubscriber(endpoint, topic=topic, replay_endpoint=replay)
    try:
        return max((seq for _, seq, _ in sub.replay(0)), default=None)
    finally:
        sub.close()
