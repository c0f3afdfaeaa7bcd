"""Small child connectors for the vLLM plugin tests.

Loaded by vLLM's ``KVConnectorFactory`` through
``"kv_connector_module_path": "support.vllm_children"``. Their worker sides return the
REAL vLLM containers of each family (``kvmerge.vllm.families``:
``LMCacheKVEvents``, ``MooncakeStoreKVEvents``, ``UMBPStoreKVEvents`` where
the release has it), built exactly as the upstream connectors build them,
from events a test queues with ``emit``; their scheduler sides reuse the
upstream connectors' own ``update_connector_output`` / ``take_events``
functions, so that a child switched to ``"native"`` behaves as upstream. Only
the transfer engines behind them (LMCache, Mooncake, UMBP) are left out.

``ThirdPartyConnector`` has its own container type (unknown to kvmerge, the
benchmark's ``ListKVEvents``): its events take the native path.

The containers are built by ``kvmerge.sim.children``'s functions, and the
abstract methods of a connector that moves no KV come from
``kvmerge.sim.children.NoTransfer``. A child of a family the running vLLM
lacks is defined but unusable there (``FAMILY_OF`` says which family each
child stands for; ``support.vllm_harness.child`` skips a test that asks for
one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorWorkerMetadata,
)

from kvmerge.sim.children import (
    ListKVEvents,
    NoTransfer,
    list_container,
    lmcache_container,
    mooncake_container,
    umbp_container,
)
from kvmerge.vllm.families import BY_NAME


@dataclass
class CountMeta(KVConnectorWorkerMetadata):
    """Worker metadata that sums over workers (to check the split by position)."""

    tag: str
    count: int = 1

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, CountMeta) and other.tag == self.tag
        return CountMeta(self.tag, self.count + other.count)


@dataclass
class Received:
    """What a child's scheduler side got in one update_connector_output."""

    kv_cache_events: Any
    worker_meta: Any
    finished_sending: set[str] | None
    finished_recving: set[str] | None
    num_workers: int | None = None
    events: list[KVCacheEvent] = field(default_factory=list)


class _Scripted(NoTransfer):
    """Worker side: returns, per step, a container of what the test queued.

    ``emit(events)`` queues one step (``None``: the worker-side method returns
    None, as a connector with nothing to say). Steps with nothing queued use
    ``idle()``. Scheduler side: records every ``update_connector_output``.
    """

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        assert vllm_config.kv_transfer_config is not None
        self.extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config)
        self.queued: list[list[KVCacheEvent] | None] = []
        self.drained = 0
        self.received: list[Received] = []
        self._kv_cache_events: Any = None
        self.meta_tag: str | None = self.extra.get("test_meta_tag")

    # --- test API --------------------------------------------------------
    def emit(self, events: Sequence[KVCacheEvent] | None) -> None:
        self.queued.append(None if events is None else list(events))

    def idle(self) -> list[KVCacheEvent] | None:
        return None

    def make_container(self, events: list[KVCacheEvent]) -> KVConnectorKVEvents | None:
        raise NotImplementedError

    # --- worker side -----------------------------------------------------
    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        self.drained += 1
        events = self.queued.pop(0) if self.queued else self.idle()
        return None if events is None else self.make_container(events)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return CountMeta(self.meta_tag) if self.meta_tag else None

    # --- scheduler side --------------------------------------------------
    def _record(self, connector_output) -> None:
        ev = connector_output.kv_cache_events
        self.received.append(
            Received(
                kv_cache_events=ev,
                worker_meta=connector_output.kv_connector_worker_meta,
                finished_sending=connector_output.finished_sending,
                finished_recving=connector_output.finished_recving,
                num_workers=ev.get_number_of_workers() if ev is not None else None,
                events=list(ev.get_all_events()) if ev is not None else [],
            )
        )


class _Family(_Scripted):
    """Scheduler side: the family's upstream connector's own
    ``update_connector_output`` / ``take_events``."""

    FAMILY: str

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._upstream = BY_NAME[self.FAMILY].connector_class()

    def update_connector_output(self, connector_output) -> None:
        self._record(connector_output)
        self._upstream.update_connector_output(self, connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        events: Iterable[KVCacheEvent] = self._upstream.take_events(self)
        return events


class LMCacheChild(_Family):
    """Worker: None when there are no events, else an ``LMCacheKVEvents``
    (``LMCacheConnectorV1.get_kv_connector_kv_cache_events``)."""

    FAMILY = "lmcache"

    def make_container(self, events):
        return lmcache_container(events)


class _RecordingScheduler:
    """Stands in for a store connector's scheduler half (no store here)."""

    def __init__(self) -> None:
        self.outputs: list[Any] = []
        self.invalidated: list[KVCacheEvent] = []
        self.own_events: list[KVCacheEvent] = []

    def update_connector_output(self, connector_output) -> None:
        self.outputs.append(connector_output)

    def invalidate_kv_events(self, events) -> None:
        self.invalidated.extend(events)

    def take_events(self) -> list[KVCacheEvent]:
        events, self.own_events = self.own_events, []
        return events


class MooncakeChild(_Family):
    """Worker: always a ``MooncakeStoreKVEvents``, empty or not, with the group
    TP replication factors from ``test_factors`` (default ``[1]``)."""

    FAMILY = "mooncake"

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.factors = tuple(self.extra.get("test_factors", (1,)))
        self.connector_scheduler = _RecordingScheduler()

    def idle(self):
        return []

    def make_container(self, events):
        return mooncake_container(events, self.factors)


class UMBPChild(_Family):
    """Worker: always a ``UMBPStoreKVEvents``. Scheduler: upstream UMBP logic,
    with scheduler-side events queued by ``scheduler_emit``."""

    FAMILY = "umbp"

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.connector_scheduler = _RecordingScheduler()

    def idle(self):
        return []

    def scheduler_emit(self, events: Sequence[KVCacheEvent]) -> None:
        self.connector_scheduler.own_events.extend(events)

    def make_container(self, events):
        return umbp_container(events)


class SilentChild(_Scripted):
    """Never emits: the base class's ``get_kv_connector_kv_cache_events``."""

    def get_kv_connector_kv_cache_events(self):
        self.drained += 1
        return KVConnectorBase_V1.get_kv_connector_kv_cache_events(self)

    def update_connector_output(self, connector_output) -> None:
        self._record(connector_output)


class ThirdPartyConnector(_Scripted):
    """Its own semantics: publishes an event once at least ``test_min_reports``
    (default 2) reports of it arrived in one step, in first-report order."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.min_reports = int(self.extra.get("test_min_reports", 2))
        self.pending: list[KVCacheEvent] = []

    def make_container(self, events):
        return list_container(events)

    def update_connector_output(self, connector_output) -> None:
        self._record(connector_output)
        ev = connector_output.kv_cache_events
        if isinstance(ev, ListKVEvents):
            counts: dict[KVCacheEvent, int] = {}
            for e in ev.get_all_events():  # dicts keep first-report order
                counts[e] = counts.get(e, 0) + 1
            self.pending.extend(e for e, n in counts.items() if n >= self.min_reports)

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self.pending = self.pending, []
        return events


#: The family each family's child stands for, by class name.
FAMILY_OF: dict[str, str] = {
    cls.__name__: cls.FAMILY for cls in (LMCacheChild, MooncakeChild, UMBPChild)
}


class HookListChild(_Scripted):
    """A third-party child whose scheduler half has the removal hook (as
    UMBP's): a list container, merged by an override (``"any"`` stands in for
    UMBP on a vLLM without the family); its scheduler half's own events,
    queued by ``scheduler_emit``, are published after the merged ones."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.connector_scheduler = _RecordingScheduler()
        self.pending: list[KVCacheEvent] = []

    def idle(self):
        return []

    def scheduler_emit(self, events: Sequence[KVCacheEvent]) -> None:
        self.connector_scheduler.own_events.extend(events)

    def make_container(self, events):
        return list_container(events)

    def update_connector_output(self, connector_output) -> None:
        self._record(connector_output)
        self.connector_scheduler.update_connector_output(connector_output)
        self.pending.extend(self.connector_scheduler.take_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self.pending = self.pending, []
        return events


class FooKVEvents(ListKVEvents):
    """A container of no registered family (``test_families`` registers one
    for it for the length of a test)."""


class FooChild(ThirdPartyConnector):
    """``ThirdPartyConnector`` whose worker side returns ``FooKVEvents``."""

    def make_container(self, events):
        return FooKVEvents(events)
