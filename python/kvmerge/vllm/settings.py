"""What a worker believes, sent with its first output, checked by the scheduler.

Workers and the scheduler read the same ``kv_transfer_config``, so they agree
unless a deployment is inconsistent: another kvmerge release on some hosts, KV
events off on one worker, a different child list or rule, another world size.
Each of those would otherwise lose events without a word (a worker whose KV
events are off looks like a worker with nothing to report). The first output
of every worker process carries its ``WorkerSettings``; the scheduler compares
them with its own and names the rank and the setting that differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import kvmerge

from .config import ChildRule, MultiSpec


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    kvmerge_version: str
    world_size: int
    rank: int
    kv_events: bool
    #: Per child, in config order: (label, configured rule, configured factors).
    children: tuple[tuple[str, ChildRule | None, tuple[int, ...] | None], ...]


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


def differences(scheduler: WorkerSettings, worker: object, rank: int) -> list[str]:
    """Each setting in which a worker's output differs from the scheduler's view,
    as ``"setting: worker ..., scheduler ..."``; empty when they agree."""
    if not isinstance(worker, WorkerSettings):
        return [f"settings: worker sent {type(worker).__name__}, not WorkerSettings"]
    found = []
    if worker.rank != rank:
        found.append(f"rank: worker believes {worker.rank}, its output says {rank}")
    for name in ("kvmerge_version", "world_size", "kv_events"):
        theirs, ours = getattr(worker, name), getattr(scheduler, name)
        if theirs != ours:
            found.append(f"{name}: worker {theirs!r}, scheduler {ours!r}")
    if worker.children != scheduler.children:
        found.append(
            "connectors (label, kv_events_merge, kv_events_replication_factors): "
            f"worker {list(worker.children)}, scheduler {list(scheduler.children)}"
        )
    return found
