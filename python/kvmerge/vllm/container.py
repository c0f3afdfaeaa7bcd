"""The container a worker hands to the scheduler: one per worker per step.

``KVMergeKVEvents`` implements vLLM's ``KVConnectorKVEvents`` so that
``KVOutputAggregator.aggregate`` combines the containers of all workers with
its usual calls::

    acc.add_events(other.get_all_events())
    acc.increment_workers(1)

``get_all_events()`` returns a ``WorkerOutputs``: a lazy, read-only sequence
that carries the workers' outputs (rank + one encoded batch per child) and
only decodes events if somebody iterates or indexes it. ``add_events``
recognises it and takes the outputs over as they are, so no event object is
built between a worker's ``kvmerge.encode`` and the scheduler's merge.

Pickling (the executor's shm ``MessageQueue`` pickles with the highest protocol
and a ``buffer_callback``) sends what a worker sends, one output, packed: its
rank, ``seq``, families, replication factors and batches in one buffer
(``_pack``; layout in ``rust/kvmerge-py/src/packed.rs``), a protocol-5
``PickleBuffer``. On receipt the buffer
is kept as it came (``_events_from_packed``): the connector's common step reads
it in Rust, and Python code that reads a field unpacks it first
(``WorkerOutput._unpack``). An output that does not pack (its first, with the
worker's settings; a native child's container; a batch the worker could not
encode; over 64 KiB, where packing would copy the batches once more) travels
as tuples, each ``EventBatch`` as a ``PickleBuffer`` of its
wire bytes, rebuilt unchecked (``EventBatch._from_pickle``: a damaged one
remembers why in ``.error``) by ``_from_wire``. Neither reconstructor raises:
unpickling runs inside vLLM's message queue, where an exception is fatal, and
the scheduler side drops just that output.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from operator import index
from pickle import PickleBuffer
from typing import Any, SupportsIndex, TypeAlias, overload

from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents

from kvmerge import EventBatch
from kvmerge._kvmerge import _pack, _unpack

from .families import ENCODED, FAMILY_NATIVE, FAMILY_REFUSED, Family
from .settings import WorkerSettings

#: The entries of an output as pickled, their batches rebuilt
#: (``EventBatch._from_pickle`` for each, in one call; never raises; not in
#: the stubs).
_entries_from_pickle = EventBatch._from_pickle_entries  # type: ignore[attr-defined]

#: The first pickle protocol with out-of-band buffers (``PickleBuffer``).
_OUT_OF_BAND_PROTOCOL = 5

#: What a worker sends for one child: its encoded batch, its own container
#: (a native child), why the worker could not encode its events (family
#: ``FAMILY_REFUSED``), or None when the child returned None this step.
Entry: TypeAlias = "EventBatch | KVConnectorKVEvents | str | None"


class WorkerOutput:
    """What one worker sends for one step.

    ``families[i]`` is the family of child ``i``'s container (see ``config``), or
    None when child ``i`` returned None; ``entries[i]`` its encoded batch or,
    for a native child, its own container (for family ``FAMILY_REFUSED``, why the
    worker could not encode it); ``factors[i]`` the replication factors a
    Mooncake store container carried. ``seq`` counts the worker's outputs (0
    for the first of its process, which also carries its ``settings``).
    """

    __slots__ = (
        "_damage",
        "_packed",
        "entries",
        "factors",
        "families",
        "rank",
        "seq",
        "settings",
    )

    def __init__(
        self,
        rank: int,
        families: tuple[Family | None, ...],
        entries: tuple[Entry, ...],
        factors: tuple[tuple[int, ...] | None, ...],
        seq: int = 0,
        settings: WorkerSettings | None = None,
    ) -> None:
        if not (len(families) == len(entries) == len(factors)):
            raise ValueError(
                "families, entries and factors must have one entry per child"
            )
        self.rank = rank
        self.families = families
        self.entries = entries
        self.factors = factors
        self.seq = seq
        self.settings = settings
        self._packed: Any = None
        self._damage: str | None = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for a field not set: an output that arrived packed
        # (``_events_from_packed``) has none until Python code reads one.
        if name in _FIELDS and self._packed is not None:
            self._unpack()
            return getattr(self, name)
        raise AttributeError(name)

    def _unpack(self) -> None:
        """Sets the fields from the packed buffer (``_unpack``: never raises;
        a damaged buffer leaves why in ``_damage``), which is then dropped:
        from here on the fields are the output, also for the step."""
        packed, self._packed = self._packed, None
        # Unchecked, as _from_wire's: ``problem`` checks them.
        fields: Any = _unpack(packed)
        (
            self.rank,
            self.seq,
            self.families,
            self.entries,
            self.factors,
            self._damage,
        ) = fields
        self.settings = None

    def problem(self) -> str | None:
        """Why the scheduler cannot use this output at all, or None.

        Outputs arrive unchecked (unpickling never raises, see ``_from_wire``):
        this is where an output another kvmerge, or a damaged message, made is
        caught, before any of it is merged.
        """
        if self._packed is not None:
            self._unpack()
        if self._damage is not None:
            return self._damage
        if type(self.rank) is not int or type(self.seq) is not int:
            return f"rank {self.rank!r} / seq {self.seq!r} are not integers"
        families, entries, factors = self.families, self.entries, self.factors
        if not (
            type(families) is tuple
            and type(entries) is tuple
            and type(factors) is tuple
        ):
            return "families, entries and factors are not tuples"
        if not (len(families) == len(entries) == len(factors)):
            return "families, entries and factors have different lengths"
        return None

    def child_problem(self, index: int) -> str | None:
        """Why what this output holds for child ``index`` cannot be merged, or
        None."""
        family, entry = self.families[index], self.entries[index]
        factors = self.factors[index]
        if family is None:
            return None if entry is None else "an entry without a family"
        if type(family) is not str:
            return f"a container family of type {type(family).__name__}"
        if family == FAMILY_REFUSED:
            return f"the worker could not encode it: {str(entry)[:500]}"
        if family == FAMILY_NATIVE:
            if isinstance(entry, KVConnectorKVEvents):
                return None
            return f"a native child's container is a {type(entry).__name__}"
        if family not in ENCODED:
            return f"an unknown container family {family[:50]!r}"
        if factors is not None and not (
            type(factors) is tuple
            and factors
            and all(type(f) is int and f >= 1 for f in factors)
        ):
            return f"replication factors {str(factors)[:100]} are not positive ints"
        if not isinstance(entry, EventBatch):
            return f"a {family} batch is a {type(entry).__name__}, not an EventBatch"
        return entry.error

    @property
    def num_children(self) -> int:
        return len(self.families)

    def decode(self, peers: Sequence[WorkerOutput] = ()) -> list[KVCacheEvent]:
        """Every child's events as objects, in child order (not on the hot
        path).

        A batch that does not carry all its events' bytes gets them from
        ``peers`` (the other workers' outputs of the same step);
        ``IncompleteBatchError`` if none of them carries an event's bytes.
        """
        events: list[KVCacheEvent] = []
        for i, (family, entry) in enumerate(
            zip(self.families, self.entries, strict=True)
        ):
            if entry is None:
                continue
            if family == FAMILY_NATIVE:
                assert isinstance(entry, KVConnectorKVEvents)
                events.extend(entry.get_all_events())
                continue
            assert isinstance(entry, EventBatch)
            if entry.uncarried:
                sources = [
                    batch
                    for p in peers
                    if i < p.num_children
                    and isinstance(batch := p.entries[i], EventBatch)
                ]
                entry = entry.filled(sources)
            events.extend(entry.decode())
        return events

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        return (_from_wire, self._wire(protocol))

    def _packed_form(self) -> Any:
        """This output in one buffer (see ``_pack``), or None when it has
        settings or an entry that is not a valid batch, or is large: those
        travel as ``_wire``'s tuples."""
        if self._packed is not None:
            return self._packed
        return _pack(
            self.rank,
            self.seq,
            self.settings,
            self.families,
            self.entries,
            self.factors,
        )

    def _wire(self, protocol: SupportsIndex = 5) -> tuple[Any, ...]:
        """The fields as pickled: each encoded batch as the ``PickleBuffer`` of
        its bytes (from protocol 5; before, the batch itself), and the indices
        of the children that hold one last, for ``_from_wire`` to rebuild them
        (``EventBatch._from_pickle``). A batch met before in this output
        travels once: later children hold the index of the first (an
        out-of-band ``PickleBuffer`` is not memoized). One reconstructor per
        message, not one per batch: each global an unpickler finds costs an
        import lookup, which at decode-size steps was most of an output's
        cost."""
        entries = self.entries
        out_of_band = index(protocol) >= _OUT_OF_BAND_PROTOCOL
        batches = []
        first: dict[int, int] = {}
        wire: list[Any] = list(entries)
        for i, entry in enumerate(entries):
            if type(entry) is EventBatch:
                at = first.get(id(entry))
                if at is None:
                    first[id(entry)] = i
                    wire[i] = PickleBuffer(entry) if out_of_band else entry  # type: ignore[arg-type]
                else:
                    wire[i] = at
                batches.append(i)
        return (
            self.rank,
            self.families,
            tuple(wire) if batches else entries,
            self.factors,
            self.seq,
            self.settings,
            tuple(batches),
        )

    def __repr__(self) -> str:
        children = ", ".join(
            "None"
            if p is None
            else (f"{k}:{len(p)}" if isinstance(p, EventBatch) else f"{k}:{p!r}")
            for k, p in zip(self.families, self.entries, strict=True)
        )
        return f"<WorkerOutput rank={self.rank} children=[{children}]>"


#: ``WorkerOutput``'s fields, which an output that arrived packed sets on
#: first use.
_FIELDS = frozenset(WorkerOutput.__slots__) - {"_damage", "_packed"}


def _from_wire(*fields: Any) -> WorkerOutput:
    """An output as pickled, unchecked: unpickling runs inside vLLM's message
    queue, where an exception is fatal to the engine; ``WorkerOutput.problem``
    checks it where one worker's output can be dropped.

    A seventh field names the children whose entries are a batch's bytes
    (``WorkerOutput._wire``): rebuilt by ``EventBatch._from_pickle_entries``,
    which never raises either (bad bytes give a batch whose ``error`` says
    why)."""
    output = object.__new__(WorkerOutput)
    output._packed = output._damage = None
    if len(fields) == 7:
        (
            output.rank,
            output.families,
            entries,
            output.factors,
            output.seq,
            output.settings,
            batches,
        ) = fields
        output.entries = _entries_from_pickle(entries, batches) if batches else entries
        return output
    (
        output.rank,
        output.families,
        output.entries,
        output.factors,
        output.seq,
        output.settings,
    ) = (*fields, *((None,) * 6))[:6]
    return output


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
                decoded.extend(output.decode(self.outputs))
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

    def __init__(
        self, outputs: Sequence[WorkerOutput] = (), num_workers: int = 1
    ) -> None:
        if num_workers <= 0:
            raise ValueError("num_workers must be greater than zero.")
        self._outputs: list[WorkerOutput] = list(outputs)
        self._num_workers = num_workers

    @classmethod
    def for_worker(cls, output: WorkerOutput) -> KVMergeKVEvents:
        return cls((output,), num_workers=1)

    @property
    def outputs(self) -> tuple[WorkerOutput, ...]:
        """The outputs gathered so far, in the order they were added."""
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
        if len(outputs) == 1 and self._num_workers == 1:
            # What every worker sends: one output, packed when it can be.
            packed = (
                outputs[0]._packed_form() if type(outputs[0]) is WorkerOutput else None
            )
            if packed is not None:
                if index(protocol) >= _OUT_OF_BAND_PROTOCOL:
                    packed = PickleBuffer(packed)
                return (_events_from_packed, (packed,))
        if not all(type(o) is WorkerOutput for o in outputs):
            return (KVMergeKVEvents, (tuple(outputs), self._num_workers))
        # One global for the whole message (see WorkerOutput._wire).
        return (
            _events_from_wire,
            (self._num_workers, tuple(o._wire(protocol) for o in outputs)),
        )

    def __repr__(self) -> str:
        return (
            f"<KVMergeKVEvents workers={self._num_workers} outputs={self._outputs!r}>"
        )


def _events_from_packed(packed: Any = None, *_: Any) -> KVMergeKVEvents:
    """``KVMergeKVEvents.__reduce_ex__``'s reconstructor for one packed output:
    the buffer is kept as it came, unread (``WorkerOutput._packed``). The
    connector's step reads it where it merges; Python code that reads a
    field unpacks it first. Never raises, whatever a damaged message passes
    (no buffer at all unpacks as a damaged one)."""
    output = object.__new__(WorkerOutput)
    output._packed = b"" if packed is None else packed
    output._damage = None
    events = object.__new__(KVMergeKVEvents)
    events._num_workers = 1
    events._outputs = [output]
    return events


def _events_from_wire(num_workers: Any = 1, outputs: Any = (), *_: Any) -> Any:
    """``KVMergeKVEvents.__reduce_ex__``'s reconstructor: never raises (see
    ``_from_wire``); what is not an output's fields stays as it came, for the
    scheduler to refuse."""
    events = object.__new__(KVMergeKVEvents)
    events._num_workers = (
        num_workers if type(num_workers) is int and num_workers > 0 else 1
    )
    if type(outputs) is tuple:
        if len(outputs) == 1 and type(outputs[0]) is tuple:
            # One worker's output: every message a worker sends.
            events._outputs = [_from_wire(*outputs[0])]
        else:
            events._outputs = [
                _from_wire(*o) if type(o) is tuple else o for o in outputs
            ]
    else:
        events._outputs = [outputs]
    return events
