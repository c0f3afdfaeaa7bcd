"""The baseline kvmerge's cost is measured against in the real server
(``benches.serve``'s ``drain``): vLLM's ``MultiConnector`` whose workers
drain their children's events every step and drop them.

Plain ``MultiConnector`` never asks its children for their events, so under
it the children skip work they do under kvmerge (building each step's
events and their container). Here they do it and nothing is sent: what is
left between this and kvmerge is kvmerge's own cost.
"""

from __future__ import annotations

from typing import Final

from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector as UpstreamMultiConnector,
)


class DrainingMultiConnector(UpstreamMultiConnector):
    """``MultiConnector``, its children's events built and dropped."""

    def get_kv_connector_kv_cache_events(self) -> None:
        for connector in self._connectors:
            container = connector.get_kv_connector_kv_cache_events()
            if container is not None:
                container.get_all_events()


#: What vLLM's connector factory loads from this module: configured as
#: ``kv_connector="MultiConnector"`` with this module's path, so that every
#: check vLLM makes by the connector's name sees ``MultiConnector``, as for
#: kvmerge's (``kvmerge.vllm.alias``).
MultiConnector = DrainingMultiConnector
DRAIN_CONNECTOR: Final = "MultiConnector"
DRAIN_MODULE_PATH: Final = __name__
