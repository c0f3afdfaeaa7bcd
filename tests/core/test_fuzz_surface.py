"""Hypothesis fuzzing of kvmerge's Python surface (issue 6).

The contract checked here, for any input:
- ``kvmerge.encode(x)`` raises ``InvalidEventError`` (a ``TypeError``), or
  returns a batch that holds exactly msgspec's encoding of the events (what
  vLLM's own publisher would send) and decodes back to them;
- ``EventBatch.from_buffer(b)`` for bytes that are not an intact batch raises
  ``CorruptBatchError``; ``pickle.loads`` of a batch whose carried bytes are
  damaged never raises (it runs inside vLLM's message queue): it returns an
  invalid batch whose ``error`` is ``from_buffer``'s message, and whose every
  use (``Merger.add``, ``add_all``, ``decode``, ...) raises that
  ``CorruptBatchError``, the merger unchanged; damage to the pickle stream
  itself gets pickle's own ``Exception``s at worst;
- ``Merger`` settings and ranks outside their ranges get ``ConfigError`` /
  ``RankError``, wrong argument types ``TypeError``;
- never a Rust panic: PyO3 raises those as ``PanicException``, a
  ``BaseException``, which none of the ``except Exception`` clauses below
  would swallow, so a panic fails the test.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import io
import pickle
import re
import sys
from pathlib import Path
from typing import Any

import msgspec
import msgspec.structs
import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from support import bad_inputs
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVConnectorKVEvents,
)

import kvmerge
from kvmerge import ConfigError, CorruptBatchError, EventBatch, InvalidEventError
from kvmerge._kvmerge import OutputMerger, WorkerOutput, WorkerSettings

# -- strategies ----------------------------------------------------------------


class OtherTagged(msgspec.Struct, tag=True):
    """A msgspec struct that is not a vLLM event but encodes like one."""

    block_hashes: list[int]
    medium: str | None = None


class BlockStoredLookalike(msgspec.Struct, tag="BlockStored"):
    """Same tag and fields as a real store: only the class tells them apart."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class Subclassed(BlockRemoved, tag="BlockRemoved"):
    """Encodes as a BlockRemoved with a field vLLM 0.33.0 does not have (a
    later vLLM's): accepted, and travels verbatim (docs/merge-rules.md)."""

    note: Any = None


class OwnTagged(BlockRemoved):
    """A subclass tagged with its own name: not an event kvmerge knows."""


EDGE_INTS = [0, -1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 2**200]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(EDGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.binary(max_size=8),
    st.binary(max_size=8).map(bytearray),
    st.just(object()),
    st.just(1 + 2j),
    st.just(decimal.Decimal("1.5")),
    st.just(datetime.datetime(2026, 1, 1)),
    st.just(AllBlocksCleared),  # the class, not an instance
    st.builds(OtherTagged, st.lists(st.integers(0, 9), max_size=2)),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=3), inner, max_size=2),
        st.frozensets(st.integers(0, 5), max_size=2),
    ),
    max_leaves=8,
)

hashes = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(max_size=16))
ints = st.integers(-(2**31), 2**31)
opt_text = st.none() | st.text(max_size=6)
# Like vLLM's: LoRA name, (mm_identifier, offset) pairs, salt, digests. Nested
# tuples are Any for msgspec: they come back as lists, as vLLM's own
# publisher's subscribers see them.
extra_item = st.none() | st.tuples(st.text(max_size=4), ints).map(tuple)
extra_entry = st.none() | st.lists(
    st.text(max_size=4) | ints | st.binary(max_size=4) | extra_item, max_size=3
).map(tuple)
VALID_FIELDS = {
    BlockStored: dict(
        block_hashes=st.lists(hashes, max_size=3),
        parent_block_hash=st.none() | hashes,
        token_ids=st.lists(ints, max_size=5),
        block_size=ints,
        lora_id=st.none() | ints,
        medium=opt_text,
        lora_name=opt_text,
        extra_keys=st.none() | st.lists(extra_entry, max_size=2),
        group_idx=st.none() | ints,
        kv_cache_spec_kind=opt_text,
        kv_cache_spec_sliding_window=st.none() | ints,
        locality=opt_text,
        ownership=opt_text,
        session_id=opt_text,
        lookahead_token_ids=st.none()
        | st.lists(st.lists(ints, max_size=3), max_size=2),
    ),
    BlockRemoved: dict(
        block_hashes=st.lists(hashes, max_size=3),
        medium=opt_text,
        group_idx=st.none() | ints,
        locality=opt_text,
        ownership=opt_text,
    ),
}


@st.composite
def vllm_events(draw, max_broken: int = 2):
    """A vLLM event, usually valid; some fields may hold anything at all.

    msgspec structs do not check types on construction, so this is how a
    buggy connector would hand kvmerge a mistyped event.
    """
    cls = draw(st.sampled_from([BlockStored, BlockRemoved, AllBlocksCleared]))
    if cls is AllBlocksCleared:
        return AllBlocksCleared()
    fields = VALID_FIELDS[cls]
    broken = draw(st.sets(st.sampled_from(sorted(fields)), max_size=max_broken))
    values = {
        name: draw(anything if name in broken else strategy)
        for name, strategy in fields.items()
    }
    return cls(**values)


not_quite_events = st.one_of(
    st.builds(
        BlockStoredLookalike,
        st.lists(st.integers(0, 9), max_size=2),
        st.none(),
        st.lists(st.integers(0, 9), max_size=2),
        st.just(16),
        st.none(),
        st.none(),
        st.none(),
    ),
    st.builds(
        Subclassed, st.lists(st.integers(0, 9), max_size=2), st.none(), note=anything
    ),
    st.builds(OwnTagged, st.lists(st.integers(0, 9), max_size=2), st.none()),
    anything,
)
event_lists = st.lists(vllm_events() | not_quite_events, max_size=4)
encode_inputs = st.one_of(
    event_lists,
    event_lists.map(tuple),
    st.lists(vllm_events(), max_size=4),
    anything,
    vllm_events(),  # an event instead of a list of events
)


VLLM_TYPES = (BlockStored, BlockRemoved, AllBlocksCleared)


def vllm_type(ev) -> type:
    """The vLLM class `ev` is (or derives from)."""
    return next(t for t in VLLM_TYPES if isinstance(ev, t))


def msgspec_round_trip(ev):
    """What vLLM's publisher's subscribers decode from `ev`'s bytes (fields
    their vLLM does not have are ignored, as msgspec does)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(ev), type=vllm_type(ev))


def _tuples(value):
    if isinstance(value, list | tuple):
        return tuple(_tuples(v) for v in value)
    return value


def nested_as_tuples(ev):
    """`ev` with the arrays nested in its `extra_keys` entries as tuples.

    msgpack has one array type, so inside those `Any`-typed entries a list
    and a tuple are the same event; kvmerge decodes them as tuples, the form
    vLLM builds (`(mm_identifier, offset)` pairs), see merge-rules.md.
    """
    if type(ev) is BlockStored and isinstance(ev.extra_keys, list):
        keys = [k if k is None else tuple(_tuples(v) for v in k) for k in ev.extra_keys]
        return msgspec.structs.replace(ev, extra_keys=keys)
    return ev


def comes_back_equal(ev) -> bool:
    """Whether msgpack can bring `ev` back `==` at all (NaN cannot be; nor
    the extra fields of a subclass, which only its bytes keep)."""
    return nested_as_tuples(msgspec_round_trip(ev)) == nested_as_tuples(ev)


# -- encode --------------------------------------------------------------------


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(encode_inputs)
@example([BlockRemoved(block_hashes=(1, 2), medium=None)])
@example(
    [
        Subclassed([1], None, note={"a": [1, None]}),
        Subclassed([1], None),  # the field at its default: omitted
        BlockRemoved([1], None),
    ]
)
@example([OwnTagged([1], None)])
@example([BlockStored([1], None, [1], 16, None, None, None, extra_keys=[["a", 1]])])
@example([BlockStored([2**64], None, [], 16, None, None, None)])
@example([BlockStored([1], None, [float("nan")], 16, None, None, None)])
@example(
    [BlockStored([1], None, [], 16, None, None, None, extra_keys=[(float("nan"),)])]
)
@example(
    [BlockStored([1], None, [], 16, None, None, None, extra_keys=[("m", ("h", 0))])]
)
@example(
    [
        BlockStored([1], None, [], 16, None, None, None, extra_keys=[("m", ["h", 0])]),
        BlockStored([1], None, [], 16, None, None, None, extra_keys=[("m", ("h", 0))]),
    ]
)
def test_encode_rejects_or_round_trips(obj):
    try:
        batch = kvmerge.encode(obj)
    except InvalidEventError as e:
        assert isinstance(e, TypeError) and isinstance(e, kvmerge.KVMergeError)
        assert str(e)
        event("refused")
        return
    events = list(obj)
    event(f"accepted {min(len(events), 2)}+ events")
    assert len(batch) == len(events)
    for ev in events:
        # Only vLLM's classes (or subclasses tagged as them), and their list
        # fields hold lists: a tuple there would decode as a list, unequal,
        # under the same identity.
        assert isinstance(ev, VLLM_TYPES)
        assert type(ev) in VLLM_TYPES or type(ev).__struct_config__.tag in (
            t.__name__ for t in VLLM_TYPES
        )
        if not isinstance(ev, AllBlocksCleared):
            assert type(ev.block_hashes) is list
    # Byte for byte what msgspec (vLLM's publisher) writes for each event,
    # fields vLLM 0.33.0 does not know included.
    raw = [bytes(r) for r in batch.raw()]
    assert raw == [msgspec.msgpack.encode(e) for e in events]
    decoded = batch.decode()
    # As msgspec decodes them (compared by bytes and class: NaN != NaN).
    assert [type(d) for d in decoded] == [vllm_type(e) for e in events]
    assert [msgspec.msgpack.encode(d) for d in decoded] == [
        msgspec.msgpack.encode(msgspec_round_trip(e)) for e in events
    ]
    for ev, back in zip(events, decoded, strict=True):
        # Whenever msgpack can bring the event back equal, we do.
        if comes_back_equal(ev):
            assert back == nested_as_tuples(ev)
    # Same identity exactly when the events are equal (among those that can
    # come back equal: NaN is not even equal to itself); an event with fields
    # vLLM 0.33.0 lacks is identified by all of its bytes.
    ids = batch.identities()
    exact = [nested_as_tuples(ev) if comes_back_equal(ev) else None for ev in events]
    for i, a in enumerate(exact):
        for j, b in enumerate(exact):
            if a is not None and b is not None:
                assert (ids[i] == ids[j]) == (a == b)
    for i, ev in enumerate(events):
        if type(ev) not in VLLM_TYPES:
            for j in range(len(events)):
                assert (ids[i] == ids[j]) == (raw[i] == raw[j])
    # And it travels: protocol 5, out of band, as vLLM's shm queue does it.
    buffers = []
    data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    back = pickle.loads(data, buffers=[bytearray(b.raw()) for b in buffers])
    assert back.identities() == ids and bytes(back) == bytes(batch)


MISTYPED = [
    ("block_hashes", (1, 2), "block_hashes"),
    ("token_ids", (1, 2), "token_ids"),
    ("extra_keys", (("a",),), "extra_keys"),
    ("extra_keys", [["a", 1]], "extra_keys: item 0"),
    ("lookahead_token_ids", ((1,),), "lookahead_token_ids"),
    ("lookahead_token_ids", [[1], (2,)], "lookahead_token_ids: item 1"),
]


@given(st.lists(vllm_events(max_broken=0), max_size=3), st.sampled_from(MISTYPED))
def test_a_mistyped_container_field_is_named(events, case):
    """A tuple where vLLM declares a list (or the reverse) is refused."""
    field, value, message = case
    ev = BlockStored([1], None, [1, 2], 16, None, None, None)
    setattr(ev, field, value)
    with pytest.raises(InvalidEventError, match=f"BlockStored.{message}"):
        kvmerge.encode([*events, ev])


# -- from_buffer and unpickling ------------------------------------------------

valid_events = vllm_events(max_broken=0)


def encodes(event) -> bool:
    try:
        kvmerge.encode([event])
    except InvalidEventError:
        return False
    return True


# Valid types can still be refused (an int beyond 64 bits): leave those out.
valid_batches = st.lists(valid_events, max_size=3).map(
    lambda evs: kvmerge.encode([e for e in evs if encodes(e)])
)


@given(st.binary(max_size=300), st.sampled_from([bytes, bytearray, memoryview]))
@example(b"", bytes)
@example(b"KVMB\x01\x00\x00\x00" + bytes(16), bytes)
def test_from_buffer_of_arbitrary_bytes_is_corrupt(data, container):
    # Arbitrary bytes pass only if they carry the magic, the version, exact
    # lengths and a matching 64-bit XXH3 of the rest: that is never random.
    with pytest.raises(CorruptBatchError) as info:
        EventBatch.from_buffer(container(data))
    assert isinstance(info.value, ValueError) and str(info.value)


@given(
    st.one_of(
        st.none(), st.integers(), st.text(), st.lists(st.integers()), st.builds(object)
    )
)
def test_from_buffer_of_a_non_buffer_is_a_type_error(obj):
    with pytest.raises(TypeError, match="bytes-like"):
        EventBatch.from_buffer(obj)


mutations = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10**6), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("append"), st.binary(min_size=1, max_size=8), st.just(0)),
    st.tuples(
        st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=4)
    ),
    st.tuples(st.just("delete"), st.integers(0, 10**6), st.integers(1, 8)),
    st.tuples(
        st.just("overwrite"), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)
    ),
)


def mutate(good: bytes, how) -> bytes:
    kind, a, b = how
    buf = bytearray(good)
    at = a % (len(good) + 1) if isinstance(a, int) else 0
    if kind == "flip":
        buf[a % len(good)] ^= 1 << b
    elif kind == "truncate":
        del buf[a % len(good) :]
    elif kind == "append":
        buf += a
    elif kind == "insert":
        buf[at:at] = b
    elif kind == "delete":
        del buf[at : at + b]
    else:
        buf[at : at + len(b)] = b
    return bytes(buf)


@given(valid_batches, mutations, st.sampled_from([bytes, bytearray, memoryview]))
def test_mutated_batches_are_corrupt(batch, how, container):
    good = bytes(batch)
    bad = mutate(good, how)
    assume(bad != good)
    with pytest.raises(CorruptBatchError):
        EventBatch.from_buffer(container(bad))


def assert_invalid_as_from_buffer(back, bad) -> None:
    """`back`, unpickled from `bad`, is an invalid batch: it says why, and its
    uses raise what `from_buffer(bad)` raises, changing no merger."""
    with pytest.raises(CorruptBatchError) as refused:
        EventBatch.from_buffer(bad)
    message = str(refused.value)
    assert isinstance(back, EventBatch) and back.error == message
    assert message in repr(back)
    m = kvmerge.Merger(2)
    m.add(1, kvmerge.encode([AllBlocksCleared()]))
    before = (m.stats(), m.step)
    uses = [
        lambda: m.add(0, back),
        lambda: m.add_all([(0, back)]),
        back.decode,
        back.raw,
        back.kinds,
        back.identities,
        lambda: back.take([0]),
        lambda: back.filled([]),
        lambda: EventBatch.concat([back, back]),
        lambda: EventBatch.from_buffer(back),
        lambda: len(back),
        lambda: bytes(back),
        lambda: back.nbytes,
        lambda: back.uncarried,
        lambda: pickle.dumps(back, protocol=5),
    ]
    for use in uses:
        with pytest.raises(CorruptBatchError) as info:
            use()
        assert str(info.value) == message
    with pytest.raises(BufferError):
        memoryview(back)
    assert (m.stats(), m.step) == before
    m.add(0, kvmerge.encode([AllBlocksCleared()]))  # rank 0 was not added
    assert [type(e) for e in m.finish_step()] == [AllBlocksCleared]


@given(valid_batches, mutations, st.sampled_from([0, 2, 4, 5]))
def test_unpickling_damaged_batch_bytes_never_raises(batch, how, protocol):
    good = bytes(batch)
    bad = mutate(good, how)
    assume(bad != good)
    if protocol == 5:
        # Out of band: the damaged bytes are the buffer handed to loads().
        buffers = []
        data = pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
        back = pickle.loads(data, buffers=[bytearray(bad)])
    else:
        # In band: the same reduction, carrying the damaged bytes.
        rebuild = batch.__reduce_ex__(protocol)[0]

        class Carrier:
            def __reduce__(self):
                return (rebuild, (bad,))

        data = pickle.dumps(Carrier(), protocol=protocol)
        assert pickle.dumps(batch, protocol=protocol) != data
        back = pickle.loads(data)
    assert_invalid_as_from_buffer(back, bad)


@given(
    st.one_of(
        st.binary(max_size=64),
        st.none(),
        st.integers(),
        st.text(max_size=4),
        st.builds(object),
        st.lists(st.integers(), max_size=3),
    )
)
def test_the_pickle_reconstructor_never_raises(arg):
    """Whatever a stream hands the reconstructor, it returns a batch."""
    rebuild = kvmerge.encode([]).__reduce_ex__(5)[0]
    back = rebuild(arg)
    assert isinstance(back, EventBatch)
    if back.error is None:
        assert bytes(back) == bytes(EventBatch.from_buffer(arg))
    else:
        with pytest.raises(CorruptBatchError, match=re.escape(back.error)):
            kvmerge.Merger(1).add(0, back)


class Unpickler(pickle.Unpickler):
    """Only the globals a batch's pickle names: a damaged stream could name
    any importable callable, and this test must not call one."""

    ALLOWED = frozenset(
        {
            ("builtins", "getattr"),
            ("__builtin__", "getattr"),  # protocols < 3 name it so
            ("kvmerge", "EventBatch"),
            ("_codecs", "encode"),
        }
    )

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed here")
        return super().find_class(module, name)


@given(valid_batches, mutations, st.sampled_from([0, 2, 5]))
def test_damaged_pickle_streams_never_panic(batch, how, protocol):
    """Damage anywhere in the pickle stream: pickle's errors or ours.

    What pickle does with a damaged stream is pickle's business (it is not a
    format for untrusted data); ours is that nothing gets past as a batch
    that is not one, and that nothing escapes as a non-Exception.
    """
    data = mutate(pickle.dumps(batch, protocol=protocol), how)
    try:
        back = Unpickler(io.BytesIO(data)).load()
    except Exception:
        return
    if isinstance(back, EventBatch) and back.error is None:
        # The carried bytes were intact (the damage hit pickle's framing in
        # a way that still loads): then it is the same batch. Damaged bytes
        # give an invalid batch (its error tells, its uses raise).
        assert bytes(back) == bytes(batch)


# -- writable buffers ----------------------------------------------------------


@given(valid_batches, st.integers(0, 10**6), st.integers(1, 255))
def test_later_writes_to_a_writable_buffer_do_not_reach_the_batch(batch, at, xor):
    """Regression: a bytearray is still writable while exported. The batch
    used to borrow it, so a later write could make a validated batch
    inconsistent, and reading it then panicked (PanicException)."""
    good = bytes(batch)
    for make in (
        bytearray,
        lambda b: memoryview(bytearray(b)),
        lambda b: memoryview(bytearray(b)).toreadonly(),
    ):
        buf = make(good)
        received = EventBatch.from_buffer(buf)
        target = buf.obj if isinstance(buf, memoryview) else buf
        target[at % len(good)] ^= xor
        assert bytes(received) == good
        assert received.identities() == batch.identities()
        assert [bytes(r) for r in received.raw()] == [bytes(r) for r in batch.raw()]


def test_writable_buffers_are_copied_and_bytes_are_borrowed():
    good = bytes(kvmerge.encode([AllBlocksCleared()]))
    ba = bytearray(good)
    EventBatch.from_buffer(ba)
    ba.extend(b"more")  # no export is held on it: it was copied
    before = sys.getrefcount(good)
    kept = EventBatch.from_buffer(good)
    assert sys.getrefcount(good) == before + 1  # the batch holds the bytes
    del kept
    assert sys.getrefcount(good) == before


class PickleBuffer(bytearray):
    """A writable buffer whose class is merely *named* like pickle's."""

    def raw(self):
        return memoryview(bytes(self))


class SpoofedBytes(bytes):
    """A bytes subclass: its buffer could be another object's (``__buffer__``)."""


def test_only_exact_immutable_types_are_borrowed():
    """Regression (issue 12): ``from_buffer`` borrowed any object whose class
    was named ``PickleBuffer``; a ``bytearray`` subclass so named was
    borrowed, and writing it afterwards gave a ``PanicException``. Only
    exact ``bytes``, ``EventBatch``, ``memoryview`` and ``pickle.PickleBuffer``
    count now; anything else is copied."""
    good = bytes(kvmerge.encode([AllBlocksCleared(), AllBlocksCleared()]))
    spoof = PickleBuffer(good)
    batch = EventBatch.from_buffer(spoof)
    spoof[24 + 24] = 0xFF  # the first record's kind: would be unvalidated
    spoof.extend(b"more")  # no export is held: it was copied
    assert bytes(batch) == good and batch.kinds() == ["AllBlocksCleared"] * 2
    assert len(batch.decode()) == 2
    view = memoryview(PickleBuffer(good))
    assert bytes(EventBatch.from_buffer(view)) == good
    sub = SpoofedBytes(good)
    before = sys.getrefcount(sub)
    kept = EventBatch.from_buffer(sub)
    assert sys.getrefcount(sub) == before  # copied, not held
    # The real PickleBuffer of bytes is borrowed (pickle.loads' buffers).
    real = pickle.PickleBuffer(good)
    before = sys.getrefcount(good)
    kept = EventBatch.from_buffer(real)
    assert sys.getrefcount(good) > before
    del kept


# -- no panic anywhere on the public surface ----------------------------------


def _good_batch() -> EventBatch:
    return kvmerge.encode(
        [
            bad_inputs.stored(1, 2, token_ids=[1, 2, 3]),
            BlockRemoved(block_hashes=[3], medium=None),
            AllBlocksCleared(),
        ]
    )


class Spoof:
    """Looks like a batch, a buffer, an int and a sequence, and is none."""

    nbytes = 10**12
    uncarried = -1

    def __index__(self):
        return 2**70

    def __len__(self):
        return 2**62

    def __iter__(self):
        return iter([self, -1, 2**64])

    def __buffer__(self, flags):
        return memoryview(bytearray(b"KVMB"))

    def __bytes__(self):
        return b"KVMB"


hostile = st.one_of(
    st.sampled_from(
        [
            None,
            0,
            -1,
            1,
            2,
            2**31,
            2**32,
            2**63,
            2**64,
            -(2**63) - 1,
            2**200,
            -(2**200),
            1.5,
            float("nan"),
            "",
            "all",
            b"",
            b"KVMB",
            bytearray(64),
            memoryview(b"x" * 100)[::3],
            [],
            [None],
            [2**70],
            [-1, 0],
            (),
            {},
            object(),
            Spoof(),
            PickleBuffer(b"KVMB"),
            pickle.PickleBuffer(b"KVMB\x02"),
            bytes(24),
            bytes(2**22),  # a giant buffer of zeros
            AllBlocksCleared(),
            True,
        ]
    ),
    st.integers(),
    st.binary(max_size=64),
    st.lists(st.integers(), max_size=3),
    st.builds(lambda: _good_batch()),
    st.builds(lambda: EventBatch.empty()),
    st.builds(lambda: kvmerge._kvmerge.EventBatch._from_pickle(b"bad")),
)


def _merger_calls(m):
    return {
        "add": lambda *a: m.add(*a),
        "add_all": lambda *a: m.add_all(*a),
        "finish_step": lambda *a: m.finish_step(*a),
        "finish_step_raw": lambda *a: m.finish_step_raw(*a),
        "finish_step_raw_and_decode": lambda *a: m.finish_step_raw_and_decode(*a),
        "finish_step_batch": lambda *a: m.finish_step_batch(*a),
        "stats": lambda *a: m.stats(*a),
        "reset": lambda *a: m.reset(*a),
        "repr": lambda *a: repr(m),
        "attrs": lambda *a: (
            m.world_size,
            m.rule,
            m.replication_factors,
            m.max_pending_steps,
            m.step,
        ),
    }


def _batch_calls(b):
    return {
        "decode": lambda *a: b.decode(*a),
        "raw": lambda *a: b.raw(*a),
        "filled": lambda *a: b.filled(*a),
        "kinds": lambda *a: b.kinds(*a),
        "indices": lambda *a: b.indices(*a),
        "take": lambda *a: b.take(*a),
        "identities": lambda *a: b.identities(*a),
        "len": lambda *a: len(b),
        "bytes": lambda *a: bytes(b),
        "repr": lambda *a: repr(b),
        "attrs": lambda *a: (b.uncarried, b.nbytes, b.error),
        "reduce": lambda *a: b.__reduce_ex__(*a),
        "pickle": lambda *a: pickle.loads(pickle.dumps(b, *a)),
        "memoryview": lambda *a: memoryview(b),
        "from_buffer": lambda *a: EventBatch.from_buffer(*a),
        "_from_pickle": lambda *a: EventBatch._from_pickle(*a),
        "concat": lambda *a: EventBatch.concat(*a),
        "empty": lambda *a: EventBatch.empty(*a),
    }


def _output_merger() -> OutputMerger:
    settings = WorkerSettings(
        "0", 2, -1, True, [("a", None, None), ("b", "quorum", [1])]
    )
    return OutputMerger(
        settings,
        2,
        {"lmcache": "all", "other": "native"},
        KVConnectorKVEvents,
        [True, False],
    )


def _output_calls():
    om = _output_merger()
    return {
        "step": lambda *a: (om.step(list(a)), om.step(a)),
        "step_arg": lambda *a: om.step(*a),
        "describe": lambda *a: om.describe(*a),
        "WorkerOutput": lambda *a: WorkerOutput(*a),
        "_from_wire": lambda *a: om.step([WorkerOutput._from_wire(*a)]),
        "WorkerSettings": lambda *a: WorkerSettings(*a),
    }


def _module_calls():
    return {
        "encode": lambda *a, **k: kvmerge.encode(*a, **k),
        "Merger": lambda *a, **k: kvmerge.Merger(*a, **k),
        "_borrow_buffers": lambda *a: (
            kvmerge._kvmerge._borrow_buffers(*a),
            kvmerge._kvmerge._borrow_buffers(False),
        ),
    }


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["merger", "batch", "stats", "outputs", "module"]),
    st.data(),
    st.lists(hostile, max_size=3),
    st.dictionaries(
        st.sampled_from(
            ["rank", "world_size", "rule", "replication_factors", "max_pending_steps"]
        ),
        hostile,
        max_size=2,
    ),
)
def test_no_call_on_the_public_surface_panics(target, data, args, kwargs):
    """Every method of Merger, EventBatch, MergerStats, the scheduler's
    OutputMerger and WorkerOutput, and the module's functions, with hostile
    arguments (the outputs of a step among them): only ``Exception`` subclasses may
    escape, never PyO3's ``PanicException`` (a ``BaseException``)."""
    m = kvmerge.Merger(2, max_pending_steps=2)
    m.add(0, _good_batch())
    if target == "merger":
        calls = _merger_calls(m)
    elif target == "batch":
        b = data.draw(hostile.filter(lambda x: isinstance(x, EventBatch)))
        calls = _batch_calls(b)
    elif target == "stats":
        st_ = m.stats()
        calls = {
            "as_dict": lambda *a: st_.as_dict(*a),
            "eq": lambda *a: [st_ == x for x in a],
            "repr": lambda *a: repr(st_),
            "attrs": lambda *a: st_.reports + st_.pending,
        }
    elif target == "outputs":
        calls = _output_calls()
    else:
        calls = _module_calls()
    name = data.draw(st.sampled_from(sorted(calls)))
    call = calls[name]
    try:
        if target == "module" and kwargs:
            call(*args, **kwargs)
        else:
            call(*args)
    except Exception:
        pass
    # Whatever happened, the merger still works and its counters add up.
    with contextlib.suppress(kvmerge.KVMergeError):
        m.add(1, _good_batch())
    m.finish_step()
    s = m.stats()
    assert s.reports == s.consumed + s.cleared + s.expired + s.pending


# -- Merger settings and ranks -------------------------------------------------

int_like = st.one_of(
    st.integers(), st.sampled_from([*EDGE_INTS, 2**16, 2**16 + 1, 2**31])
)


@given(
    int_like | scalars,
    st.sampled_from(["all", "quorum", "any"]) | st.text(max_size=6) | scalars,
    st.none() | st.lists(int_like, max_size=3) | anything,
    st.none() | int_like | scalars,
)
def test_merger_settings_are_checked(world_size, rule, factors, max_pending):
    try:
        m = kvmerge.Merger(world_size, rule, factors, max_pending)
    except ConfigError as e:
        assert isinstance(e, ValueError) and str(e)
        return
    except TypeError:
        # Not an int, a str, a sequence of ints: a wrong argument type.
        return
    assert m.world_size == world_size >= 1 and m.rule == rule
    m.add(0, kvmerge.encode([AllBlocksCleared()]))
    m.finish_step()
    s = m.stats()
    assert s.reports == s.consumed + s.cleared + s.expired + s.pending


@given(int_like)
def test_any_rank_is_added_or_refused(rank):
    m = kvmerge.Merger(4)
    batch = kvmerge.encode([AllBlocksCleared()])
    before = m.stats()
    try:
        m.add(rank, batch)
    except kvmerge.RankError as e:
        assert str(rank) in str(e)
        assert m.stats() == before
        with pytest.raises(kvmerge.RankError):
            m.add_all([(0, batch), (rank, batch)])
        assert m.stats() == before  # add_all is all or nothing
        return
    assert 0 <= rank < 4


# -- the documented table ----------------------------------------------------


def test_every_bad_input_is_refused_as_documented():
    """docs/robustness.md shows tests/support/bad_inputs.py's output, and that output
    is all refusals of the right kinds (regenerate the table if this fails
    after a message changed)."""
    assert bad_inputs.check() == []
    doc = (Path(__file__).resolve().parents[2] / "docs" / "robustness.md").read_text()
    block = doc.split("<!-- bad-inputs:begin -->\n")[1].split(
        "<!-- bad-inputs:end -->"
    )[0]
    assert block == bad_inputs.table()
