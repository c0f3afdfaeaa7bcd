"""A connector family that exists nowhere but here: ``foo``, whose workers
report in a ``FooStoreKVEvents`` and which kvmerge merges with rule ``"any"``.

What a new family takes, end to end: its registry entry (``FOO``), and its
simulated child (``sim_child``: a ``SimChild`` subclass and its
``SimFamily``). Its upstream connector (``FooStoreConnector``) is only what a
child set to ``"native"`` would run. ``tests/sim/test_sim.py`` runs it
through vLLM's scheduler loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents

from kvmerge.sim.children import ListKVEvents, SimChild, SimFamily
from kvmerge.vllm.families import FamilyInfo

FOO = FamilyInfo(
    name="foo",
    module=__name__,
    container="FooStoreKVEvents",
    connector="FooStoreConnector",
    rule="any",
    factors=None,
    scheduler=None,
    hook=False,
    medium="DISK",
)


class FooStoreKVEvents(ListKVEvents):
    """The family's container: every worker's events, in order."""


class FooStoreConnector:
    """The family's own scheduler side: every event its workers reported,
    once per step (its own rule, which kvmerge replaces)."""

    def update_connector_output(self, connector_output: Any) -> None:
        events = connector_output.kv_cache_events
        self._kv_cache_events = events

    def take_events(self) -> Iterable[KVCacheEvent]:
        events, self._kv_cache_events = self._kv_cache_events, None
        return [] if events is None else list(events.get_all_events())


def sim_child() -> SimFamily:
    """The family's simulated child, made while ``FOO`` is registered
    (``kvmerge.vllm.families.extended``): a module attribute, as vLLM's
    connector factory finds it (``kv_connector_module_path``)."""

    class SimFoo(SimChild, family="foo"):
        @classmethod
        def make_container(
            cls, world_size: int, events: list[KVCacheEvent]
        ) -> KVConnectorKVEvents:
            return FooStoreKVEvents(events)

    SimFoo.__module__ = __name__
    SimFoo.__qualname__ = "SimFoo"
    globals()["SimFoo"] = SimFoo
    return SimFamily(SimFoo, {"late": True, "lost": True, "repeat": True}, 48)
