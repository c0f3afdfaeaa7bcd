"""``KVMergeMultiConnector``: vLLM's ``MultiConnector`` whose children's KV
events reach the publisher, merged across workers by ``kvmerge.Merger``.

Only the event path differs from upstream:

* worker side, ``get_kv_connector_kv_cache_events``: every step, every child
  is drained (children that return None too) and one ``KVMergeKVEvents`` is
  returned, always, holding this worker's rank and, per child (by position),
  the child's events encoded with ``kvmerge.encode`` for this rank (one
  batch: every event's record, the bytes only of the events this rank
  carries under the child's rule: docs/merge-rules.md, "Whose bytes
  travel"), or for a native child the child's own container;
* scheduler side, ``update_connector_output``: each merged child's batches of
  all workers' outputs go to the child's ``kvmerge.Merger`` (world size from
  the vLLM config), native children's containers are recombined with the
  child's own methods; every
  child then gets its ``update_connector_output`` with its own worker metadata
  and only its own (native) container;
* ``take_events``: per child, in config order, the merged events, then
  whatever the child's own ``take_events`` yields;
* ``reset_cache``: upstream behaviour, and every merger drops its pending state.
* ``get_num_new_matched_tokens``, ``request_finished``: upstream's, noting
  which requests run, for when kvmerge's stats go out (``kvmerge.vllm.stats``).

Merged events leave ``take_events`` as ``msgspec.Raw`` (each event's msgpack
bytes, which vLLM's ``ZmqEventPublisher`` writes verbatim: a view of them in
the worker's message they came in) unless the connector's extra config says
``"kv_events_output": "objects"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorWorkerMetadata,
)

import kvmerge
from kvmerge import EventBatch, KVMergeError, RankError
from kvmerge._kvmerge import OutputMerger, StepResult

from .alias import MODULE_PATH, UPSTREAM_NAME
from .config import (
    MERGE_KEY,
    ChildSpec,
    MultiSpec,
    parse_multi,
)
from .container import KVMergeKVEvents, WorkerOutput
from .families import (
    BY_NAME,
    Family,
    container_family,
    default_rule,
    implied_rules,
)
from .incidents import Incidents
from .log import get_logger
from .native import combine_native
from .refusals import Refusals
from .settings import settings_of
from .stats import (
    SchedulerReports,
    StatsTracker,
    StepTimer,
    WithKVMergePromMetrics,
    WorkerMeter,
    build_stats,
    with_merge_stats,
)
from .topology import aggregated_world_size, worker_rank

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)

_EMPTY: EventBatch | None = None


def _empty_batch() -> EventBatch:
    global _EMPTY
    if _EMPTY is None:
        _EMPTY = EventBatch.empty()
    return _EMPTY


class _Child:
    """Scheduler-side state of one child that is Python's: its connector,
    its merged events until ``take_events``, its removal hook and its
    refusal count. Its mode, family, rule and merger are the
    ``OutputMerger``'s."""

    #: This child's batches dropped as bad, and its steps whose merged events
    #: were lost (read by the stats).
    refused: int = 0

    def __init__(self, spec: ChildSpec, connector: Any) -> None:
        self.spec = spec
        self.connector = connector
        #: Merged events waiting for take_events.
        self.out: list[Any] = []
        # UMBP's scheduler drops its own pending events for blocks that workers
        # removed (upstream feeds it the workers' events, see
        # UMBPStoreConnector.update_connector_output); feed it what we publish.
        self.invalidate = getattr(
            getattr(connector, "connector_scheduler", None),
            "invalidate_kv_events",
            None,
        )

    @property
    def label(self) -> str:
        return f"KVMergeMultiConnector {self.spec.label}"

    def publish(self, events: list[Any], removed: list[Any] | None) -> None:
        """A finished step's events, and its removals decoded for the hook
        (None when the events are objects: picked from them)."""
        if self.invalidate is not None:
            if removed is None:
                removed = [e for e in events if isinstance(e, BlockRemoved)]
            if removed:
                self.invalidate(removed)
        self.out.extend(events)


class KVMergeMultiConnector(MultiConnector):
    """``MultiConnector`` that publishes every child's KV events, merged.

    Extra config (besides ``connectors``): ``max_pending_steps`` (int, default
    32) and ``kv_events_output`` (``"raw"``, default, or ``"objects"``); per
    child: ``kv_events_merge`` (``"all"``, ``"quorum"``, ``"any"`` or
    ``"native"``) and ``kv_events_replication_factors`` (list of int).
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        ktc = vllm_config.kv_transfer_config
        if ktc is None:
            raise ValueError("kv_transfer_config must be set for KVMergeMultiConnector")
        # Settings first: misconfiguration fails before any child is built.
        spec: MultiSpec = parse_multi(ktc.kv_connector_extra_config)
        if ktc.kv_connector != UPSTREAM_NAME:
            # A config made before the plugin loaded keeps kvmerge's own name
            # (alias): vLLM skipped everything it derives from the children
            # of a connector named "MultiConnector".
            if not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager and (
                not MultiConnector.all_children_support_hma(ktc)
            ):
                raise ValueError(
                    f"KVMergeMultiConnector: kv_connector is {ktc.kv_connector!r}, "
                    "the hybrid KV cache manager is enabled and not every child "
                    "connector supports it; name 'MultiConnector' with "
                    f"kv_connector_module_path {MODULE_PATH!r}, or pass "
                    "--disable-hybrid-kv-cache-manager"
                )
            if role == KVConnectorRole.SCHEDULER:
                logger.warning(
                    "KVMergeMultiConnector: kv_connector is %r, so vLLM derived "
                    "the KV roles and the children's engine-level setup as for a "
                    "single connector, not as for MultiConnector; name %r with "
                    "kv_connector_module_path %r to get MultiConnector's",
                    ktc.kv_connector,
                    UPSTREAM_NAME,
                    MODULE_PATH,
                )
        super().__init__(vllm_config, role, kv_cache_config)
        self._spec = spec
        events_config = vllm_config.kv_events_config
        # Without KV events nothing is published: children are still drained
        # every step, but their events are not encoded (native children still
        # send their containers, for the children's own bookkeeping).
        self._events_enabled = bool(
            events_config is not None and events_config.enable_kv_cache_events
        )
        self._world_size = aggregated_world_size(vllm_config)
        self._rank: int | None = None
        #: Worker side: how many outputs this worker has made.
        self._seq = 0
        #: Worker side: kvmerge's own time making them, and their bytes.
        self._meter = WorkerMeter()
        self._children: list[_Child] = []
        #: Scheduler side: its engine steps and its own time in them.
        self._timer = StepTimer()
        #: Scheduler side: the requests running, when its stats go out.
        self._reports = SchedulerReports()
        if role == KVConnectorRole.SCHEDULER:
            self._refusals = Refusals()
            #: Worker outputs that never arrived (a gap in a rank's seq).
            self.lost_outputs = 0
            # Quiet for a whole pending window: nothing of the incident is left.
            self._incidents = Incidents(self._world_size, spec.max_pending_steps + 1)
            self._children = [
                _Child(child_spec, connector)
                for child_spec, connector in zip(
                    spec.children, self._connectors, strict=True
                )
            ]
            # Every check and merge of a step (kvmerge._kvmerge.OutputMerger);
            # a configured merger that cannot be made fails here, at start-up.
            self._merger = OutputMerger(
                # What every worker should believe (rank aside): each child's
                # label, rule and factors among it.
                settings_of(spec, self._world_size, -1, self._events_enabled),
                spec.max_pending_steps,
                implied_rules(),
                KVConnectorKVEvents,
                [child.invalidate is not None for child in self._children],
                objects=spec.output == "objects",
                guard=spec.guard,
            )
            for i in range(len(self._children)):
                self._log_merger(i)

    # ==============================
    # Worker side
    # ==============================
    @property
    def worker_rank(self) -> int:
        """This worker's rank among the outputs the executor aggregates."""
        if self._rank is None:
            rank = worker_rank(self._vllm_config)
            if not 0 <= rank < self._world_size:
                raise RankError(
                    f"KVMergeMultiConnector: worker rank {rank} is outside the "
                    f"aggregated world of {self._world_size} workers"
                )
            self._rank = rank
        return self._rank

    def get_kv_connector_kv_cache_events(self) -> KVMergeKVEvents:
        entries: list[Any] = [None] * len(self._connectors)
        # kvmerge's own time: encoding and the output, not the children's calls.
        encode_ns = 0
        for i, (spec, connector) in enumerate(
            zip(self._spec.children, self._connectors, strict=True)
        ):
            # Every child, every step: a child that returns None is drained too.
            container = connector.get_kv_connector_kv_cache_events()
            if container is None:
                continue
            family = container_family(container)
            if spec.rule_for(family) == "native":
                entries[i] = container
                continue
            if not self._events_enabled:
                continue
            info = BY_NAME.get(family)
            try:
                # The container's methods are a third party's code.
                factors = (
                    info.factors.read(container, connector)
                    if info is not None and info.factors is not None
                    else None
                )
                events = container.get_all_events()
                started = perf_counter_ns()
                batch = (
                    self._encode(events, spec, family, factors)
                    if events
                    else _empty_batch()
                )
                encode_ns += perf_counter_ns() - started
            except Exception as e:
                # On the step path: this child's events of this step are
                # lost, the rest goes on; the scheduler counts and logs it.
                text = e if isinstance(e, KVMergeError) else f"{type(e).__name__}: {e}"
                why = (
                    f"cannot encode the events of its {type(container).__name__} "
                    f"(set {MERGE_KEY}='native' to pass them through unmerged): {text}"
                )
                logger.error(
                    "KVMergeMultiConnector %s: rank %d: %s",
                    spec.label,
                    self.worker_rank,
                    why,
                )
                entries[i] = why
                continue
            entries[i] = (family, batch, factors)
        seq = self._seq
        self._seq += 1
        started = perf_counter_ns()
        output = WorkerOutput.for_step(
            self.worker_rank,
            seq,
            entries,
            settings_of(
                self._spec, self._world_size, self.worker_rank, self._events_enabled
            )
            if seq == 0
            else None,
        )
        container = KVMergeKVEvents.for_worker(output)
        self._meter.add(encode_ns + perf_counter_ns() - started, output.nbytes)
        return container

    def _encode(
        self,
        events: list[Any],
        spec: ChildSpec,
        family: Family,
        reported: tuple[int, ...] | None,
    ) -> EventBatch:
        """This rank's batch of a child's events: every event's record, and
        the bytes only of the events this rank carries under the rule the
        scheduler's merger applies (``kvmerge.encode`` with a rank)."""
        plan = spec.config.plan(default_rule(family), reported)
        if plan is None:
            # No merger can take this batch (the scheduler says why): keep it all.
            return kvmerge.encode(events)
        rule, factors = plan
        return kvmerge.encode(
            events,
            rank=self.worker_rank,
            world_size=self._world_size,
            rule=rule,
            replication_factors=factors,
        )

    # ==============================
    # Scheduler side
    # ==============================
    @property
    def world_size(self) -> int:
        """The merge denominator: workers whose outputs the executor aggregates."""
        return self._world_size

    def merge_stats(self) -> list[dict[str, int] | None]:
        """Per child (config order): its merger's counters, None if it has none."""
        return [s.as_dict() if s is not None else None for s in self._merger.stats()]

    def _log_merger(self, index: int) -> None:
        merging = self._merger.describe(index)
        if merging is not None:
            logger.info("%s: merging with %s", self._children[index].label, merging)

    def _merge_step(self, outputs: Sequence[object]) -> list[Any]:
        """One step: ``OutputMerger.step`` checks and merges it; here its
        refusals are counted and logged, its events handed on, and the native
        children's containers combined."""
        result: StepResult = self._merger.step(outputs)
        children, refusals = self._children, self._refusals
        refusals.step = result.step
        for refusal in result.refusals:
            rank = refusal.rank
            if refusal.kind == "settings":
                logger.error(
                    "KVMergeMultiConnector: rank %s's settings differ from the "
                    "scheduler's: %s: its outputs are dropped",
                    rank,
                    refusal.detail,
                )
            if refusal.child is None:
                refusals.refuse_output(children, rank, refusal.detail)
            else:
                refusals.refuse(children[refusal.child], rank, refusal.detail)
        for rank, first, last in result.gaps:
            logger.warning(
                "KVMergeMultiConnector: step %d: rank %d's outputs %d..%d never "
                "arrived (vLLM drops the KV events of an output it salvages from "
                "a failed step); their events are lost, and the other ranks' "
                "reports of them will expire",
                result.step,
                rank,
                first,
                last,
            )
            self.lost_outputs += last - first + 1
        native: list[Any] = []
        for index, (child, took) in enumerate(
            zip(children, result.children, strict=True)
        ):
            if took.started:
                self._log_merger(index)
            if took.lost is not None:
                refusals.lost(child, took.lost)
            if took.natives is not None:
                native.append(
                    combine_native(took.natives, partial(refusals.refuse, child))
                )
                continue
            native.append(None)
            if took.events:
                child.publish(took.events, took.removed)
        refusals.end_step()
        self._incidents.observe(result.step, result.ranks, result.expired)
        return native

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self._role != KVConnectorRole.SCHEDULER:
            # Nothing to merge outside the scheduler: upstream's behaviour.
            super().update_connector_output(connector_output)
            return
        started = perf_counter_ns()
        n = len(self._children)
        events = connector_output.kv_cache_events
        native: list[KVConnectorKVEvents | None] = [None] * n
        if isinstance(events, KVMergeKVEvents):
            native = self._merge_step(events.outputs)
        elif events is not None:
            # Some other connector's container: no worker of ours made it.
            # The OutputMerger counts only the steps it merges: this one is
            # named by the number the next merged step takes.
            self._refusals.step = self._merger.steps
            self._refusals.refuse_output(
                self._children,
                None,
                f"the aggregated events are a {type(events).__name__}, not the "
                "workers' KVMergeKVEvents",
            )
            self._refusals.end_step()
        meta = connector_output.kv_connector_worker_meta
        if meta is not None and not isinstance(meta, MultiKVConnectorWorkerMetadata):
            raise TypeError(
                "KVMergeMultiConnector: expected MultiKVConnectorWorkerMetadata, "
                f"got {type(meta).__name__}"
            )
        # As upstream hands each child its own worker metadata: in the
        # caller's output, restored afterwards; here its own container too.
        try:
            for i, child in enumerate(self._children):
                connector_output.kv_cache_events = native[i]
                connector_output.kv_connector_worker_meta = (
                    meta.metadata[i] if meta is not None else None
                )
                child.connector.update_connector_output(connector_output)
        finally:
            connector_output.kv_cache_events = events
            connector_output.kv_connector_worker_meta = meta
        self._timer.ns += perf_counter_ns() - started

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # vLLM's scheduler asks this first of a request it schedules.
        self._reports.started(request.request_id)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(
        self, request: Request, blocks: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._reports.finished(request.request_id)
        return super().request_finished(request, blocks)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._reports.finished(request.request_id)
        return super().request_finished_all_groups(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        started = perf_counter_ns()
        events: list[Any] = []
        for child in self._children:
            if child.out:
                events.extend(child.out)
                child.out = []
            events.extend(child.connector.take_events())
        self._timer.ns += perf_counter_ns() - started
        return events

    def reset_cache(self) -> bool:
        try:
            return super().reset_cache()
        finally:
            if self._children:
                self._merger.reset()
                for child in self._children:
                    child.out.clear()
                self._incidents.close(self._merger.steps, "closed by reset_cache()")

    # ==============================
    # Stats (kvmerge.vllm.stats)
    # ==============================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The children's stats as ``MultiConnector`` returns them; on the
        scheduler side, with kvmerge's counters and its steps and time since
        the previous call; on a worker, with the outputs kvmerge made, its
        time making them and their bytes (at most once a second)."""
        started = perf_counter_ns()
        children_stats = super().get_kv_connector_stats()
        if not self._children:
            # Worker side (the scheduler always has children).
            return with_merge_stats(
                children_stats, None, worker=self._meter.collect(started)
            )
        timer = self._timer
        # vLLM's scheduler calls this once per step (update_from_output),
        # before take_events: a report counts its own step.
        timer.steps += 1
        if not self._reports.due_now(started):
            timer.ns += perf_counter_ns() - started
            return children_stats
        tracker = self.__dict__.get("_stats_tracker")
        if tracker is None:
            tracker = self._stats_tracker = StatsTracker()
        counters = [
            (child.spec.label, stats, child.refused)
            for child, stats in zip(self._children, self._merger.stats(), strict=True)
        ]
        stats = with_merge_stats(
            children_stats, tracker.collect(counters), timer.collect()
        )
        timer.ns += perf_counter_ns() - started
        return stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return build_stats(data, super().build_kv_connector_stats)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        children = super().build_prom_metrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )
        return WithKVMergePromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues, children
        )
