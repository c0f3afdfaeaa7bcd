"""Compiled core of kvmerge (Rust, PyO3). Import from `kvmerge`, not from here."""

from collections.abc import Sequence
from typing import Any, Literal, final

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = [
    "CapacityError",
    "ConfigError",
    "CorruptBatchError",
    "EventBatch",
    "GroupError",
    "IncompleteBatchError",
    "InvalidEventError",
    "KVMergeError",
    "Merger",
    "MergerStats",
    "RankError",
    "_borrow_buffers",
    "_expired",
    "_layout",
    "_merge_children",
    "_merge_common_step",
    "_pack",
    "_unpack",
    "encode",
]

#: The version of the kvmerge-py crate, the Cargo workspace's version.
__version__: str

_Event = BlockStored | BlockRemoved | AllBlocksCleared
_Rule = Literal["all", "quorum", "any"]
_EventClass = Literal["BlockStored", "BlockRemoved", "AllBlocksCleared"]

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
        """Drop every pending report and the current step's batches (counters stay)."""

def _borrow_buffers(enter: bool) -> None:
    """Open or close a `kvmerge.borrow_buffers()` block on this thread."""

def _layout() -> str | None:
    """How `encode` reads lists and ints: in place as `"sized"` (CPython
    3.11) or `"tagged"` (3.12 to 3.14), None through the stable ABI."""

def _merge_children(
    outputs: Sequence[Any],
    plans: Sequence[
        tuple[int, str, tuple[int, ...] | None, Merger, _EventClass | None] | None
    ],
) -> list[
    tuple[list[msgspec.Raw], list[_Event] | None] | KVMergeError | Literal[False] | None
]:
    """`KVMergeMultiConnector`'s step for its children in the common case.

    Per plan (a child's position in each output, its family, replication
    factors, merger, and the kind of events its hook reads), when every
    output (a checked `WorkerOutput`) holds a valid batch of that family for
    the child (reporting no factors or these) or nothing: adds them all and
    finishes the step, giving its events as `finish_step_raw` does and those
    of the kind decoded (None when no kind is given), or, when those do not
    decode, the `CorruptBatchError` that lost the step's events (returned,
    not raised). None for a child with anything else in an output, and
    for one whose merger refuses the batches (left unchanged): the caller
    merges those itself. For a plan that is None (plans are in child
    order), False when no output holds anything for its child, else None."""

def _merge_common_step(
    outputs: Sequence[Any],
    plans: Sequence[
        tuple[int, str, tuple[int, ...] | None, Merger, _EventClass | None] | None
    ],
    output_type: type,
    last_seq: dict[int, int],
    misconfigured: set[int],
) -> (
    tuple[
        list[Any],
        list[int],
        list[
            tuple[list[msgspec.Raw], list[_Event] | None]
            | KVMergeError
            | Literal[False]
            | None
        ],
    ]
    | None
):
    """`KVMergeMultiConnector`'s whole step in the common case, from the
    outputs as they arrived (unchecked).

    When every output is exactly of `output_type` (`WorkerOutput`), with no
    settings, an int rank and `seq`, one entry per plan in each of its
    tuples (or still packed, `_packed`, in a readable buffer with one entry
    per plan), a rank seen once in the step, not in `misconfigured`, and the
    `seq` after the one `last_seq` holds for that rank: records each rank's
    `seq` in `last_seq` and returns the outputs in rank order, their ranks,
    and `_merge_children`'s result for them. Otherwise None, and nothing is
    changed: the caller checks the outputs one by one."""

def _pack(
    rank: object,
    seq: object,
    settings: object,
    families: object,
    entries: object,
    factors: object,
) -> bytes | None:
    """A worker output's fields in one buffer, as a message carries it: None
    unless it has no settings, an int rank and `seq`, tuples of one entry per
    child, and for each child either nothing (no family, entry nor factors)
    or a family name, a valid `EventBatch` and no factors or a tuple of ints;
    and unless the buffer would exceed 64 KiB (larger outputs send each
    batch as its own buffer, without a copy)."""

def _unpack(
    packed: object,
) -> tuple[
    int | None,
    int | None,
    tuple[str | None, ...],
    tuple[EventBatch | None, ...],
    tuple[tuple[int, ...] | None, ...],
    str | None,
]:
    """`_pack`'s fields back: rank, seq, families, entries, factors, and None;
    never raises for what it is given. For a damaged buffer: its rank when
    the header got that far (else None), None, three empty tuples, and why.
    A batch that does not validate comes back as an `EventBatch` whose
    `error` says why."""

def _expired(mergers: Sequence[Merger | None]) -> int:
    """The mergers' `stats().expired`, summed (None: no merger)."""

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
