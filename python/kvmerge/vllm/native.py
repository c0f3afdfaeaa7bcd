"""Native children: children whose containers kvmerge does not merge itself.

The scheduler side rebuilds such a child's per-worker containers from the
worker outputs and combines them exactly as vLLM 0.33.0's
``KVOutputAggregator.aggregate`` would have, with the child's own methods; the
child's ``update_connector_output`` then receives the combined container and
its ``take_events`` drains it, so third-party connectors keep their semantics
(including which workers count: a worker that returned None is skipped, as
upstream does).

Those methods are a third party's code on vLLM's step path, where an
exception kills the engine (upstream's aggregator would die of it too). A
container whose methods raise costs only itself: its rank's container is
refused. The container the others are combined into may be half-changed by
its own failing method, so a raise there costs the child's step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm.distributed.kv_events import KVConnectorKVEvents

#: Called with the rank whose container is dropped and why.
Refuse = Callable[[int, str], None]


def combine_native(
    containers: Sequence[tuple[int, KVConnectorKVEvents]], refuse: Refuse
) -> KVConnectorKVEvents | None:
    """Combine per-worker ``(rank, container)`` (in rank order) like
    ``KVOutputAggregator``, into the first: the step (``OutputMerger``) passed
    on only containers of a class the first is an instance of."""
    if not containers:
        return None
    first_rank, combined = containers[0]
    for rank, container in containers[1:]:
        try:
            if not container:
                continue
            events = container.get_all_events()
        except Exception as e:
            refuse(rank, _raised(e))
            continue
        try:
            combined.add_events(events)
            combined.increment_workers(1)
        except Exception as e:
            refuse(first_rank, _raised(e, f"rank {rank}'s"))
            return None
    try:
        return combined if combined else None
    except Exception as e:
        refuse(first_rank, _raised(e))
        return None


def _raised(e: Exception, combining: str | None = None) -> str:
    where = (
        f"its container raised while {combining} events were added to it, "
        "so the child's combined events of this step are dropped"
        if combining
        else "its container raised"
    )
    return f"{where}: {type(e).__name__}: {e}"
