"""One step's merged output is one batch, at most 4 GiB of events (32-bit
offsets). Issue 12: a merged step over that limit panicked in the core
(``PanicException``, a ``BaseException`` that kills vLLM's engine).

The merger now refuses, at ``add``, a report that would let the pending
reports carry more bytes than one output batch holds (``CapacityError``, a
``KVMergeError``: the connector drops that rank's report), with nothing
changed. The bound counts each batch's carried bytes once per report, so
these tests stay cheap: the same 4 MiB batch is added over and over (one
copy in memory), and the refusal comes before any 4 GiB output is built.
"""

from __future__ import annotations

import pytest
from vllm.distributed.kv_events import BlockRemoved

import kvmerge
from kvmerge import CapacityError, EventBatch, KVMergeError, Merger

HASHES = 466_034  # 9 bytes each: events of 4 MiB + ~40 bytes


def big_event() -> BlockRemoved:
    """A 4 MiB removal that rank 0 carries in a world of 2 (rule "all")."""
    for value in range(2**64 - 1, 2**64 - 200, -1):
        ev = BlockRemoved(block_hashes=[value] * HASHES, medium=None)
        if kvmerge.encode([ev], rank=1, world_size=2).uncarried == 1:
            return ev
    raise AssertionError("no hash value with rank 0 as the carrier")


@pytest.fixture(scope="module")
def big():
    return big_event()


def test_the_reported_case_is_refused_at_add_with_nothing_changed(big):
    """World 2, rule "all", max_pending_steps 1024: rank 0 adds the same
    one-event 4 MiB batch every step; 1,024 of them, completed at once by
    rank 1's 41 KB carrier batch, made a 4 GiB output. The 1,024th add is
    refused; the merger goes on."""
    m = Merger(2, "all", max_pending_steps=1024)
    batch = kvmerge.encode([big])
    assert 4 << 20 < batch.nbytes < (4 << 20) + 4096
    for _ in range(1023):
        m.add(0, batch)
        assert m.finish_step_raw() == []
    before, step = m.stats(), m.step
    with pytest.raises(CapacityError, match="drop this batch") as info:
        m.add(0, batch)
    assert isinstance(info.value, KVMergeError) and isinstance(info.value, ValueError)
    with pytest.raises(CapacityError):
        m.add_all([(1, EventBatch.empty()), (0, batch)])
    assert (m.stats(), m.step) == (before, step)
    # Rank 1's carrier batch: the bytes left to rank 0, 40 bytes a record.
    # (Encoding [big] * 1024 would msgspec-encode 4 GiB first: concatenate
    # the one-event carrier batch instead, which is the same batch.)
    one = kvmerge.encode([big], rank=1, world_size=2, rule="all")
    carrier = EventBatch.concat([one] * 1024)
    assert carrier.uncarried == 1024 and carrier.nbytes < 42_000
    # Filling it from rank 0's batch would be a 4 GiB batch: refused too,
    # before anything is allocated (was a panic in the gather).
    with pytest.raises(ValueError, match="4 GiB"):
        carrier.filled([batch])
    with pytest.raises(ValueError, match="4 GiB"):
        EventBatch.concat([batch] * 1024)
    # Two of rank 1's reports complete two of rank 0's: 8 MiB out.
    m.add(0, EventBatch.empty())
    m.add(1, carrier.take([0, 1]))
    out = m.finish_step_batch()
    assert len(out) == 2 and out.identities() == [batch.identities()[0]] * 2
    s = m.stats()
    assert s.published == 2 and s.pending == 1021
    assert s.reports == s.consumed + s.cleared + s.expired + s.pending
    m.reset()
    m.add(0, batch)  # room again


def test_every_output_path_is_bounded(big):
    """The bound holds for each rule and each way of closing a step: up to
    the limit everything is accepted, one report more is refused."""
    batch = kvmerge.encode([big])
    per = len(batch.raw()[0])
    fits = (2**32 - 1 - 5) // per
    for rule in ("all", "quorum", "any"):
        factors = [1] if rule == "quorum" else None
        m = Merger(2, rule, factors, max_pending_steps=2 * fits)
        if rule == "any":
            # Nothing waits under "any": the limit is one step's reports.
            reports = [(r, batch) for r in range(2)]
            m.add_all(reports)
            assert len(m.finish_step_raw()) == 1
            continue
        for _ in range(fits):
            m.add(0, batch)
            m.finish_step()
        with pytest.raises(CapacityError):
            m.add(0, batch)
        assert m.stats().pending == fits
