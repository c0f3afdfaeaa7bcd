"""``kvmerge demo --compare``: the same workload through vLLM's own path.

vLLM 0.33.0's ``MultiConnector`` publishes none of its children's events, so
"vLLM's own path" is what vLLM does for each child connector *alone*: every
worker returns the child's own container (``LMCacheKVEvents``,
``MooncakeStoreKVEvents``, ``UMBPStoreKVEvents``), a ``KVOutputAggregator``
combines them, and the child's own ``update_connector_output`` and
``take_events`` (the upstream methods) produce what the scheduler publishes.

Both paths run here, in this process, step by step and interleaved (which one
goes first alternates), on the same workload: each rank's events are computed
once per step and handed to both paths' worker-side connectors. Worker outputs
are pickled as vLLM's shm ``MessageQueue`` pickles them. The time measured is
the scheduler's: ``KVOutputAggregator.aggregate`` + ``update_connector_output``
+ ``take_events`` (for vLLM's path, summed over the children).
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pickle import PickleBuffer
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from .checks import StreamChecker
from .config import build, kvmerge_config, single_config
from .workload import LaneScript, Settings

OOB_THRESHOLD = 1024 * 1024  # MessageQueue.enqueue: buffers below 1 MiB in line


def shm_roundtrip(obj: Any) -> Any:
    """Pickle as ``MessageQueue.enqueue`` does, unpickle as ``dequeue`` does."""
    oob: list[Any] = []

    def callback(buf: PickleBuffer) -> bool:
        raw = buf.raw()
        if len(raw) < OOB_THRESHOLD:
            return True
        oob.append(bytearray(raw))
        return False

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL, buffer_callback=callback)
    return pickle.loads(data, buffers=oob)


def _output(events: Any, meta: Any = None) -> ModelRunnerOutput:
    out = KVConnectorOutput()
    out.kv_cache_events = events
    out.kv_connector_worker_meta = meta
    return ModelRunnerOutput.with_kv_conn_output_only(out)


@dataclass
class PathResult:
    checker: StreamChecker = field(default_factory=StreamChecker)
    ns: list[int] = field(default_factory=list)
    #: Events out per lane.
    out: list[int] = field(default_factory=list)


@dataclass
class CompareResult:
    steps: int
    kvmerge: PathResult
    vllm: PathResult
    errors: list[str] = field(default_factory=list)


class _Feed:
    """Hands one precomputed batch per call to a worker-side demo child."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def __call__(self) -> list[Any]:
        return self.events


def compare(
    settings: Settings,
    steps: int,
    max_pending_steps: int,
    *,
    progress: Callable[[int], None] | None = None,
    stop: Callable[[], bool] | None = None,
) -> CompareResult:
    world = settings.workers
    lanes = len(settings.kinds)
    scripts = [
        LaneScript(settings, lane, kind) for lane, kind in enumerate(settings.kinds)
    ]
    # feeds[lane][rank]: what that rank's child returns this step, both paths.
    feeds = [[_Feed() for _ in range(world)] for _ in range(lanes)]

    kv_sched = build(
        kvmerge_config(settings, max_pending_steps=max_pending_steps), SCHED
    )
    kv_workers = []
    for rank in range(world):
        w = build(
            kvmerge_config(settings, max_pending_steps=max_pending_steps, rank=rank),
            WORKER,
        )
        for lane, child in enumerate(w.sub_connectors):
            child.events_source = feeds[lane][rank]
        kv_workers.append(w)
    kv_agg = KVOutputAggregator.from_connector(kv_sched, world)

    up_sched = [build(single_config(settings, lane), SCHED) for lane in range(lanes)]
    up_workers = []
    for lane in range(lanes):
        row = []
        for rank in range(world):
            child = build(single_config(settings, lane, rank=rank), WORKER)
            child.events_source = feeds[lane][rank]
            row.append(child)
        up_workers.append(row)
    up_agg = [KVOutputAggregator.from_connector(c, world) for c in up_sched]

    result = CompareResult(0, PathResult(out=[0] * lanes), PathResult(out=[0] * lanes))
    kind_lane = {kind: lane for lane, kind in enumerate(settings.kinds)}

    def lane_of(event: Any) -> int | None:
        from .checks import KIND_OF_MEDIUM

        kind = KIND_OF_MEDIUM.get(getattr(event, "medium", None))  # type: ignore[arg-type]
        return kind_lane.get(kind) if kind is not None else None

    def run_kvmerge(pre: list[Any]) -> None:
        outputs = [
            shm_roundtrip(
                _output(
                    w.get_kv_connector_kv_cache_events(),
                    w.build_connector_worker_meta(),
                )
            )
            for w in kv_workers
        ]
        t0 = time.perf_counter_ns()
        out = kv_agg.aggregate(outputs, output_rank=0)
        kv_out = out.kv_connector_output if out is not None else None
        if kv_out:
            kv_sched.update_connector_output(kv_out)
        events = list(kv_sched.take_events())
        result.kvmerge.ns.append(time.perf_counter_ns() - t0)
        _account(result.kvmerge, pre + events)

    def run_vllm(pre: list[Any]) -> None:
        total = 0
        events: list[Any] = []
        for lane in range(lanes):
            outputs = [
                shm_roundtrip(_output(w.get_kv_connector_kv_cache_events()))
                for w in up_workers[lane]
            ]
            t0 = time.perf_counter_ns()
            out = up_agg[lane].aggregate(outputs, output_rank=0)
            kv_out = out.kv_connector_output if out is not None else None
            if kv_out:
                up_sched[lane].update_connector_output(kv_out)
            events.extend(up_sched[lane].take_events())
            total += time.perf_counter_ns() - t0
        result.vllm.ns.append(total)
        _account(result.vllm, pre + events)

    def _account(path: PathResult, events: list[Any]) -> None:
        # Through msgspec, as a subscriber sees them (kvmerge's are msgspec.Raw).
        decoded = _through_wire(events)
        path.checker.feed(decoded)
        for event in decoded:
            lane = lane_of(event)
            if lane is not None:
                path.out[lane] += 1

    for s in range(steps):
        if stop is not None and stop():
            break
        for lane, script in enumerate(scripts):
            step = script.next_step()
            for rank in range(world):
                feeds[lane][rank].events = step.batches[rank]
        pre: list[Any] = []
        if settings.resets_at(s):
            # reset_prefix_cache(reset_connector=True): the GPU cache's clear
            # goes first in the step's batch; the connectors are reset.
            pre = [AllBlocksCleared()]
            kv_sched.reset_cache()
            for c in up_sched:
                c.reset_cache()
        for path in (run_kvmerge, run_vllm) if s % 2 == 0 else (run_vllm, run_kvmerge):
            try:
                path(pre)
            except Exception as e:  # vLLM's path may fail on what it is given
                name = "kvmerge" if path is run_kvmerge else "vLLM"
                result.errors.append(f"step {s}, {name}: {type(e).__name__}: {e}")
                if path is run_kvmerge:
                    raise
        result.steps = s + 1
        if progress is not None:
            progress(s + 1)
    return result


def _through_wire(events: list[Any]) -> list[Any]:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    if not events:
        return []
    payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
    return list(msgspec.msgpack.decode(payload, type=KVEventBatch).events)


SCHED = KVConnectorRole.SCHEDULER
WORKER = KVConnectorRole.WORKER
