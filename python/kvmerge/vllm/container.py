"""The container a worker hands to the scheduler: one per worker per step.

``KVMergeKVEvents`` implements vLLM's ``KVConnectorKVEvents`` so that
``KVOutputAggregator.aggregate`` combines the containers of all workers with
its usual calls::

    acc.add_events(other.get_all_events())
    acc.increment_workers(1)

``get_all_events()`` returns a ``WorkerReports``: a lazy, read-only sequence
that carries the workers' reports (rank + one encoded batch per lane) and only
decodes events if somebody iterates or indexes it. ``add_events`` recognises it
and takes the reports over as they are, so no event object is built between a
worker's ``kvmerge.encode`` and the scheduler's merge.

Pickling (the executor's shm ``MessageQueue`` pickles with the highest protocol
and a ``buffer_callback``) keeps the ``EventBatch`` objects as they are: each
reduces to a protocol-5 ``PickleBuffer`` of its wire bytes, which travels out
of band when large. On receipt a batch is rebuilt unchecked by raising nothing
(``EventBatch._from_pickle``: a damaged one remembers why in ``.error``), and
reports likewise (``_from_wire``): unpickling runs inside vLLM's message queue,
where an exception is fatal, and the scheduler side drops just that report.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pickle import PickleBuffer
from typing import Any, TypeAlias, overload

from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents

from kvmerge import EventBatch

from .rules import ENCODED_KINDS, KIND_NATIVE, KIND_REFUSED
from .settings import WorkerSettings

#: ``EventBatch``'s pickle reconstructor (never raises; not in the stubs).
_batch_from_pickle = EventBatch._from_pickle  # type: ignore[attr-defined]

#: One lane's payload: an encoded batch, the child's own container, or None
#: when the child returned None this step.
Payload: TypeAlias = "EventBatch | KVConnectorKVEvents | None"


class WorkerReport:
    """One worker's contribution to one step.

    ``kinds[i]`` is the kind of child ``i``'s container (see ``rules``), or None
    when child ``i`` returned None; ``payloads[i]`` its encoded batch or, for
    native lanes, its own container (for a ``KIND_REFUSED`` lane, why the
    worker could not encode it); ``factors[i]`` the replication factors a
    Mooncake store container carried. ``seq`` counts the worker's reports (0
    for the first of its process, which also carries its ``settings``).
    """

    __slots__ = ("factors", "kinds", "payloads", "rank", "seq", "settings")

    def __init__(
        self,
        rank: int,
        kinds: tuple[str | None, ...],
        payloads: tuple[Payload, ...],
        factors: tuple[tuple[int, ...] | None, ...],
        seq: int = 0,
        settings: WorkerSettings | None = None,
    ) -> None:
        if not (len(kinds) == len(payloads) == len(factors)):
            raise ValueError("kinds, payloads and factors must have one entry per lane")
        self.rank = rank
        self.kinds = kinds
        self.payloads = payloads
        self.factors = factors
        self.seq = seq
        self.settings = settings

    def problem(self) -> str | None:
        """Why the scheduler cannot use this report at all, or None.

        Reports arrive unchecked (unpickling never raises, see ``_from_wire``):
        this is where a report another kvmerge, or a damaged message, made is
        caught, before any of it is merged.
        """
        if type(self.rank) is not int or type(self.seq) is not int:
            return f"rank {self.rank!r} / seq {self.seq!r} are not integers"
        kinds, payloads, factors = self.kinds, self.payloads, self.factors
        if not (
            type(kinds) is tuple and type(payloads) is tuple and type(factors) is tuple
        ):
            return "kinds, payloads and factors are not tuples"
        if not (len(kinds) == len(payloads) == len(factors)):
            return "kinds, payloads and factors have different lengths"
        return None

    def lane_problem(self, lane: int) -> str | None:
        """Why lane ``lane`` of this report cannot be merged, or None."""
        kind, payload = self.kinds[lane], self.payloads[lane]
        factors = self.factors[lane]
        if kind is None:
            return None if payload is None else "a payload without a kind"
        if type(kind) is not str:
            return f"a lane kind of type {type(kind).__name__}"
        if kind == KIND_REFUSED:
            return f"the worker could not encode it: {str(payload)[:500]}"
        if kind == KIND_NATIVE:
            if isinstance(payload, KVConnectorKVEvents):
                return None
            return f"a native lane carries {type(payload).__name__}"
        if kind not in ENCODED_KINDS:
            return f"an unknown lane kind {kind[:50]!r}"
        if factors is not None and not (
            type(factors) is tuple
            and factors
            and all(type(f) is int and f >= 1 for f in factors)
        ):
            return f"replication factors {str(factors)[:100]} are not positive ints"
        if not isinstance(payload, EventBatch):
            return f"a {kind} lane carries {type(payload).__name__}, not EventBatch"
        return payload.error

    @property
    def num_lanes(self) -> int:
        return len(self.kinds)

    def decode(self, peers: Sequence[WorkerReport] = ()) -> list[KVCacheEvent]:
        """Every lane's events as objects, in lane order (not on the hot path).

        A batch that left bytes to other ranks gets them from ``peers`` (the
        other workers' reports of the same step); ``IncompleteBatchError`` if
        none of them carries an event's bytes.
        """
        events: list[KVCacheEvent] = []
        for lane, (kind, payload) in enumerate(
            zip(self.kinds, self.payloads, strict=True)
        ):
            if payload is None:
                continue
            if kind == KIND_NATIVE:
                events.extend(payload.get_all_events())  # type: ignore[union-attr]
                continue
            assert isinstance(payload, EventBatch)
            if payload.elided:
                sources = [
                    p.payloads[lane]
                    for p in peers
                    if lane < p.num_lanes and isinstance(p.payloads[lane], EventBatch)
                ]
                payload = payload.filled(sources)  # type: ignore[arg-type]
            events.extend(payload.decode())
        return events

    def __reduce__(self) -> tuple[Any, ...]:
        return (_from_wire, self._wire())

    def _wire(self) -> tuple[Any, ...]:
        """The fields as pickled: each encoded batch as the ``PickleBuffer``
        of its bytes, and the lanes that hold one last, for ``_from_wire``
        to rebuild them (``EventBatch._from_pickle``). A batch met before in
        this report travels once: later lanes hold the index of the first
        (an out-of-band ``PickleBuffer`` is not memoized). One
        reconstructor per message, not one per batch: each global an
        unpickler finds costs an import lookup, which at decode-size steps
        was most of a report's cost."""
        payloads = self.payloads
        lanes = []
        first: dict[int, int] = {}
        wire: list[Any] = list(payloads)
        for i, payload in enumerate(payloads):
            if type(payload) is EventBatch:
                at = first.get(id(payload))
                if at is None:
                    first[id(payload)] = i
                    wire[i] = PickleBuffer(payload)  # type: ignore[arg-type]
                else:
                    wire[i] = at
                lanes.append(i)
        return (
            self.rank,
            self.kinds,
            tuple(wire) if lanes else payloads,
            self.factors,
            self.seq,
            self.settings,
            tuple(lanes),
        )

    def __repr__(self) -> str:
        lanes = ", ".join(
            "None"
            if p is None
            else (f"{k}:{len(p)}" if isinstance(p, EventBatch) else f"{k}:{p!r}")
            for k, p in zip(self.kinds, self.payloads, strict=True)
        )
        return f"<WorkerReport rank={self.rank} lanes=[{lanes}]>"


def _from_wire(*fields: Any) -> WorkerReport:
    """A report as pickled, unchecked: unpickling runs inside vLLM's message
    queue, where an exception is fatal to the engine; ``WorkerReport.problem``
    checks it where one worker's report can be dropped.

    A seventh field names the lanes whose payloads are a batch's bytes
    (``WorkerReport._wire``): rebuilt with ``EventBatch._from_pickle``, which
    never raises either (bad bytes give a batch whose ``error`` says why)."""
    report = object.__new__(WorkerReport)
    n = len(fields)
    if n == 7:
        (
            report.rank,
            report.kinds,
            payloads,
            report.factors,
            report.seq,
            report.settings,
            lanes,
        ) = fields
        report.payloads = _rebuild(payloads, lanes)
        return report
    values = (*fields, *((None,) * 6))[:6]
    (
        report.rank,
        report.kinds,
        report.payloads,
        report.factors,
        report.seq,
        report.settings,
    ) = values
    return report


def _rebuild(payloads: Any, lanes: Any) -> Any:
    """The payloads with each named lane's buffer made a batch again, and
    each lane that names an earlier one given that lane's batch; as they
    came if the lanes are not a tuple of in-range ints (the report's checks
    then refuse them)."""
    if not lanes or type(payloads) is not tuple or type(lanes) is not tuple:
        return payloads
    out = list(payloads)
    n = len(out)
    for i in lanes:
        if type(i) is not int or not 0 <= i < n:
            return payloads
        buffer = out[i]
        if type(buffer) is int:
            # The batch of an earlier lane (left as it is if that is none).
            if 0 <= buffer < i and type(out[buffer]) is EventBatch:
                out[i] = out[buffer]
        else:
            out[i] = _batch_from_pickle(buffer)
    return tuple(out)


class WorkerReports(Sequence[KVCacheEvent]):
    """What ``KVMergeKVEvents.get_all_events()`` returns.

    As a sequence it holds the decoded events of every report (all lanes, in
    report then lane order), decoded once on first use. ``KVMergeKVEvents``
    never uses it that way: it reads ``.reports``.
    """

    __slots__ = ("_decoded", "reports")

    def __init__(self, reports: Sequence[WorkerReport]) -> None:
        self.reports: tuple[WorkerReport, ...] = tuple(reports)
        self._decoded: list[KVCacheEvent] | None = None

    def _events(self) -> list[KVCacheEvent]:
        if self._decoded is None:
            decoded: list[KVCacheEvent] = []
            for report in self.reports:
                decoded.extend(report.decode(self.reports))
            self._decoded = decoded
        return self._decoded

    @overload
    def __getitem__(self, index: int) -> KVCacheEvent: ...
    @overload
    def __getitem__(self, index: slice) -> list[KVCacheEvent]: ...
    def __getitem__(self, index: int | slice) -> KVCacheEvent | list[KVCacheEvent]:
        return self._events()[index]

    def __len__(self) -> int:
        return len(self._events())

    def __iter__(self) -> Iterator[KVCacheEvent]:
        return iter(self._events())

    def __reduce__(self) -> tuple[Any, ...]:
        # By report, never by event: pickling does not decode.
        return (WorkerReports, (self.reports,))

    def __repr__(self) -> str:
        return f"<WorkerReports ranks={[r.rank for r in self.reports]}>"


class KVMergeKVEvents(KVConnectorKVEvents):
    """The KVMergeMultiConnector container: one worker report per worker."""

    __slots__ = ("_num_workers", "_reports")

    def __init__(
        self, reports: Sequence[WorkerReport] = (), num_workers: int = 1
    ) -> None:
        if num_workers <= 0:
            raise ValueError("num_workers must be greater than zero.")
        self._reports: list[WorkerReport] = list(reports)
        self._num_workers = num_workers

    @classmethod
    def for_worker(cls, report: WorkerReport) -> KVMergeKVEvents:
        return cls((report,), num_workers=1)

    @property
    def reports(self) -> tuple[WorkerReport, ...]:
        """The reports gathered so far, in the order they were added."""
        return tuple(self._reports)

    # --- KVConnectorKVEvents -------------------------------------------------
    def add_events(self, events: Sequence[KVCacheEvent]) -> None:  # type: ignore[override]
        """Take over another container's reports (``get_all_events()`` of a
        ``KVMergeKVEvents``), without decoding them."""
        if isinstance(events, WorkerReports):
            self._reports.extend(events.reports)
            return
        if isinstance(events, Sequence) and len(events) == 0:
            return
        raise TypeError(
            "KVMergeKVEvents.add_events takes another KVMergeKVEvents' "
            f"get_all_events(), not {type(events).__name__}: events must be "
            "encoded on the worker that saw them"
        )

    def aggregate(self) -> KVMergeKVEvents:
        """A no-op: the scheduler-side ``kvmerge.Merger`` does the merging, with
        state across steps that a per-step container cannot hold."""
        return self

    def increment_workers(self, count: int = 1) -> None:
        if count <= 0:
            raise ValueError("count must be positive.")
        self._num_workers += count

    def get_all_events(self) -> WorkerReports:  # type: ignore[override]
        return WorkerReports(self._reports)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._reports.clear()
        self._num_workers = 1

    # --- Python protocol -----------------------------------------------------
    def __bool__(self) -> bool:
        # Always true, also when empty: vLLM drops falsy containers
        # (``KVConnectorOutput.is_empty``, ``KVOutputAggregator``), and an empty
        # container must still reach the scheduler so that the worker counts.
        return True

    def __reduce__(self) -> tuple[Any, ...]:
        reports = self._reports
        if not all(type(r) is WorkerReport for r in reports):
            return (KVMergeKVEvents, (tuple(reports), self._num_workers))
        # One global for the whole message (see WorkerReport._wire).
        return (
            _events_from_wire,
            (self._num_workers, tuple(r._wire() for r in reports)),
        )

    def __repr__(self) -> str:
        return (
            f"<KVMergeKVEvents workers={self._num_workers} reports={self._reports!r}>"
        )


def _events_from_wire(num_workers: Any = 1, reports: Any = (), *_: Any) -> Any:
    """``KVMergeKVEvents.__reduce__``'s reconstructor: never raises (see
    ``_from_wire``); what is not a report's fields stays as it came, for the
    scheduler to refuse."""
    events = object.__new__(KVMergeKVEvents)
    events._num_workers = (
        num_workers if type(num_workers) is int and num_workers > 0 else 1
    )
    if type(reports) is tuple:
        events._reports = [_from_wire(*r) if type(r) is tuple else r for r in reports]
    else:
        events._reports = [reports]
    return events
