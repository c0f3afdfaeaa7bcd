"""Compiled core of kvmerge (Rust, PyO3). Import from `kvmerge`, not from here."""

from collections.abc import Sequence
from typing import Any, Literal, final

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = [
    "FACTORS_KEY",
    "MERGE_KEY",
    "CapacityError",
    "ChildConfig",
    "ChildStep",
    "ConfigError",
    "CorruptBatchError",
    "EventBatch",
    "GroupError",
    "IncompleteBatchError",
    "InvalidEventError",
    "KVMergeError",
    "Merger",
    "MergerStats",
    "OutputMerger",
    "RankError",
    "Refusal",
    "StepResult",
    "WorkerOutput",
    "WorkerSettings",
    "_borrow_buffers",
    "_layout",
    "_refusal_kinds",
    "encode",
]

#: The version of the kvmerge-py crate, the Cargo workspace's version.
__version__: str

#: The key of a child's rule in its `kv_connector_extra_config`.
MERGE_KEY: str
#: The key of a child's replication factors (rule "quorum").
FACTORS_KEY: str

_Event = BlockStored | BlockRemoved | AllBlocksCleared
_Rule = Literal["all", "quorum", "any"]
#: A child's rule: a merger's, or its own container's ("native").
_ChildRule = Literal["all", "quorum", "any", "native"]
_EventClass = Literal["BlockStored", "BlockRemoved", "AllBlocksCleared"]
#: The names of `_refusal_kinds()`, in its order (tests/plugin/test_refusals.py).
_RefusalKind = Literal[
    "output",
    "rank",
    "duplicate",
    "settings",
    "misconfigured",
    "children",
    "encode",
    "native",
    "family",
    "factors",
    "batch",
    "merge",
]

# The exceptions' docstrings are written here only: the extension's build
# (rust/kvmerge-py/build.rs) gives them to the classes it makes at run time.
class KVMergeError(Exception):
    """Base of every error kvmerge raises."""

class CorruptBatchError(KVMergeError, ValueError):
    """A batch buffer is truncated, corrupted or not a kvmerge batch."""

class InvalidEventError(KVMergeError, TypeError):
    """`encode` got something that is not a vLLM KV cache event of a known shape."""

class ConfigError(KVMergeError, ValueError):
    """A `Merger` setting is invalid."""

class RankError(KVMergeError, ValueError):
    """A rank outside the world, or a rank added twice in one step."""

class GroupError(KVMergeError, ValueError):
    """A `BlockStored.group_idx` without a replication factor (rule "quorum")."""

class IncompleteBatchError(KVMergeError, ValueError):
    """A batch that does not carry all of its events' bytes (other ranks carry
    them): it can be merged, not read."""

class CapacityError(KVMergeError, ValueError):
    """A batch the merger cannot take: with it, one step's merged output could
    exceed a batch's 4 GiB limit (`Merger.add`; drop the batch)."""

@final
class EventBatch:
    """An immutable, encoded batch of KV cache events with their identities.

    Supports the buffer protocol (its bytes are the wire format) and pickles
    as an out-of-band `pickle.PickleBuffer` with protocol 5.

    Unpickling never raises for bad bytes: it gives an *invalid* batch, whose
    `error` says why. Every other use of an invalid batch (`Merger.add`,
    `add_all`, `decode`, `raw`, `kinds`, `take`, `len`, `bytes`, `nbytes`,
    the buffer protocol, pickling...) raises `CorruptBatchError` with that
    message (`BufferError` for the buffer protocol), as `from_buffer` would
    have; `repr` does not.
    """

    @staticmethod
    def from_buffer(buffer: Any) -> EventBatch:
        """A batch of a received buffer: borrowed if immutable (exact bytes, or
        read-only inside `kvmerge.borrow_buffers()`), else copied. Raises
        `CorruptBatchError` for bad bytes, `TypeError` for a non-buffer."""

    @property
    def error(self) -> str | None:
        """Why this batch, unpickled from bad bytes, is not one (the message its
        uses raise as `CorruptBatchError`); None for a valid batch."""

    @staticmethod
    def empty() -> EventBatch: ...
    def decode(self) -> list[_Event]:
        """The events, equal to the encoded ones, in order."""

    def raw(self) -> list[msgspec.Raw]:
        """Each event's msgpack encoding, ready for a msgspec encoder: a
        read-only view of this batch's bytes (nothing copied), which keeps
        them alive."""

    def filled(self, sources: Sequence[EventBatch]) -> EventBatch:
        """This batch with the bytes it does not carry taken from `sources` (other
        ranks' batches of the same step and child), by identity."""

    def kinds(self) -> list[_EventClass]:
        """Each event's class name ("BlockStored", "BlockRemoved" or
        "AllBlocksCleared"), without decoding."""

    def indices(self, kind: _EventClass) -> list[int]:
        """The indices of the events of class `kind`, in order, without
        decoding (`ValueError` for another name)."""

    def take(self, indices: Sequence[int]) -> EventBatch:
        """A new batch of the events at `indices`, in that order, without decoding."""

    @staticmethod
    def concat(batches: Sequence[EventBatch]) -> EventBatch:
        """One batch of all the events of `batches`, in order, without decoding:
        e.g. a rank's salvaged earlier output followed by its current one, to add
        as that rank's single batch of the step."""

    def identities(self) -> list[bytes]:
        """Each event's 16-byte identity."""

    @property
    def uncarried(self) -> int:
        """How many events' bytes this batch does not carry (other ranks carry
        them: `encode` with a rank): such a batch can be merged, not read."""

    @property
    def nbytes(self) -> int: ...
    def __len__(self) -> int: ...
    def __bytes__(self) -> bytes: ...
    def __reduce_ex__(self, protocol: Any, /) -> tuple[Any, ...]: ...

@final
class MergerStats:
    steps: int
    batches: int
    reports: int
    published: int
    consumed: int
    cleared: int
    expired: int
    pending: int
    withheld: int
    """Publications the guard withheld (the three below together)."""
    withheld_orphan: int
    withheld_duplicate: int
    withheld_unknown: int
    def as_dict(self) -> dict[str, int]: ...

@final
class Merger:
    """Merges per-rank event batches into events published once."""

    def __new__(
        cls,
        world_size: int,
        rule: _Rule = "all",
        replication_factors: Sequence[int] | None = None,
        max_pending_steps: int = 32,
        guard: bool = False,
    ) -> Merger: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rule(self) -> _Rule: ...
    @property
    def replication_factors(self) -> list[int] | None: ...
    @property
    def max_pending_steps(self) -> int: ...
    @property
    def guard(self) -> bool:
        """Whether each published event a router cannot apply is withheld
        and counted (docs/merge-rules.md, "Guard")."""
    @property
    def step(self) -> int:
        """The number of the step now being collected."""

    def add(self, rank: int, batch: EventBatch) -> None:
        """Add `rank`'s batch of this step. Raises (the merger unchanged)
        `CorruptBatchError` for an invalid batch (`EventBatch.error`),
        `RankError`, `GroupError`, `ConfigError` (bytes this rank must carry and
        does not), or `CapacityError` when the pending reports would carry
        more bytes than one step's output can hold (4 GiB)."""

    def add_all(self, batches: Sequence[tuple[int, EventBatch]]) -> None:
        """Add several ranks' batches at once: all of them, or none on error."""

    def finish_step(self) -> list[_Event]: ...
    def finish_step_raw(self) -> list[msgspec.Raw]:
        """`finish_step`, each event's msgpack encoding a read-only view of
        it in the batch it came in (nothing copied; it keeps that batch's
        buffer alive)."""
    def finish_step_raw_and_decode(
        self, kind: _EventClass
    ) -> tuple[list[msgspec.Raw], list[_Event]]:
        """`finish_step_raw`, and the published events of class `kind`
        decoded, in order: for a hook that reads one kind, without a copy of
        the step's events (`ValueError` for another name, before the step is
        finished)."""

    def finish_step_batch(self) -> EventBatch: ...
    def stats(self) -> MergerStats: ...
    def reset(self) -> None:
        """Drop every pending report and the current step's batches, and
        what the guard holds (counters stay)."""

def _borrow_buffers(enter: bool) -> None:
    """Open or close a `kvmerge.borrow_buffers()` block on this thread."""

def _layout() -> str | None:
    """How `encode` reads lists and ints: in place as `"sized"` (CPython
    3.11) or `"tagged"` (3.12 to 3.14), None through the stable ABI."""

@final
class WorkerSettings:
    """What a worker believes (rank aside, the scheduler's own): sent with a
    worker process's first output, compared by the scheduler."""

    def __new__(
        cls,
        kvmerge_version: str,
        world_size: int,
        rank: int,
        kv_events: bool,
        children: Sequence[tuple[str, str | None, Sequence[int] | None]],
    ) -> WorkerSettings: ...
    @property
    def kvmerge_version(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def kv_events(self) -> bool: ...
    @property
    def children(
        self,
    ) -> tuple[tuple[str, str | None, tuple[int, ...] | None], ...]:
        """Per child, in config order: its label, configured rule (None:
        inferred) and configured replication factors."""

    def differences(self, worker: WorkerSettings, rank: int) -> list[str]:
        """Each setting in which `worker`'s (from an output of `rank`)
        differs from these: `"setting: worker ..., scheduler ..."`."""

    def __eq__(self, value: object, /) -> bool: ...
    __hash__: None  # type: ignore[assignment]

#: What a worker sends for one child: nothing (None), why it could not
#: encode the child's events (str), its encoded batch with the child's family
#: and the replication factors its container reported, or a native child's
#: own container.
_Entry = None | str | tuple[str, EventBatch, tuple[int, ...] | None] | Any

@final
class WorkerOutput:
    """What one worker sends the scheduler for one step: one buffer, and a
    native child's container beside it. Its fields are read back only off
    the step path (tests, `decode`); the step reads the buffer, in Rust."""

    def __new__(
        cls,
        rank: int,
        seq: int,
        entries: Sequence[_Entry],
        settings: WorkerSettings | None = None,
    ) -> WorkerOutput:
        """`ValueError` when a value does not fit the buffer (a family name
        or over 255 factors, a batch over 4 GiB, over 65,535 children) or a
        batch does not read; `TypeError` for an entry of another shape."""

    @staticmethod
    def for_step(
        rank: int,
        seq: int,
        entries: Sequence[_Entry],
        settings: WorkerSettings | None = None,
    ) -> WorkerOutput:
        """The worker's step path's form: a child's entry the constructor
        would raise for becomes that child's refusal (`its entry cannot be
        sent: ...`), which the scheduler counts and logs with the rank.
        `ValueError` only for what no entry causes (over 65,535 children,
        settings that do not fit)."""

    @staticmethod
    def _from_wire(
        buffer: object = None, natives: object = None, *_rest: object
    ) -> WorkerOutput:
        """The pickle reconstructor; never raises: a damaged buffer makes an
        output whose `damage` says why."""

    def _wire(self, protocol: int) -> tuple[Any, Any]:
        """What `_from_wire` takes: the buffer (a `PickleBuffer` from
        protocol 5) and the natives."""

    def __reduce_ex__(self, protocol: Any, /) -> tuple[Any, ...]: ...
    @property
    def rank(self) -> int | None:
        """None for a damaged buffer whose header ends before it."""

    @property
    def seq(self) -> int | None: ...
    @property
    def settings(self) -> WorkerSettings | None:
        """The worker's settings: its first output's only."""

    @property
    def nbytes(self) -> int:
        """The bytes of its buffer: what travels, beside any native
        container (0 for a damaged output)."""

    @property
    def damage(self) -> str | None:
        """Why the buffer is not an output (unpickled from a damaged message)."""

    @property
    def entries(self) -> tuple[EventBatch | str | Any, ...]:
        """Per child: its batch (one that does not read comes back as an
        `EventBatch` whose `error` says why), the worker's reason, a native
        child's container, or None. Empty for a damaged output."""

    @property
    def families(self) -> tuple[str | None, ...]:
        """Per child: the family of its batch, else None."""

    @property
    def factors(self) -> tuple[tuple[int, ...] | None, ...]:
        """Per child: the replication factors its batch's container
        reported, else None."""

@final
class Refusal:
    """What the step refused: `kind` (one of `_refusal_kinds()`), the `rank`
    that sent it (None when unknown), the `child` (None: the whole output,
    every child), and the `detail` the log shows."""

    @property
    def kind(self) -> _RefusalKind: ...
    @property
    def rank(self) -> int | None: ...
    @property
    def child(self) -> int | None: ...
    @property
    def detail(self) -> str: ...

@final
class ChildStep:
    """What one step gave one child of an `OutputMerger`."""

    @property
    def events(self) -> list[Any] | None:
        """A merged child's events that became complete (`msgspec.Raw` views,
        or objects); None for a native child, before it has a merger, or when
        they are lost."""

    @property
    def removed(self) -> list[BlockRemoved] | None:
        """For a child with a removal hook whose events are views: its
        `BlockRemoved` events decoded (the hook's input); else None."""

    @property
    def natives(self) -> list[tuple[int, Any]] | None:
        """A native child's containers, `(rank, container)` in rank order;
        None for any other child."""

    @property
    def lost(self) -> str | None:
        """Why this step's merged events are lost (they do not decode), or
        None."""

    @property
    def started(self) -> bool:
        """Whether this step made the child's merger (from a first batch)."""

@final
class StepResult:
    """One step of an `OutputMerger`."""

    @property
    def step(self) -> int:
        """This step's number (0 for the merger's first): the one every log
        line, metric and refusal about it names."""

    @property
    def ranks(self) -> list[int]:
        """The ranks whose outputs were taken, ascending."""

    @property
    def children(self) -> list[ChildStep]:
        """Per child, in config order: what the step gave it."""

    @property
    def refusals(self) -> list[Refusal]:
        """Every refusal of the step: whole outputs first, then child by
        child."""

    @property
    def gaps(self) -> list[tuple[int, int, int]]:
        """`(rank, first, last)`: a rank's outputs `first..last` (by `seq`)
        that never arrived."""

    @property
    def expired(self) -> int:
        """Reports that expired in this step, over all children."""

@final
class ChildConfig:
    """A child's configured rule (None: inferred from its container's
    family) and replication factors, checked once for the worker and the
    scheduler (`kvmerge_core::step::ChildConfig`). `ConfigError` naming the
    setting when they cannot work: a rule that is none, factors that are not
    a non-empty list of integers >= 1, factors for a rule other than
    "quorum"."""

    def __new__(cls, rule: object = None, factors: object = None) -> ChildConfig: ...
    @property
    def rule(self) -> _ChildRule | None: ...
    @property
    def factors(self) -> tuple[int, ...] | None: ...
    def rule_for(self, implied: _ChildRule) -> _ChildRule:
        """The rule for a container whose family implies `implied`: the
        configured one wins."""

    def plan(
        self, implied: _ChildRule, reported: Sequence[int] | None = None
    ) -> tuple[_Rule, tuple[int, ...] | None] | None:
        """How a container whose family implies `implied`, and which reported
        `reported` factors, is merged: its rule and the factors "quorum" uses
        (configured factors win); None when no merger takes it (rule
        "native", or "quorum" without valid factors)."""

@final
class OutputMerger:
    """`KVMergeMultiConnector`'s scheduler step: every check of the workers'
    outputs and of each child's part of them, and every merge, in one call
    (`kvmerge_core::step`).

    `settings` are what every worker should believe (rank -1): the world
    size, and each child's label, rule and factors. `families` maps each
    encoded family to the rule it implies; `native_type` is vLLM's
    `KVConnectorKVEvents`; `hooks` says per child whether its scheduler has a
    removal hook; `objects` whether merged events leave as objects (else as
    views). `ConfigError` (naming the child and the setting) when a
    configured merger cannot be made."""

    def __new__(
        cls,
        settings: WorkerSettings,
        max_pending_steps: int,
        families: dict[str, _ChildRule],
        native_type: type,
        hooks: Sequence[bool],
        *,
        objects: bool = False,
        guard: bool = True,
    ) -> OutputMerger: ...
    def step(self, outputs: Sequence[object]) -> StepResult:
        """One step's outputs, as they arrived (anything in an output's
        place is refused). Never raises for what they hold, except
        `ConfigError` on the first step when a worker's settings differ
        from the scheduler's (start-up: nothing is changed)."""

    @property
    def steps(self) -> int:
        """How many steps it has merged."""

    def stats(self) -> list[MergerStats | None]:
        """Per child: its merger's counters, None before it has one."""

    def describe(self, index: int) -> str | None:
        """How child `index` merges (rule, factors and where they came
        from, world size, max_pending_steps); None without a merger."""

    def reset(self) -> None:
        """Every merger drops its pending state (`Merger.reset`)."""

def _refusal_kinds() -> list[tuple[str, str]]:
    """Every kind of `Refusal`, with what it means, in declaration order."""

def encode(
    events: Sequence[_Event],
    *,
    rank: int | None = None,
    world_size: int | None = None,
    rule: _Rule = "all",
    replication_factors: Sequence[int] | None = None,
) -> EventBatch:
    """Encode vLLM KV cache events into a batch (identities computed here).

    Fields vLLM 0.33.0 does not have (a later vLLM's, or those of a subclass
    tagged as its vLLM base) travel verbatim and take part in the identity.

    With `rank` and `world_size` (and the merger's `rule` and
    `replication_factors`), the batch does not carry the bytes of the events
    other ranks are bound to carry; every event's record stays.
    """
