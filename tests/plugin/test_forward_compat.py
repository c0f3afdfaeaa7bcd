"""Events with fields vLLM 0.33.0 does not have (issue 11, item 4).

The next vLLM may add an optional field to ``BlockStored`` or
``BlockRemoved``. Its events must still be encoded, merged by their whole
bytes and published byte for byte, under every rule; decoding gives the known
fields and ignores the others, as msgspec does. A later vLLM's events are
stood in for by subclasses of today's classes, tagged as their bases, with
extra defaulted fields.
"""

from __future__ import annotations

import pickle

import msgspec
import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

import kvmerge
from kvmerge import EventBatch, InvalidEventError, Merger
from kvmerge.vllm.families import available_names


class FutureStored(BlockStored, tag="BlockStored"):
    priority: int | None = None
    tier_hints: dict[str, list[int]] | None = None


class FutureRemoved(BlockRemoved, tag="BlockRemoved"):
    reason: str | None = None


class FutureCleared(AllBlocksCleared, tag="AllBlocksCleared"):
    epoch: int = 0


KNOWN = {
    FutureStored: BlockStored,
    FutureRemoved: BlockRemoved,
    FutureCleared: AllBlocksCleared,
}


def plain_stored(
    h: int, group: int | None = None, *, cls: type[BlockStored] = BlockStored, **extra
) -> BlockStored:
    """A store of block ``h`` (4 tokens) as ``cls``, ``extra`` its own fields."""
    return cls(
        block_hashes=[h],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        group_idx=group,
        **extra,
    )


def future_stored(h: int, group: int | None = None, **extra) -> BlockStored:
    return plain_stored(h, group, cls=FutureStored, **extra)


def known(event):
    """What vLLM 0.33.0 decodes of ``event``: its own class, known fields."""
    base = KNOWN.get(type(event), type(event))
    names = base.__struct_fields__
    return base(**{n: getattr(event, n) for n in names})


# One step's common sequence: every kind, extra fields set and at defaults.
SEQ = [
    future_stored(1, group=0, priority=3, tier_hints={"ssd": [1, 2]}),
    future_stored(2, group=1, priority=7),
    future_stored(3, group=0),  # the extra fields at their defaults: omitted
    FutureRemoved(block_hashes=[1], medium="GPU", reason="evicted"),
    FutureCleared(epoch=2),
    future_stored(4, group=1, tier_hints={}),
]
WORLD = 4
FACTORS = {"quorum": [1, 2]}


def oob_roundtrip(batch: EventBatch) -> EventBatch:
    """Pickled as vLLM's shm MessageQueue does: protocol 5, out of band."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert buffers, "the batch's bytes travel out of band"
    return pickle.loads(data, buffers=[bytes(b.raw()) for b in buffers])


def encoded(events) -> list[bytes]:
    return [msgspec.msgpack.encode(e) for e in events]


def test_encode_keeps_every_byte_and_decode_the_known_fields():
    batch = kvmerge.encode(SEQ)
    raw = [bytes(r) for r in batch.raw()]
    assert raw == encoded(SEQ)
    assert b"priority" in raw[0] and b"tier_hints" in raw[0] and b"reason" in raw[3]
    assert batch.kinds() == [KNOWN[type(e)].__name__ for e in SEQ]
    assert batch.decode() == [known(e) for e in SEQ]
    back = oob_roundtrip(batch)
    assert bytes(back) == bytes(batch) and back.decode() == batch.decode()


def test_the_extra_field_takes_part_in_the_identity():
    with_extra = kvmerge.encode([future_stored(1, priority=3)]).identities()
    at_default = kvmerge.encode([future_stored(1)]).identities()
    plain = kvmerge.encode([plain_stored(1)]).identities()
    # A default is omitted, as msgspec omits vLLM's: the same bytes, the same
    # identity; a value set makes another event.
    assert at_default == plain and with_extra != plain
    m = Merger(2, "all", max_pending_steps=0)
    m.add(0, kvmerge.encode([future_stored(1, priority=3), future_stored(2)]))
    m.add(1, kvmerge.encode([plain_stored(1), plain_stored(2)]))
    assert [bytes(r) for r in m.finish_step_raw()] == encoded([plain_stored(2)])
    assert m.stats().expired == 2


def reports(rule: str, identical: bool) -> list[list]:
    """Each rank's events: the common sequence, and unless ``identical`` an
    event of the rank's own first (so the merger takes its general path)."""
    if identical:
        return [list(SEQ) for _ in range(WORLD)]
    return [[future_stored(100 + r, priority=r), *SEQ] for r in range(WORLD)]


def expected(rule: str, identical: bool) -> list:
    own = [] if identical or rule != "any" else reports(rule, False)
    firsts = [evs[0] for evs in own]
    return [*firsts, *SEQ] if firsts else list(SEQ)


@pytest.mark.parametrize("rule", ["all", "quorum", "any"])
@pytest.mark.parametrize("identical", [True, False], ids=["identical", "general"])
@pytest.mark.parametrize("lean", [False, True], ids=["full", "lean"])
def test_merged_and_published_byte_for_byte(rule, identical, lean):
    factors = FACTORS.get(rule)
    raw_m = Merger(WORLD, rule, factors, max_pending_steps=0)
    obj_m = Merger(WORLD, rule, factors, max_pending_steps=0)
    uncarried = 0
    for rank, events in enumerate(reports(rule, identical)):
        if lean:
            batch = kvmerge.encode(
                events,
                rank=rank,
                world_size=WORLD,
                rule=rule,
                replication_factors=factors,
            )
        else:
            batch = kvmerge.encode(events)
        uncarried += batch.uncarried
        batch = oob_roundtrip(batch)
        raw_m.add(rank, batch)
        obj_m.add(rank, batch)
    if lean and rule != "any":
        assert uncarried > 0
    want = expected(rule, identical)
    raw = raw_m.finish_step_raw()
    assert [bytes(r) for r in raw] == encoded(want)
    assert obj_m.finish_step() == [known(e) for e in want]
    # What a subscriber of vLLM's publisher decodes of the published batch.
    payload = msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=raw))
    got = msgspec.msgpack.decode(payload, type=KVEventBatch)
    assert got.events == [known(e) for e in want]
    stats = raw_m.stats()
    assert stats.pending == 0
    assert stats.reports == stats.consumed + stats.cleared + stats.expired


def test_concat_and_take_keep_the_extra_bytes():
    a, b = kvmerge.encode(SEQ[:2]), kvmerge.encode(SEQ[2:])
    both = EventBatch.concat([a, b])
    assert [bytes(r) for r in both.raw()] == encoded(SEQ)
    assert [bytes(r) for r in both.take([3, 0]).raw()] == encoded([SEQ[3], SEQ[0]])


class OwnTag(BlockRemoved, tag="OwnTag"):
    reason: str | None = None


class OtherTagField(BlockRemoved, tag="BlockRemoved", tag_field="kind"):
    pass


class AsArray(BlockRemoved, tag="BlockRemoved", array_like=True):
    pass


@pytest.mark.parametrize(
    ("event", "needle"),
    [
        (OwnTag(block_hashes=[1], medium=None), 'tagged "OwnTag"'),
        (OtherTagField(block_hashes=[1], medium=None), 'in field "kind"'),
        (AsArray(block_hashes=[1], medium=None), "expected a map"),
        (FutureRemoved(block_hashes=(1,), medium=None), "block_hashes"),
        (FutureRemoved(block_hashes=[1], medium=3), "BlockRemoved.medium"),
        (FutureRemoved(block_hashes=[1], medium=None, reason=object()), "encode"),
        (future_stored(1, priority=2**64), "encode"),
    ],
)
def test_only_malformed_events_are_refused(event, needle):
    with pytest.raises(InvalidEventError, match=needle):
        kvmerge.encode([event])


# --- through the real vLLM connector ------------------------------------------


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("name", "extra", "events"),
    [
        ("LMCacheChild", {}, [SEQ[0], SEQ[1], SEQ[3]]),
        ("MooncakeChild", {"test_factors": [1, 2]}, [SEQ[0], SEQ[1], SEQ[3]]),
        pytest.param(
            "UMBPChild",
            {},
            [SEQ[0], SEQ[1], SEQ[3]],
            marks=pytest.mark.skipif(
                "umbp" not in available_names(), reason="no UMBP in this vLLM"
            ),
        ),
    ],
)
def test_through_kvmerge_multi_connector(bus, name, extra, events):
    """Children emitting such events through KVMergeMultiConnector: the
    merged ``take_events()`` output holds their bytes, and vLLM's publisher
    sends them to subscribers, who decode the known fields."""
    from support.vllm_harness import Cluster, child

    from kvmerge.vllm import register

    register()
    c = Cluster([child(name, **extra)], bus, tp=2, kv_events_output="raw")
    for r in range(2):
        c.emit(r, 0, events)
    out = c.schedule(c.aggregate())
    assert all(type(e) is msgspec.Raw for e in out)
    assert [bytes(e) for e in out] == encoded(events)
    assert c.bus.publish(out) == [known(e) for e in events]
