"""The scheduler merges its children in the common case with one call
(``_merge_children``); anything else goes through each child's own step.

Hypothesis draws steps of real worker outputs (through the shm pickling and
vLLM's aggregator), some with one rank's batch for one child tampered with
(damaged, of another family, other replication factors, missing, or other
events), and hands each step to two scheduler connectors: the real one, and
one whose children always take their own step. What they publish, what their
scheduler hooks are fed, their counters and their refusals must be the same.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.vllm_harness import Cluster, any_child, child, removed, stored
from test_step_path_hostile import damaged_batch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput

import kvmerge
from kvmerge import _schema
from kvmerge._kvmerge import _unpack
from kvmerge.sim.model import create_connector
from kvmerge.vllm import KVMergeKVEvents, register
from kvmerge.vllm import connector as connector_module
from kvmerge.vllm.container import WorkerOutput, _from_wire

pytestmark = pytest.mark.vllm

TP = 2
CHILDREN = [
    any_child(kv_events_merge="any"),
    child("LMCacheChild"),
    child("MooncakeChild", test_factors=[2]),
]

stores = st.lists(st.integers(1, 6).map(stored), max_size=4)
mixed = st.lists(
    st.one_of(st.integers(1, 6).map(stored), st.integers(1, 6).map(removed)),
    max_size=4,
)
#: Per child (config order): what each rank's child reports in a step.
child_events = st.tuples(mixed, stores, mixed)
tampering = st.sampled_from(
    ["damaged", "family", "factors", "true factor", "nothing", "other events"]
)
steps = st.lists(
    st.tuples(
        child_events,
        # Most steps have every rank report alike, the common case.
        st.one_of(st.just(None), child_events),
        st.one_of(
            st.just(None),
            st.tuples(st.integers(0, TP - 1), st.integers(0, 2), tampering),
        ),
    ),
    min_size=1,
    max_size=6,
)


def tampered(output: WorkerOutput, index: int, how: str) -> WorkerOutput:
    families, entries, factors = (
        list(output.families),
        list(output.entries),
        list(output.factors),
    )
    if how == "damaged":
        entries[index] = damaged_batch()
    elif how == "family":
        families[index] = "lmcache" if families[index] != "lmcache" else "umbp"
    elif how == "factors":
        factors[index] = (3,)
    elif how == "true factor":
        factors[index] = (True,)
    elif how == "nothing":
        families[index], entries[index], factors[index] = None, None, None
    else:
        entries[index] = kvmerge.encode([stored(99)])
    return _from_wire(
        output.rank,
        tuple(families),
        tuple(entries),
        tuple(factors),
        output.seq,
        output.settings,
    )


def cluster_and_own_steps(bus: Any) -> tuple[Cluster, Any]:
    """A cluster, and a second scheduler connector of its config whose
    children always take their own step."""
    register()
    c = Cluster(CHILDREN, bus, tp=TP)
    own_steps = create_connector(c.cfg, KVConnectorRole.SCHEDULER)
    for ch in own_steps._children:
        ch.plan = lambda: None
    return c, own_steps


def observed(scheduler: Any, published: list[bytes]) -> dict[str, Any]:
    hooks = [
        [bytes(kvmerge.encode([e])) for e in c.connector_scheduler.invalidated]
        for c in scheduler.sub_connectors
        if hasattr(c, "connector_scheduler")
    ]
    return {
        "published": published,
        "hooks": hooks,
        "stats": scheduler.merge_stats(),
        "refused": [c.refused for c in scheduler._children],
        "lost": scheduler.lost_outputs,
    }


@settings(max_examples=60, deadline=None)
@given(steps=steps)
def test_the_one_call_step_merges_as_each_childs_own_step(bus, steps):
    c, own_steps = cluster_and_own_steps(bus)
    published: dict[int, list[bytes]] = {id(c.scheduler): [], id(own_steps): []}
    for events, other, tamper in steps:
        for rank in range(TP):
            reported = other if other is not None and rank == TP - 1 else events
            for index, child_reports in enumerate(reported):
                c.emit(rank, index, child_reports)
        outputs = list(c.aggregate().kv_connector_output.kv_cache_events.outputs)
        if tamper is not None:
            rank, index, how = tamper
            outputs[rank] = tampered(outputs[rank], index, how)
        for scheduler in (c.scheduler, own_steps):
            container = KVMergeKVEvents(outputs, num_workers=TP)
            scheduler.update_connector_output(
                KVConnectorOutput(kv_cache_events=container)
            )
            published[id(scheduler)] += [bytes(e) for e in scheduler.take_events()]
    assert observed(c.scheduler, published[id(c.scheduler)]) == observed(
        own_steps, published[id(own_steps)]
    )


def test_the_common_step_is_one_call(bus, monkeypatch):
    """Once every child's family and merger are known, a step of well-formed
    outputs takes no child's own step (the test above would pass if the one
    call never merged anything)."""
    register()
    c = Cluster(CHILDREN, bus, tp=TP)
    own: list[int] = []
    step = connector_module._Child.step

    def counted(self: Any, *args: Any) -> Any:
        own.append(self.spec.index)
        return step(self, *args)

    monkeypatch.setattr(connector_module._Child, "step", counted)
    for rank in range(TP):
        for index in range(3):
            c.emit(rank, index, [stored(1)])
    assert c.step() == [stored(1)] * 3
    assert sorted(own) == [0, 1, 2]  # the first step resolves each child
    own.clear()
    for h in range(2, 6):
        for rank in range(TP):
            for index in range(3):
                c.emit(rank, index, [stored(h), removed(h - 1)] if index != 1 else [])
        assert c.step() == [stored(h), removed(h - 1)] * 2
    assert own == []
    hook = c.children("scheduler")[0].connector_scheduler
    assert hook.invalidated == [removed(h) for h in range(1, 5)]


def test_a_child_nothing_was_sent_to_takes_no_step_of_its_own(bus, monkeypatch):
    """A child no worker sent anything (one without KV events, as most
    connectors, or one with none yet) has no plan, since kvmerge learns its
    family from what it sends; its own step would unpack every output to find
    nothing there, every step. The one call says so, and the child's step
    is left out until something arrives for it."""
    register()
    c = Cluster(
        [child("SilentChild"), child("LMCacheChild"), child("LMCacheChild")],
        bus,
        tp=TP,
    )
    own: list[int] = []
    unpacked: list[int] = []
    step, unpack = connector_module._Child.step, WorkerOutput._unpack

    def counted(self: Any, *args: Any) -> Any:
        own.append(self.spec.index)
        return step(self, *args)

    def counted_unpack(self: WorkerOutput) -> None:
        unpacked.append(1)
        unpack(self)

    monkeypatch.setattr(connector_module._Child, "step", counted)
    monkeypatch.setattr(WorkerOutput, "_unpack", counted_unpack)
    for h in range(1, 6):
        for rank in range(TP):
            c.emit(rank, 1, [stored(h)])
            # The last child has events from the fourth step on.
            c.emit(rank, 2, [stored(10 + h)] if h >= 4 else [])
        assert c.step() == [stored(h)] + ([stored(10 + h)] if h >= 4 else [])
        # A child's first events resolve it in its own step, which unpacks
        # the outputs (a worker's first output, with its settings, travels
        # unpacked); nothing else takes a child's step or unpacks.
        assert own == {1: [1], 4: [2]}.get(h, [])
        assert len(unpacked) == (TP if h == 4 else 0)
        own.clear()
        unpacked.clear()
    assert [ch.merger is None for ch in c.scheduler._children] == [True, False, False]


class _Forged:
    """A decoder that fails as msgspec does on bytes that are not an event:
    what a forged removal (a worker that rewrote a batch and its checksum)
    makes of the hook's decode; such a batch passes every structural check."""

    def decode(self, payload: Any) -> Any:
        raise msgspec.DecodeError("forged")


def test_a_hook_removal_that_does_not_decode_loses_the_step_not_the_engine(
    bus, monkeypatch
):
    c, own_steps = cluster_and_own_steps(bus)
    published: dict[int, list[list[bytes]]] = {id(c.scheduler): [], id(own_steps): []}
    for h in (1, 2):
        for rank in range(TP):
            for index in range(3):
                c.emit(rank, index, [stored(h)] + ([removed(h - 1)] if h > 1 else []))
        outputs = c.aggregate().kv_connector_output.kv_cache_events.outputs
        with monkeypatch.context() as m:
            if h == 2:
                m.setattr(_schema, "_DECODER", _Forged())
            for scheduler in (c.scheduler, own_steps):
                scheduler.update_connector_output(
                    KVConnectorOutput(
                        kv_cache_events=KVMergeKVEvents(outputs, num_workers=TP)
                    )
                )
                published[id(scheduler)].append(
                    [bytes(e) for e in scheduler.take_events()]
                )
    for scheduler in (c.scheduler, own_steps):
        # The hooks' children (UMBP's and Mooncake's) lost step 2; the other
        # child's events went out.
        assert [ch.refused for ch in scheduler._children] == [1, 0, 1]
        assert published[id(scheduler)][1] == [
            bytes(kvmerge.encode([e]).raw()[0]) for e in (stored(2), removed(1))
        ]
    assert observed(c.scheduler, published[id(c.scheduler)][1]) == observed(
        own_steps, published[id(own_steps)][1]
    )


# --- which steps are the common case ------------------------------------------

WORLD = 4
N = 3


class _Subclass(WorkerOutput):
    __slots__ = ()


def _output(
    rank: int,
    seq: int,
    odd: dict[str, Any],
    packed: bool = False,
    held: tuple[bool, ...] = (False,) * N,
) -> Any:
    """A well-formed output of ``rank`` (an empty LMCache batch for each
    child ``held`` says, the others None), then ``odd``'s fields set as they
    are; or, ``packed``, as it arrives packed."""
    families = tuple("lmcache" if h else None for h in held)
    entries = tuple(kvmerge.EventBatch.empty() if h else None for h in held)
    output = _from_wire(rank, families, entries, (None,) * N, seq, None)
    for name, value in odd.items():
        setattr(output, name, value)
    if packed:
        container = pickle.loads(pickle.dumps(KVMergeKVEvents.for_worker(output)))
        (output,) = container._outputs
        assert output._packed is not None
    return output


class _Fields:
    """An output's fields as the rules read them, without unpacking it."""

    def __init__(self, output: WorkerOutput) -> None:
        if output._packed is None:
            self.rank, self.seq, self.settings = (
                output.rank,
                output.seq,
                output.settings,
            )
            self.families, self.entries = output.families, output.entries
            self.factors = output.factors
        else:
            fields = _unpack(output._packed)
            self.rank, self.seq, self.families, self.entries, self.factors, _ = fields
            self.settings = None


def _reference_common(
    outputs: list[Any], last_seq: dict[int, int], misconfigured: set[int]
) -> bool:
    """The common case as ``_merge_common_step``'s docs state it, output by
    output."""
    seen: set[int] = set()
    for output in outputs:
        if type(output) is not WorkerOutput:
            return False
        o = _Fields(output)
        if o.settings is not None:
            return False
        if type(o.rank) is not int or type(o.seq) is not int:
            return False
        if not all(
            type(t) is tuple and len(t) == N for t in (o.families, o.entries, o.factors)
        ):
            return False
        if o.rank in seen or o.rank in misconfigured:
            return False
        if last_seq.get(o.rank) != o.seq - 1:
            return False
        seen.add(o.rank)
    return True


_odd_fields = st.sampled_from(
    [
        {"settings": "settings"},
        {"families": [None] * N},
        {"entries": (None,) * (N - 1)},
        {"factors": (None,) * (N + 1)},
        {"rank": True},
        {"rank": "1"},
        {"seq": 2.0},
        {"seq": False},
    ]
)


_defects = st.sampled_from(
    [
        "odd field",
        "subclass",
        "not an output",
        "seq gap",
        "seq again",
        "twice",
        "misconfigured",
    ]
)


@st.composite
def _steps(draw: Any) -> tuple[list[Any], dict[int, int], set[int]]:
    """A step of well-formed outputs (all ranks or some), then, half the
    time, one defect in one of them."""
    last_seq = {r: draw(st.integers(0, 5)) for r in range(WORLD)}
    ranks = draw(st.permutations(range(WORLD)))[: draw(st.integers(1, WORLD))]
    outputs: list[Any] = [
        _output(
            r,
            last_seq[r] + 1,
            {},
            packed=draw(st.booleans()),
            held=draw(st.tuples(*[st.booleans()] * N)),
        )
        for r in ranks
    ]
    misconfigured: set[int] = set()
    if draw(st.booleans()):
        at = draw(st.integers(0, len(outputs) - 1))
        victim = outputs[at]
        defect = draw(_defects)
        if defect == "odd field":
            outputs[at] = _output(victim.rank, victim.seq, draw(_odd_fields))
        elif defect == "subclass":
            subclassed = object.__new__(_Subclass)
            for name in WorkerOutput.__slots__:
                setattr(subclassed, name, getattr(victim, name))
            outputs[at] = subclassed
        elif defect == "not an output":
            outputs[at] = ("an output", victim.rank)
        elif defect in ("seq gap", "seq again"):
            outputs[at] = _output(
                victim.rank, victim.seq + (1 if defect == "seq gap" else -1), {}
            )
        elif defect == "twice":
            outputs.append(_output(victim.rank, victim.seq, {}))
        else:
            misconfigured.add(victim.rank)
    return outputs, last_seq, misconfigured


@settings(max_examples=300, deadline=None)
@given(step=_steps())
def test_the_common_step_is_the_common_case_and_only_it(step):
    """``_merge_common_step`` takes a step exactly when the rule says it is
    the common case: it then records every rank's ``seq``, orders the
    outputs by rank and says which children nothing was sent to; otherwise
    it changes nothing, for the caller's checks."""
    outputs, last_seq, misconfigured = step
    before = dict(last_seq)
    expected = _reference_common(outputs, last_seq, misconfigured)
    got = kvmerge._kvmerge._merge_common_step(
        outputs, [None] * N, WorkerOutput, last_seq, misconfigured
    )
    if not expected:
        assert got is None
        assert last_seq == before
        return
    assert got is not None
    # Read where they arrived: the call unpacked nothing.
    packed = [o for o in outputs if o._packed is not None]
    ordered, ranks, results = got
    assert all(o._packed is not None for o in packed)
    assert ordered == sorted(outputs, key=lambda o: o.rank)
    assert ranks == [o.rank for o in ordered]
    # No plan: False for a child no output holds anything for.
    fields = [_Fields(o) for o in outputs]
    assert results == [
        None
        if any(f.families[i] is not None or f.entries[i] is not None for f in fields)
        else False
        for i in range(N)
    ]
    assert last_seq == {**before, **{o.rank: o.seq for o in outputs}}
