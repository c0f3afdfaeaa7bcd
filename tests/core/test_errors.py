"""Every bad input gets its own exception class, with a message naming it."""

import functools
import pickle

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import bad_inputs
from support.strategies import HAS_LOOKAHEAD, events
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

import kvmerge
from kvmerge import (
    ConfigError,
    CorruptBatchError,
    EventBatch,
    GroupError,
    InvalidEventError,
    KVMergeError,
    Merger,
    RankError,
)

#: A store of blocks 1 and 2 with three token ids; keywords replace fields.
stored = functools.partial(bad_inputs.stored, 1, 2, token_ids=[1, 2, 3])


GOOD = [stored(group_idx=0), BlockRemoved(block_hashes=[b"\x01"], medium=None)]


def test_hierarchy():
    for cls, std in [
        (CorruptBatchError, ValueError),
        (InvalidEventError, TypeError),
        (ConfigError, ValueError),
        (RankError, ValueError),
        (GroupError, ValueError),
    ]:
        assert issubclass(cls, KVMergeError) and issubclass(cls, std)
    assert issubclass(KVMergeError, Exception)


# -- corrupt buffers -----------------------------------------------------------


def wire(evs=GOOD):
    return bytes(kvmerge.encode(evs))


@given(st.lists(events(), max_size=4), st.data())
def test_every_truncation_is_detected(evs, data):
    good = wire(evs)
    cut = data.draw(st.integers(0, len(good) - 1))
    with pytest.raises(CorruptBatchError):
        EventBatch.from_buffer(good[:cut])


def test_truncated_message():
    good = wire()
    for cut in (0, 3, len(good) // 2, len(good) - 1):
        with pytest.raises(CorruptBatchError, match=r"(?i)truncat|short|length|size"):
            EventBatch.from_buffer(good[:cut])


@given(st.lists(events(), max_size=4), st.data())
def test_every_flipped_bit_is_detected(evs, data):
    good = bytearray(wire(evs))
    i = data.draw(st.integers(0, len(good) - 1), label="byte")
    good[i] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    with pytest.raises(CorruptBatchError):
        EventBatch.from_buffer(bytes(good))


def test_flipped_payload_byte_fails_the_checksum():
    evs = [BlockRemoved(block_hashes=[b"0123456789abcdef"], medium="GPU")]
    buf = bytearray(wire(evs))
    # Flip a byte inside the event's own msgpack bytes, not in any header.
    at = bytes(buf).index(b"0123456789abcdef") + 5
    buf[at] ^= 0xFF
    with pytest.raises(CorruptBatchError, match=r"(?i)checksum"):
        EventBatch.from_buffer(buf)


def test_wrong_magic():
    buf = bytearray(wire())
    buf[0] ^= 0xFF
    with pytest.raises(CorruptBatchError, match=r"(?i)magic|not a kvmerge"):
        EventBatch.from_buffer(buf)
    with pytest.raises(CorruptBatchError, match=r"(?i)magic|not a kvmerge"):
        EventBatch.from_buffer(msgspec.msgpack.encode(GOOD) * 4)


def test_trailing_garbage():
    with pytest.raises(CorruptBatchError):
        EventBatch.from_buffer(wire() + b"\x00")


def test_corrupt_out_of_band_pickle():
    buffers = []
    data = pickle.dumps(
        kvmerge.encode(GOOD), protocol=5, buffer_callback=buffers.append
    )
    with buffers[0].raw() as view:
        payload = bytearray(view)
    payload[-1] ^= 0x01
    # Unpickling runs inside vLLM's message queue: it never raises for the
    # bytes; the batch remembers why it is invalid, and using it raises.
    back = pickle.loads(data, buffers=[payload])
    assert back.error is not None and "checksum" in back.error
    with pytest.raises(CorruptBatchError, match="checksum"):
        kvmerge.Merger(1).add(0, back)
    with pytest.raises(CorruptBatchError, match="checksum"):
        back.decode()


def test_from_buffer_needs_a_buffer():
    for obj in ("text", 12, None, [1, 2]):
        with pytest.raises(TypeError):
            EventBatch.from_buffer(obj)


# -- encode --------------------------------------------------------------------


class NotAnEvent(msgspec.Struct, tag=True):
    block_hashes: list[int]


@pytest.mark.parametrize(
    ("obj", "name"),
    [
        ({"type": "AllBlocksCleared"}, "dict"),
        (42, "int"),
        (None, "None"),
        ("BlockStored", "str"),
        (NotAnEvent([1]), "NotAnEvent"),
        (AllBlocksCleared, "StructMeta|type"),  # the class, not an instance
    ],
)
def test_encode_rejects_non_events(obj, name):
    with pytest.raises(InvalidEventError, match=name):
        kvmerge.encode([*GOOD, obj])
    with pytest.raises(InvalidEventError):
        kvmerge.encode([obj])


def test_encode_rejects_a_non_sequence():
    with pytest.raises(TypeError):
        kvmerge.encode(AllBlocksCleared())


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (stored(block_hashes=[1.5]), "block_hashes"),
        (stored(block_hashes=[1, "a"]), "block_hashes"),
        (stored(block_hashes=None), "block_hashes"),
        (stored(token_ids=["a"]), "token_ids"),
        (stored(token_ids=[1, None]), "token_ids"),
        (stored(block_size="16"), "block_size"),
        (stored(parent_block_hash=1.0), "parent_block_hash"),
        (stored(medium=3), "medium"),
        (stored(group_idx="0"), "group_idx"),
        (stored(extra_keys=[["a", 1]]), "extra_keys"),
        # vLLM 0.32's BlockStored has no such field.
        *(
            [(stored(lookahead_token_ids=[[1.0]]), "lookahead_token_ids")]
            if HAS_LOOKAHEAD
            else []
        ),
        (BlockRemoved(block_hashes=[1], medium=b"GPU"), "medium"),
        (BlockRemoved(block_hashes=(1, 2), medium=None), "block_hashes"),
    ],
)
def test_encode_rejects_wrong_field_types(event, field):
    with pytest.raises(InvalidEventError, match=field):
        kvmerge.encode([event])


@pytest.mark.parametrize(
    "event",
    [
        stored(block_hashes=[2**64]),
        stored(block_hashes=[-(2**63) - 1]),
        stored(parent_block_hash=2**70),
        BlockRemoved(block_hashes=[1, 2**64], medium=None),
    ],
)
def test_encode_rejects_hashes_outside_64_bits(event):
    with pytest.raises(InvalidEventError, match=r"(?i)hash|range|64"):
        kvmerge.encode([event])


def test_encode_accepts_the_64_bit_extremes():
    evs = [stored(block_hashes=[2**64 - 1, -(2**63)], parent_block_hash=2**64 - 1)]
    assert kvmerge.encode(evs).decode() == evs


# -- Merger settings -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(world_size=0), "world_size"),
        (dict(world_size=-3), "world_size"),
        (dict(world_size=2, rule="majority"), "majority"),
        (dict(world_size=2, rule="ALL"), "ALL"),
        (dict(world_size=2, rule="quorum"), "replication_factors"),
        (dict(world_size=2, rule="quorum", replication_factors=[1, 0]), "factor"),
        (dict(world_size=2, rule="quorum", replication_factors=[-2]), "factor"),
        (dict(world_size=2, rule="all", replication_factors=[1]), "factor"),
        (dict(world_size=2, rule="any", replication_factors=[1]), "factor"),
        (dict(world_size=2, max_pending_steps=-1), "max_pending_steps"),
    ],
)
def test_config_errors(kwargs, pattern):
    with pytest.raises(ConfigError, match=pattern):
        Merger(**kwargs)


def test_config_defaults_and_properties():
    m = Merger(8, "quorum", (1, 4, 2), max_pending_steps=0)
    assert (m.world_size, m.rule, m.max_pending_steps, m.step) == (8, "quorum", 0, 0)
    assert m.replication_factors == [1, 4, 2]
    d = Merger(3)
    assert (d.rule, d.replication_factors, d.max_pending_steps) == ("all", None, 32)


# -- Merger.add ------------------------------------------------------------------


def bad_call_leaves_no_trace(m, world_size, call):
    """The failed call changes nothing: same stats, every other rank free."""
    before = m.stats().as_dict()
    call()
    assert m.stats().as_dict() == before
    for r in range(1, world_size):
        m.add(r, kvmerge.encode(GOOD))
    assert m.finish_step() == GOOD


@pytest.mark.parametrize("rank", [-1, 3, 4, -(2**40), 2**40])
def test_rank_outside_world(rank):
    m = Merger(3, "quorum", [1])
    m.add(0, kvmerge.encode(GOOD))

    def call():
        with pytest.raises(RankError, match=str(rank)):
            m.add(rank, kvmerge.encode(GOOD))

    bad_call_leaves_no_trace(m, 3, call)


def test_same_rank_twice_in_a_step():
    m = Merger(3, "quorum", [1])
    m.add(0, kvmerge.encode(GOOD))

    def call():
        with pytest.raises(RankError, match="0"):
            m.add(0, kvmerge.encode([]))

    bad_call_leaves_no_trace(m, 3, call)
    m.add(0, kvmerge.encode([]))  # a new step: rank 0 may add again


@pytest.mark.parametrize("group", [1, 2, 100, -1])
def test_group_outside_factors(group):
    m = Merger(3, "quorum", [1])
    m.add(0, kvmerge.encode(GOOD))
    bad = [*GOOD, stored(group_idx=group)]

    def call():
        with pytest.raises(GroupError, match=str(group)):
            m.add(1, kvmerge.encode(bad))

    bad_call_leaves_no_trace(m, 3, call)


def test_group_is_only_checked_for_quorum_stores():
    # Removals have factor 1 whatever their group; other rules take any group.
    m = Merger(2, "quorum", [1])
    m.add(0, kvmerge.encode([BlockRemoved(block_hashes=[1], medium=None, group_idx=9)]))
    for rule in ("all", "any"):
        Merger(2, rule).add(0, kvmerge.encode([stored(group_idx=9)]))


def test_add_needs_a_batch():
    m = Merger(2)
    with pytest.raises(TypeError):
        m.add(0, GOOD)
    m.add(0, kvmerge.encode(GOOD))  # the failed call did not use rank 0


def test_add_all_is_all_or_nothing():
    m = Merger(3, "quorum", [1])
    bad_group = [stored(group_idx=5)]
    for reports, error in [
        ([(0, GOOD), (1, GOOD), (3, GOOD)], RankError),
        ([(0, GOOD), (1, GOOD), (0, GOOD)], RankError),
        ([(0, GOOD), (1, bad_group)], GroupError),
    ]:
        before = m.stats().as_dict()
        with pytest.raises(error):
            m.add_all([(r, kvmerge.encode(evs)) for r, evs in reports])
        assert m.stats().as_dict() == before
    m.add_all([(r, kvmerge.encode(GOOD)) for r in (2, 0, 1)])
    assert m.finish_step() == GOOD


def test_a_bad_kind_leaves_the_step_unfinished():
    m = Merger(1)
    m.add(0, kvmerge.encode(GOOD))
    before = (m.step, m.stats().as_dict())
    with pytest.raises(ValueError, match="finish_step_raw_and_decode"):
        m.finish_step_raw_and_decode("KVCacheEvent")  # type: ignore[arg-type]
    assert (m.step, m.stats().as_dict()) == before
    raws, removed = m.finish_step_raw_and_decode("BlockStored")
    assert [bytes(r) for r in raws] == [bytes(r) for r in kvmerge.encode(GOOD).raw()]
    assert removed == [e for e in GOOD if type(e).__name__ == "BlockStored"]
