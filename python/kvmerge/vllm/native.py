"""Native children: children whose containers kvmerge does not merge itself.

The scheduler side rebuilds such a child's per-worker containers from the
worker outputs and combines them exactly as vLLM 0.33.0's
``KVOutputAggregator.aggregate`` would have, with the child's own methods; the
child's ``update_connector_output`` then receives the combined container and
its ``take_events`` drains it, so third-party connectors keep their semantics
(including which workers count: a worker that returned None is skipped, as
upstream does).
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm.distributed.kv_events import KVConnectorKVEvents


def combine_native(
    containers: Iterable[KVConnectorKVEvents],
) -> KVConnectorKVEvents | None:
    """Combine per-worker containers (in rank order) like ``KVOutputAggregator``,
    into the first: the step (``OutputMerger``) passed on only containers of
    a class the first is an instance of."""
    combined: KVConnectorKVEvents | None = None
    for container in containers:
        if combined is None:
            combined = container
        elif container:
            combined.add_events(container.get_all_events())
            combined.increment_workers(1)
    return combined or None
