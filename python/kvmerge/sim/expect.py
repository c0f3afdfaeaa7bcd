"""What the published stream must be, from the rules and nothing else.

``Expected`` follows the engine step by step from each ``SchedulerOutput``'s
connector metadata, as every worker does: per simulated child one ``Tier``
(the same on every rank), every rank's ``Reporter`` (its faults), the events
each rank sends, and ``kvmerge.testing.reference.ReferenceMerger`` (the rules
of docs/merge-rules.md, written independently of the engine) merging them.
What it returns for a step is what the connector must publish in that step,
in child order.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from kvmerge import DEFAULT_MAX_PENDING_STEPS, Rule
from kvmerge.testing.reference import ReferenceMerger
from kvmerge.vllm.config import MAX_PENDING_KEY, MERGE_KEY, is_merged
from kvmerge.vllm.families import BY_NAME

from . import children
from .children import (
    EXTRA_KEY,
    ChildSettings,
    SaveMeta,
    SimChild,
)
from .tier import Reporter, Tier


@dataclass
class _Child:
    cls: type[SimChild]
    tier: Tier
    reporters: list[Reporter]
    merger: ReferenceMerger


def _rule(entry: Mapping[str, Any], cls: type[SimChild]) -> Rule:
    """kvmerge's rule for the child: its override, or its container's (also
    for a child set to vLLM's own path: what kvmerge would publish)."""
    extra = entry.get("kv_connector_extra_config") or {}
    override = extra.get(MERGE_KEY)
    if is_merged(override):
        return override
    return BY_NAME[cls.FAMILY].rule


class Expected:
    """Every simulated child's expected publications, step by step."""

    def __init__(self, config: Any) -> None:
        ktc = config.kv_transfer_config
        extra = ktc.kv_connector_extra_config
        self.world_size = int(config.parallel_config.world_size)
        self.block_size = int(config.cache_config.block_size)
        max_pending = int(extra.get(MAX_PENDING_KEY, DEFAULT_MAX_PENDING_STEPS))
        self.children: list[_Child | None] = []
        for entry in extra["connectors"]:
            # Where vLLM's connector factory finds it: a family's child
            # may live outside kvmerge.sim.children.
            module = entry.get("kv_connector_module_path")
            home = importlib.import_module(module) if module else children
            cls = getattr(home, entry["kv_connector"], None)
            child_extra = entry.get("kv_connector_extra_config") or {}
            if (
                not isinstance(cls, type)
                or not issubclass(cls, SimChild)
                or EXTRA_KEY not in child_extra
            ):
                self.children.append(None)
                continue
            settings = ChildSettings.from_extra(child_extra)
            rule = _rule(entry, cls)
            factors = cls.factors(self.world_size)
            merger = ReferenceMerger(
                self.world_size,
                rule,
                list(factors) if rule == "quorum" and factors else None,
                max_pending_steps=max_pending,
                # The connector guards every child it merges.
                guard=True,
            )
            self.children.append(
                _Child(
                    cls,
                    Tier(settings.capacity),
                    [
                        Reporter(settings.faults, settings.index, r, self.world_size)
                        for r in range(self.world_size)
                    ],
                    merger,
                )
            )
        self.step = 0
        #: Reports per child (every rank).
        self.reports: Counter[int] = Counter()

    def on_step(self, scheduler_output: Any) -> list[list[Any]]:
        """Each child's publications under kvmerge's rules for this step ([]
        where the child is not a simulated one)."""
        metas = list(getattr(scheduler_output.kv_connector_metadata, "metadata", ()))
        out: list[list[Any]] = []
        for i, child in enumerate(self.children):
            meta = metas[i] if i < len(metas) else None
            if child is None or not isinstance(meta, SaveMeta):
                out.append([])
                continue
            if meta.reset:
                child.tier.clear()
                for r in child.reporters:
                    r.reset()
            changes = child.tier.save(meta.chains)
            for rank, reporter in enumerate(child.reporters):
                events = children.events(
                    child.cls,
                    rank,
                    self.world_size,
                    self.block_size,
                    reporter.report(self.step, changes),
                )
                # What the worker side reads back from the family's container
                # (a Counter groups a rank's repeated reports, for one).
                container = child.cls.make_container(self.world_size, events)
                events = list(container.get_all_events()) if container else []
                if events and reporter.damages(self.step):
                    events = []  # refused by the connector: an empty report
                self.reports[i] += len(events)
                child.merger.add(rank, events)
            out.append(child.merger.finish_step())
        self.step += 1
        return out

    def reset(self) -> None:
        """The engine reset its prefix cache (and the connector)."""
        for child in self.children:
            if child is not None:
                child.merger.reset()


_encode = msgspec.msgpack.encode


def same_events(got: Sequence[Any], want: Sequence[Any]) -> str | None:
    """None when equal (as the publisher encodes them), else where they differ."""
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if _encode(g) != _encode(w):
            return f"event {i}: published {g!r}, expected {w!r}"
    if len(got) != len(want):
        return f"published {len(got)} events, expected {len(want)}"
    return None
