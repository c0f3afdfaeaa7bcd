"""The baseline kvmerge's cost is measured against in the real server
(``benches.serve``'s ``drain``): vLLM's ``MultiConnector`` whose workers
drain their children's events every step and drop them.

Plain ``MultiConnector`` never asks its children for their events, so under
it the children skip work they do under kvmerge (building each step's
events and their container). Here they do it and nothing is sent: what is
left between this and kvmerge is kvmerge's own cost.

With ``SPEND_KEY`` set (``benches.serve``'s ``spend``) it besides spends a
fixed CPU time every step on each side: kvmerge's measured time, without
anything else kvmerge does (its output's trip, its events' publishing).
"""

from __future__ import annotations

from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector as UpstreamMultiConnector,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput

#: The extra config's key of the CPU time to spend a step, in microseconds:
#: ``{"scheduler": us, "worker": us}``.
SPEND_KEY: Final = "kvmerge_spend_us"


def _spin(ns: int) -> None:
    # Busy, holding the GIL, as Python code on the step path does.
    end = perf_counter_ns() + ns
    while perf_counter_ns() < end:
        pass


class DrainingMultiConnector(UpstreamMultiConnector):
    """``MultiConnector``, its children's events built and dropped; with
    ``SPEND_KEY`` in its extra config, besides, a fixed CPU time spent every
    step in the scheduler's ``update_connector_output`` and in each worker's
    output (``benches.serve``'s ``spend``: kvmerge's measured time, nothing
    else of kvmerge's)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        # MultiConnector's own __init__ has checked the transfer config is set.
        ktc: Any = vllm_config.kv_transfer_config
        spend = ktc.kv_connector_extra_config.get(SPEND_KEY) or {}
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._spend_ns = int(float(spend.get(side, 0)) * 1000)

    def get_kv_connector_kv_cache_events(self) -> None:
        for connector in self._connectors:
            container = connector.get_kv_connector_kv_cache_events()
            if container is not None:
                container.get_all_events()
        if self._spend_ns:
            _spin(self._spend_ns)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        super().update_connector_output(connector_output)
        if self._spend_ns:
            _spin(self._spend_ns)


#: What vLLM's connector factory loads from this module: configured as
#: ``kv_connector="MultiConnector"`` with this module's path, so that every
#: check vLLM makes by the connector's name sees ``MultiConnector``, as for
#: kvmerge's (``kvmerge.vllm.alias``).
MultiConnector = DrainingMultiConnector
DRAIN_CONNECTOR: Final = "MultiConnector"
DRAIN_MODULE_PATH: Final = __name__
