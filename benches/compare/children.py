"""The child connectors of the benchmark, for both paths.

vLLM loads them by name through ``"kv_connector_module_path":
"benches.compare.children"``, as children of vLLM's own ``MultiConnector``
(path A) or of ``KVMergeMultiConnector`` (path B). Their worker sides return
the REAL vLLM containers, built exactly as the upstream workers build
them (``LMCacheConnectorV1`` and ``MooncakeStoreConnector``: create the
container, ``add_events``); their scheduler sides run the upstream
connectors' own ``update_connector_output`` and ``take_events``. Only the
stores behind them are left out: a worker's events for a step are handed in
with ``feed`` before the step. What moves no KV comes from the simulation
harness (``kvmerge.sim.children``: ``NoTransfer``, the store-scheduler
stand-in); the containers are built here, for the plugin tests' children too.

``ListChild`` stands for a third-party connector whose container is a plain
list. vLLM 0.33.0's ``AllBlocksCleared`` is not hashable, so the Counter-based
LMCache and Mooncake containers cannot carry it (``add_events`` raises
``TypeError``); a list container can. Path B merges it with rule ``"all"``
(``kv_events_merge`` override); path A uses its own scheduler side, which
applies LMCache's per-step rule (an event is kept when every worker of the
step reported it), counting events by their msgpack encoding since clears
cannot be hashed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents

from kvmerge import Rule
from kvmerge.sim.children import (
    ListKVEvents,
    NoTransfer,
    list_container,
    lmcache_container,
    mooncake_container,
    scheduler_for,
)
from kvmerge.vllm.families import BY_NAME

MODULE = __name__

#: child family -> (connector class name in this module, rule kvmerge applies:
#: a registered family's own, ``kvmerge.vllm.families``; the third-party
#: list's by its ``kv_events_merge`` override)
CHILDREN: dict[str, tuple[str, Rule]] = {
    "lmcache": ("BenchLMCacheConnector", BY_NAME["lmcache"].rule),
    "mooncake": ("BenchMooncakeConnector", BY_NAME["mooncake"].rule),
    "list": ("BenchListConnector", "all"),
}
#: Group TP replication factors of the Mooncake child's containers.
MOONCAKE_FACTORS = (1,)


class _Fed(NoTransfer):
    """Worker side: returns a container of the events ``feed`` handed in."""

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._next: list[KVCacheEvent] = []
        self._kv_cache_events: Any = None

    def feed(self, events: Sequence[KVCacheEvent]) -> None:
        """This worker's events for the next step (what its store produced)."""
        self._next = list(events)

    def _take_fed(self) -> list[KVCacheEvent]:
        events, self._next = self._next, []
        return events


class _Upstream(_Fed):
    """Scheduler side: the family's upstream connector's own methods, over
    the stand-in of its scheduler half (with the removal hook where the
    family's has one)."""

    FAMILY: str

    def __init__(self, vllm_config, role, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        info = BY_NAME[self.FAMILY]
        self._upstream = info.connector_class()
        if info.scheduler is not None:
            self.connector_scheduler = scheduler_for(info)()

    def update_connector_output(self, connector_output) -> None:
        self._upstream.update_connector_output(self, connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._upstream.take_events(self)


class BenchLMCacheConnector(_Upstream):
    FAMILY = "lmcache"

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return lmcache_container(self._take_fed())


class BenchMooncakeConnector(_Upstream):
    FAMILY = "mooncake"

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents:
        return mooncake_container(self._take_fed(), MOONCAKE_FACTORS)


_ENCODER = msgspec.msgpack.Encoder()


class BenchListConnector(_Fed):
    """Scheduler side: LMCache's per-step rule, keyed by encoding."""

    def get_kv_connector_kv_cache_events(self) -> ListKVEvents:
        return list_container(self._take_fed())

    def update_connector_output(self, connector_output) -> None:
        ev = connector_output.kv_cache_events
        if not isinstance(ev, ListKVEvents):
            return
        events = ev.get_all_events()
        keys = [_ENCODER.encode(e) for e in events]
        counts = Counter(keys)
        first: dict[bytes, KVCacheEvent] = {}
        for key, e in zip(keys, events, strict=True):
            first.setdefault(key, e)
        workers = ev.get_number_of_workers()
        kept = [first[k] for k, n in counts.items() if n == workers]
        self._kv_cache_events = (self._kv_cache_events or []) + kept

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._kv_cache_events = self._kv_cache_events or [], None
        return events


#: child family -> the function its worker uses to build a container.
CONTAINERS = {
    "lmcache": lmcache_container,
    "mooncake": mooncake_container,
    "list": list_container,
}


def reported(family: str, events: list[KVCacheEvent]) -> list[KVCacheEvent]:
    """What a worker of this child reports for ``events``: its container's
    ``get_all_events()`` (Counter containers group repeated events together),
    or nothing when it returns no container."""
    container = CONTAINERS[family](events)
    return [] if container is None else list(container.get_all_events())
