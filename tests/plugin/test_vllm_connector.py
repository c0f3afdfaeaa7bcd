"""KVMergeMultiConnector in one process, against real vLLM 0.33.0.

Every step goes the way vLLM takes it: worker connectors build their outputs,
the outputs are pickled as the shm MessageQueue pickles them, a real
KVOutputAggregator combines them, the scheduler connector gets
update_connector_output then take_events, and a real ZmqEventPublisher
publishes what the test reads back with a SUB socket (see support.vllm_harness).
Expectations are worked out by hand from docs/merge-rules.md.
"""

from __future__ import annotations

import logging
import pickle
import random

import msgspec
import pytest
from support.vllm_children import CountMeta
from support.vllm_harness import (
    HAS_UMBP,
    Cluster,
    any_child,
    child,
    cleared,
    removed,
    stored,
    worker_output,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorWorkerMetadata,
)

import kvmerge
from kvmerge.sim.children import ListKVEvents
from kvmerge.sim.model import connector_config, create_connector, worker_config
from kvmerge.sim.transport import shm_roundtrip
from kvmerge.testing.reference import ReferenceMerger, assert_same_events
from kvmerge.vllm import KVMergeKVEvents, KVMergeMultiConnector, register
from kvmerge.vllm.container import WorkerOutputs, decode
from kvmerge.vllm.topology import aggregated_world_size, worker_rank

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("registered")]

SCHEDULER = KVConnectorRole.SCHEDULER
WORKER = KVConnectorRole.WORKER


def refused_step(c: Cluster, ranks: list[int]) -> str:
    """One step in which exactly ``ranks``' batches of child 0 are refused:
    nothing raises or is published, each is counted, each rank logged once.
    Returns the warnings' text."""
    refusals = logging.getLogger("vllm.kvmerge.refusals")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    refusals.addHandler(handler)
    before = c.scheduler._children[0].refused
    try:
        assert c.step() == []
    finally:
        refusals.removeHandler(handler)
    assert c.scheduler._children[0].refused - before == len(ranks)
    lines = [r.getMessage() for r in records if "dropped rank" in r.getMessage()]
    assert [
        int(line.split("dropped rank ")[1].split("'")[0]) for line in lines
    ] == ranks
    return "\n".join(lines)


def kvmerge_warnings(caplog) -> list[str]:
    """kvmerge's log lines of WARNING and above, in order."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("vllm.kvmerge") and r.levelno >= logging.WARNING
    ]


def chain(n: int, start: int = 1) -> list:
    """n stores, each the parent of the next."""
    return [stored(h, h - 1 if h > start else None) for h in range(start, start + n)]


# --- registration ------------------------------------------------------------
def test_factory_builds_it_by_module_path_and_by_registered_name():
    register()
    register()  # idempotent: vLLM loads plugins in every process, maybe twice
    for module_path in ("kvmerge.vllm", None):
        cfg = connector_config([child("LMCacheChild")], module_path=module_path)
        for role in (SCHEDULER, WORKER):
            conn = create_connector(cfg, role)
            assert type(conn) is KVMergeMultiConnector
            assert isinstance(conn, MultiConnector)
            assert type(conn.sub_connectors[0]).__name__ == "LMCacheChild"


# --- rule "all" (LMCacheKVEvents) ------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_all_rule_counts_every_worker_of_the_config(bus, tp):
    c = Cluster([child("LMCacheChild")], bus, tp=tp, max_pending_steps=2)
    last = tp - 1
    s1, s2, s3 = chain(3)
    # Step 0: the last rank reports s2 one step late.
    for r in range(tp):
        c.emit(r, 0, [s1, s2] if r != last else [s1])
    out = c.aggregate()
    container = out.kv_connector_output.kv_cache_events
    assert isinstance(container, KVMergeKVEvents)
    assert container.get_number_of_workers() == tp
    assert [out.rank for out in container.outputs] == list(range(tp))
    assert bus.publish(c.schedule(out)) == [s1]
    # Step 1: only the late rank has something; the others return None.
    c.emit(last, 0, [s2])
    assert c.step() == [s2]
    # Step 2: one rank of tp reports s3. Upstream LMCache would publish it
    # (workers that return None do not count there); the world counts here.
    c.emit(0, 0, [s3])
    assert c.step() == []
    assert c.step() == []
    assert c.step() == []  # s3 expired at the end of step 2 + max_pending_steps
    assert c.scheduler.merge_stats()[0] == {
        "steps": 5,
        "batches": 5 * tp,
        "reports": 2 * tp + 1,
        "published": 2,
        "consumed": 2 * tp,
        "cleared": 0,
        "expired": 1,
        "pending": 0,
        "withheld": 0,
        "withheld_orphan": 0,
        "withheld_duplicate": 0,
        "withheld_unknown": 0,
    }


def test_two_outputs_claiming_one_rank_keep_the_first_and_say_so(bus, caplog):
    """Two outputs of one rank in one step can only come from two workers that
    believe they have the same rank (vLLM's salvaged outputs carry no KV
    events): the second is dropped, counted and logged with the rank."""
    c = Cluster([child("LMCacheChild")], bus, tp=2)
    s1, s2, s3 = stored(1), stored(2), stored(3)
    outputs = []
    for rank, events in ((0, [s1]), (1, [s1, s2, s3]), (0, [s2])):
        c.emit(rank, 0, events)
        outputs.append(shm_roundtrip(worker_output(c.workers[rank]))[0])
    with caplog.at_level(logging.WARNING):
        published = c.bus.publish(c.schedule(c.aggregator.aggregate(outputs, 0)))
    assert published == [s1]  # rank 0's second output (s2) was dropped
    assert c.scheduler._children[0].refused == 1
    (line,) = [
        r.getMessage() for r in caplog.records if "dropped rank" in r.getMessage()
    ]
    assert "rank 0" in line and "connectors[0] (LMCacheChild)" in line
    assert "a second output claims rank 0" in line


@pytest.mark.skipif(
    not hasattr(KVOutputAggregator, "ft_defer_kv_connector_outputs"),
    reason="this vLLM salvages no output of a failed step (0.33 added it)",
)
def test_vllms_salvaged_output_loses_its_events_and_the_gap_is_reported(bus, caplog):
    """vLLM's own salvage path (KVOutputAggregator.ft_defer_kv_connector_outputs,
    what the executor calls for a worker whose step failed) drops the step's
    KV events: kvmerge sees the gap in that rank's outputs, counts and logs
    it; the other ranks' reports of the lost events expire."""
    c = Cluster([child("LMCacheChild")], bus, tp=2, max_pending_steps=2)
    s1, s2, s3 = stored(1), stored(2), stored(3)
    c.emit(0, 0, [s1])
    c.emit(1, 0, [s1])
    assert c.step() == [s1]
    # Step 1: rank 1's get_output() fails; its KV output is salvaged.
    c.emit(0, 0, [s2])
    c.emit(1, 0, [s2])
    good = shm_roundtrip(worker_output(c.workers[0]))[0]
    failed = shm_roundtrip(worker_output(c.workers[1]))[0]
    c.aggregator.ft_defer_kv_connector_outputs([failed.kv_connector_output])
    assert failed.kv_connector_output.kv_cache_events is None  # vLLM dropped them
    assert c.bus.publish(c.schedule(c.aggregator.aggregate([good, good], 0))) == []
    # Step 2: the salvaged output joins; rank 1 reports again.
    c.emit(0, 0, [s3])
    c.emit(1, 0, [s3])
    with caplog.at_level(logging.WARNING, logger="vllm.kvmerge"):
        assert c.step() == [s3]
        for _ in range(3):
            c.step()
    assert c.scheduler.lost_outputs == 1
    assert any(
        "rank 1's outputs 1..1 never arrived" in r.getMessage() for r in caplog.records
    )
    stats = c.scheduler.merge_stats()[0]
    assert stats["expired"] == 1  # rank 0's s2: rank 1's report of it was lost
    assert stats["pending"] == 0


def test_duplicates_in_one_worker_do_not_stand_in_for_another(bus):
    c = Cluster([child("LMCacheChild")], bus, tp=2)
    s1 = stored(1)
    c.emit(0, 0, [s1, s1])  # rank 0 reports s1 twice (vLLM PR #49689)
    c.emit(1, 0, [s1])
    assert c.step() == [s1]
    # Rank 0's second report did not complete s1 a second time on its own.
    stats = c.scheduler.merge_stats()[0]
    assert (stats["withheld"], stats["pending"]) == (0, 1)
    c.emit(1, 0, [s1])  # now rank 1 matches rank 0's second report
    # The rule publishes s1 again; the guard withholds it (s1 is held).
    assert c.step() == []
    stats = c.scheduler.merge_stats()[0]
    assert stats["pending"] == 0
    assert (stats["withheld"], stats["withheld_duplicate"]) == (1, 1)
    assert (stats["withheld_orphan"], stats["withheld_unknown"]) == (0, 0)


def test_all_blocks_cleared_is_a_barrier_for_every_rank(bus):
    # AllBlocksCleared is not hashable in vLLM 0.33.0, so the Counter-based
    # upstream containers cannot carry it; a third-party list container with
    # rule "all" can (and shows an override on an unknown container type).
    c = Cluster([child("ThirdPartyConnector", kv_events_merge="all")], bus, tp=2)
    s1, s2, s3 = stored(1), stored(2), stored(3)
    c.emit(0, 0, [s1, cleared(), s2])
    c.emit(1, 0, [s1])
    assert c.step() == [s1]  # rank 1 has not cleared yet: s2 waits behind
    c.emit(1, 0, [cleared(), s2, s3])
    assert c.step() == [cleared(), s2]
    c.emit(0, 0, [s3])
    assert c.step() == [s3]
    received = c.children("scheduler")[0].received
    assert all(r.kv_cache_events is None for r in received)


def test_bytes_block_hashes(bus):
    c = Cluster([child("LMCacheChild")], bus, tp=2)
    h1, h2 = bytes(range(32)), bytes(range(32, 64))
    events = [stored(h1), stored(h2, h1), removed(h1)]
    for r in range(2):
        c.emit(r, 0, events)
    got = c.step()
    assert got == events
    assert got[1].parent_block_hash == h1 and isinstance(got[1].block_hashes[0], bytes)


# --- rule "quorum" (MooncakeStoreKVEvents) --------------------------------------
def test_quorum_with_gqa_replication_factors(bus):
    # TP=8; group 1's KV heads are replicated on 4 ranks (factor 4): two
    # distinct ranks complete one of its stores; group 0 needs all eight.
    c = Cluster(
        [child("MooncakeChild", test_factors=[1, 4])], bus, tp=8, max_pending_steps=1
    )
    g0, g1a, g1b = stored(10, group=0), stored(20, group=1), stored(30, group=1)
    for r in range(8):
        events = [g0]
        if r in (0, 4):
            events.append(g1a)
        if r == 0:
            events.append(g1b)
        if r == 3:
            events.append(g0)  # a duplicate: collapsed
        c.emit(r, 0, events)
    assert c.step() == [g0, g1a]
    c.emit(2, 0, [g1b])  # the second rank for g1b, one step later
    assert c.step() == [g1b]
    for r in range(8):
        c.emit(r, 0, [removed(10)] if r != 5 else [])
    assert c.step() == []  # a removal has factor 1: 7 of 8 is not enough
    assert c.step() == []
    stats = c.scheduler.merge_stats()[0]
    assert stats["expired"] == 7 and stats["pending"] == 0
    # Every worker returned a container every step (Mooncake does).
    assert stats["batches"] == 4 * 8


def test_quorum_factors_must_cover_reported_groups(bus):
    c = Cluster([child("MooncakeChild", test_factors=[1])], bus, tp=2)
    for r in range(2):
        c.emit(r, 0, [stored(1, group=0)])
    assert c.step() == [stored(1, group=0)]
    for r in range(2):
        c.emit(r, 0, [stored(2, group=1)])
    msg = refused_step(c, [0, 1])  # on the step path: dropped, not raised
    assert "connectors[0] (MooncakeChild)" in msg and "replication factors" in msg
    for r in range(2):
        c.emit(r, 0, [stored(3, group=0)])
    assert c.step() == [stored(3, group=0)]  # later steps merge as usual


def test_configured_factors_override_the_containers(bus):
    c = Cluster(
        [
            child(
                "MooncakeChild", test_factors=[1], kv_events_replication_factors=[1, 2]
            )
        ],
        bus,
        tp=2,
    )
    c.emit(0, 0, [stored(2, group=1)])
    assert c.step() == [stored(2, group=1)]


# --- rule "any" (UMBPStoreKVEvents, or an override where vLLM has no UMBP) --------
@pytest.mark.parametrize("output", ["raw", "objects"])
def test_any_rule_and_the_childs_own_scheduler_events(bus, output):
    c = Cluster([any_child()], bus, tp=4, kv_events_output=output)
    s1, s2, s5, s6, s9 = (stored(h) for h in (1, 2, 5, 6, 9))
    s77, r1, r9 = stored(77), removed(1), removed(9)

    def withheld() -> tuple[int, int, int, int]:
        stats = c.scheduler.merge_stats()[0]
        return (
            stats["withheld"],
            stats["withheld_orphan"],
            stats["withheld_duplicate"],
            stats["withheld_unknown"],
        )

    for r in range(4):
        c.emit(r, 0, [s1, s5, r9] if r == 2 else [s1, r9])
    umbp = c.children("scheduler")[0]
    umbp.scheduler_emit([s77])  # an event UMBP's scheduler half makes itself
    # The rule publishes s1, r9, s5; the guard withholds r9 (block 9 is not
    # held), and the child's hook sees no removal.
    assert c.step() == [s1, s5, s77]
    assert withheld() == (1, 0, 0, 1)
    assert umbp.connector_scheduler.invalidated == []
    for r in range(4):
        c.emit(r, 0, [s9])
    assert c.step() == [s9]
    for r in range(4):
        c.emit(r, 0, [s2, s6, r9] if r == 2 else [s2, r9])
    # Position order (index, then rank): s2; r9 (ranks 0, 1), s6 (rank 2).
    assert c.step() == [s2, r9, s6]
    # The child's scheduler half saw the published removals (all that UMBP's
    # invalidate_kv_events reads), to invalidate its own pending events.
    assert umbp.connector_scheduler.invalidated == [r9]
    for r in range(4):
        c.emit(r, 0, [s1])
    # Repetitions across steps are kept by the rule: s1 again, which the
    # guard withholds (still held); once removed, it is published again.
    assert c.step() == []
    assert withheld() == (2, 0, 1, 1)
    for r in range(4):
        c.emit(r, 0, [r1])
    assert c.step() == [r1]
    assert umbp.connector_scheduler.invalidated == [r9, r1]
    for r in range(4):
        c.emit(r, 0, [s1])
    assert c.step() == [s1]
    assert withheld() == (2, 0, 1, 1)


# --- children by position, native and silent children ---------------------------
def test_children_by_position_with_native_and_silent_children(bus):
    c = Cluster(
        [
            child("LMCacheChild"),
            child("LMCacheChild"),  # same class: a child of its own
            child("SilentChild"),
            child("ThirdPartyConnector", test_min_reports=2),  # native
        ],
        bus,
        tp=2,
    )
    s1, s2, s3, s4, s5 = (stored(h) for h in range(1, 6))
    for r in range(2):
        c.emit(r, 0, [s1])
        c.emit(r, 1, [s2])
        c.emit(r, 3, [s3] if r == 0 else [s3, s4])
    # Config order; the native child applies its own rule (2 reports).
    assert c.step() == [s1, s2, s3]
    c.emit(0, 3, None)  # the native child returns None on rank 0
    c.emit(1, 3, [s5, s5])
    assert c.step() == [s5]
    for r in range(2):
        assert c.children(r)[2].drained == 2  # drained every step
    sched = c.children("scheduler")
    for i in (0, 1, 2):
        assert [x.kv_cache_events for x in sched[i].received] == [None, None]
    native = sched[3].received
    assert [type(x.kv_cache_events) for x in native] == [ListKVEvents] * 2
    # Combined with the child's own methods: workers that returned None do not
    # count, as in upstream's KVOutputAggregator.
    assert [x.num_workers for x in native] == [2, 1]
    assert native[0].events == [s3, s3, s4]


def test_children_get_their_own_output_fields(bus):
    c = Cluster(
        [
            child("LMCacheChild", test_meta_tag="a"),
            child("ThirdPartyConnector", test_meta_tag="b"),
            child("SilentChild"),
        ],
        bus,
        tp=2,
    )
    for r in range(2):
        c.emit(r, 0, [stored(1)])
        c.emit(r, 1, [stored(2)])
    out = c.aggregate(finished_sending={"req-1"})
    kv_out = out.kv_connector_output
    events, meta = kv_out.kv_cache_events, kv_out.kv_connector_worker_meta
    assert isinstance(meta, MultiKVConnectorWorkerMetadata)
    c.scheduler.update_connector_output(kv_out)
    # The caller's output is left as it was.
    assert kv_out.kv_cache_events is events
    assert kv_out.kv_connector_worker_meta is meta
    got = [s.received[-1] for s in c.children("scheduler")]
    assert [g.worker_meta for g in got] == [CountMeta("a", 2), CountMeta("b", 2), None]
    assert all(g.finished_sending == {"req-1"} for g in got)
    assert got[0].kv_cache_events is None and got[2].kv_cache_events is None
    assert isinstance(got[1].kv_cache_events, ListKVEvents)
    assert c.bus.publish(list(c.scheduler.take_events())) == [stored(1), stored(2)]


# --- world size, reset, output format -------------------------------------------
def test_world_size_comes_from_the_config_not_from_arrivals(bus):
    c = Cluster([child("LMCacheChild")], bus, tp=2, pp=2)
    assert c.scheduler.world_size == 4
    assert [w.worker_rank for w in c.workers] == [0, 1, 2, 3]
    s1 = stored(1)
    for r in range(3):
        c.emit(r, 0, [s1])
    # Rank 3's output is missing from this step: 3 reports of 4 are not "all".
    assert c.bus.publish(c.schedule(c.aggregate(ranks=[0, 1, 2]))) == []
    c.emit(3, 0, [s1])
    assert c.step() == [s1]


def test_reset_cache_drops_pending_reports(bus):
    s1 = stored(1)
    for reset in (False, True):
        c = Cluster([child("LMCacheChild")], bus, tp=2)
        c.emit(0, 0, [s1])
        assert c.step() == []
        if reset:
            assert c.scheduler.reset_cache() is True
        c.emit(1, 0, [s1])
        assert c.step() == ([] if reset else [s1])
    assert c.scheduler.merge_stats()[0]["pending"] == 1


def test_without_kv_events_children_are_drained_but_nothing_is_encoded(bus):
    c = Cluster(
        [child("LMCacheChild"), child("ThirdPartyConnector")],
        bus,
        tp=2,
        kv_events=False,
    )
    for r in range(2):
        c.emit(r, 0, [stored(1)])
        c.emit(r, 1, [stored(2)])
    out = c.aggregate()
    worker_outputs = out.kv_connector_output.kv_cache_events.outputs
    assert [wo.entries[0] for wo in worker_outputs] == [None, None]
    assert all(isinstance(wo.entries[1], ListKVEvents) for wo in worker_outputs)
    # The native child still gets its container (its own bookkeeping).
    assert c.bus.publish(c.schedule(out)) == [stored(2)]
    assert all(w.sub_connectors[0].drained == 1 for w in c.workers)


@pytest.mark.parametrize("output", ["raw", "objects"])
def test_take_events_output_format(bus, output):
    c = Cluster([any_child()], bus, tp=2, kv_events_output=output)
    for r in range(2):
        c.emit(r, 0, [stored(1)])
    c.scheduler.update_connector_output(c.aggregate().kv_connector_output)
    events = list(c.scheduler.take_events())
    kind = msgspec.Raw if output == "raw" else type(stored(1))
    assert [type(e) for e in events] == [kind]
    assert c.bus.publish(events) == [stored(1)]


# --- the container ---------------------------------------------------------------
def test_container_pickles_out_of_band_and_aggregates_without_decoding(
    bus, monkeypatch
):
    c = Cluster([child("LMCacheChild"), child("SilentChild")], bus, tp=4)
    events = chain(5)
    for r in range(4):
        c.emit(r, 0, events)
    outputs = [worker_output(w) for w in c.workers]

    # Protocol 5: each EventBatch is a PickleBuffer; nothing is an event object.
    container = outputs[0].kv_connector_output.kv_cache_events
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(container, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1
    assert b"BlockStored" not in data and b"kv_events" not in data
    copy = pickle.loads(data, buffers=buffers)
    sent, got = container.outputs[0].entries[0], copy.outputs[0].entries[0]
    assert bytes(got) == bytes(sent)
    assert got.identities() == kvmerge.encode(events).identities()
    # Rule "all" in a world of 4: each event's bytes travel from one rank.
    sent_batches = [
        o.kv_connector_output.kv_cache_events.outputs[0].entries[0] for o in outputs
    ]
    assert sum(len(b) - b.uncarried for b in sent_batches) == len(events)
    assert (
        decode(
            copy.outputs[0],
            [o.kv_connector_output.kv_cache_events.outputs[0] for o in outputs],
        )
        == events
    )
    assert copy.outputs[0].entries[1] is None  # the silent child

    # Through the shm pickling and the aggregator, nothing gets decoded: the
    # outputs the scheduler merges are the very objects that were unpickled.
    received = [shm_roundtrip(o)[0] for o in outputs]
    sent_outputs = [o.kv_connector_output.kv_cache_events.outputs[0] for o in received]

    def no_decoding(self):
        raise AssertionError("worker outputs were decoded")

    monkeypatch.setattr(WorkerOutputs, "_events", no_decoding)
    out = c.aggregator.aggregate(received, output_rank=0)
    combined = out.kv_connector_output.kv_cache_events
    assert len(combined.outputs) == len(sent_outputs)
    assert all(a is b for a, b in zip(combined.outputs, sent_outputs, strict=True))
    assert combined.get_number_of_workers() == 4
    assert c.bus.publish(c.schedule(out)) == events
    monkeypatch.undo()

    # A generic consumer iterating get_all_events() still gets event objects.
    assert list(combined.get_all_events()) == events * 4
    assert len(combined.get_all_events()) == 20
    with pytest.raises(TypeError):
        combined.add_events([stored(1)])


def test_container_interface(bus):
    cfg = connector_config([any_child()], tp=2)
    workers = [create_connector(worker_config(cfg, r), WORKER) for r in range(2)]
    for w in workers:
        w.sub_connectors[0].emit([stored(1)])
    a, b = (w.get_kv_connector_kv_cache_events() for w in workers)
    assert bool(KVMergeKVEvents()) is True  # empty still counts as a worker
    assert a.aggregate() is a
    a.merge(b)
    a.increment_workers(1)
    assert [o.rank for o in a.outputs] == [0, 1] and a.get_number_of_workers() == 2
    with pytest.raises(ValueError):
        a.increment_workers(0)
    a.clear_events()
    assert a.outputs == () and a.get_number_of_workers() == 1


# --- misconfiguration ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("children", "extra", "needle"),
    [
        (
            [child("LMCacheChild"), child("MooncakeChild", kv_events_merge="majority")],
            {},
            "connectors[1] (MooncakeChild): kv_events_merge='majority'",
        ),
        (
            [
                child(
                    "LMCacheChild",
                    kv_events_merge="all",
                    kv_events_replication_factors=[2],
                )
            ],
            {},
            "connectors[0] (LMCacheChild): kv_events_replication_factors",
        ),
        (
            [child("MooncakeChild", kv_events_replication_factors=[1, 0])],
            {},
            "connectors[0] (MooncakeChild): kv_events_replication_factors=[1, 0]",
        ),
        ([child("LMCacheChild")], {"max_pending_steps": -1}, "max_pending_steps=-1"),
        ([child("LMCacheChild")], {"kv_events_output": "json"}, "kv_events_output"),
    ],
)
def test_misconfiguration_fails_at_construction(children, extra, needle):
    cfg = connector_config(children, **extra)
    for role in (SCHEDULER, WORKER):
        with pytest.raises(kvmerge.ConfigError) as err:
            create_connector(cfg, role)
        assert needle in str(err.value)


def test_quorum_without_factors_fails_at_the_first_step(bus):
    c = Cluster([child("LMCacheChild", kv_events_merge="quorum")], bus, tp=2)
    assert c.step() == []  # nothing reported yet: nothing to complain about
    for r in range(2):
        c.emit(r, 0, [stored(1)])
    msg = refused_step(c, [0, 1])
    assert "connectors[0] (LMCacheChild)" in msg
    assert "kv_events_merge='quorum'" in msg and "kv_events_replication_factors" in msg


def test_configured_factors_must_cover_reported_groups(bus):
    c = Cluster(
        [
            child(
                "ThirdPartyConnector",
                kv_events_merge="quorum",
                kv_events_replication_factors=[1],
            )
        ],
        bus,
        tp=2,
    )
    c.emit(0, 0, [stored(1, group=2)])
    msg = refused_step(c, [0])
    assert "connectors[0] (ThirdPartyConnector)" in msg
    assert "kv_events_replication_factors" in msg


# --- the whole path against the reference model ----------------------------------
@pytest.mark.parametrize(
    ("name", "extra", "rule", "factors"),
    [
        ("LMCacheChild", {}, "all", None),
        ("MooncakeChild", {"test_factors": [1, 2]}, "quorum", [1, 2]),
        pytest.param(
            "UMBPChild",
            {},
            "any",
            None,
            marks=pytest.mark.skipif(not HAS_UMBP, reason="no UMBP in this vLLM"),
        ),
        ("ThirdPartyConnector", {"kv_events_merge": "all"}, "all", None),
        (
            "ThirdPartyConnector",
            {"kv_events_merge": "quorum", "kv_events_replication_factors": [2, 1]},
            "quorum",
            [2, 1],
        ),
        ("ThirdPartyConnector", {"kv_events_merge": "any"}, "any", None),
    ],
)
def test_random_steps_match_the_reference_model(bus, name, extra, rule, factors):
    """Seeded random steps through workers, pickling, aggregator, scheduler and
    publisher publish what kvmerge.testing.reference's model says, step by step."""
    tp, steps, mps = 4, 14, 2
    rng = random.Random(f"{name}-{rule}")
    pool = [stored(h, group=h % 2) for h in range(1, 7)] + [removed(h) for h in (1, 2)]
    if name == "ThirdPartyConnector":
        pool.append(cleared())  # only list containers can carry it (not hashable)
    c = Cluster([child(name, **extra)], bus, tp=tp, max_pending_steps=mps)
    model = ReferenceMerger(tp, rule, factors, mps, guard=True)
    for _ in range(steps):
        for r in range(tp):
            worker_child = c.workers[r].sub_connectors[0]
            events = rng.choices(pool, k=rng.choice([0, 0, 1, 2, 3, 4]))
            worker_child.emit(events)
            # The model sees what the child's real container hands over.
            container = worker_child.make_container(list(events))
            model.add(r, list(container.get_all_events()) if container else [])
        assert_same_events(c.step(), model.finish_step())
    # The counters the plugin drives (one batch per rank per step, every event
    # reported); how reports end is the core's business (tests/test_merger*).
    keys = (
        "steps",
        "batches",
        "reports",
        "published",
        "withheld",
        "withheld_orphan",
        "withheld_duplicate",
        "withheld_unknown",
    )
    got = c.scheduler.merge_stats()[0]
    assert {k: got[k] for k in keys} == {k: model.stats.as_dict()[k] for k in keys}
    assert got["batches"] == steps * tp


def test_hybrid_kv_cache_manager_needs_every_child_to_support_it():
    cfg = connector_config([child("LMCacheChild")])
    # vLLM turned it off (the config is MultiConnector's, by the alias): turn
    # it on by hand, as --no-disable-hybrid-kv-cache-manager would; then vLLM's
    # factory refuses, as for MultiConnector with such a child.
    assert cfg.kv_transfer_config.kv_connector == "MultiConnector"
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache-manager"):
        create_connector(cfg, SCHEDULER)


def test_world_and_rank_under_the_external_launcher():
    # One scheduler per process, fed by its own worker only.
    cfg = worker_config(connector_config([child("LMCacheChild")], tp=4), 3)
    assert worker_rank(cfg) == 3 and aggregated_world_size(cfg) == 4
    cfg.parallel_config.distributed_executor_backend = "external_launcher"
    assert worker_rank(cfg) == 0 and aggregated_world_size(cfg) == 1


def test_worker_loss_is_logged_once_per_incident(bus, vllm_caplog):
    """A rank silent for three steps makes the other rank's reports expire step
    after step: one warning when it starts, one line when it is over."""
    c = Cluster([child("LMCacheChild")], bus, tp=2, max_pending_steps=1)
    for step in range(10):
        lost = 1 <= step <= 3  # rank 1's worker is gone for steps 1-3
        for r in (0,) if lost else (0, 1):
            c.emit(r, 0, [stored(step)])
        c.bus.publish(c.schedule(c.aggregate(ranks=[0] if lost else [0, 1])))
    lines = kvmerge_warnings(vllm_caplog)
    assert len(lines) == 2, lines
    assert "step 1: rank(s) [1] sent no output" in lines[0]
    assert "is over" in lines[1]
    assert "rank(s) [1] sent no output and 3 pending report(s) expired" in lines[1]
    assert c.scheduler.merge_stats()[0]["expired"] == 3


def test_every_line_names_the_output_mergers_step(bus, vllm_caplog):
    """One step number (``StepResult.step``, from 0) in every line: a step
    whose container is another connector's is not a step the merger counts,
    so it takes the number of the next merged step, and the steps after it
    keep the merger's numbers (the refusals once counted such steps apart)."""
    from vllm.v1.outputs import KVConnectorOutput

    c = Cluster([child("LMCacheChild")], bus, tp=2)
    for r in (0, 1):
        c.emit(r, 0, [stored(1)])
    assert c.step() == [stored(1)]  # merged step 0
    # Not a step of ours: named by the next merged step's number, 1.
    c.scheduler.update_connector_output(
        KVConnectorOutput(kv_cache_events=ListKVEvents([stored(9)]))
    )
    assert list(c.scheduler.take_events()) == []
    # Merged step 1: a second output claims rank 0.
    outputs = []
    for rank, events in ((0, [stored(2)]), (1, [stored(2)]), (0, [stored(3)])):
        c.emit(rank, 0, events)
        outputs.append(shm_roundtrip(worker_output(c.workers[rank]))[0])
    c.bus.publish(c.schedule(c.aggregator.aggregate(outputs, 0)))
    for r in (0, 1):  # merged step 2: every rank agrees again
        c.emit(r, 0, [stored(4)])
    assert c.step() == [stored(4)]
    lines = kvmerge_warnings(vllm_caplog)
    assert len(lines) == 5, lines
    assert "step 1: dropped rank ?'s batch: the aggregated events are a " in lines[0]
    assert "step 1: dropped rank 0's batch: a second output claims rank 0" in lines[1]
    assert (
        "rank ?'s batches are accepted again at step 1: 1 refused since step 1"
        in (lines[2])
    )
    # The refused second output's number is missing from rank 0's outputs.
    assert "step 2: rank 0's outputs 2..2 never arrived" in lines[3]
    assert (
        "rank 0's batches are accepted again at step 2: 1 refused since step 1"
        in (lines[4])
    )
    assert c.scheduler._merger.steps == 3


# --- start-up: every worker's settings are the scheduler's -----------------------
def mismatched_cluster(bus, **worker_changes):
    """A TP 2 cluster whose rank 1 worker was built from another config."""
    c = Cluster([child("LMCacheChild"), any_child()], bus, tp=2)
    odd = connector_config(
        worker_changes.pop("children", [child("LMCacheChild"), any_child()]),
        tp=2,
        **worker_changes,
    )
    c.workers[1] = create_connector(worker_config(odd, 1), WORKER)
    return c


@pytest.mark.parametrize(
    ("changes", "setting"),
    [
        ({"kv_events": False}, "kv_events: worker False, scheduler True"),
        ({"children": [child("LMCacheChild")]}, "connectors (label"),
        (
            {"children": [any_child(), child("LMCacheChild")]},
            "connectors (label",
        ),
        (
            {
                "children": [
                    child("LMCacheChild", kv_events_merge="any"),
                    any_child(),
                ]
            },
            "connectors (label",
        ),
    ],
    ids=["kv-events-off", "child-missing", "children-reordered", "other-rule"],
)
def test_a_worker_with_other_settings_fails_the_first_step_naming_it(
    bus, changes, setting
):
    c = mismatched_cluster(bus, **changes)
    with pytest.raises(kvmerge.ConfigError) as err:
        c.step()
    msg = str(err.value)
    assert "rank 1's settings differ from the scheduler's" in msg
    assert setting in msg


def test_after_start_up_a_restarted_worker_with_other_settings_is_dropped_and_logged(
    bus, caplog
):
    """Past the first step an error would be an outage: the odd worker's
    outputs are dropped, counted and logged with the rank and the setting;
    the others' batches merge as the rules give without them."""
    c = Cluster([child("LMCacheChild", kv_events_merge="any")], bus, tp=2)
    s1, s2 = stored(1), stored(2)
    c.emit(0, 0, [s1])
    c.emit(1, 0, [s1])
    assert c.step() == [s1]
    # Rank 1 restarts from a config with KV events off.
    odd = connector_config(
        [child("LMCacheChild", kv_events_merge="any")], tp=2, kv_events=False
    )
    c.workers[1] = create_connector(worker_config(odd, 1), WORKER)
    c.emit(0, 0, [s2])
    c.emit(1, 0, [s2])
    with caplog.at_level(logging.WARNING, logger="vllm.kvmerge"):
        assert c.step() == [s2]  # rank 0's batch ("any")
        c.emit(1, 0, [stored(3)])
        assert c.step() == []  # still dropped: rank 1 is misconfigured
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "rank 1's settings differ from the scheduler's" in text
    assert "kv_events: worker False, scheduler True" in text
    assert c.scheduler._children[0].refused == 2


# --- a damaged batch from one rank ------------------------------------------------
def damaged_roundtrip(obj, flip_at: int):
    """``shm_roundtrip`` with one byte of child 0's batch flipped (at
    ``flip_at`` in the batch) after the worker sent it, in the output's
    out-of-band buffer (as a bad link or a stray write would)."""
    batch = bytes(obj.kv_connector_output.kv_cache_events.outputs[0].entries[0])
    oob: list[bytearray] = []

    def callback(buf: pickle.PickleBuffer) -> bool:
        oob.append(bytearray(buf.raw()))
        return False

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=callback)
    assert len(oob) == 1, "the output's buffer goes out of band"
    start = oob[0].find(batch)
    assert start > 0
    oob[0][start + flip_at % len(batch)] ^= 0x40
    return pickle.loads(data, buffers=oob)


@pytest.mark.parametrize("flip_at", [0, 5, 17, 40, 99, -1])
def test_a_damaged_batch_drops_that_ranks_batch_only(bus, flip_at):
    """Unpickling one rank's damaged batch does not raise (vLLM's dequeue runs
    it); that rank's batch of that child and step is dropped and counted,
    and what is published equals the reference model without that batch."""
    tp, rule = 3, "any"
    c = Cluster([any_child(), child("LMCacheChild")], bus, tp=tp)
    models = [
        ReferenceMerger(tp, rule, guard=True),
        ReferenceMerger(tp, "all", guard=True),
    ]
    events = [[stored(10 * r + 1), stored(99)] for r in range(tp)]
    outputs = []
    for r in range(tp):
        for i in (0, 1):
            c.emit(r, i, events[r])
        out = worker_output(c.workers[r])
        outputs.append(
            damaged_roundtrip(out, flip_at) if r == 1 else shm_roundtrip(out)[0]
        )
        # Rank 1's batch of child 0 is the damaged one.
        models[0].add(r, [] if r == 1 else events[r])
        models[1].add(r, events[r])
    published = c.bus.publish(c.schedule(c.aggregator.aggregate(outputs, 0)))
    expected = models[0].finish_step() + models[1].finish_step()
    assert_same_events(published, expected)
    children = c.scheduler._children
    assert (children[0].refused, children[1].refused) == (1, 0)
