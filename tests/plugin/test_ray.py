"""KVMergeMultiConnector across Ray actors (issue 7), on a local, loopback-only
Ray cluster that this module starts and tears down.

Four Ray actors act as the ranks of a TP=4 group (a real gloo group, so each
connector takes its rank from vLLM's parallel state); each holds one worker-side
``KVMergeMultiConnector`` whose children return vLLM's own containers
(``LMCacheKVEvents``, ``MooncakeStoreKVEvents``, ``UMBPStoreKVEvents`` or,
on a vLLM without UMBP, a list container merged by rule "any", and a
third-party container on the native path). Each step the driver collects the
four ``ModelRunnerOutput``s, combines them with a real ``KVOutputAggregator``,
runs the scheduler connector and publishes through a real ``ZmqEventPublisher``;
what a SUB socket reads back must equal ``reference.ReferenceMerger``'s merge.

Two transports carry the outputs:

* ``ray.get`` of the actor methods' results: Ray's serialization and object
  store (what a Ray-driven worker pool or a custom executor uses);
* the response ``MessageQueue`` of vLLM 0.33.0's ``RayExecutorV2``
  (``RayWorkerProc._init_message_queues``): TCP for a worker on another node,
  shared memory for one on the executor's node. This is the path a multi-node
  vLLM 0.33.0 deployment actually takes (docs/deployment.md).

The zero-copy tests look at where the bytes of a large batch live in the
driver after ``ray.get``: in Ray's plasma mapping (/dev/shm) or on the heap.
"""

from __future__ import annotations

import gc
import pickle
import random
import socket
from collections.abc import Callable
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from support import ray_actors as ra  # noqa: E402
from support.vllm_harness import (  # noqa: E402
    Bus,
    any_child,
    any_container,
    child,
    cleared,
    removed,
    stored,
)
from vllm.distributed.device_communicators.shm_broadcast import (  # noqa: E402
    MessageQueue,
)
from vllm.distributed.kv_transfer.kv_connector.utils import (  # noqa: E402
    KVOutputAggregator,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
)
from vllm.v1.executor.multiproc_executor import WorkerProc  # noqa: E402

import kvmerge  # noqa: E402
from kvmerge import EventBatch  # noqa: E402
from kvmerge.sim.children import lmcache_container, mooncake_container  # noqa: E402
from kvmerge.sim.model import connector_config, create_connector  # noqa: E402
from kvmerge.sim.transport import OOB_THRESHOLD  # noqa: E402
from kvmerge.testing.reference import (  # noqa: E402
    COUNTERS,
    ReferenceMerger,
    assert_same_events,
)
from kvmerge.vllm import KVMergeKVEvents  # noqa: E402

# A hang guard: the module takes well under two minutes on an idle 2-core box.
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(420),
    pytest.mark.usefixtures("registered"),
]

TP = 4
FACTORS = [1, 2]
CHILDREN = [
    child("LMCacheChild"),
    child("MooncakeChild", test_factors=FACTORS),
    any_child(),
    # vLLM 0.33.0's own containers cannot hold AllBlocksCleared (unhashable):
    # a list container with rule "all" carries the clears.
    child("ThirdPartyConnector", kv_events_merge="all"),
    child("ThirdPartyConnector", test_min_reports=2),
]
#: The merged children's rules; the last child is native (its own container).
RULES: list[tuple[str, list[int] | None]] = [
    ("all", None),
    ("quorum", FACTORS),
    ("any", None),
    ("all", None),
]
NATIVE = len(RULES)
#: Stores in the big step's LMCache batch ("all": each rank carries the bytes
#: of a quarter of them, and every record): 14000 x about 100 bytes, 1.4 MB
#: per rank, far over Ray's 100 KiB limit for objects returned inline, so
#: each output goes through the plasma store (and over 1 MiB: out of band in
#: the MessageQueue too).
BIG = 14000
BIG_START = 10**6
RAY_TIMEOUT = 120


# --- the cluster ---------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    saved = ra.start_ray(num_cpus=2, object_store_mb=256)
    try:
        yield ray
    finally:
        left = ra.stop_ray(saved)
        assert not left, f"Ray processes left after ray.shutdown(): {left}"


@pytest.fixture(scope="module")
def ranks(ray_cluster):
    """TP actors in a real gloo TP group, in rank order."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # num_cpus=0 as vLLM's RayExecutorV2 creates its worker actors.
    actor_cls = ray.remote(num_cpus=0)(ra.RankActor)
    actors = [
        actor_cls.remote(rank, CHILDREN, TP, dist_port=port) for rank in range(TP)
    ]
    try:
        # Each actor imports vLLM: about 10 CPU seconds.
        info = ray.get([a.ready.remote() for a in actors], timeout=300)
        # The ranks come from vLLM's parallel state (parallel_config.rank is 0).
        assert [i["rank"] for i in info] == list(range(TP))
        assert {i["connector"] for i in info} == {"KVMergeMultiConnector"}
        assert len({i["pid"] for i in info}) == TP
        yield actors
    finally:
        try:
            ray.get([a.close.remote() for a in actors], timeout=30)
        finally:
            for a in actors:
                ray.kill(a)


# --- the script: what each rank's children emit --------------------------------
def make_script(seed: int, steps: int) -> list[list[list[Any]]]:
    """``script[step][rank][child]``: events (or None) per child, random but
    shaped like real reports: stores in parent order, late and missing
    reports, duplicates, removals, a clear."""
    rng = random.Random(seed)
    lmcache_pool = [stored(h, h - 1 if h > 1 else None) for h in range(1, 13)]
    mooncake_pool = [stored(100 + h, group=h % 2) for h in range(10)] + [
        removed(100 + h) for h in range(3)
    ]
    umbp_pool = [stored(200 + h) for h in range(8)] + [removed(200 + h) for h in (0, 1)]
    list_pool = [stored(400 + h, 399 + h if h else None) for h in range(8)]
    third_pool = [stored(300 + h) for h in range(6)]

    def pick(pool: list[Any], k: int) -> list[Any]:
        idx = sorted(rng.sample(range(len(pool)), k=min(k, len(pool))))
        return [pool[i] for i in idx]

    script = []
    for step in range(steps):
        per_rank = []
        for _rank in range(TP):
            lm = pick(lmcache_pool, rng.randint(0, 6))
            if lm and rng.random() < 0.2:
                lm.append(lm[0])  # a rank's own duplicate
            mc = pick(mooncake_pool, rng.randint(0, 5))
            um = pick(umbp_pool, rng.randint(0, 4))
            if um and rng.random() < 0.3:
                um.append(um[-1])
            ls = pick(list_pool, rng.randint(0, 4))
            if step >= steps // 2 and rng.random() < 0.3:
                ls.insert(rng.randint(0, len(ls)), cleared())
            tp_ = None if rng.random() < 0.25 else pick(third_pool, rng.randint(0, 3))
            per_rank.append([lm, mc, um, ls, tp_])
        script.append(per_rank)
    return script


def big_step() -> list[list[Any]]:
    """Every rank stores the same long chain (the LMCache child), nothing else."""
    chain = ("chain", BIG, BIG_START)
    return [[chain, [], [], [], []] for _ in range(TP)]


class Expected:
    """The reference merge of a script, child by child, step by step."""

    def __init__(self) -> None:
        # The connector guards every child's merger: so does the model.
        self.refs = [
            ReferenceMerger(TP, rule, factors, guard=True) for rule, factors in RULES
        ]

    def step(self, per_rank: list[list[Any]]) -> list[Any]:
        events: list[Any] = []
        for i, ref in enumerate(self.refs):
            for rank, per_child in enumerate(per_rank):
                ref.add(rank, handed_over(i, resolve(per_child[i])))
            events.extend(ref.finish_step())
        # ThirdPartyConnector (native): the aggregated container holds every
        # worker's events in rank order (workers that returned None skipped);
        # its take_events publishes those reported at least twice, in
        # first-report order.
        counts: dict[Any, int] = {}
        for per_child in per_rank:
            for e in per_child[NATIVE] or []:
                counts[e] = counts.get(e, 0) + 1
        events.extend(e for e, n in counts.items() if n >= 2)
        return events


def handed_over(index: int, events: list[Any] | None) -> list[Any]:
    """What the child's real container hands over (``get_all_events``): the
    upstream containers count (LMCache, Mooncake: duplicates grouped) or
    de-duplicate (UMBP) the events they are given."""
    if not events:
        return []
    if index == 0:
        container: Any = lmcache_container(events)
    elif index == 1:
        container = mooncake_container(events, tuple(FACTORS))
    elif index == 2:
        return any_container(events)
    else:
        return list(events)
    return list(container.get_all_events())


def resolve(events: Any) -> Any:
    if isinstance(events, tuple) and events[0] == "chain":
        return ra.chain_events(*events[1:])
    return events


def scheduler_side() -> tuple[Any, KVOutputAggregator]:
    cfg = connector_config(CHILDREN, tp=TP)
    scheduler = create_connector(cfg, KVConnectorRole.SCHEDULER)
    return scheduler, KVOutputAggregator.from_connector(scheduler, TP)


#: How a test gets the TP outputs of one step: (step, per rank the events per
#: child) -> outputs
#: in rank order (and, for ray.get, the object refs they came from).
Collect = Callable[[int, list[list[Any]]], tuple[list[Any], list[Any]]]


def schedule(
    scheduler: Any, aggregator: KVOutputAggregator, outputs: list[Any], step: int
) -> list[Any]:
    """The executor's and the scheduler's part of one step; returns the events
    handed to the publisher."""
    for rank, out in enumerate(outputs):
        container = out.kv_connector_output.kv_cache_events
        assert isinstance(container, KVMergeKVEvents)
        assert [o.rank for o in container.outputs] == [rank]
    out = aggregator.aggregate(outputs, output_rank=0)
    kv_out = out.kv_connector_output
    # Every rank finished req-{step}: the aggregator reports it once.
    assert kv_out.finished_sending == {f"req-{step}"}
    assert kv_out.kv_cache_events.get_number_of_workers() == TP
    scheduler.update_connector_output(kv_out)
    return list(scheduler.take_events())


def run_script(collect: Collect, bus: Bus, seed: int, steps: int) -> None:
    """Random steps: what the SUB socket reads equals the reference merge,
    step by step, and the mergers' counters equal the model's."""
    scheduler, aggregator = scheduler_side()
    expected = Expected()
    published = 0
    for step, per_rank in enumerate(make_script(seed, steps)):
        outputs, _refs = collect(step, per_rank)
        got = bus.publish(schedule(scheduler, aggregator, outputs, step))
        assert_same_events(got, expected.step(per_rank))
        published += len(got)
    assert published > 0
    stats = scheduler.merge_stats()
    assert stats[:NATIVE] == [ref.stats.as_dict() for ref in expected.refs]
    assert stats[NATIVE] is None  # the native child has no merger


def run_big_step(
    collect: Collect,
    bus: Bus,
    inspect: Callable[[list[Any], list[Any]], None] | None = None,
) -> None:
    """Every rank stores the same BIG-store chain in one step: rule "all"
    publishes each store once, in chain order (the reference model's answer,
    which the model itself takes minutes to compute for this many events)."""
    scheduler, aggregator = scheduler_side()
    per_rank = big_step()
    outputs, refs = collect(0, per_rank)
    for out in outputs:
        batch = out.kv_connector_output.kv_cache_events.outputs[0].entries[0]
        assert isinstance(batch, EventBatch) and len(batch) == BIG
        assert batch.nbytes > OOB_THRESHOLD  # out of band in the MessageQueue too
    if inspect is not None:  # before the aggregator adds to outputs[0]
        inspect(outputs, refs)
    got = bus.publish(schedule(scheduler, aggregator, outputs, 0))
    assert_same_events(got, ra.chain_events(BIG, BIG_START))
    idle = dict.fromkeys(COUNTERS, 0) | {"steps": 1, "batches": TP}
    reports = TP * BIG
    assert scheduler.merge_stats() == [
        idle | {"reports": reports, "published": BIG, "consumed": reports},
        idle,
        idle,
        idle,
        None,
    ]


# --- through ray.get -------------------------------------------------------------
def collect_ray_get(ranks: list[Any]) -> Collect:
    def collect(step: int, per_rank: list[list[Any]]) -> tuple[list[Any], list[Any]]:
        refs = [
            a.step.remote(per_rank[rank], finished_sending={f"req-{step}"})
            for rank, a in enumerate(ranks)
        ]
        return ray.get(refs, timeout=RAY_TIMEOUT), refs

    return collect


def test_merged_events_through_ray_get_equal_the_reference_merge(ranks, bus):
    run_script(collect_ray_get(ranks), bus, seed=7, steps=8)


def test_large_batches_travel_out_of_band_through_the_object_store(ranks, bus):
    run_big_step(collect_ray_get(ranks), bus, inspect=check_sizes)


def check_sizes(outputs: list[Any], refs: list[Any]) -> None:
    sizes = ray.experimental.get_object_locations(refs, timeout_ms=10_000)
    for ref, out in zip(refs, outputs, strict=True):
        entries = out.kv_connector_output.kv_cache_events.outputs[0].entries
        batch = entries[0]
        # Ray serializes with cloudpickle, protocol 5, every PickleBuffer out
        # of band whatever its size; the same pickling here shows what Ray
        # had to store: the worker's output as one buffer (its header and
        # every child's batch), and a small in-band pickle with no event in it.
        oob: list[pickle.PickleBuffer] = []
        inband = pickle.dumps(out, protocol=5, buffer_callback=oob.append)
        batches = sum(p.nbytes for p in entries if isinstance(p, EventBatch))
        assert len(oob) == 1
        assert batches < oob[0].raw().nbytes < batches + 1024
        assert len(inband) < 8 * 1024, len(inband)
        # Over Ray's 100 KiB inline limit: the output lives in the plasma
        # store, data + metadata little more than the batch.
        loc = sizes[ref]
        assert loc["node_ids"], loc
        assert batch.nbytes < loc["object_size"] < batch.nbytes + 16 * 1024, loc


# --- zero copy -------------------------------------------------------------------
@pytest.fixture(scope="module")
def probed(ranks):
    """A large batch returned by a rank, once as an ``EventBatch`` and once as
    a ``BufferProbe`` (the same pickling, recording what the unpickler hands
    to ``EventBatch.from_buffer``)."""
    ra.PROBES.clear()
    ref = ranks[1].probe.remote(BIG)
    obj = ray.get(ref, timeout=RAY_TIMEOUT)
    assert len(ra.PROBES) == 1
    loc = ray.experimental.get_object_locations([ref], timeout_ms=10_000)[ref]
    # Keep the ref (and so the plasma object) alive for the whole module.
    yield ref, obj, ra.PROBES[0], loc


def test_ray_hands_its_buffer_over_without_copying(probed):
    _ref, obj, probe, loc = probed
    nbytes = obj["nbytes"]
    # What EventBatch.from_buffer receives from Ray's unpickler: Ray's own
    # read-only SubBuffer (not a bytes/bytearray copy), of the batch's size...
    assert probe["chain"] == ["ray._raylet.SubBuffer"]
    assert probe["readonly"] and probe["nbytes"] == nbytes
    # ...pointing into the plasma store's shared mapping, where Ray's
    # documented zero-copy numpy arrays of the same object live too.
    assert ra.in_object_store(probe["buffer_address"]), probe["buffer_mapping"]
    array_address = obj["array"].ctypes.data
    assert ra.in_object_store(array_address)
    assert ra.mapping_of(array_address) == probe["buffer_mapping"]
    assert not obj["array"].flags.writeable
    # The object holds the batch three times (batch, probe, array) and a
    # little framing: events are never pickled one by one.
    assert 3 * nbytes < loc["object_size"] < 3 * nbytes + 16 * 1024, loc
    # Either way the batch the Rust side reads is intact.
    batch = obj["batch"]
    assert bytes(batch) == bytes(probe["batch"]) == bytes(obj["array"])
    assert len(batch.decode()) == BIG


def test_rust_side_borrows_rays_buffer_when_the_caller_vouches(ranks):
    """Inside ``kvmerge.borrow_buffers()`` the batch the Rust side reads is
    Ray's plasma buffer itself; outside it, the same object is copied once
    (the SubBuffer type also views reusable compiled-graph channels)."""
    ref = ranks[1].probe.remote(BIG)
    ra.PROBES.clear()
    with kvmerge.borrow_buffers():
        borrowed = ray.get(ref, timeout=RAY_TIMEOUT)
    copied = ray.get(ref, timeout=RAY_TIMEOUT)
    inside, outside = ra.PROBES
    assert inside["chain"] == outside["chain"] == ["ray._raylet.SubBuffer"]
    assert inside["batch_address"] == inside["buffer_address"]
    assert ra.in_object_store(ra.address_of(borrowed["batch"]))
    assert outside["batch_address"] != outside["buffer_address"]
    assert not ra.in_object_store(outside["batch_address"])
    # The batch keeps the plasma object alive after the last ObjectRef is
    # gone: it holds Ray's buffer, which pins the object.
    del ref, copied, inside, outside
    ra.PROBES.clear()
    gc.collect()
    batch = borrowed["probe"]
    assert bytes(batch) == bytes(borrowed["batch"])
    assert batch.decode() == ra.chain_events(BIG)
    assert ra.in_object_store(ra.address_of(batch))


# --- through vLLM 0.33.0 RayExecutorV2's response MessageQueue -------------------
@pytest.mark.parametrize("same_node", [False, True], ids=["tcp", "shm"])
def test_merged_events_through_the_ray_executors_message_queue(ranks, bus, same_node):
    handles = ray.get(
        [a.open_response_mq.remote(same_node) for a in ranks], timeout=RAY_TIMEOUT
    )
    # The executor's side: MessageQueue.create_from_handle(handle, 0), as in
    # RayExecutorV2._init_executor; a worker on another node has no local
    # reader, so its queue is read over TCP (127.0.0.1 here).
    mqs = [MessageQueue.create_from_handle(h, 0) for h in handles]
    try:
        assert all(mq._is_remote_reader != same_node for mq in mqs)
        ready = [a.response_mq_ready.remote() for a in ranks]
        for mq in mqs:
            mq.wait_until_ready()
        ray.get(ready, timeout=RAY_TIMEOUT)

        def collect(
            step: int, per_rank: list[list[Any]]
        ) -> tuple[list[Any], list[Any]]:
            sent = [
                a.step_mq.remote(per_rank[rank], finished_sending={f"req-{step}"})
                for rank, a in enumerate(ranks)
            ]
            outputs = []
            for mq in mqs:  # MultiprocExecutor.collective_rpc's get_response
                status, output = mq.dequeue(timeout=RAY_TIMEOUT)
                assert status == WorkerProc.ResponseStatus.SUCCESS, output
                outputs.append(output)
            ray.get(sent, timeout=RAY_TIMEOUT)
            return outputs, []

        run_script(collect, bus, seed=11 + same_node, steps=5)
        run_big_step(collect, bus)
    finally:
        ray.get([a.close_response_mq.remote() for a in ranks], timeout=30)
        for mq in mqs:
            mq.shutdown()


# --- Ray compiled graphs (last: the graph takes the actor over until teardown) ---
def test_compiled_graph_channels_honour_the_out_of_band_pickling(ranks):
    """Ray compiled graphs move results through shared-memory channels with
    the same serialization context: the batch reaches EventBatch.from_buffer
    as a read-only SubBuffer into shared memory, never event by event."""
    from ray.dag import InputNode

    with InputNode() as inp:
        dag = ranks[2].probe.bind(inp)
    compiled = dag.experimental_compile()
    try:
        ra.PROBES.clear()
        obj = ray.get(compiled.execute(BIG), timeout=RAY_TIMEOUT)
        kept = obj["batch"]
        ray.get(compiled.execute(BIG), timeout=RAY_TIMEOUT)
    finally:
        compiled.teardown()
    probe = ra.PROBES[0]
    assert probe["chain"] == ["ray._raylet.SubBuffer"]
    assert probe["readonly"] and probe["nbytes"] == obj["nbytes"]
    assert "rw-s" in probe["buffer_mapping"], probe["buffer_mapping"]
    # A batch from the first execution is intact after the second.
    assert bytes(kept) == bytes(probe["batch"])
    assert len(kept.decode()) == BIG
