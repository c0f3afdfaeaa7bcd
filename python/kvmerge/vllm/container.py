"""The container a worker hands to the scheduler: one per worker per step.

``KVMergeKVEvents`` implements vLLM's ``KVConnectorKVEvents`` so that
``KVOutputAggregator.aggregate`` combines the containers of all workers with
its usual calls::

    acc.add_events(other.get_all_events())
    acc.increment_workers(1)

``get_all_events()`` returns a ``WorkerOutputs``: a lazy, read-only sequence
that carries the workers' outputs and only decodes events if somebody
iterates or indexes it. ``add_events`` recognises it and takes the outputs
over as they are, so no event object is built between a worker's
``kvmerge.encode`` and the scheduler's merge.

A ``WorkerOutput`` (``kvmerge._kvmerge``) is one buffer: the worker's rank,
``seq``, first-step settings and, per child, its encoded batch (layout in
``rust/kvmerge-core/src/step/wire.rs``), with a native child's container beside it.
Pickled (the executor's shm ``MessageQueue`` pickles with the highest
protocol and a ``buffer_callback``), a message is one reconstructor and, per
output, its buffer as a protocol-5 ``PickleBuffer`` and its natives. Neither
reconstructor raises: unpickling runs inside vLLM's message queue, where an
exception is fatal, and the scheduler's step drops just the damaged output.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, SupportsIndex, overload

from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents

from kvmerge import EventBatch
from kvmerge._kvmerge import WorkerOutput

__all__ = ["KVMergeKVEvents", "WorkerOutput", "WorkerOutputs", "decode"]

#: ``WorkerOutput``'s pickle reconstructor (never raises; not in the docs).
_output_from_wire = WorkerOutput._from_wire


def decode(output: WorkerOutput, peers: Sequence[WorkerOutput] = ()) -> list[Any]:
    """Every child's events of ``output`` as objects, in child order (not on
    the step path: tests and the lazy ``WorkerOutputs``).

    A batch that does not carry all its events' bytes gets them from
    ``peers`` (the other workers' outputs of the same step);
    ``IncompleteBatchError`` if none of them carries an event's bytes.
    """
    events: list[Any] = []
    for i, entry in enumerate(output.entries):
        if entry is None or isinstance(entry, str):
            continue
        if not isinstance(entry, EventBatch):
            events.extend(entry.get_all_events())
            continue
        if entry.uncarried:
            sources: list[EventBatch] = []
            for peer in peers:
                theirs = peer.entries[i] if i < len(peer.entries) else None
                if isinstance(theirs, EventBatch):
                    sources.append(theirs)
            entry = entry.filled(sources)
        events.extend(entry.decode())
    return events


class WorkerOutputs(Sequence[KVCacheEvent]):
    """What ``KVMergeKVEvents.get_all_events()`` returns.

    As a sequence it holds the decoded events of every output (all children,
    in output then child order), decoded once on first use.
    ``KVMergeKVEvents`` never uses it that way: it reads ``.outputs``.
    """

    __slots__ = ("_decoded", "outputs")

    def __init__(self, outputs: Sequence[WorkerOutput]) -> None:
        self.outputs: tuple[WorkerOutput, ...] = tuple(outputs)
        self._decoded: list[KVCacheEvent] | None = None

    def _events(self) -> list[KVCacheEvent]:
        if self._decoded is None:
            decoded: list[KVCacheEvent] = []
            for output in self.outputs:
                decoded.extend(decode(output, self.outputs))
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
        # By output, never by event: pickling does not decode.
        return (WorkerOutputs, (self.outputs,))

    def __repr__(self) -> str:
        return f"<WorkerOutputs ranks={[o.rank for o in self.outputs]}>"


class KVMergeKVEvents(KVConnectorKVEvents):
    """The KVMergeMultiConnector container: one worker output per worker."""

    __slots__ = ("_num_workers", "_outputs")

    def __init__(self, outputs: Sequence[Any] = (), num_workers: int = 1) -> None:
        if num_workers <= 0:
            raise ValueError("num_workers must be greater than zero.")
        self._outputs: list[Any] = list(outputs)
        self._num_workers = num_workers

    @classmethod
    def for_worker(cls, output: WorkerOutput) -> KVMergeKVEvents:
        return cls((output,), num_workers=1)

    @property
    def outputs(self) -> tuple[Any, ...]:
        """The outputs gathered so far, in the order they were added (what a
        damaged message delivered in an output's place included: the
        scheduler's step refuses it)."""
        return tuple(self._outputs)

    # --- KVConnectorKVEvents -------------------------------------------------
    def add_events(self, events: Sequence[KVCacheEvent]) -> None:
        """Take over another container's outputs (``get_all_events()`` of a
        ``KVMergeKVEvents``), without decoding them."""
        if isinstance(events, WorkerOutputs):
            self._outputs.extend(events.outputs)
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

    def get_all_events(self) -> WorkerOutputs:
        return WorkerOutputs(self._outputs)

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def clear_events(self) -> None:
        self._outputs.clear()
        self._num_workers = 1

    # --- Python protocol -----------------------------------------------------
    # No ``__bool__`` nor ``__len__``: always true, also when empty, without a
    # Python call. vLLM drops falsy containers (``KVConnectorOutput.is_empty``,
    # ``KVOutputAggregator``), and an empty container must still reach the
    # scheduler so that the worker counts.

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        outputs = self._outputs
        if not all(type(o) is WorkerOutput for o in outputs):
            return (KVMergeKVEvents, (tuple(outputs), self._num_workers))
        # One global for the whole message (each one an unpickler finds
        # costs an import lookup): the outputs' buffers and natives, flat.
        wire: list[Any] = [self._num_workers]
        for output in outputs:
            wire.extend(output._wire(protocol))
        return (_events_from_wire, tuple(wire))

    def __repr__(self) -> str:
        return (
            f"<KVMergeKVEvents workers={self._num_workers} outputs={self._outputs!r}>"
        )


def _events_from_wire(num_workers: Any = 1, *wire: Any) -> KVMergeKVEvents:
    """``KVMergeKVEvents.__reduce_ex__``'s reconstructor: each output from its
    buffer and natives (``WorkerOutput._from_wire``). Never raises, whatever
    a damaged message passes: a damaged output is the step's to refuse."""
    events = object.__new__(KVMergeKVEvents)
    events._num_workers = (
        num_workers if type(num_workers) is int and num_workers > 0 else 1
    )
    events._outputs = [
        _output_from_wire(*wire[i : i + 2]) for i in range(0, len(wire), 2)
    ]
    return events
