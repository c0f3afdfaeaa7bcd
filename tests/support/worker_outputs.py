"""Worker outputs as a damaged message could deliver them, for the tests of
the scheduler's step path (``tests/plugin/test_step_path_hostile.py``,
``test_worker_output.py``, ``test_refusals.py``).

A ``WorkerOutput`` travels as one buffer (``rust/kvmerge-core/src/step/wire.rs``);
these helpers damage a real one's buffer (cut, a byte flipped, bytes
appended, a byte flipped inside one child's batch) and rebuild the output
with the pickle reconstructor, ``WorkerOutput._from_wire``, as unpickling
a damaged message would.
"""

from __future__ import annotations

from typing import Any

from kvmerge import EventBatch
from kvmerge._kvmerge import WorkerOutput
from kvmerge.vllm import register
from support.vllm_harness import Bus, Cluster, any_child, child, stored

#: The first byte after the rank (bytes 8..16 of the header): a buffer cut
#: here or later still names its rank.
RANK_END = 16


def buffer_of(output: WorkerOutput) -> bytes:
    """The buffer ``output`` travels as (in band, as protocols 0-4 send it)."""
    buffer, _natives = output._wire(4)
    return bytes(buffer)


def natives_of(output: WorkerOutput) -> Any:
    """What travels beside the buffer: None, or per child its native container."""
    return output._wire(4)[1]


def received(buffer: Any, natives: Any = None) -> WorkerOutput:
    """The output unpickling makes of ``buffer`` (never raises)."""
    return WorkerOutput._from_wire(buffer, natives)


def batches_at(output: WorkerOutput) -> int:
    """Where ``output``'s batches start in its buffer: all after the header."""
    sizes = sum(e.nbytes for e in output.entries if isinstance(e, EventBatch))
    return len(buffer_of(output)) - sizes


def batch_range(output: WorkerOutput, index: int) -> range:
    """The bytes of child ``index``'s batch in ``output``'s buffer (batches
    follow the header in child order)."""
    at = batches_at(output)
    for i, entry in enumerate(output.entries):
        if not isinstance(entry, EventBatch):
            continue
        if i == index:
            return range(at, at + entry.nbytes)
        at += entry.nbytes
    raise ValueError(f"child {index} of {output!r} holds no batch")


def cut(output: WorkerOutput, at: int) -> WorkerOutput:
    return received(buffer_of(output)[:at], natives_of(output))


def flipped(output: WorkerOutput, at: int) -> WorkerOutput:
    data = bytearray(buffer_of(output))
    data[at] ^= 0xFF
    return received(bytes(data), natives_of(output))


def extended(output: WorkerOutput, extra: bytes) -> WorkerOutput:
    return received(buffer_of(output) + extra, natives_of(output))


def with_damaged_batch(output: WorkerOutput, index: int) -> WorkerOutput:
    """``output`` with a byte in the middle of child ``index``'s batch flipped:
    the header still reads, that batch does not (its checksum)."""
    span = batch_range(output, index)
    return flipped(output, span[len(span) // 2])


def started_cluster(bus: Bus) -> Cluster:
    """TP 2: UMBP's child (or its stand-in) under rule "any", with its removal
    hook, then LMCache's under "all"; one step taken, so past start-up (a
    worker's settings that differ are refused, not raised)."""
    register()
    c = Cluster([any_child(kv_events_merge="any"), child("LMCacheChild")], bus, tp=2)
    for r in range(2):
        c.emit(r, 0, [stored(1)])
    assert c.step() == [stored(1)]
    return c
