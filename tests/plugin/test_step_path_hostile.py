"""Nothing one worker sends makes the scheduler's step path raise.

vLLM treats an exception in ``update_connector_output`` / ``take_events`` as
fatal to the engine. Hypothesis builds worker outputs as a damaged message or
another kvmerge could deliver them: random bytes and damaged real buffers
through ``WorkerOutput._from_wire`` (as unpickling does) with anything beside
them as natives; real outputs whose header says what no worker of this
cluster would (any rank, seq gaps, another number of children, unknown
families, bad replication factors, refused entries, foreign containers, odd
settings), or with one child's batch damaged; and anything at all in an
output's place. They go, beside a good output of rank 0, to the real
scheduler connector as vLLM's aggregator would hand them. Nothing may raise,
rank 0's store must still publish under rule "any", and every output the
step cannot take is counted on every child. Likewise a native child's
containers raising in any method the scheduler's combining calls, on any
ranks.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.vllm_harness import Cluster, child, stored, worker_output
from support.worker_outputs import (
    RANK_END,
    buffer_of,
    cut,
    received,
    started_cluster,
    with_damaged_batch,
)
from vllm.v1.outputs import KVConnectorOutput

import kvmerge
from kvmerge._kvmerge import StepResult, WorkerOutput, WorkerSettings
from kvmerge.sim.children import ListKVEvents
from kvmerge.vllm import KVMergeKVEvents, register
from kvmerge.vllm.settings import settings_of

pytestmark = pytest.mark.vllm

WORLD = 2
i64 = st.integers(-(2**63), 2**63 - 1)
anything = st.one_of(
    st.none(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.tuples(st.none(), st.integers()),
    st.sampled_from(["lmcache", "umbp", "mooncake", "other", "native", "refused"]),
)
families = st.one_of(
    st.sampled_from(["umbp", "lmcache", "mooncake", "other", "native", "bogus"]),
    st.text(min_size=1, max_size=8),
)
factors = st.one_of(
    st.none(),
    st.tuples(st.integers(-2, 3)),
    st.lists(i64, max_size=3).map(tuple),
)
natives = st.one_of(
    st.builds(lambda: ListKVEvents([stored(3)])),
    st.builds(KVMergeKVEvents),
    st.sampled_from([0, b"x", 1.5]),
)
batches = st.one_of(
    st.builds(lambda: kvmerge.encode([stored(7)])),
    st.builds(kvmerge.EventBatch.empty),
)
entries = st.one_of(
    st.none(),
    st.text(max_size=20),  # the worker's reason: it could not encode
    st.tuples(families, batches, factors),
    natives,
)
worker_settings = st.builds(
    WorkerSettings,
    kvmerge_version=st.sampled_from([kvmerge.__version__, "0.0.1"]),
    world_size=st.integers(0, 4),
    rank=st.integers(-1, 3),
    kv_events=st.booleans(),
    children=st.just(()),
)
#: Real outputs with whatever a header can say (what the constructor takes).
crafted = st.builds(
    WorkerOutput,
    st.one_of(st.integers(-1, WORLD), i64),
    st.one_of(st.integers(0, 5), i64),
    st.lists(entries, max_size=3),
    st.one_of(st.none(), worker_settings),
)
#: Real outputs of rank 1 with one entry per child: the step gets as far as
#: each child's part.
rank_1 = st.builds(
    WorkerOutput,
    st.just(1),
    st.one_of(st.integers(0, 5), i64),
    st.lists(entries, min_size=2, max_size=2),
    # Mostly none: differing settings refuse the whole output.
    st.one_of(st.none(), st.none(), st.none(), worker_settings),
)


def _two_batches(rank: int, seq: int) -> WorkerOutput:
    batch = kvmerge.encode([stored(7)])
    return WorkerOutput(rank, seq, [("umbp", batch, None), ("lmcache", batch, None)])


@st.composite
def damaged_buffers(draw: Any) -> WorkerOutput:
    """A real output of two batches, its buffer cut, a byte flipped, bytes
    appended, or one child's batch damaged."""
    output = _two_batches(draw(st.sampled_from([1, 1, 0, 2])), draw(st.integers(0, 5)))
    data = bytearray(buffer_of(output))
    how = draw(st.sampled_from(["cut", "flip", "extend", "batch"]))
    if how == "batch":
        return with_damaged_batch(output, draw(st.integers(0, 1)))
    at = draw(st.integers(0, len(data) - 1))
    if how == "cut":
        del data[at:]
    elif how == "flip":
        data[at] ^= 0xFF
    else:
        data += draw(st.binary(min_size=1, max_size=8))
    return received(bytes(data), draw(st.one_of(st.none(), anything)))


#: Each kind of output about as often as the others (drawn by ``one_of``,
#: the plain values' branches outnumbered and outdrew the rest).
outputs = st.sampled_from(
    [
        rank_1,
        rank_1,
        damaged_buffers(),
        crafted,
        st.builds(received, st.binary(max_size=80), st.one_of(anything, natives)),
        st.builds(received, anything, anything),
        st.one_of(anything, natives),
    ]
).flatmap(lambda kind: kind)


@pytest.fixture(scope="module")
def cluster(bus):
    """One cluster for every Hypothesis example (a hostile output may leave
    rank 1 marked misconfigured: the property holds all the same)."""
    return started_cluster(bus)


@pytest.fixture
def fresh(bus):
    """A cluster of its own, for tests that count what one output does."""
    return started_cluster(bus)


def refused_whole(hostile: list[Any]) -> int:
    """How many of ``hostile`` (after rank 0's good output) the step must
    refuse whole, on every child: what is not a readable output, and any
    rank but 1 or a second output of rank 1."""
    whole, rank_1 = 0, 0
    for output in hostile:
        if (
            type(output) is not WorkerOutput
            or output.damage is not None
            or output.rank != 1
        ):
            whole += 1
        else:
            rank_1 += 1
    return whole + max(rank_1 - 1, 0)


_hashes = itertools.count(1000)


@settings(max_examples=300, deadline=None)
@given(hostile=st.lists(outputs, min_size=1, max_size=3))
def test_no_output_makes_the_step_path_raise(cluster, hostile):
    c = cluster
    h = next(_hashes)  # a block no earlier example stored
    c.emit(0, 0, [stored(h)])
    c.emit(0, 1, [])
    good = worker_output(c.workers[0]).kv_connector_output.kv_cache_events
    container = KVMergeKVEvents([*good.outputs, *hostile], num_workers=WORLD)
    before = [child.refused for child in c.scheduler._children]
    c.scheduler.update_connector_output(KVConnectorOutput(kv_cache_events=container))
    published = [bytes(e) for e in c.scheduler.take_events()]
    # Rule "any": rank 0's store publishes whatever the other "rank" sent.
    assert bytes(kvmerge.encode([stored(h)]).raw()[0]) in published
    whole = refused_whole(hostile)
    for ch, b in zip(c.scheduler._children, before, strict=True):
        assert ch.refused - b >= whole, (hostile, ch.refused - b, whole)
    # Rank 1 agrees again (its settings as the scheduler's): a hostile
    # output's settings leave it misconfigured, and the next examples' rank 1
    # outputs would all be refused before anything else was checked.
    agreeing = settings_of(c.scheduler._spec, WORLD, 1, True)
    c.scheduler.update_connector_output(
        KVConnectorOutput(
            kv_cache_events=KVMergeKVEvents(
                [WorkerOutput(1, 0, [None, None], agreeing)]
            )
        )
    )
    list(c.scheduler.take_events())
    for t in c.children("scheduler"):
        t.received.clear()


def test_a_foreign_container_is_refused_not_raised(fresh):
    cluster = fresh
    before = [child.refused for child in cluster.scheduler._children]
    foreign = ListKVEvents([stored(3)])
    cluster.scheduler.update_connector_output(
        KVConnectorOutput(kv_cache_events=foreign)
    )
    assert list(cluster.scheduler.take_events()) == []
    after = [child.refused for child in cluster.scheduler._children]
    assert after == [b + 1 for b in before]


class _Spy:
    """The scheduler's ``OutputMerger``, its step results kept: what each
    refusal's kind was, on the connector's own step."""

    def __init__(self, merger: Any) -> None:
        self._merger = merger
        self.results: list[StepResult] = []

    def step(self, outputs: Any) -> StepResult:
        result = self._merger.step(outputs)
        self.results.append(result)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._merger, name)


def _odd_settings(rank: int) -> WorkerSettings:
    return WorkerSettings(kvmerge.__version__ + ".other", WORLD, rank, True, ())


def _plain(rank: int, entries: list[Any] | None = None) -> WorkerOutput:
    return WorkerOutput(rank, 1, [None, None] if entries is None else entries)


def _batch() -> kvmerge.EventBatch:
    return kvmerge.encode([stored(5)])


#: (outputs of one step, refused per child, (kind, rank, child) per refusal,
#: the rank the log names).
KNOWN_BAD: dict[str, tuple[Any, tuple[int, int], list[Any], str]] = {
    "not-an-output": (
        lambda: ["not an output"],
        (1, 1),
        [("output", None, None)],
        "?",
    ),
    # Where a rank of the wrong type once came: a buffer whose header ends
    # after the rank.
    "damaged-buffer": (
        lambda: [cut(_two_batches(1, 1), RANK_END + 4)],
        (1, 1),
        [("output", 1, None)],
        "1",
    ),
    "damaged-before-the-rank": (
        lambda: [cut(_two_batches(1, 1), RANK_END - 1)],
        (1, 1),
        [("output", None, None)],
        "?",
    ),
    "rank-7": (lambda: [_plain(7)], (1, 1), [("rank", 7, None)], "7"),
    "one-child": (lambda: [_plain(1, [None])], (1, 1), [("children", 1, None)], "1"),
    # Where a str payload in child 0 once came: its batch damaged in transit.
    "damaged-batch": (
        lambda: [with_damaged_batch(_two_batches(1, 1), 0)],
        (1, 0),
        [("batch", 1, 0)],
        "1",
    ),
    "bogus-family": (
        lambda: [_plain(1, [("bogus", _batch(), None), None])],
        (1, 0),
        [("family", 1, 0)],
        "1",
    ),
    # Where a bad entry in child 1 once came: a native "container" that is no
    # KVConnectorKVEvents.
    "child-1": (
        lambda: [_plain(1, [None, b"b"])],
        (0, 1),
        [("native", 1, 1)],
        "1",
    ),
    "duplicate-rank": (
        lambda: [_plain(1), _plain(1)],
        (1, 1),
        [("duplicate", 1, None)],
        "1",
    ),
    "odd-settings": (
        lambda: [WorkerOutput(1, 1, [None, None], _odd_settings(1))],
        (1, 1),
        [("settings", 1, None)],
        "1",
    ),
    "misconfigured": (
        lambda: [WorkerOutput(1, 1, [None, None], _odd_settings(1)), _plain(1)],
        (2, 2),
        [("settings", 1, None), ("misconfigured", 1, None)],
        "1",
    ),
    "refused-entry": (
        lambda: [_plain(1, [None, "could not encode"])],
        (0, 1),
        [("encode", 1, 1)],
        "1",
    ),
    # Factors a container reports are read only where they are used (rule
    # "quorum" without configured ones): on child 0, rule "any", (0,) is
    # taken (tests/plugin/test_refusals.py, "factors-unused"; the refused
    # ones there, "factors-negative" and "factors-missing").
    # Child 0 took batches before: a container where batches came is refused.
    "native-for-a-merged-child": (
        lambda: [_plain(1, [ListKVEvents([stored(3)]), None])],
        (1, 0),
        [("family", 1, 0)],
        "1",
    ),
}


@pytest.mark.parametrize(
    ("make", "children_refused", "kinds", "rank"),
    KNOWN_BAD.values(),
    ids=KNOWN_BAD.keys(),
)
def test_known_bad_outputs_are_each_counted_once_per_child(
    fresh, vllm_caplog, make, children_refused, kinds, rank
):
    """The property above cannot pass by refusing nothing: these outputs are
    refused on exactly the children they spoil, for the reason given, and
    the log names the rank."""
    cluster = fresh
    spy = cluster.scheduler._merger = _Spy(cluster.scheduler._merger)
    children = cluster.scheduler._children
    before = [child.refused for child in children]
    container = KVMergeKVEvents(make(), num_workers=1)
    vllm_caplog.clear()
    cluster.scheduler.update_connector_output(
        KVConnectorOutput(kv_cache_events=container)
    )
    list(cluster.scheduler.take_events())
    refused = tuple(c.refused - b for c, b in zip(children, before, strict=True))
    assert refused == children_refused
    (result,) = spy.results
    assert [(r.kind, r.rank, r.child) for r in result.refusals] == kinds
    warnings = [r.getMessage() for r in vllm_caplog.records if r.levelname == "WARNING"]
    # An unknown rank is written "?".
    assert any(f"dropped rank {rank}'s batch" in w for w in warnings), warnings


def test_a_native_container_of_another_type_is_refused_not_raised(bus):
    """A native child's containers are combined with the child's own
    methods: one of another ``KVConnectorKVEvents`` class than rank 0's
    must cost only itself."""
    register()
    c = Cluster([child("ThirdPartyConnector")], bus, tp=WORLD)
    for r in range(WORLD):
        c.emit(r, 0, [stored(1)])
    c.step()
    c.emit(0, 0, [stored(2)])
    good = worker_output(c.workers[0]).kv_connector_output.kv_cache_events
    other = WorkerOutput(1, 1, [KVMergeKVEvents()])
    (native,) = c.scheduler._children
    before = native.refused
    c.scheduler.update_connector_output(
        KVConnectorOutput(
            kv_cache_events=KVMergeKVEvents([*good.outputs, other], num_workers=WORLD)
        )
    )
    list(c.scheduler.take_events())
    assert native.refused == before + 1


class _RaisingList(ListKVEvents):
    """A third-party container whose method ``fails`` raises."""

    def __init__(self, events: list[Any], fails: str | None = None) -> None:
        super().__init__(events)
        self.fails = fails

    def _call(self, name: str) -> None:
        if name == self.fails:
            raise RuntimeError(f"{name} broke")

    def get_all_events(self) -> list[Any]:
        self._call("get_all_events")
        return super().get_all_events()

    def add_events(self, events: Any) -> None:
        self._call("add_events")
        super().add_events(events)

    def increment_workers(self, count: int = 1) -> None:
        self._call("increment_workers")
        super().increment_workers(count)

    def __bool__(self) -> bool:
        self._call("__bool__")
        return True


@pytest.mark.parametrize(
    ("rank", "fails", "published"),
    [
        # Another rank's container raising costs only that rank's events.
        (1, "get_all_events", [0]),
        (1, "__bool__", [0]),
        # The container the others are combined into may be half-changed:
        # the child's step is dropped.
        (0, "add_events", []),
        (0, "increment_workers", []),
        (0, "__bool__", []),
    ],
)
def test_a_native_container_that_raises_is_refused_not_raised(
    bus, vllm_caplog, rank, fails, published
):
    """A native child's containers are a third party's code on the step path:
    one whose methods raise is counted and logged with its rank, and the
    engine lives on (upstream's aggregator would raise)."""
    register()
    c = Cluster([child("ThirdPartyConnector", test_min_reports=1)], bus, tp=WORLD)
    for r in range(WORLD):
        c.emit(r, 0, [stored(9)])
    assert c.step() == [stored(9)]
    (native,) = c.scheduler._children
    events = {r: stored(r + 1) for r in range(WORLD)}

    def output(r: int, seq: int, fails: str | None) -> WorkerOutput:
        return WorkerOutput(r, seq, [_RaisingList([events[r]], fails)])

    before = native.refused
    vllm_caplog.clear()
    outputs = [output(r, 1, fails if r == rank else None) for r in range(WORLD)]
    c.scheduler.update_connector_output(
        KVConnectorOutput(kv_cache_events=KVMergeKVEvents(outputs, num_workers=WORLD))
    )
    got = bus.publish(list(c.scheduler.take_events()))
    assert got == [events[r] for r in published]
    assert native.refused == before + 1
    warnings = [r.getMessage() for r in vllm_caplog.records if r.levelname == "WARNING"]
    assert any(
        f"dropped rank {rank}'s batch" in w and f"RuntimeError: {fails} broke" in w
        for w in warnings
    ), warnings
    # The next step merges as before.
    outputs = [output(r, 2, None) for r in range(WORLD)]
    c.scheduler.update_connector_output(
        KVConnectorOutput(kv_cache_events=KVMergeKVEvents(outputs, num_workers=WORLD))
    )
    assert bus.publish(list(c.scheduler.take_events())) == list(events.values())
    assert native.refused == before + 1


#: What a rank's native container does: nothing wrong, or raise in one of
#: the methods the scheduler's combining calls.
_FAILS = (None, "get_all_events", "add_events", "increment_workers", "__bool__")


@st.composite
def raising_steps(draw: Any) -> dict[int, str | None]:
    """The ranks of a TP 3 world that send a container (at least one), each
    with what its container does. The first one's ``get_all_events`` never
    raises: the child's own scheduler reads the combined container with it,
    the child's code and not kvmerge's (upstream's too)."""
    ranks = draw(st.lists(st.integers(0, 2), min_size=1, max_size=3, unique=True))
    step = {r: draw(st.sampled_from(_FAILS)) for r in sorted(ranks)}
    first = min(step)
    if step[first] == "get_all_events":
        step[first] = None
    return step


def combined_by_the_rules(step: dict[int, str | None]) -> tuple[list[int], int]:
    """What native.py's docstring says the child gets, written from it: the
    ranks whose events reach the child's scheduler, and the refusals. A
    container that raises while read is that rank's refusal; the first one
    (the others are combined into it) raising costs the child's step."""
    first, *others = sorted(step)
    kept, refused = [first], 0
    for rank in others:
        if step[rank] in ("__bool__", "get_all_events"):
            refused += 1
            continue
        if step[first] in ("add_events", "increment_workers"):
            return [], refused + 1
        kept.append(rank)
    if step[first] == "__bool__":
        return [], refused + 1
    return kept, refused


@settings(max_examples=60, deadline=None)
@given(step=raising_steps())
def test_no_native_container_makes_the_step_path_raise(bus, step):
    """Hypothesis: a native child's containers raising in any method the
    combining calls, on any ranks: the step never raises, the child gets the
    events of exactly the ranks the rules keep, each refusal is counted, and
    the next step merges as before."""
    register()
    tp = 3
    c = Cluster([child("ThirdPartyConnector", test_min_reports=1)], bus, tp=tp)
    (native,) = c.scheduler._children
    events = {r: stored(r + 1) for r in range(tp)}
    outputs = [
        WorkerOutput(r, 0, [_RaisingList([events[r]], f)]) for r, f in step.items()
    ]
    c.scheduler.update_connector_output(
        KVConnectorOutput(kv_cache_events=KVMergeKVEvents(outputs, num_workers=tp))
    )
    kept, refused = combined_by_the_rules(step)
    assert bus.publish(list(c.scheduler.take_events())) == [events[r] for r in kept]
    assert native.refused == refused
    outputs = [WorkerOutput(r, 1, [_RaisingList([events[r]])]) for r in range(tp)]
    c.scheduler.update_connector_output(
        KVConnectorOutput(kv_cache_events=KVMergeKVEvents(outputs, num_workers=tp))
    )
    assert bus.publish(list(c.scheduler.take_events())) == list(events.values())


def test_a_worker_container_that_raises_costs_its_part_only(bus, vllm_caplog):
    """On the worker, a child's container is a third party's code too: one
    whose ``get_all_events`` raises on rank 1 is that child's refusal of
    rank 1 at the scheduler, logged with the exception, and rank 0's store
    still publishes under rule "any"."""
    register()
    c = Cluster([child("LMCacheChild", kv_events_merge="any")], bus, tp=WORLD)
    (worker_child,) = c.children(1)
    make = worker_child.make_container

    def raising(events: list[Any]) -> Any:
        container = make(events)

        def get_all_events() -> list[Any]:
            raise RuntimeError("get_all_events broke")

        container.get_all_events = get_all_events
        return container

    worker_child.make_container = raising
    (merged,) = c.scheduler._children
    for r in range(WORLD):
        c.emit(r, 0, [stored(r + 1)])
    vllm_caplog.clear()
    assert c.step() == [stored(1)]
    assert merged.refused == 1
    warnings = [r.getMessage() for r in vllm_caplog.records if r.levelname == "WARNING"]
    assert any(
        "dropped rank 1's batch" in w and "RuntimeError: get_all_events broke" in w
        for w in warnings
    ), warnings
