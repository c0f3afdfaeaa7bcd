"""A worker's output travels as one buffer (``WorkerOutput``; its layout in
``rust/kvmerge-core/src/step/wire.rs``), a native child's container beside it.

Hypothesis draws outputs and sends them through vLLM's shm pickling, in band
and out of band: what arrives has the fields that were sent and pickles to
the same buffer again. Damaged buffers never raise where vLLM unpickles or
steps: the output is refused on the children it spoils, with its rank when
the header still says it.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.vllm_harness import removed, stored
from support.worker_outputs import (
    RANK_END,
    batch_range,
    batches_at,
    buffer_of,
    received,
    started_cluster,
)
from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.v1.outputs import KVConnectorOutput

import kvmerge
from kvmerge import EventBatch
from kvmerge._kvmerge import OutputMerger, WorkerOutput, WorkerSettings
from kvmerge.sim.children import ListKVEvents, lmcache_container
from kvmerge.sim.transport import dequeue, enqueue
from kvmerge.vllm import KVMergeKVEvents
from kvmerge.vllm.container import _events_from_wire
from kvmerge.vllm.families import ENCODED

pytestmark = pytest.mark.vllm

i64 = st.integers(-(2**63), 2**63 - 1)
events = st.lists(
    st.one_of(st.integers(1, 50).map(stored), st.integers(1, 50).map(removed)),
    max_size=6,
)
#: Any family a header can name: a family's name is 1 to 255 bytes of UTF-8.
family_names = st.one_of(
    st.sampled_from(sorted(ENCODED)),
    st.text(min_size=1, max_size=60).filter(lambda f: len(f.encode()) <= 255),
)
encoded = st.tuples(
    family_names,
    events.map(kvmerge.encode),
    # An empty tuple travels as "no factors": a count of 0 (wire.rs).
    st.one_of(st.none(), st.lists(i64, min_size=1, max_size=4).map(tuple)),
)
native = st.one_of(
    events.map(ListKVEvents),
    # vLLM's own KVConnectorKVEvents subclass.
    events.map(lmcache_container),
)
entries = st.one_of(
    st.none(), st.text(max_size=40), encoded, native.filter(lambda n: n is not None)
)
worker_settings = st.builds(
    WorkerSettings,
    kvmerge_version=st.text(max_size=12),
    world_size=i64,
    rank=i64,
    kv_events=st.booleans(),
    children=st.lists(
        st.tuples(
            st.text(max_size=20),
            st.one_of(st.none(), st.sampled_from(["any", "all", "quorum", "native"])),
            st.one_of(st.none(), st.lists(i64, min_size=1, max_size=3).map(tuple)),
        ),
        max_size=3,
    ),
)


def fields(output: WorkerOutput) -> dict[str, Any]:
    """What an output says: its header, and per child its batch's bytes, its
    reason, or its native container's events."""

    def entry(e: Any) -> Any:
        if e is None or isinstance(e, str):
            return e
        if isinstance(e, EventBatch):
            assert e.error is None, e.error
            return bytes(e)
        return (type(e).__name__, list(e.get_all_events()))

    return {
        "rank": output.rank,
        "seq": output.seq,
        "settings": output.settings,
        "damage": output.damage,
        "families": output.families,
        # Lists or tuples (kvmerge.vllm reads them either way; the stub
        # says tuples: test_factors_come_back_as_tuples).
        "factors": tuple(None if f is None else tuple(f) for f in output.factors),
        "entries": [entry(e) for e in output.entries],
    }


def sent(output: WorkerOutput, *, out_of_band: bool = False) -> WorkerOutput:
    """``output`` through vLLM's shm pickling (``kvmerge.sim.transport``);
    ``out_of_band``: its buffer sent out of band however small (as the queue
    sends one of 1 MiB or more, and Ray every one)."""
    container = KVMergeKVEvents.for_worker(output)
    if out_of_band:
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(container, protocol=5, buffer_callback=buffers.append)
        assert len(buffers) == 1
        # As the message queue hands them over: copied into a bytearray.
        got = pickle.loads(data, buffers=[bytearray(b.raw()) for b in buffers])
    else:
        got = dequeue(enqueue(container))
    (output,) = got.outputs
    return output


@settings(max_examples=150, deadline=None)
@given(
    rank=i64,
    seq=i64,
    kids=st.lists(entries, max_size=5),
    worker=st.one_of(st.none(), worker_settings),
    out_of_band=st.booleans(),
)
def test_an_output_arrives_with_the_fields_sent(rank, seq, kids, worker, out_of_band):
    output = WorkerOutput(rank, seq, kids, worker)
    got = sent(output, out_of_band=out_of_band)
    assert fields(got) == fields(output)
    assert (got.rank, got.seq, got.settings) == (rank, seq, worker)
    assert got.families == tuple(k[0] if type(k) is tuple else None for k in kids)
    assert fields(got)["factors"] == tuple(
        k[2] if type(k) is tuple else None for k in kids
    )
    # Sent on unchanged: the same buffer again.
    assert buffer_of(got) == buffer_of(output)
    assert fields(sent(got)) == fields(output)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_every_pickle_protocol(protocol):
    output = WorkerOutput(
        2,
        5,
        [
            ("lmcache", kvmerge.encode([stored(1)]), None),
            ("mooncake", kvmerge.encode([removed(1)]), (1, 2)),
            "could not encode",
            ListKVEvents([stored(3)]),
            None,
        ],
        WorkerSettings(kvmerge.__version__, 4, 2, True, [("c", "quorum", (2,))]),
    )
    for message in (output, KVMergeKVEvents.for_worker(output)):
        got = pickle.loads(pickle.dumps(message, protocol=protocol))
        (got,) = got.outputs if isinstance(got, KVMergeKVEvents) else (got,)
        assert fields(got) == fields(output)


# --- damage --------------------------------------------------------------------

TEMPLATE = WorkerOutput(
    1,
    7,
    [
        ("umbp", kvmerge.encode([stored(5), removed(4)]), None),
        ("lmcache", kvmerge.encode([stored(6)]), (1, 2)),
    ],
)
BUFFER = buffer_of(TEMPLATE)
BATCHES_AT = batches_at(TEMPLATE)

damage = st.one_of(
    st.tuples(st.just("cut"), st.integers(0, len(BUFFER) - 1)),
    st.tuples(st.just("flip"), st.integers(0, len(BUFFER) - 1)),
    st.tuples(st.just("extend"), st.integers(1, 16)),
)


def damaged(how: str, at: int) -> bytes:
    data = bytearray(BUFFER)
    if how == "cut":
        del data[at:]
    elif how == "flip":
        data[at] ^= 0xFF
    else:
        data += bytes(at)
    return bytes(data)


@settings(max_examples=300, deadline=None)
@given(how=damage)
def test_a_damaged_buffer_never_raises_and_is_caught_where_it_matters(how):
    data = damaged(*how)
    output = received(data)  # never raises
    # As a message delivers it: KVMergeKVEvents' reconstructor.
    (again,) = _events_from_wire(2, data, None).outputs
    assert repr(again) == repr(output)
    kind, at = how
    if kind != "flip":
        # The batches no longer take exactly what the header says.
        assert output.damage is not None
        assert output.entries == output.families == output.factors == ()
        assert output.seq is None and output.settings is None
        assert output.rank == (1 if kind == "extend" or at >= RANK_END else None)
        assert str(output.rank if output.rank is not None else "?") in repr(output)
        return
    if at >= BATCHES_AT:
        # A batch's bytes: its checks catch every flipped byte, in that
        # child only.
        assert output.damage is None
        spoilt = [i for i in range(2) if at in batch_range(TEMPLATE, i)]
        errors = [e.error for e in output.entries]
        assert [i for i, e in enumerate(errors) if e is not None] == spoilt, errors
        return
    # The header: the output is damaged, or reads as another well-formed one
    # (rank, seq, factors and family names carry no checksum).
    if output.damage is None:
        assert fields(output) != fields(TEMPLATE)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=120), natives=st.one_of(st.none(), st.integers()))
def test_random_bytes_never_raise(data, natives):
    output = received(data, natives)
    (again,) = _events_from_wire(1, data, natives).outputs
    for o in (output, again):
        repr(o)
        assert len(o.entries) == len(o.families) == len(o.factors)
        assert o.settings is None or o.damage is None


@pytest.mark.parametrize(
    ("data", "rank"),
    [
        (b"", None),
        (b"KVMO", None),
        (b"x" * 100, None),
        (BUFFER[:8], None),
        # A header of rank 0 and no children, then 21 bytes no batch takes.
        (b"KVMO\x02\x00\x00\x00" + bytes(40), 0),
    ],
)
def test_what_is_not_a_buffer_of_an_output_is_damage(data, rank):
    output = received(data)
    assert output.damage is not None and output.rank == rank


@pytest.mark.parametrize(
    "args", [(), (None,), (object(),), (12,), ("KVMO",), (BUFFER[:10], 1, 2, 3)]
)
def test_what_a_damaged_message_hands_the_reconstructor_is_damage(args):
    assert WorkerOutput._from_wire(*args).damage is not None
    (output,) = _events_from_wire(*(1, *args[:1], None)).outputs
    assert output.damage is not None


def test_an_older_format_names_its_version():
    data = bytearray(BUFFER)
    data[4] = 1
    assert "format version 1" in (received(bytes(data)).damage or "")


def test_a_damaged_output_is_refused_with_its_rank_and_the_others_merged(
    bus, vllm_caplog
):
    # UMBP's child under rule "any", LMCache's under "all"; TP 2, started.
    c = started_cluster(bus)
    # The last byte is LMCache's batch's; 20 bytes hold the rank, not the seq.
    for h, (how, at) in ((2, ("flip", -1)), (3, ("cut", RANK_END + 4))):
        for r in range(2):
            c.emit(r, 0, [stored(h)])
            c.emit(r, 1, [stored(h)])
        outputs = list(c.aggregate().kv_connector_output.kv_cache_events.outputs)
        bad = bytearray(buffer_of(outputs[1]))
        if how == "flip":
            bad[at] ^= 0xFF
        else:
            del bad[at:]
        outputs[1] = received(bytes(bad))
        before = [ch.refused for ch in c.scheduler._children]
        vllm_caplog.clear()
        c.scheduler.update_connector_output(
            KVConnectorOutput(kv_cache_events=KVMergeKVEvents(outputs, num_workers=2))
        )
        published = c.bus.publish(list(c.scheduler.take_events()))
        refused = [
            ch.refused - b for ch, b in zip(c.scheduler._children, before, strict=True)
        ]
        if how == "flip":
            # One batch of rank 1 spoilt: that child alone refuses it. Rule
            # "any" (UMBP) publishes rank 0's store, rule "all" waits.
            assert refused == [0, 1] and published == [stored(h)]
        else:
            assert refused == [1, 1] and published == [stored(h)]
        assert "dropped rank 1's batch" in vllm_caplog.text, vllm_caplog.text


def test_a_buffer_python_can_still_write_is_read_from_a_copy():
    """vLLM hands an out-of-band buffer over as a ``bytearray``: the batches
    read from it must not change when it does (only immutable buffers are
    borrowed, as for ``EventBatch.from_buffer``)."""
    buffer = bytearray(BUFFER)
    output = received(buffer)
    entries = output.entries
    buffer[:] = bytes(len(buffer))
    expected = [bytes(e) for e in TEMPLATE.entries]
    assert [bytes(e) for e in entries] == expected
    # Read again after the change: from the copy too.
    assert [bytes(e) for e in output.entries] == expected
    assert output.entries[0].decode() == [stored(5), removed(4)]


# --- what the constructor refuses -------------------------------------------


def _damaged_batch() -> EventBatch:
    good = kvmerge.encode([stored(5)])
    raw = bytearray(bytes(good))
    raw[len(raw) // 2] ^= 0xFF
    data = pickle.dumps(good, protocol=5, buffer_callback=lambda b: False)
    batch = pickle.loads(data, buffers=[raw])
    assert batch.error is not None
    return batch


BATCH = kvmerge.encode([stored(1)])


#: Entries of another shape than ``(family, batch, factors)``.
OTHER_SHAPES = {
    "2-tuple": ("lmcache", BATCH),
    "4-tuple": ("lmcache", BATCH, None, None),
    "bytes": ("lmcache", bytes(BATCH), None),
    "int-family": (1, BATCH, None),
    "str-factors": ("lmcache", BATCH, "12"),
    "huge-factor": ("lmcache", BATCH, (2**64,)),
}


@pytest.mark.parametrize("entry", OTHER_SHAPES.values(), ids=OTHER_SHAPES.keys())
def test_an_entry_of_another_shape_is_a_type_error(entry):
    with pytest.raises(TypeError, match="an encoded child's entry is"):
        WorkerOutput(0, 0, [entry])


#: Entries the buffer has no room for, and why.
UNFITTING = {
    "long-family": (("x" * 256, BATCH, None), "family's name is 256 bytes"),
    "long-utf8-family": (("é" * 128, BATCH, None), "family's name is 256 bytes"),
    "empty-family": (("", BATCH, None), "family is empty"),
    "256-factors": (
        ("lmcache", BATCH, tuple(range(1, 257))),
        "256 replication factors",
    ),
    "invalid": (("lmcache", _damaged_batch(), None), "batch does not read"),
}


@pytest.mark.parametrize(("entry", "why"), UNFITTING.values(), ids=UNFITTING.keys())
def test_what_does_not_fit_the_buffer_is_a_value_error(entry, why):
    with pytest.raises(ValueError, match=why):
        WorkerOutput(0, 0, [entry])


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        *((e, "an encoded child's entry is") for e in OTHER_SHAPES.values()),
        *UNFITTING.values(),
    ],
    ids=[*OTHER_SHAPES.keys(), *UNFITTING.keys()],
)
def test_on_the_step_path_an_entry_that_cannot_be_sent_is_that_childs_refusal(
    entry, why
):
    """What the constructor raises for costs the worker's step path only that
    child's part: its refusal, which the scheduler counts and logs."""
    good = ("lmcache", BATCH, (2,))
    output = WorkerOutput.for_step(3, 7, [good, entry, None])
    assert fields(output) == fields(WorkerOutput(3, 7, [good, output.entries[1], None]))
    reason = output.entries[1]
    assert isinstance(reason, str), reason
    assert reason.startswith("its entry cannot be sent: ") and why in reason, reason


#: Entries a worker may hand ``for_step`` that the buffer cannot carry:
#: every way past the wire form's limits, and every other shape.
_unsendable = st.one_of(
    st.sampled_from([*OTHER_SHAPES.values(), *(e for e, _ in UNFITTING.values())]),
    st.integers(256, 600).map(lambda n: ("x" * n, BATCH, None)),
    st.integers(128, 300).map(lambda n: ("é" * n, BATCH, None)),
    st.integers(256, 400).map(lambda n: ("lmcache", BATCH, tuple(range(1, n + 1)))),
    st.one_of(st.integers(2**63, 2**80), st.integers(-(2**80), -(2**63) - 1)).map(
        lambda f: ("lmcache", BATCH, (1, f))
    ),
)
_sendable = st.sampled_from(
    [None, ("lmcache", BATCH, None), ("x" * 255, BATCH, None), "could not encode"]
)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), _sendable, _unsendable), min_size=1, max_size=8)
)
def test_no_entry_a_worker_sends_makes_the_step_path_raise(drawn):
    """Whatever a worker's children hand over, past every limit of the wire
    form or of another shape, ``for_step`` never raises and the scheduler's
    step refuses exactly those children (``encode``), each with the
    worker's reason; the others are taken as they are."""
    entries = [bad if spoiled else good for spoiled, good, bad in drawn]
    output = WorkerOutput.for_step(0, 1, entries)
    children = [(f"connectors[{i}] (X)", None, None) for i in range(len(entries))]
    merger = OutputMerger(
        WorkerSettings(kvmerge.__version__, 1, -1, True, children),
        4,
        {"lmcache": "all", "x" * 255: "any"},
        KVConnectorKVEvents,
        [False] * len(entries),
    )
    result = merger.step([output])
    expected = {
        i
        for i, (spoiled, good, _) in enumerate(drawn)
        if spoiled or isinstance(good, str)
    }
    assert {r.child for r in result.refusals} == expected
    assert {r.kind for r in result.refusals} <= {"encode"}
    for r in result.refusals:
        if drawn[r.child][0]:
            assert "its entry cannot be sent: " in r.detail, r.detail


def test_on_the_step_path_what_no_entry_causes_still_raises():
    with pytest.raises(ValueError, match="65536 children"):
        WorkerOutput.for_step(0, 0, [None] * 65536)


def test_the_longest_that_fits_is_taken():
    output = WorkerOutput(0, 0, [("x" * 255, BATCH, tuple(range(1, 256)))])
    assert output.families == ("x" * 255,)
    assert fields(output)["factors"] == (tuple(range(1, 256)),)


def test_factors_come_back_as_tuples():
    assert WorkerOutput(0, 0, [("lmcache", BATCH, (1, 2))]).factors == ((1, 2),)


def test_a_long_reason_is_cut():
    # 2000 bytes at most, cut at a character.
    output = WorkerOutput(0, 0, ["é" * 1500, "a" * 2001, "ok"])
    assert output.entries == ("é" * 1000, "a" * 2000, "ok")
