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

Merged events leave ``take_events`` as ``msgspec.Raw`` (each event's msgpack
bytes, which vLLM's ``ZmqEventPublisher`` writes verbatim: a view of them in
the worker's message they came in) unless the connector's extra config says
``"kv_events_output": "objects"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

from vllm.distributed.kv_events import BlockRemoved, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorWorkerMetadata,
)

import kvmerge
from kvmerge import ConfigError, EventBatch, GroupError, KVMergeError, RankError, Rule
from kvmerge._kvmerge import _expired, _merge_children, _merge_common_step

from .alias import MODULE_PATH, UPSTREAM_NAME
from .config import (
    FACTORS_KEY,
    MERGE_KEY,
    ChildSpec,
    Mode,
    MultiSpec,
    Output,
    is_merged,
    parse_multi,
)
from .container import KVMergeKVEvents, WorkerOutput
from .families import (
    BY_NAME,
    FAMILY_NATIVE,
    FAMILY_REFUSED,
    Family,
    container_family,
    default_rule,
)
from .incidents import Incidents
from .log import get_logger
from .native import combine_native
from .refusals import Refusals
from .settings import differences, settings_of
from .stats import (
    StatsTracker,
    StepTimer,
    WithKVMergePromMetrics,
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

logger = get_logger(__name__)

_EMPTY: EventBatch | None = None

#: The kind of event a child's scheduler hook (``invalidate_kv_events``)
#: reads: it drops its own pending events of the blocks workers removed.
_HOOK_KIND: Final = "BlockRemoved"

#: ``_merge_children``'s view of one child (``_Child.plan``): its position in
#: the outputs, its family, replication factors and merger, and the kind of
#: events to return decoded for its hook, if any.
_Plan: TypeAlias = tuple[
    int,
    str,
    "tuple[int, ...] | None",
    "kvmerge.Merger",
    "Literal['BlockRemoved'] | None",
]


def _empty_batch() -> EventBatch:
    global _EMPTY
    if _EMPTY is None:
        _EMPTY = EventBatch.empty()
    return _EMPTY


class _Child:
    """Scheduler-side state of one child."""

    #: This child's batches dropped as bad, and its steps whose merged events
    #: were lost (read by the stats).
    refused: int = 0

    def __init__(
        self,
        spec: ChildSpec,
        connector: Any,
        world_size: int,
        max_pending_steps: int,
        output: Output,
    ) -> None:
        self.spec = spec
        self.connector = connector
        self.world_size = world_size
        self.max_pending_steps = max_pending_steps
        self.objects = output == "objects"
        #: Merged or native once known (configured, or from the first
        #: container a worker sent).
        self.mode: Mode | None = None
        #: The first container family seen (a child whose rule is inferred must
        #: stay consistent).
        self.family: Family | None = None
        self.rule: Rule | None = None
        self.factors: tuple[int, ...] | None = None
        self.factors_source = ""
        self.merger: kvmerge.Merger | None = None
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
        rule = spec.rule
        if rule == "native":
            self.mode = "native"
        elif is_merged(rule):
            self.mode = "merge"
            if rule != "quorum" or spec.factors is not None:
                self._make_merger(rule, spec.factors, FACTORS_KEY)

    @property
    def label(self) -> str:
        return f"KVMergeMultiConnector {self.spec.label}"

    def _rule_setting(self) -> str:
        if self.spec.rule is not None:
            return f"{MERGE_KEY}={self.spec.rule!r}"
        return f"{MERGE_KEY} (inferred {self.rule!r} from a {self.family} container)"

    def _make_merger(
        self, rule: Rule, factors: tuple[int, ...] | None, source: str
    ) -> None:
        try:
            self.merger = kvmerge.Merger(
                self.world_size,
                rule,
                list(factors) if factors is not None else None,
                self.max_pending_steps,
            )
        except ConfigError as e:
            raise ConfigError(
                f"{self.label}: rule {rule!r} with replication factors {factors} "
                f"(from {source or 'nowhere'}): {e}"
            ) from e
        self.rule, self.factors, self.factors_source = rule, factors, source
        logger.info(
            "%s: merging with rule %r, replication factors %s (from %s), "
            "world size %d, max_pending_steps %d",
            self.label,
            rule,
            factors,
            source or "none",
            self.world_size,
            self.max_pending_steps,
        )

    def _resolve(self, family: Family, reported: tuple[int, ...] | None) -> str | None:
        """Fix this child's mode, family and merger from a rank's container of
        ``family`` (with the replication factors it ``reported``); or say why
        this rank's container cannot join this child."""
        if self.family is None:
            self.family = family
        elif family != self.family:
            return (
                f"a {family} container, but this child returned {self.family} "
                "containers before"
            )
        if self.mode is None:
            self.mode = "native" if self.family == FAMILY_NATIVE else "merge"
        elif (family == FAMILY_NATIVE) != (self.mode == "native"):
            # The worker decided otherwise than this side's configuration.
            return (
                f"a {family} "
                f"{'container' if family == FAMILY_NATIVE else 'batch'}, but "
                f"the scheduler's {MERGE_KEY} setting is {self.spec.rule!r}: "
                "workers and scheduler must share the same kv_transfer_config"
            )
        if self.mode != "merge":
            return None
        if self.merger is None:
            rule = self.spec.rule_for(family)
            if not is_merged(rule):
                # An encoded container of a family this side passes through.
                return (
                    f"a {family} batch, but the scheduler infers {MERGE_KEY}="
                    f"{rule!r} for a {family} container: workers and scheduler must "
                    "share the same kv_transfer_config"
                )
            factors, source = self.spec.factors, FACTORS_KEY
            if rule == "quorum" and factors is None:
                factors, source = reported, f"the {family} container"
                if factors is None:
                    return (
                        f"{MERGE_KEY}='quorum' needs replication factors, one per "
                        f"KV cache group: set {FACTORS_KEY} in this child's "
                        "kv_connector_extra_config (its containers carry none)"
                    )
            try:
                self._make_merger(rule, factors, source)
            except ConfigError as e:
                return str(e)
        elif (
            self.rule == "quorum"
            and self.factors_source != FACTORS_KEY
            and reported is not None
            and tuple(reported) != self.factors
        ):
            return (
                f"replication factors {tuple(reported)}, others {self.factors}; "
                f"set {FACTORS_KEY} to choose"
            )
        return None

    def step(self, outputs: Sequence[WorkerOutput], refusals: Refusals) -> Any:
        """One aggregated step of this child, from the (checked, rank-ordered)
        worker outputs; returns this child's native container, if any.

        A rank's batch that cannot be merged (of another family than this
        child's, a bad batch, a group without a factor, a batch that does not
        carry bytes it must carry) is dropped and counted (``refused``); the
        other ranks' batches merge as if it had not been sent.

        The common case, once this child's mode, family and merger are fixed,
        does not come here: ``_merge_children`` merges it, and hands over
        any step it cannot take as it is.
        """
        index = self.spec.index
        empty = _empty_batch()
        batches: list[tuple[int, Any]] = []
        present: list[Any] = []
        for output in outputs:
            family = output.families[index]
            entry = output.entries[index]
            if family is None and entry is None:
                batches.append((output.rank, empty))
                continue
            why = output.child_problem(index)
            if why is None and family is not None:
                why = self._resolve(family=family, reported=output.factors[index])
            if why is not None:
                refusals.refuse(self, output.rank, why)
                batches.append((output.rank, empty))
            elif family is None:
                batches.append((output.rank, empty))
            else:
                present.append(entry)
                batches.append((output.rank, entry))
        if self.mode == "native":
            return combine_native(self.spec.label, present)
        merger = self.merger
        if merger is None:  # nothing sent by this child yet
            return None
        try:
            # All ranks of the step or none: a rejected batch leaves the
            # merger as it was, and the ranks are then added one by one.
            merger.add_all(batches)
        except KVMergeError:
            for rank, batch in batches:
                try:
                    merger.add(rank, batch)
                except KVMergeError as e:
                    refusals.refuse(self, rank, self._explain(e))
        try:
            if self.objects:
                events = merger.finish_step()
                if self.invalidate is not None:
                    removed = [e for e in events if isinstance(e, BlockRemoved)]
                    if removed:
                        self.invalidate(removed)
                self.out.extend(events)
            elif self.invalidate is not None:
                # The hook only reads removals: decode those alone.
                self.publish(*merger.finish_step_raw_and_decode(_HOOK_KIND))
            else:
                self.out.extend(merger.finish_step_raw())
        except KVMergeError as e:
            self.lose(merger, e, refusals)
        return None

    def lose(self, merger: kvmerge.Merger, e: KVMergeError, refusals: Refusals) -> None:
        """A step ``merger`` merged, but whose events could not be given out
        (a removal for the hook that does not decode): counted and logged."""
        refusals.lost(self, merger.step, self._explain(e))

    @property
    def settled(self) -> bool:
        """Whether this child's mode, family and merger are fixed for good,
        and so its ``plan``."""
        return self.mode == "native" or (
            self.merger is not None and self.family is not None
        )

    def plan(self) -> _Plan | None:
        """What ``_merge_children`` needs to merge this child's step without
        Python, once its mode, family and merger are fixed and its events
        leave as views; None until then (``step`` merges it)."""
        merger, family = self.merger, self.family
        if merger is None or family is None or self.mode != "merge" or self.objects:
            return None
        kind: Literal["BlockRemoved"] | None = (
            _HOOK_KIND if self.invalidate is not None else None
        )
        return (self.spec.index, family, self.factors, merger, kind)

    def publish(self, raws: list[Any], removed: list[Any] | None) -> None:
        """A finished step's events (as views), and those of ``_HOOK_KIND``
        decoded when this child has a hook that reads them."""
        if removed and self.invalidate is not None:
            self.invalidate(removed)
        self.out.extend(raws)

    def _explain(self, e: KVMergeError) -> str:
        if isinstance(e, GroupError):
            return (
                f"{self._rule_setting()} with replication factors {self.factors} "
                f"(from {self.factors_source}) does not cover its KV cache group: {e}"
            )
        return f"{type(e).__name__}: {e}"

    def reset(self) -> None:
        if self.merger is not None:
            self.merger.reset()
        self.out.clear()


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
        self._children: list[_Child] = []
        #: Scheduler side: its engine steps and its own time in them.
        self._timer = StepTimer()
        if role == KVConnectorRole.SCHEDULER:
            # What every worker should believe (rank aside): WorkerSettings.
            self._settings = settings_of(
                spec, self._world_size, -1, self._events_enabled
            )
            self._refusals = Refusals()
            self._misconfigured: set[int] = set()
            self._last_seq: dict[int, int] = {}
            #: Worker outputs that never arrived (a gap in a rank's seq).
            self.lost_outputs = 0
            # Quiet for a whole pending window: nothing of the incident is left.
            self._incidents = Incidents(self._world_size, spec.max_pending_steps + 1)
            self._steps = 0
            #: The mergers' expired counters after the last step (None: to
            #: be summed again, after reset_cache).
            self._expired_total: int | None = None
            #: Every child's plan, until the step of a child not yet settled
            #: runs (see ``_Child.settled``).
            self._plans: list[_Plan | None] | None = None
            self._children = [
                _Child(
                    child_spec,
                    connector,
                    self._world_size,
                    spec.max_pending_steps,
                    spec.output,
                )
                for child_spec, connector in zip(
                    spec.children, self._connectors, strict=True
                )
            ]

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
        n = len(self._connectors)
        families: list[Family | None] = [None] * n
        entries: list[Any] = [None] * n
        factors: list[tuple[int, ...] | None] = [None] * n
        for i, (spec, connector) in enumerate(
            zip(self._spec.children, self._connectors, strict=True)
        ):
            # Every child, every step: a child that returns None is drained too.
            container = connector.get_kv_connector_kv_cache_events()
            if container is None:
                continue
            family = container_family(container)
            encode = spec.encodes
            if encode is None:
                encode = is_merged(default_rule(family))
            if not encode:
                families[i], entries[i] = FAMILY_NATIVE, container
                continue
            if not self._events_enabled:
                continue
            info = BY_NAME.get(family)
            if info is not None and info.factors is not None:
                factors[i] = info.factors.read(container, connector)
            events = container.get_all_events()
            try:
                entries[i] = (
                    self._encode(events, spec, family, factors[i])
                    if events
                    else _empty_batch()
                )
            except KVMergeError as e:
                # On the step path: this child's events of this step are
                # lost, the rest goes on; the scheduler counts and logs it.
                why = (
                    f"cannot encode the events of its {type(container).__name__} "
                    f"(set {MERGE_KEY}='native' to pass them through unmerged): {e}"
                )
                logger.error(
                    "KVMergeMultiConnector %s: rank %d: %s",
                    spec.label,
                    self.worker_rank,
                    why,
                )
                families[i], entries[i] = FAMILY_REFUSED, why
                continue
            families[i] = family
        seq = self._seq
        self._seq += 1
        output = WorkerOutput(
            self.worker_rank,
            tuple(families),
            tuple(entries),
            tuple(factors),
            seq=seq,
            settings=(
                settings_of(
                    self._spec, self._world_size, self.worker_rank, self._events_enabled
                )
                if seq == 0
                else None
            ),
        )
        return KVMergeKVEvents.for_worker(output)

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
        rule = spec.rule_for(family)
        factors = spec.factors if spec.factors is not None else reported
        if not is_merged(rule) or (rule == "quorum" and not factors):
            # No merger can take this batch (the scheduler says why): keep it all.
            return kvmerge.encode(events)
        return kvmerge.encode(
            events,
            rank=self.worker_rank,
            world_size=self._world_size,
            rule=rule,
            replication_factors=list(factors) if rule == "quorum" and factors else None,
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
        return [
            child.merger.stats().as_dict() if child.merger is not None else None
            for child in self._children
        ]

    def _merge_step(self, outputs: Sequence[WorkerOutput]) -> list[Any]:
        children = self._children
        plans = self._plans
        if plans is None:
            # Kept until the step of a child not yet settled runs: nothing
            # else changes a plan.
            plans = self._plans = [child.plan() for child in children]
        # The common case (every output the next of a known rank, no
        # settings, one entry per child) is checked, ordered and merged in
        # one call; anything else is checked here, output by output.
        common = _merge_common_step(
            outputs, plans, WorkerOutput, self._last_seq, self._misconfigured
        )
        if common is None:
            ordered = self._checked(outputs)
            ranks = [o.rank for o in ordered]
            results = _merge_children(ordered, plans)
        else:
            # The ranks as read: an output that arrived packed stays so.
            ordered, ranks, results = common
        expired_before = self._expired_total
        if expired_before is None:
            expired_before = self._expired()
        refusals = self._refusals
        # Children in the common case are merged in that call; the others
        # (and any the call could not merge: the merger is then unchanged)
        # by their own step, which explains and counts what it drops.
        native: list[Any] = []
        for child, plan, result in zip(children, plans, results, strict=True):
            if result is False and child.merger is None:
                # No worker sent anything to a child with nothing to finish
                # (no events yet, or no KV events at all, as most
                # connectors): its step would unpack every output to find
                # that out, every step.
                native.append(None)
                continue
            if plan is None or result is None or result is False:
                if not child.settled:
                    self._plans = None
                native.append(child.step(ordered, refusals))
                continue
            if isinstance(result, KVMergeError):
                child.lose(plan[3], result, refusals)
            else:
                child.publish(*result)
            native.append(None)
        refusals.end_step()
        expired = self._expired_total = self._expired()
        self._incidents.observe(self._steps, ranks, expired - expired_before)
        self._steps += 1
        return native

    def _checked(self, outputs: Sequence[Any]) -> list[WorkerOutput]:
        """The outputs that can be merged, in rank order; the others refused
        (counted and logged with their rank)."""
        by_rank: dict[int, WorkerOutput] = {}
        for output in outputs:
            why = self._output_problem(output, by_rank)
            if why is not None:
                who = getattr(output, "rank", "?")
                self._refusals.refuse_output(self._children, who, why)
                continue
            by_rank[output.rank] = output
        return [by_rank[rank] for rank in sorted(by_rank)]

    def _output_problem(self, output: Any, seen: dict[int, WorkerOutput]) -> str | None:
        """Why a worker's output cannot be merged at all, or None.

        A worker whose settings differ from the scheduler's fails the engine on
        the first step (start-up: misconfiguration should stop it, loudly);
        from then on its outputs are dropped and logged, as any bad output.
        """
        if type(output) is not WorkerOutput and not isinstance(output, WorkerOutput):
            return f"not a WorkerOutput but {type(output).__name__}"
        why = output.problem()
        if why is not None:
            return why
        rank = output.rank
        if not 0 <= rank < self._world_size:
            return f"rank {rank} is outside the aggregated world of {self._world_size}"
        if rank in seen:
            return (
                f"a second output claims rank {rank} in one step (two workers "
                "with one rank? vLLM's salvaged outputs carry no KV events)"
            )
        if output.settings is not None:
            differ = differences(self._settings, output.settings, rank)
            if differ:
                message = (
                    f"KVMergeMultiConnector: rank {rank}'s settings differ from "
                    f"the scheduler's: {'; '.join(differ)}"
                )
                if self._steps == 0:
                    raise ConfigError(message)
                logger.error("%s: its outputs are dropped", message)
                self._misconfigured.add(rank)
                return "; ".join(differ)
            self._misconfigured.discard(rank)
        if rank in self._misconfigured:
            return "its settings differ from the scheduler's (logged at its start)"
        if len(output.families) != len(self._children):
            return (
                f"{output.num_children} children for {len(self._children)} "
                "connectors: workers and scheduler must share the same "
                "kv_transfer_config"
            )
        last = self._last_seq.get(rank)
        if last is not None and output.seq > last + 1:
            logger.warning(
                "KVMergeMultiConnector: step %d: rank %d's outputs %d..%d never "
                "arrived (vLLM drops the KV events of an output it salvages from "
                "a failed step); their events are lost, and the other ranks' "
                "reports of them will expire",
                self._steps,
                rank,
                last + 1,
                output.seq - 1,
            )
            self.lost_outputs += output.seq - last - 1
        self._last_seq[rank] = output.seq
        return None

    def _expired(self) -> int:
        return _expired([child.merger for child in self._children])

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
            self._refusals.refuse_output(
                self._children,
                "?",
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

    def take_events(self) -> Iterable[KVCacheEvent]:
        started = perf_counter_ns()
        events: list[Any] = []
        for child in self._children:
            if child.out:
                events.extend(child.out)
                child.out = []
            events.extend(child.connector.take_events())
        # vLLM's scheduler calls this once per step (update_from_output).
        timer = self._timer
        timer.steps += 1
        timer.ns += perf_counter_ns() - started
        return events

    def reset_cache(self) -> bool:
        try:
            return super().reset_cache()
        finally:
            for child in self._children:
                child.reset()
            if self._children:
                self._expired_total = None
                self._incidents.close(self._steps, "closed by reset_cache()")

    # ==============================
    # Stats (kvmerge.vllm.stats)
    # ==============================
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The children's stats as ``MultiConnector`` returns them; on the
        scheduler side, with kvmerge's counters and its steps and time since
        the previous call."""
        started = perf_counter_ns()
        children_stats = super().get_kv_connector_stats()
        if not self._children:
            return children_stats
        tracker = self.__dict__.get("_stats_tracker")
        if tracker is None:
            tracker = self._stats_tracker = StatsTracker()
        timer = self._timer
        stats = with_merge_stats(
            children_stats, tracker.collect(self._children), timer.collect()
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
