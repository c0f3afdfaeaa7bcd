"""Nothing one worker sends makes the scheduler's step path raise.

vLLM treats an exception in ``update_connector_output`` / ``take_events`` as
fatal to the engine. Hypothesis builds worker outputs as a damaged message or
another kvmerge could deliver them (through ``_from_wire`` or
``_events_from_packed``, as unpickling does: any field of any type, damaged
batches, foreign containers, odd settings, damaged or random packed buffers) and
hands them, beside a good output of the other rank, to the real scheduler
connector as vLLM's aggregator would. Nothing may raise, the good rank's
events must still publish under rule "any", and every bad batch is counted.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.vllm_harness import Bus, Cluster, any_child, child, stored, worker_output
from vllm.v1.outputs import KVConnectorOutput

import kvmerge
from kvmerge._kvmerge import _pack
from kvmerge.sim.children import ListKVEvents
from kvmerge.vllm import KVMergeKVEvents, register
from kvmerge.vllm.container import _events_from_packed, _from_wire
from kvmerge.vllm.settings import WorkerSettings

pytestmark = pytest.mark.vllm


def damaged_batch() -> kvmerge.EventBatch:
    good = kvmerge.encode([stored(5)])
    raw = bytearray(bytes(good))
    raw[len(raw) // 2] ^= 0xFF
    data = pickle.dumps(good, protocol=5, buffer_callback=lambda b: False)
    batch = pickle.loads(data, buffers=[raw])
    assert batch.error is not None
    return batch


anything = st.one_of(
    st.none(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.sampled_from(["lmcache", "umbp", "mooncake", "other", "native", "refused"]),
)
entries = st.one_of(
    anything,
    st.builds(lambda: kvmerge.encode([stored(7)])),
    st.builds(kvmerge.EventBatch.empty),
    st.builds(damaged_batch),
    st.builds(lambda: KVMergeKVEvents()),
)
factors = st.one_of(
    st.none(), st.tuples(st.integers(-2, 3)), st.lists(st.integers(0, 2)), anything
)
child_tuples = st.integers(0, 3).flatmap(
    lambda n: st.tuples(
        st.tuples(*[anything] * n),
        st.tuples(*[entries] * n),
        st.tuples(*[factors] * n),
    )
)
worker_settings = st.one_of(
    st.none(),
    anything,
    st.builds(
        WorkerSettings,
        kvmerge_version=st.sampled_from([kvmerge.__version__, "0.0.1"]),
        world_size=st.integers(0, 4),
        rank=st.integers(-1, 3),
        kv_events=st.booleans(),
        children=st.just(()),
    ),
)


def _packed_output(data: bytes) -> Any:
    """An output as it arrives packed (``_events_from_packed``), of ``data``."""
    return _events_from_packed(data)._outputs[0]


def _damaged_packed(rank: int, at: int, flip: bool) -> Any:
    """A real packed output of ``rank`` (one batch per child), a byte flipped
    or the buffer cut at ``at``."""
    batch = kvmerge.encode([stored(7)])
    data = bytearray(
        _pack(rank, 1, None, ("umbp", "lmcache"), (batch, batch), (None, None)) or b""
    )
    at %= len(data)
    if flip:
        data[at] ^= 0xFF
    else:
        del data[at:]
    return _packed_output(bytes(data))


packed_outputs = st.one_of(
    st.binary(max_size=80).map(_packed_output),
    st.builds(_damaged_packed, st.integers(0, 3), st.integers(0, 10**4), st.booleans()),
)
outputs = st.one_of(
    packed_outputs,
    st.builds(
        lambda rank, children, seq, s: _from_wire(rank, *children, seq, s),
        st.one_of(st.just(1), anything),
        st.one_of(child_tuples, st.tuples(anything, anything, anything)),
        st.one_of(st.integers(0, 5), anything),
        worker_settings,
    ),
    anything,
)


def started_cluster(bus: Bus) -> Cluster:
    register()
    c = Cluster([any_child(kv_events_merge="any"), child("LMCacheChild")], bus, tp=2)
    for r in range(2):
        c.emit(r, 0, [stored(1)])
    assert c.step() == [stored(1)]  # past start-up: settings checked
    return c


@pytest.fixture(scope="module")
def cluster(bus):
    """One cluster for every Hypothesis example (a hostile output may leave
    rank 1 marked misconfigured: the property holds all the same)."""
    return started_cluster(bus)


@pytest.fixture
def fresh(bus):
    """A cluster of its own, for tests that count what one output does."""
    return started_cluster(bus)


@settings(max_examples=300, deadline=None)
@given(hostile=st.lists(outputs, min_size=1, max_size=3))
def test_no_output_makes_the_step_path_raise(cluster, hostile):
    c = cluster
    c.emit(0, 0, [stored(9)])
    c.emit(0, 1, [])
    good = worker_output(c.workers[0]).kv_connector_output.kv_cache_events
    container = KVMergeKVEvents([*good.outputs, *hostile], num_workers=2)
    refused_before = [child.refused for child in c.scheduler._children]
    c.scheduler.update_connector_output(KVConnectorOutput(kv_cache_events=container))
    published = list(c.scheduler.take_events())
    # Rule "any": rank 0's store publishes whatever the other "rank" sent,
    # unless one of them (a valid rank 1 output, say) carried it too.
    assert any(b"\x09" in bytes(e) for e in published) or published == []
    assert all(
        child.refused >= before
        for child, before in zip(c.scheduler._children, refused_before, strict=True)
    )
    for t in c.children("scheduler"):
        t.received.clear()


def test_a_foreign_container_is_refused_not_raised(fresh):
    cluster = fresh
    before = cluster.scheduler._children[0].refused
    foreign = ListKVEvents([stored(3)])
    cluster.scheduler.update_connector_output(
        KVConnectorOutput(kv_cache_events=foreign)
    )
    assert list(cluster.scheduler.take_events()) == []
    assert cluster.scheduler._children[0].refused == before + 1


@pytest.mark.parametrize(
    ("bad", "children_refused"),
    [
        ("not an output", (1, 1)),
        (_from_wire("1", (None, None), (None, None), (None, None), 1, None), (1, 1)),
        (_from_wire(7, (None, None), (None, None), (None, None), 1, None), (1, 1)),
        (_from_wire(1, (None,), (None,), (None,), 1, None), (1, 1)),
        (_from_wire(1, ("umbp", None), ("x", None), (None, None), 1, None), (1, 0)),
        (_from_wire(1, ("bogus", None), (None, None), (None, None), 1, None), (1, 0)),
        (_from_wire(1, (None, "lmcache"), (None, "b"), (None, None), 1, None), (0, 1)),
    ],
    ids=[
        "not-an-output",
        "str-rank",
        "rank-7",
        "one-child",
        "str-payload",
        "bogus-kind",
        "child-1",
    ],
)
def test_known_bad_outputs_are_each_counted_once_per_child(
    fresh, bad, children_refused
):
    """The property above cannot pass by refusing nothing: these outputs are
    refused on exactly the children they spoil."""
    cluster = fresh
    children = cluster.scheduler._children
    before = [child.refused for child in children]
    container = KVMergeKVEvents([bad], num_workers=1)
    cluster.scheduler.update_connector_output(
        KVConnectorOutput(kv_cache_events=container)
    )
    list(cluster.scheduler.take_events())
    refused = tuple(c.refused - b for c, b in zip(children, before, strict=True))
    assert refused == children_refused
