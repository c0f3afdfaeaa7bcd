"""The connector's guard (docs/merge-rules.md, "Guard") through vLLM's real
classes: on by default, off with ``kv_events_guard: false``, and any other
value refused at start-up naming the setting."""

from __future__ import annotations

import pytest
from support.vllm_harness import Cluster, child, removed, stored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvmerge import ConfigError
from kvmerge.sim.model import connector_config, create_connector
from kvmerge.vllm.config import GUARD_KEY

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("registered")]


def _steps(c: Cluster) -> list[list[object]]:
    """A store of 1, the same store again, a removal of a block never
    stored: every rank alike, a step each."""
    out = []
    for events in ([stored(1, None)], [stored(1, None)], [removed(7)]):
        for r in range(c.world_size):
            c.emit(r, 0, events)
        out.append(c.step())
    return out


def test_the_guard_withholds_and_counts_what_no_router_can_apply(bus):
    c = Cluster([child("LMCacheChild")], bus, tp=2)
    assert _steps(c) == [[stored(1, None)], [], []]
    stats = c.scheduler.merge_stats()[0]
    assert (stats["withheld_duplicate"], stats["withheld_unknown"]) == (1, 1)
    assert stats["published"] == 1


def test_kv_events_guard_false_publishes_what_the_rules_publish(bus):
    c = Cluster([child("LMCacheChild")], bus, tp=2, **{GUARD_KEY: False})
    assert _steps(c) == [[stored(1, None)], [stored(1, None)], [removed(7)]]
    assert c.scheduler.merge_stats()[0]["withheld"] == 0


@pytest.mark.parametrize("value", ["no", 0, None])
def test_kv_events_guard_must_be_a_bool(value):
    cfg = connector_config([child("LMCacheChild")], tp=2, **{GUARD_KEY: value})
    with pytest.raises(ConfigError, match=f"{GUARD_KEY}=.* must be true or false"):
        create_connector(cfg, KVConnectorRole.SCHEDULER)
