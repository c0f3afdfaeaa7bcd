"""Demo child connectors for ``kvmerge demo`` (not for serving: they move no KV).

``DemoLMCacheConnector``, ``DemoMooncakeConnector`` and ``DemoUMBPConnector``
stand in for vLLM 0.33.0's ``LMCacheConnectorV1``, ``MooncakeStoreConnector``
and ``UMBPStoreConnector`` where KV events are concerned, and nowhere else:

* worker side: ``get_kv_connector_kv_cache_events`` returns the REAL vLLM
  container of the connector it stands for (``LMCacheKVEvents``,
  ``MooncakeStoreKVEvents``, ``UMBPStoreKVEvents``), built as the upstream
  worker builds it: LMCache returns None when it has no events, the Mooncake
  store and UMBP always return a container. The events come from the demo's
  deterministic workload (``kvmerge.demo.workload``) for this worker's rank;
* scheduler side: ``update_connector_output``, ``take_events`` and
  ``reset_cache`` are the upstream connectors' own methods, so that the same
  children show vLLM's own behaviour when their containers reach them
  (``kvmerge demo --compare``).

They load through ``"kv_connector_module_path": "kvmerge.demo.connectors"``;
their ``kv_connector_extra_config`` holds ``{"kvmerge_demo": {...}}`` (the
demo's ``Settings``, the lane and the kind).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
    LMCacheConnectorV1,
    LMCacheKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
    MooncakeStoreConnector,
    MooncakeStoreKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.umbp.connector import (
    UMBPStoreConnector,
    UMBPStoreKVEvents,
)

from .workload import LaneScript, Settings

#: The key of the demo's settings in a child's kv_connector_extra_config.
EXTRA_KEY = "kvmerge_demo"


class _DemoStoreScheduler:
    """The store-side scheduler object the upstream Mooncake/UMBP methods call
    (``connector_scheduler``): no store behind it, no events of its own."""

    def __init__(self) -> None:
        self.load_specs: dict[str, Any] = {}
        self.invalidated = 0
        self.resets = 0

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def invalidate_kv_events(self, events: Iterable[KVCacheEvent]) -> None:
        self.invalidated += sum(1 for _ in events)

    def take_events(self) -> list[KVCacheEvent]:
        return []

    def reset_store(self) -> bool:
        self.resets += 1
        return True


class _DemoConnector(KVConnectorBase_V1):
    """Shared part: the workload lane, and the abstract methods (no KV moves)."""

    KIND = ""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        demo = dict(ktc.kv_connector_extra_config.get(EXTRA_KEY) or {})
        self.settings = Settings.from_extra(demo.get("settings", {}))
        self.lane = int(demo.get("lane", 0))
        kind = str(demo.get("kind", self.KIND))
        if kind != self.KIND:
            raise ValueError(f"{type(self).__name__} is the {self.KIND!r} demo lane")
        self.rank = int(vllm_config.parallel_config.rank)
        #: State the upstream scheduler-side methods use.
        self._kv_cache_events: Any = None
        self.connector_scheduler = _DemoStoreScheduler()
        self.script: LaneScript | None = None
        #: Set by an in-process driver that computes the workload once for
        #: every rank (``kvmerge demo --compare``): returns this step's events.
        self.events_source: Callable[[], list[KVCacheEvent]] | None = None

    # --- worker side ---------------------------------------------------------
    def next_events(self) -> list[KVCacheEvent]:
        """This rank's events for the next engine step (one call per step)."""
        if self.events_source is not None:
            return self.events_source()
        if self.script is None:
            self.script = LaneScript(self.settings, self.lane, self.KIND)
        return self.script.next_step().batches[self.rank]

    def make_container(self, events: list[KVCacheEvent]) -> KVConnectorKVEvents | None:
        raise NotImplementedError

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        return self.make_container(self.next_events())

    # --- nothing to load or save -----------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


class DemoLMCacheConnector(_DemoConnector):
    """Demo stand-in for ``LMCacheConnectorV1``'s KV events.

    Worker: None when this step has no events, else an ``LMCacheKVEvents``
    with ``num_workers=1``, as ``LMCacheConnectorV1`` builds it. Scheduler:
    ``LMCacheConnectorV1.update_connector_output`` / ``take_events``.
    """

    KIND = "lmcache"

    def make_container(self, events: list[KVCacheEvent]) -> LMCacheKVEvents | None:
        if not events:
            return None
        container = LMCacheKVEvents(num_workers=1)
        container.add_events(events)
        return container

    def update_connector_output(self, connector_output: Any) -> None:
        LMCacheConnectorV1.update_connector_output(self, connector_output)  # type: ignore[arg-type]

    def take_events(self) -> Iterable[KVCacheEvent]:
        return LMCacheConnectorV1.take_events(self)  # type: ignore[arg-type]


class DemoMooncakeConnector(_DemoConnector):
    """Demo stand-in for ``MooncakeStoreConnector``'s KV events.

    Worker: always a ``MooncakeStoreKVEvents`` (empty or not) carrying the
    group TP replication factors (two KV cache groups; the second one is
    replicated on half the ranks when the world size is even). Scheduler:
    ``MooncakeStoreConnector``'s own methods.
    """

    KIND = "mooncake"

    def make_container(self, events: list[KVCacheEvent]) -> MooncakeStoreKVEvents:
        factors = self.settings.factors(self.KIND)
        assert factors is not None
        container = MooncakeStoreKVEvents(
            num_workers=1, group_tp_replication_factors=factors
        )
        container.add_events(events)
        return container

    def update_connector_output(self, connector_output: Any) -> None:
        MooncakeStoreConnector.update_connector_output(self, connector_output)  # type: ignore[arg-type]

    def take_events(self) -> Iterable[KVCacheEvent]:
        return MooncakeStoreConnector.take_events(self)  # type: ignore[arg-type]

    def reset_cache(self) -> bool | None:
        return MooncakeStoreConnector.reset_cache(self)  # type: ignore[arg-type]


class DemoUMBPConnector(_DemoConnector):
    """Demo stand-in for ``UMBPStoreConnector``'s KV events.

    Worker: always a ``UMBPStoreKVEvents`` (a shared store: every rank reports
    the same events). Scheduler: ``UMBPStoreConnector``'s own methods.
    """

    KIND = "umbp"

    def make_container(self, events: list[KVCacheEvent]) -> UMBPStoreKVEvents:
        return UMBPStoreKVEvents(events)

    def update_connector_output(self, connector_output: Any) -> None:
        UMBPStoreConnector.update_connector_output(self, connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return UMBPStoreConnector.take_events(self)  # type: ignore[arg-type]

    def reset_cache(self) -> bool | None:
        return UMBPStoreConnector.reset_cache(self)  # type: ignore[arg-type]


CONNECTORS = {
    c.KIND: c for c in (DemoLMCacheConnector, DemoMooncakeConnector, DemoUMBPConnector)
}
