"""The two event paths, each with real vLLM 0.33.0 configs and connectors.

Path A, vLLM 0.33.0 as shipped: vLLM's ``MultiConnector`` with the benchmark's
children. Upstream ``MultiConnector`` has no event support, so each child's
events travel on their own: per rank, each child's worker side returns its
native container (``LMCacheKVEvents``, ``MooncakeStoreKVEvents``), wrapped in a
``KVConnectorOutput`` / ``ModelRunnerOutput`` as the model runner wraps it;
the rank's outputs are pickled in one message; on the scheduler each child's
outputs go through a ``KVOutputAggregator`` and the child's own
``update_connector_output`` and ``take_events``.

Path B, kvmerge: ``KVMergeMultiConnector`` with the same children; per rank
one ``ModelRunnerOutput`` holding its ``KVMergeKVEvents``, the same pickling,
one ``KVOutputAggregator``, and the connector's ``update_connector_output`` and
``take_events``.

Both paths share the simulation harness's configs and connectors
(``kvmerge.sim.model``) and ``transport`` (the shm ``MessageQueue``'s
pickling), and are timed by the caller around the same calls:
``worker(rank)`` (the rank's worker-side event call plus pickling) and
``scheduler(wires)`` (unpickling, aggregation, ``update_connector_output``,
``take_events`` drained to a list).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvmerge import DEFAULT_MAX_PENDING_STEPS
from kvmerge.sim.model import (
    CONNECTOR,
    MODULE_PATH,
    child_entry,
    connector_config,
    create_connector,
    worker_config,
)
from kvmerge.sim.transport import Wire, dequeue, enqueue
from kvmerge.vllm.config import MAX_PENDING_KEY, OUTPUT_KEY

from . import children as bench_children

SCHEDULER = KVConnectorRole.SCHEDULER
WORKER = KVConnectorRole.WORKER


def bench_entry(family: str) -> dict[str, Any]:
    """The ``connectors`` entry of the benchmark's child of ``family``."""
    cls_name, rule = bench_children.CHILDREN[family]
    extra: dict[str, Any] = {}
    if family == "list":
        # An unknown container: kvmerge merges it only when told a rule.
        extra["kv_events_merge"] = rule
    return child_entry(cls_name, bench_children.MODULE, extra)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """vLLM warns at every connector and config it builds; the bench builds
    dozens (the same warnings each time)."""
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


@lru_cache(maxsize=32)
def path_config(
    connector: str, world_size: int, families: tuple[str, ...], output: str = "raw"
) -> VllmConfig:
    """The config of a path: ``connector`` (vLLM's ``MultiConnector`` by its
    name, or kvmerge's) over the children of ``families``, TP ``world_size``."""
    module_path = None
    extra: dict[str, Any] = {}
    if connector == CONNECTOR:
        module_path = MODULE_PATH
        extra = {MAX_PENDING_KEY: DEFAULT_MAX_PENDING_STEPS, OUTPUT_KEY: output}
    with _quiet():
        cfg = connector_config(
            [bench_entry(k) for k in families],
            tp=world_size,
            connector=connector,
            module_path=module_path,
            **extra,
        )
    # As --disable-hybrid-kv-cache-manager: kvmerge's connector named as such
    # (not through the alias) needs it where the platform keeps the hybrid
    # manager on (vLLM 0.32's CPU build); elsewhere vLLM has turned it off.
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = True
    return cfg


def _build(cfg: VllmConfig, role: KVConnectorRole) -> Any:
    with _quiet():
        return create_connector(cfg, role)


def _wrap(container: Any) -> ModelRunnerOutput:
    """``KVConnectorModelRunnerMixin``: the events in a ``KVConnectorOutput``,
    in a ``ModelRunnerOutput``."""
    out = KVConnectorOutput()
    out.kv_cache_events = container
    return ModelRunnerOutput.with_kv_conn_output_only(out)


def _scheduler_step(
    aggregator: KVOutputAggregator,
    connector: Any,
    wires: Sequence[Wire],
    *,
    hand_events: bool = True,
) -> list[Any]:
    """vLLM's scheduler side of one step with one connector: every rank's
    message unpickled, aggregated, handed to the connector (without the
    aggregated events unless ``hand_events``), its events drained."""
    output = aggregator.aggregate([dequeue(w) for w in wires], output_rank=0)
    kv_out = output.kv_connector_output if output is not None else None
    if kv_out:
        if not hand_events:
            kv_out.kv_cache_events = None
        connector.update_connector_output(kv_out)
    return list(connector.take_events())


class Path:
    name = "?"
    label = "?"

    def __init__(self, world_size: int, families: Sequence[str]) -> None:
        self.world_size = world_size
        self.families = tuple(families)
        self.workers: list[Any] = []

    def feed(self, events: Sequence[Sequence[Sequence[Any]]]) -> None:
        """Hand each rank's children their events for the next step."""
        for rank, worker in enumerate(self.workers):
            for i, child in enumerate(worker.sub_connectors):
                child.feed(events[i][rank])

    def worker(self, rank: int) -> Wire:
        raise NotImplementedError

    def scheduler(self, wires: Sequence[Wire]) -> Any:
        raise NotImplementedError

    def per_child(self, result: Any) -> list[list[Any]]:
        """The scheduler's output of one step, per child (for the checks)."""
        raise NotImplementedError


class PathA(Path):
    """vLLM 0.33.0's own path: each child's native container on its own."""

    name = "A"
    label = "vLLM 0.33.0"

    def __init__(self, world_size: int, families: Sequence[str]) -> None:
        super().__init__(world_size, families)
        cfg = path_config("MultiConnector", world_size, self.families)
        self.multi = _build(cfg, SCHEDULER)
        self.children = self.multi.sub_connectors
        self.workers = [
            _build(worker_config(cfg, r), WORKER) for r in range(world_size)
        ]
        self._worker_children = [w.sub_connectors for w in self.workers]
        self.aggregators = [
            KVOutputAggregator.from_connector(c, world_size) for c in self.children
        ]

    def worker(self, rank: int) -> Wire:
        outputs = tuple(
            _wrap(child.get_kv_connector_kv_cache_events())
            for child in self._worker_children[rank]
        )
        return enqueue(outputs)

    def scheduler(self, wires: Sequence[Wire]) -> list[list[Any]]:
        received = [dequeue(w) for w in wires]
        result = []
        for i, child in enumerate(self.children):
            output = self.aggregators[i].aggregate(
                [r[i] for r in received], output_rank=0
            )
            kv_out = output.kv_connector_output if output is not None else None
            if kv_out:
                child.update_connector_output(kv_out)
            result.append(list(child.take_events()))
        return result

    def per_child(self, result: list[list[Any]]) -> list[list[Any]]:
        return result


class EmptyEvents(KVConnectorKVEvents):
    """The least a rank's KV events can cost vLLM's scheduler side: a
    container that holds nothing, whose methods do nothing (``Floor`` with
    ``envelope``)."""

    __slots__ = ()

    def add_events(self, events: list[KVCacheEvent]) -> None:
        pass

    def aggregate(self) -> EmptyEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        pass

    def get_all_events(self) -> list[KVCacheEvent]:
        return []

    def get_number_of_workers(self) -> int:
        return 1

    def clear_events(self) -> None:
        pass


class Floor:
    """vLLM's scheduler side with no KV events at all: per rank a
    ``ModelRunnerOutput`` without a ``KVConnectorOutput``, the
    ``KVOutputAggregator``, and upstream ``MultiConnector``'s
    ``update_connector_output`` and ``take_events`` over the same children.
    Any path that carries KV events pays at least this per step: the floor
    under path B's scheduler side (``--profile``).

    With ``envelope``, each rank's message carries an ``EmptyEvents`` in a
    ``KVConnectorOutput``, as a rank's container travels, and the
    aggregator combines them; the children then get the output without it,
    as a merged child of path B gets none. What vLLM charges any event path
    that sends one container per rank, before it does anything with it."""

    def __init__(
        self, world_size: int, families: Sequence[str], *, envelope: bool = False
    ) -> None:
        self.world_size = world_size
        self.envelope = envelope
        cfg = path_config("MultiConnector", world_size, tuple(families))
        self.multi = _build(cfg, SCHEDULER)
        self.aggregator = KVOutputAggregator.from_connector(self.multi, world_size)

    def wires(self) -> list[Wire]:
        return [
            enqueue(_wrap(EmptyEvents() if self.envelope else None))
            for _ in range(self.world_size)
        ]

    def scheduler(self, wires: Sequence[Wire]) -> list[Any]:
        return _scheduler_step(self.aggregator, self.multi, wires, hand_events=False)


class PathB(Path):
    """kvmerge: ``KVMergeMultiConnector``."""

    name = "B"
    label = "kvmerge"

    def __init__(
        self, world_size: int, families: Sequence[str], output: str = "raw"
    ) -> None:
        super().__init__(world_size, families)
        cfg = path_config(CONNECTOR, world_size, self.families, output)
        self.connector = _build(cfg, SCHEDULER)
        self.workers = [
            _build(worker_config(cfg, r), WORKER) for r in range(world_size)
        ]
        self.aggregator = KVOutputAggregator.from_connector(self.connector, world_size)
        self._published = [0] * len(self.families)

    def worker(self, rank: int) -> Wire:
        return enqueue(_wrap(self.workers[rank].get_kv_connector_kv_cache_events()))

    def scheduler(self, wires: Sequence[Wire]) -> list[Any]:
        return _scheduler_step(self.aggregator, self.connector, wires)

    def per_child(self, result: list[Any]) -> list[list[Any]]:
        """Split the step's events by child, with the mergers' public counters
        (each child's merged events come out in config order, and the
        benchmark's children add none of their own on this path)."""
        stats = self.connector.merge_stats()
        out: list[list[Any]] = []
        at = 0
        for i, s in enumerate(stats):
            published = s["published"] if s is not None else 0
            n, self._published[i] = published - self._published[i], published
            out.append(result[at : at + n])
            at += n
        if at != len(result):
            raise AssertionError(
                f"path B published {len(result)} events, its mergers count {at}"
            )
        return out
