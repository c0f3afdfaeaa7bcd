"""A worker's output travels packed: one buffer, read by the scheduler's
common step where it merges, unpacked into fields only when Python reads
one (``kvmerge.vllm.container``, ``rust/kvmerge-py/src/packed.rs``).

Hypothesis draws outputs and sends them through the shm pickling: what
arrives has the fields that were sent, whether the message kept the buffer in
line or out of band. Damaged buffers never raise where vLLM unpickles or
steps: the output is refused on the children it spoils, with its rank when
the header still says it.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.vllm_harness import removed, stored
from test_step_path_hostile import started_cluster
from vllm.v1.outputs import KVConnectorOutput

import kvmerge
from kvmerge._kvmerge import _pack, _unpack
from kvmerge.sim.transport import dequeue, enqueue
from kvmerge.vllm import KVMergeKVEvents
from kvmerge.vllm.container import WorkerOutput, _events_from_packed
from kvmerge.vllm.families import ENCODED, FAMILY_NATIVE, FAMILY_REFUSED
from kvmerge.vllm.settings import WorkerSettings

pytestmark = pytest.mark.vllm

events = st.lists(
    st.one_of(st.integers(1, 50).map(stored), st.integers(1, 50).map(removed)),
    max_size=6,
)
encoded_child = st.tuples(
    st.sampled_from(sorted(ENCODED)),
    events.map(kvmerge.encode),
    st.one_of(st.none(), st.lists(st.integers(1, 2**63 - 1), min_size=1, max_size=4)),
).map(lambda c: (c[0], c[1], None if c[2] is None else tuple(c[2])))
children = st.lists(st.one_of(st.just((None, None, None)), encoded_child), max_size=5)
ints = st.integers(-(2**63), 2**63 - 1)


def make_output(rank: int, seq: int, kids: list[tuple[Any, Any, Any]]) -> WorkerOutput:
    families, entries, factors = (tuple(c[i] for c in kids) for i in range(3))
    return WorkerOutput(rank, families, entries, factors, seq)


def fields(output: WorkerOutput) -> tuple[Any, ...]:
    return (
        output.rank,
        output.seq,
        output.settings,
        output.families,
        tuple(None if e is None else bytes(e) for e in output.entries),
        output.factors,
    )


def sent(output: WorkerOutput, *, out_of_band: bool = False) -> WorkerOutput:
    """``output`` through vLLM's shm pickling; ``out_of_band``: its buffer
    sent out of band however small (as Ray sends every one)."""
    container = KVMergeKVEvents.for_worker(output)
    if out_of_band:
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(container, protocol=5, buffer_callback=buffers.append)
        # As the message queue hands them over: copied into a bytearray.
        received = pickle.loads(data, buffers=[bytearray(b.raw()) for b in buffers])
    else:
        received = dequeue(enqueue(container))
    (got,) = received._outputs
    return got


@settings(max_examples=150, deadline=None)
@given(rank=ints, seq=ints, kids=children, out_of_band=st.booleans())
def test_a_packed_output_arrives_with_the_fields_sent(rank, seq, kids, out_of_band):
    output = make_output(rank, seq, kids)
    got = sent(output, out_of_band=out_of_band)
    assert got._packed is not None  # unread so far
    assert got.problem() is None
    assert got._packed is None  # read: unpacked once, for good
    assert fields(got) == fields(output)
    assert [got.child_problem(i) for i in range(len(kids))] == [None] * len(kids)
    # Sent on unchanged: packed again as it came.
    assert fields(sent(got)) == fields(output)


def native_container() -> Any:
    return KVMergeKVEvents()


@pytest.mark.parametrize(
    "change",
    [
        {"settings": WorkerSettings(kvmerge.__version__, 2, 0, True, ())},
        {"entries": (native_container(),), "families": (FAMILY_NATIVE,)},
        {"entries": ("could not encode",), "families": (FAMILY_REFUSED,)},
        {"entries": (b"not a batch",)},
        {"rank": True},
        {"seq": 2**63},
        {"factors": ((1, True),)},
        {"factors": ((),)},
        {"families": ("x" * 256,)},
        {"families": (None,)},
    ],
    ids=lambda change: ",".join(change),
)
def test_outputs_that_do_not_pack_travel_as_fields(change):
    base = {
        "rank": 1,
        "seq": 3,
        "settings": None,
        "families": ("lmcache",),
        "entries": (kvmerge.encode([stored(1)]),),
        "factors": (None,),
    }
    values = {**base, **change}
    assert _pack(**values) is None
    output = WorkerOutput(
        values["rank"],
        values["families"],
        values["entries"],
        values["factors"],
        values["seq"],
        values["settings"],
    )
    got = sent(output)
    assert got._packed is None
    assert (got.rank, got.seq, got.families, got.factors) == (
        output.rank,
        output.seq,
        output.families,
        output.factors,
    )


def test_a_large_output_sends_each_batch_as_its_own_buffer():
    """Above 64 KiB packing would copy the batches once more on the worker;
    each batch goes out as its own buffer instead (out of band from 1 MiB)."""
    big = kvmerge.encode([stored(h) for h in range(1, 3000)])
    assert big.nbytes > 64 << 10
    small = kvmerge.encode([stored(1)])
    for entries, packs in (((big, small), False), ((small, small), True)):
        output = make_output(0, 1, [("lmcache", e, None) for e in entries])
        assert (
            _pack(0, 1, None, output.families, entries, (None, None)) is not None
        ) == packs
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(
            KVMergeKVEvents.for_worker(output),
            protocol=5,
            buffer_callback=buffers.append,
        )
        sizes = sorted(b.raw().nbytes for b in buffers)
        if packs:
            assert len(buffers) == 1 and sizes[0] > 2 * small.nbytes
        else:
            assert sizes == sorted(e.nbytes for e in entries)
        (got,) = pickle.loads(data, buffers=buffers)._outputs
        assert fields(got) == fields(output)


@pytest.mark.parametrize("protocol", range(2, pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("packs", [True, False], ids=["packed", "fields"])
def test_every_pickle_protocol(protocol, packs):
    output = make_output(2, 5, [("lmcache", kvmerge.encode([stored(1)]), None)])
    if not packs:  # a worker's first output carries its settings
        output.settings = WorkerSettings(kvmerge.__version__, 4, 2, True, ())
    container = KVMergeKVEvents.for_worker(output)
    (got,) = pickle.loads(pickle.dumps(container, protocol=protocol))._outputs
    assert (got._packed is not None) == packs
    assert fields(got) == fields(output)


# --- damage --------------------------------------------------------------------

TEMPLATE = make_output(
    1,
    7,
    [
        ("umbp", kvmerge.encode([stored(5), removed(4)]), None),
        ("lmcache", kvmerge.encode([stored(6)]), (1, 2)),
    ],
)
PACKED = bytes(
    _pack(
        TEMPLATE.rank,
        TEMPLATE.seq,
        None,
        TEMPLATE.families,
        TEMPLATE.entries,
        TEMPLATE.factors,
    )
    or b""
)
#: Where the batches start: everything after the header.
BATCHES_AT = len(PACKED) - sum(e.nbytes for e in TEMPLATE.entries)

damage = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, len(PACKED) - 1)),
    st.tuples(st.just("flip"), st.integers(0, len(PACKED) - 1)),
    st.tuples(st.just("extend"), st.integers(1, 16)),
)


def damaged(how: str, at: int) -> bytes:
    data = bytearray(PACKED)
    if how == "truncate":
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
    fields_or_damage = _unpack(data)  # never raises
    output = _events_from_packed(data)._outputs[0]
    why = output.problem()
    kind, at = how
    if kind != "flip":
        # The batches no longer take exactly what the header says.
        assert why is not None and "damaged" in why
        return
    if at >= BATCHES_AT:
        # A batch's bytes: its checks catch every flipped byte.
        assert why is None
        problems = [output.child_problem(i) for i in range(2)]
        assert sum(p is not None for p in problems) == 1, problems
        return
    # The header: the output is refused, or reads as another well-formed one
    # (rank, seq, factors and family names carry no checksum, as pickled
    # tuples did not).
    if why is None:
        assert fields_or_damage[5] is None
        assert fields(output) != fields(TEMPLATE)


def test_random_bytes_are_no_output():
    for data in (b"", b"KVMO", b"KVMO\x02\x00\x00\x00" + bytes(40), b"x" * 100):
        output = _events_from_packed(data)._outputs[0]
        assert "damaged" in (output.problem() or "")
    # What a damaged message could hand the reconstructor instead.
    for args in ((object(),), (None,), (), (b"", 1, 2)):
        output = _events_from_packed(*args)._outputs[0]
        assert "damaged" in (output.problem() or ""), args


def test_a_damaged_output_is_refused_with_its_rank_and_the_others_merged(bus, caplog):
    # UMBP's child under rule "any", LMCache's under "all"; TP 2, started.
    c = started_cluster(bus)
    # The last byte is LMCache's batch's; 20 bytes hold the rank, not the seq.
    for h, how in ((2, ("flip", -1)), (3, ("truncate", 20))):
        for r in range(2):
            c.emit(r, 0, [stored(h)])
            c.emit(r, 1, [stored(h)])
        outputs = list(c.aggregate().kv_connector_output.kv_cache_events._outputs)
        good = bytes(outputs[1]._packed)
        bad = bytearray(good)
        if how[0] == "flip":
            bad[how[1]] ^= 0xFF
        else:
            del bad[how[1] :]
        outputs[1] = _events_from_packed(bytes(bad))._outputs[0]
        before = [ch.refused for ch in c.scheduler._children]
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            c.scheduler.update_connector_output(
                KVConnectorOutput(
                    kv_cache_events=KVMergeKVEvents(outputs, num_workers=2)
                )
            )
            published = c.bus.publish(list(c.scheduler.take_events()))
        refused = [
            ch.refused - b for ch, b in zip(c.scheduler._children, before, strict=True)
        ]
        if how[0] == "flip":
            # One batch of rank 1 spoilt: that child alone refuses it. Rule
            # "any" (UMBP) publishes rank 0's store, rule "all" waits.
            assert refused == [0, 1] and published == [stored(h)]
        else:
            assert refused == [1, 1] and published == [stored(h)]
        assert "rank 1" in caplog.text, caplog.text


def test_a_buffer_python_can_still_write_is_read_from_a_copy():
    """vLLM hands an out-of-band buffer over as a ``bytearray``: the batches
    read from it must not change when it does (only immutable buffers are
    borrowed, as for ``EventBatch.from_buffer``)."""
    buffer = bytearray(PACKED)
    received = _events_from_packed(buffer)._outputs[0]
    entries = received.entries
    buffer[:] = bytes(len(buffer))
    assert [bytes(e) for e in entries] == [bytes(e) for e in TEMPLATE.entries]
    assert entries[0].decode() == [stored(5), removed(4)]
