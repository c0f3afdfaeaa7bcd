"""kvmerge's counters on vLLM's connector-stats path.

Every step vLLM's scheduler calls ``get_kv_connector_stats()`` on its
connector, aggregates the result with the workers' stats
(``KVConnectorOutput.kv_connector_stats``) and ships ``to_dict()`` in
``SchedulerStats.kv_connector_stats`` to the stat loggers, which rebuild it
with the connector class's ``build_kv_connector_stats`` (``LoggingStatLogger``,
through ``KVConnectorLogging``: one "KV Transfer metrics" line per interval)
or feed it to the metrics its ``build_prom_metrics`` made
(``PrometheusStatLogger``, through ``KVConnectorProm``).

``MultiConnector`` sends a ``MultiKVConnectorStats``: the children's stats
keyed by class name. ``KVMergeMultiConnector``'s scheduler side adds one more
entry, under ``KEY`` (``"kvmerge"``, not a class name): a ``KVMergeStats``
holding, per merged child (by ``ChildSpec.label``), what happened since the
previous call:

* ``reports``: event reports the workers sent (``MergerStats.reports``);
* ``published``: events published (``MergerStats.published``);
* ``expired``: reports that waited ``max_pending_steps`` for the other ranks
  and were dropped;
* ``cleared``: pending reports an ``AllBlocksCleared`` discarded;
* ``withheld``: events the rules published that the guard kept out of the
  stream, a router being unable to apply them (``MergerStats.withheld``,
  docs/merge-rules.md "Guard");
* ``refused``: the workers' batches dropped as bad, and steps whose merged
  events were lost (``_Child.refused``);
* ``pending``: reports waiting now (a level, not an increment).

Prometheus (labels ``model_name``, ``engine`` as vLLM's own, and
``connector``, the child: ``connectors[0] (LMCacheConnectorV1)``):
``vllm:kvmerge_reports_total``, ``vllm:kvmerge_published_total``,
``vllm:kvmerge_expired_total``, ``vllm:kvmerge_cleared_total``,
``vllm:kvmerge_withheld_total``,
``vllm:kvmerge_refused_total`` (counters) and ``vllm:kvmerge_pending``
(gauge).

The connector's own time in the engine-core process goes beside them, under
``STEP_KEY`` (``"kvmerge_step"``), in a ``KVMergeStepStats``: the engine steps
since the previous report (``get_kv_connector_stats`` calls: vLLM's scheduler
makes one per ``update_from_output``, the report's own step among them) and
the nanoseconds the connector spent in its scheduler-side calls of those
steps (``update_connector_output``, ``get_kv_connector_stats``,
``take_events``, its children's calls included: what it adds to the engine's
busy loop). Prometheus, labels ``model_name`` and
``engine``: ``vllm:kvmerge_steps_total`` and ``vllm:kvmerge_step_seconds_total``
(counters: their rates' ratio is the mean time per step); the log line:
``kvmerge_step={'steps': 120, 'ms': 4.2, 'us_per_step': 35.0}``.

The workers' side goes beside them, under ``WORKER_KEY``
(``"kvmerge_worker"``), in a ``KVMergeWorkerStats`` that each worker's
``get_kv_connector_stats`` returns and vLLM's aggregator sums over the
ranks: the worker outputs kvmerge made, the nanoseconds it spent making them
(encoding each merged child's events and writing the output's buffer; the
children's own calls not included) and the bytes of their buffers (what
travels to the scheduler, beside any native container). Prometheus, labels
``model_name`` and ``engine``: ``vllm:kvmerge_worker_outputs_total``,
``vllm:kvmerge_worker_encode_seconds_total`` and
``vllm:kvmerge_worker_output_bytes_total`` (counters: the encode time and
bytes per output are their rates' ratios); the log line:
``kvmerge_worker={'outputs': 240, 'us_per_output': 35.0, 'bytes_per_output': 3622}``.

Each side reports at most once a second (``Interval``), counting every step
in between, so that most steps' messages carry nothing of kvmerge's and
vLLM's loggers see it once a second, not once a step. The scheduler's side
reports besides at every step that leaves no request running
(``SchedulerReports``), so that the counters of an engine gone idle are
whole; a worker's last second waits for the engine's next step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorStats,
)

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge
    from vllm.config import VllmConfig

    from kvmerge import MergerStats

#: kvmerge's entry in ``MultiKVConnectorStats.data``.
KEY: Final = "kvmerge"
#: Monotonic counters: increments in the stats, Prometheus counters.
COUNTERS: Final = (
    "reports",
    "published",
    "expired",
    "cleared",
    "withheld",
    "refused",
)
#: A level: the latest value in the stats, a Prometheus gauge.
PENDING: Final = "pending"
#: The Prometheus label naming the child.
LABEL: Final = "connector"
PREFIX: Final = "vllm:kvmerge_"
#: The names as ``prometheus_client`` exposes them.
METRIC_NAMES: Final = (*(f"{PREFIX}{c}_total" for c in COUNTERS), PREFIX + PENDING)
#: The connector's own scheduler-side time, beside ``KEY``.
STEP_KEY: Final = "kvmerge_step"
#: ``KVMergeStepStats.data``'s counters: engine steps, nanoseconds in them.
STEPS: Final = "steps"
STEP_NS: Final = "ns"
STEP_METRIC_NAMES: Final = (f"{PREFIX}steps_total", f"{PREFIX}step_seconds_total")
#: The workers' side, beside ``KEY``.
WORKER_KEY: Final = "kvmerge_worker"
#: ``KVMergeWorkerStats.data``'s counters: outputs, nanoseconds, bytes.
OUTPUTS: Final = "outputs"
ENCODE_NS: Final = "encode_ns"
OUTPUT_BYTES: Final = "bytes"
WORKER_COUNTERS: Final = (OUTPUTS, ENCODE_NS, OUTPUT_BYTES)
WORKER_METRIC_NAMES: Final = (
    f"{PREFIX}worker_outputs_total",
    f"{PREFIX}worker_encode_seconds_total",
    f"{PREFIX}worker_output_bytes_total",
)
#: How often, at most, each side reports (nanoseconds).
REPORT_NS: Final = 1_000_000_000

_MERGER_COUNTERS: Final = ("reports", "published", "expired", "cleared", "withheld")
_DOC: Final = {
    "reports": "KV event reports the workers sent, per child (events in).",
    "published": "KV events published after merging, per child (events out).",
    "expired": "KV event reports dropped after waiting max_pending_steps for "
    "the other ranks, per child.",
    "cleared": "Pending KV event reports discarded by an AllBlocksCleared, per child.",
    "withheld": "KV events withheld as no router could apply them (a store of a "
    "block held, or whose parent is not, a removal of a block not held), per child.",
    "refused": "Workers' batches of KV events refused as bad, per child.",
    PENDING: "KV event reports waiting for the other ranks, per child.",
}


@dataclass
class KVMergeStats(KVConnectorStats):
    """``data``: ``{child label: {"reports": n, ..., "pending": n}}``, the
    counters as increments over the interval covered, ``pending`` as the
    latest value. Plain dicts and ints: it travels serialized."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for label, values in other.data.items():
            mine = self.data.get(label)
            if mine is None:
                self.data[label] = dict(values)
                continue
            for name in COUNTERS:
                mine[name] = mine.get(name, 0) + values.get(name, 0)
            if PENDING in values:
                mine[PENDING] = values[PENDING]
        return self

    def reduce(self) -> dict[str, Any]:
        return {
            label: " ".join(
                f"{name}={values.get(name, 0)}" for name in (*COUNTERS, PENDING)
            )
            for label, values in self.data.items()
        }

    def is_empty(self) -> bool:
        return not any(
            values.get(name, 0) for values in self.data.values() for name in COUNTERS
        )


@dataclass
class KVMergeStepStats(KVConnectorStats):
    """``data``: ``{"steps": n, "ns": n}``, the engine steps of the interval
    covered and the nanoseconds the connector spent in them (increments)."""

    def reset(self) -> None:
        self.data = {STEPS: 0, STEP_NS: 0}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in (STEPS, STEP_NS):
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, Any]:
        steps, ns = self.data.get(STEPS, 0), self.data.get(STEP_NS, 0)
        return {
            "steps": steps,
            "ms": round(ns / 1e6, 3),
            "us_per_step": round(ns / 1e3 / steps, 1) if steps else 0.0,
        }

    def is_empty(self) -> bool:
        return not self.data.get(STEPS) and not self.data.get(STEP_NS)


@dataclass
class KVMergeWorkerStats(KVConnectorStats):
    """``data``: ``{"outputs": n, "encode_ns": n, "bytes": n}``, over the
    interval covered and every worker whose stats were aggregated in
    (increments)."""

    def reset(self) -> None:
        self.data = dict.fromkeys(WORKER_COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in WORKER_COUNTERS:
            self.data[name] = self.data.get(name, 0) + other.data.get(name, 0)
        return self

    def reduce(self) -> dict[str, Any]:
        outputs = self.data.get(OUTPUTS, 0)
        ns, nbytes = self.data.get(ENCODE_NS, 0), self.data.get(OUTPUT_BYTES, 0)
        return {
            "outputs": outputs,
            "us_per_output": round(ns / 1e3 / outputs, 1) if outputs else 0.0,
            "bytes_per_output": round(nbytes / outputs) if outputs else 0,
        }

    def is_empty(self) -> bool:
        return not self.data.get(OUTPUTS)


class Interval:
    """At most one report every ``interval_ns``: each report goes through
    vLLM's stat loggers in the front end, in the Python of every step that
    carries one (about 70 us for kvmerge's, docs/benchmarks.md "What a
    report costs"), so that most steps carry none."""

    __slots__ = ("_at",)

    #: The least time between two reports (nanoseconds).
    interval_ns: ClassVar[int] = REPORT_NS

    def __init__(self) -> None:
        self._at: int | None = None

    def due(self, now_ns: int) -> bool:
        return self._at is None or now_ns - self._at >= self.interval_ns

    def reported(self, now_ns: int) -> None:
        self._at = now_ns


class SchedulerReports:
    """Scheduler side: when kvmerge's stats go out. At most once an
    ``Interval`` while a request runs, and at every step that leaves none
    running: vLLM's scheduler sends stats only with a step's outputs, so an
    engine gone idle would otherwise keep its last counts until its next
    request. A request runs from vLLM's first ``get_num_new_matched_tokens``
    for it to its ``request_finished``."""

    __slots__ = ("_interval", "_running")

    def __init__(self) -> None:
        self._interval = Interval()
        self._running: set[str] = set()

    def started(self, request_id: str) -> None:
        self._running.add(request_id)

    def finished(self, request_id: str) -> None:
        self._running.discard(request_id)

    def due_now(self, now_ns: int) -> bool:
        """Whether this step reports (if so, the interval starts again)."""
        if self._running and not self._interval.due(now_ns):
            return False
        self._interval.reported(now_ns)
        return True


class WorkerMeter:
    """Worker side: the outputs kvmerge made, its nanoseconds making them
    and their bytes, totals; ``collect`` the increments since the previous
    report, at most once an ``Interval`` (None in between)."""

    __slots__ = ("_interval", "_last", "bytes", "ns", "outputs")

    def __init__(self) -> None:
        self.outputs = self.ns = self.bytes = 0
        self._last = (0, 0, 0)
        self._interval = Interval()

    def add(self, ns: int, nbytes: int) -> None:
        self.outputs += 1
        self.ns += ns
        self.bytes += nbytes

    def collect(self, now_ns: int) -> KVMergeWorkerStats | None:
        if self.outputs == self._last[0] or not self._interval.due(now_ns):
            return None
        totals = (self.outputs, self.ns, self.bytes)
        data = {
            name: now - last
            for name, now, last in zip(WORKER_COUNTERS, totals, self._last, strict=True)
        }
        self._last = totals
        self._interval.reported(now_ns)
        return KVMergeWorkerStats(data=data)


#: Our entries in ``MultiKVConnectorStats.data``, and their classes.
_OURS: Final[dict[str, type[KVConnectorStats]]] = {
    KEY: KVMergeStats,
    STEP_KEY: KVMergeStepStats,
    WORKER_KEY: KVMergeWorkerStats,
}


class StepTimer:
    """Scheduler side: the connector's engine steps and its nanoseconds in
    them (``perf_counter_ns``), totals; ``collect`` the increments since the
    previous ``collect``."""

    __slots__ = ("_ns", "_steps", "ns", "steps")

    def __init__(self) -> None:
        self.ns = self.steps = self._ns = self._steps = 0

    def collect(self) -> KVMergeStepStats:
        stats = KVMergeStepStats(
            data={STEPS: self.steps - self._steps, STEP_NS: self.ns - self._ns}
        )
        self._steps, self._ns = self.steps, self.ns
        return stats


class StatsTracker:
    """Scheduler side: each child's counters since the previous ``collect``."""

    def __init__(self) -> None:
        self._last: dict[int, dict[str, int]] = {}

    def collect(
        self, children: Sequence[tuple[str, MergerStats | None, int]]
    ) -> KVMergeStats:
        """From each child's label, merger counters (None: no merger yet) and
        refusals, in config order."""
        data: dict[str, dict[str, int]] = {}
        for i, (label, stats, refused) in enumerate(children):
            if stats is None and not refused:
                continue
            now = stats.as_dict() if stats is not None else {}
            current = {name: int(now.get(name, 0)) for name in _MERGER_COUNTERS}
            current["refused"] = refused
            last = self._last.get(i, {})
            entry = {}
            for name in COUNTERS:
                before = last.get(name, 0)
                # A replaced merger starts from zero: all of it is new.
                value = current[name]
                entry[name] = value - before if value >= before else value
            entry[PENDING] = int(now.get(PENDING, 0))
            self._last[i] = current
            data[label] = entry
        return KVMergeStats(data=data)


def with_merge_stats(
    children: KVConnectorStats | None,
    ours: KVMergeStats | None,
    step: KVMergeStepStats | None = None,
    worker: KVMergeWorkerStats | None = None,
) -> KVConnectorStats | None:
    """The children's stats as ``MultiConnector`` returns them, plus ours
    (each only when it holds something)."""
    for key, stats in ((KEY, ours), (STEP_KEY, step), (WORKER_KEY, worker)):
        if stats is None or stats.is_empty():
            continue
        if children is None:
            children = MultiKVConnectorStats()
        children.data[key] = stats
    return children


def build_stats(
    data: dict[str, Any] | None,
    build_children: Callable[[dict[str, Any] | None], KVConnectorStats | None],
) -> KVConnectorStats | None:
    """``build_kv_connector_stats``: ours rebuilt, the rest by ``MultiConnector``."""
    if data is None or not any(key in data for key in _OURS):
        return build_children(data)
    stats = build_children({k: v for k, v in data.items() if k not in _OURS})
    if stats is None:
        stats = MultiKVConnectorStats()
    for key, cls in _OURS.items():
        ours = data.get(key)
        if ours is not None:
            stats.data[key] = (
                ours if isinstance(ours, KVConnectorStats) else cls(data=dict(ours))
            )
    return stats


class KVMergePromMetrics(KVConnectorPromMetrics):
    """The ``vllm:kvmerge_*`` metrics, fed ``KVMergeStats.data``."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(
            vllm_config,
            metric_types,
            labelnames,
            per_engine_labelvalues,
        )
        names = [*labelnames, LABEL]
        self.counters: dict[str, Counter] = {
            name: self._counter_cls(
                name=PREFIX + name, documentation=_DOC[name], labelnames=names
            )
            for name in COUNTERS
        }
        self.pending: Gauge = self._gauge_cls(
            name=PREFIX + PENDING,
            documentation=_DOC[PENDING],
            labelnames=names,
            multiprocess_mode="mostrecent",
        )
        steps_name, seconds_name = STEP_METRIC_NAMES
        self.steps: Counter = self._counter_cls(
            name=steps_name.removesuffix("_total"),
            documentation="Engine steps the connector took part in (scheduler side).",
            labelnames=labelnames,
        )
        self.step_seconds: Counter = self._counter_cls(
            name=seconds_name.removesuffix("_total"),
            documentation="Seconds the connector spent in its scheduler-side calls "
            "of those steps (update_connector_output, get_kv_connector_stats, "
            "take_events).",
            labelnames=labelnames,
        )
        worker_docs = (
            "Worker outputs kvmerge made, every worker's (one per worker and step).",
            "Seconds the workers spent making them: encoding each merged child's "
            "events and writing the output's buffer.",
            "Bytes of those outputs' buffers (what travels to the scheduler).",
        )
        self.worker: dict[str, Counter] = {
            key: self._counter_cls(
                name=name.removesuffix("_total"),
                documentation=doc,
                labelnames=labelnames,
            )
            for key, name, doc in zip(
                WORKER_COUNTERS,
                WORKER_METRIC_NAMES,
                worker_docs,
                strict=True,
            )
        }

    def observe_worker(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for key, counter in self.worker.items():
            value = max(0, data.get(key, 0))
            counter.labels(*labelvalues).inc(value / 1e9 if key == ENCODE_NS else value)

    def observe_step(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        labelvalues = self.per_engine_labelvalues[engine_idx]
        self.steps.labels(*labelvalues).inc(max(0, data.get(STEPS, 0)))
        self.step_seconds.labels(*labelvalues).inc(max(0, data.get(STEP_NS, 0)) / 1e9)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for label, values in transfer_stats_data.items():
            for name, counter in self.counters.items():
                counter.labels(*labelvalues, label).inc(max(0, values.get(name, 0)))
            if PENDING in values:
                self.pending.labels(*labelvalues, label).set(values[PENDING])


class WithKVMergePromMetrics(KVMergePromMetrics):
    """``MultiConnector``'s metrics for the children's entries, ours for ours."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
        children: KVConnectorPromMetrics | None,
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.children = children

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        ours = transfer_stats_data.get(KEY)
        if ours is not None:
            if isinstance(ours, KVConnectorStats):
                ours = ours.to_dict()
            super().observe(ours, engine_idx)
        step = transfer_stats_data.get(STEP_KEY)
        if step is not None:
            if isinstance(step, KVConnectorStats):
                step = step.to_dict()
            self.observe_step(step, engine_idx)
        worker = transfer_stats_data.get(WORKER_KEY)
        if worker is not None:
            if isinstance(worker, KVConnectorStats):
                worker = worker.to_dict()
            self.observe_worker(worker, engine_idx)
        if any(key in transfer_stats_data for key in _OURS):
            transfer_stats_data = {
                k: v for k, v in transfer_stats_data.items() if k not in _OURS
            }
        if self.children is not None and transfer_stats_data:
            self.children.observe(transfer_stats_data, engine_idx)
