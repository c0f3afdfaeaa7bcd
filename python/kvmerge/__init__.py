"""kvmerge: merge vLLM KV-cache events from many workers, in Rust.

`encode` runs on each worker, `Merger` on the scheduler; `kvmerge.vllm` holds
the `KVMergeMultiConnector` that wires both into vLLM.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final, Literal, TypeAlias, get_args

from kvmerge._kvmerge import (
    CapacityError,
    ConfigError,
    CorruptBatchError,
    EventBatch,
    GroupError,
    IncompleteBatchError,
    InvalidEventError,
    KVMergeError,
    Merger,
    MergerStats,
    RankError,
    __version__,
    _borrow_buffers,
    encode,
)

__all__ = [
    "DEFAULT_MAX_PENDING_STEPS",
    "RULES",
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
    "Rule",
    "__version__",
    "borrow_buffers",
    "encode",
]

#: A rule a ``Merger`` applies (docs/merge-rules.md; the stubs' ``_Rule``).
Rule: TypeAlias = Literal["all", "quorum", "any"]
#: Every rule, in the order the docs give them.
RULES: Final[tuple[Rule, ...]] = get_args(Rule)
#: ``Merger``'s default ``max_pending_steps`` (the Rust core's), for the layers
#: that pass a setting on to it.
DEFAULT_MAX_PENDING_STEPS: Final[int] = Merger(1).max_pending_steps


@contextmanager
def borrow_buffers() -> Iterator[None]:
    """Within this block, on this thread, ``EventBatch.from_buffer`` (and so
    unpickling a batch) borrows every read-only buffer instead of copying it.

    The caller vouches that no such buffer changes while a batch made of it
    lives. That holds for what ``ray.get`` returns from Ray's object store (a
    sealed object, pinned while the batch holds its buffer); it does not hold
    for a Ray compiled graph's channel, which the next execution overwrites,
    nor for a read-only view of memory that someone else writes. Outside the
    block, ``bytes`` and ``EventBatch`` buffers are borrowed and everything
    else is copied once.
    """
    _borrow_buffers(True)
    try:
        yield
    finally:
        _borrow_buffers(False)
