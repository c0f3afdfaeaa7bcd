"""``kvmerge.encode`` writes vLLM's events itself (``rust/kvmerge-py/src/write.rs``)
and leaves what it cannot write to msgspec, event by event. Both must give the
same bytes, or two ranks would disagree on an event's identity: each event's
bytes here are compared with msgspec's, and each batch with the one the same
events make through msgspec (instances of subclasses that encode as vLLM's
classes do, which the writer leaves to msgspec).
"""

from __future__ import annotations

import enum

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.strategies import block_stored, events
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

import kvmerge


class _Stored(BlockStored, tag="BlockStored"):
    pass


class _Removed(BlockRemoved, tag="BlockRemoved"):
    pass


class _Cleared(AllBlocksCleared, tag="AllBlocksCleared"):
    pass


_VIA_MSGSPEC = {
    BlockStored: _Stored,
    BlockRemoved: _Removed,
    AllBlocksCleared: _Cleared,
}


def via_msgspec(event: object) -> object:
    """The same event as an instance the writer leaves to msgspec."""
    cls = type(event)
    return _VIA_MSGSPEC[cls](**{f: getattr(event, f) for f in cls.__struct_fields__})


def assert_written_as_msgspec(evs: list[object]) -> None:
    batch = kvmerge.encode(evs)
    assert [bytes(r) for r in batch.raw()] == [msgspec.msgpack.encode(e) for e in evs]
    assert bytes(batch) == bytes(kvmerge.encode([via_msgspec(e) for e in evs]))
    for rule, factors in (("all", None), ("quorum", [1, 2, 4])):
        for rank in range(4):
            kw = {"rank": rank, "world_size": 4, "rule": rule}
            if factors:
                kw["replication_factors"] = factors
            try:
                want = bytes(kvmerge.encode([via_msgspec(e) for e in evs], **kw))
            except kvmerge.GroupError:
                # A group beyond the factors: refused either way.
                with pytest.raises(kvmerge.GroupError):
                    kvmerge.encode(evs, **kw)
                continue
            assert bytes(kvmerge.encode(evs, **kw)) == want


@settings(max_examples=300)
@given(st.lists(events(), max_size=20))
def test_every_event_is_written_as_msgspec_writes_it(evs):
    assert_written_as_msgspec(evs)


@settings(max_examples=100)
@given(st.lists(events(), min_size=1, max_size=10), st.data())
def test_events_left_to_msgspec_mix_with_written_ones(evs, data):
    mixed = [
        via_msgspec(e) if data.draw(st.booleans(), label=f"msgspec {i}") else e
        for i, e in enumerate(evs)
    ]
    assert bytes(kvmerge.encode(mixed)) == bytes(kvmerge.encode(evs))


# Each msgpack width and its edges: a wrong bound writes a longer or shorter
# form than msgspec's (same value, other bytes, other identity).
EDGES = [
    0, 1, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, 2**63 - 1, 2**63,
    2**64 - 1, -1, -32, -33, -128, -129, -32_768, -32_769, -(2**31), -(2**31) - 1,
    -(2**63),
]  # fmt: skip
LENGTHS = [0, 1, 31, 32, 255, 256, 65_535, 65_536]


def test_every_int_width_and_its_edges():
    stored = BlockStored(
        block_hashes=EDGES,
        parent_block_hash=2**64 - 1,
        token_ids=EDGES,
        block_size=-(2**63),
        lora_id=2**63,
        medium=None,
        lora_name=None,
        group_idx=2**64 - 1,
        lookahead_token_ids=[EDGES, []],
    )
    assert_written_as_msgspec([stored])


@pytest.mark.parametrize("n", LENGTHS)
def test_every_str_and_bin_length(n):
    assert_written_as_msgspec(
        [
            BlockRemoved(block_hashes=[b"\xff" * n], medium="é" * (n // 2)),
            BlockStored(
                block_hashes=[],
                parent_block_hash=b"x" * n,
                token_ids=[],
                block_size=16,
                lora_id=None,
                medium="x" * n,
                lora_name="🙂" * (n // 4),
                session_id="",
            ),
        ]
    )


def test_values_of_other_types_go_to_msgspec_and_encode_alike():
    """An int subclass, extra_keys of any kind: msgspec's to write; the bytes
    are those of the plain values. A str subclass msgspec refuses."""

    class Token(enum.IntEnum):
        A = 7

    class Name(str):
        pass

    def stored(**kw):
        base = {
            "block_hashes": [1],
            "parent_block_hash": None,
            "token_ids": [7, 8],
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        return BlockStored(**{**base, **kw})

    odd = stored(token_ids=[Token.A, 8])
    assert bytes(kvmerge.encode([odd])) == bytes(kvmerge.encode([stored()]))
    with pytest.raises(kvmerge.InvalidEventError, match="type Name is unsupported"):
        kvmerge.encode([stored(medium=Name("GPU"))])
    keyed = [
        stored(extra_keys=[("lora", 1, b"\x00", None, 1.5)]),
        stored(extra_keys=[None, ()]),
        stored(extra_keys=[]),
    ]
    assert_written_as_msgspec(keyed)


def test_refusals_name_the_event_and_leave_nothing_half_written():
    good = BlockRemoved(block_hashes=[1], medium=None)
    bad = [
        BlockRemoved(block_hashes=[2**64], medium=None),  # beyond 64 bits
        BlockRemoved(block_hashes=[True], medium=None),  # a bool, not an int
        BlockRemoved(block_hashes=[1], medium="\udc80"),  # not UTF-8
        BlockRemoved(block_hashes=(1,), medium=None),  # a tuple for a list
    ]
    for b in bad:
        with pytest.raises(kvmerge.InvalidEventError, match=r"^event 1: "):
            kvmerge.encode([good, b, good])
    assert bytes(kvmerge.encode([good, good])) == bytes(
        kvmerge.encode([via_msgspec(good), via_msgspec(good)])
    )


@settings(max_examples=50)
@given(st.lists(block_stored(), min_size=1, max_size=5))
def test_large_batches_written_without_the_gil_match_too(evs):
    """Past 256 KiB the batch is built with the GIL released."""
    many = evs * (300_000 // max(1, len(msgspec.msgpack.encode(evs))) + 1)
    assert bytes(kvmerge.encode(many)) == bytes(
        kvmerge.encode([via_msgspec(e) for e in many])
    )
