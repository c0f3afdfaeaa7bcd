"""What a worker believes, sent with its first output, checked by the scheduler.

Workers and the scheduler read the same ``kv_transfer_config``, so they agree
unless a deployment is inconsistent: another kvmerge release on some hosts, KV
events off on one worker, a different child list or rule, another world size.
Each of those would otherwise lose events without a word (a worker whose KV
events are off looks like a worker with nothing to report). The first output
of every worker process carries its ``WorkerSettings``; the scheduler's
``OutputMerger`` compares them with its own and names the rank and the
setting that differ.
"""

from __future__ import annotations

import kvmerge
from kvmerge._kvmerge import WorkerSettings

from .config import MultiSpec

__all__ = ["WorkerSettings", "settings_of"]


def settings_of(
    spec: MultiSpec, world_size: int, rank: int, kv_events: bool
) -> WorkerSettings:
    return WorkerSettings(
        kvmerge_version=kvmerge.__version__,
        world_size=world_size,
        rank=rank,
        kv_events=kv_events,
        children=tuple((c.label, c.rule, c.factors) for c in spec.children),
    )
