"""The demo's checks of a published KV-event stream.

``StreamChecker`` reads the events in publication order and checks what a
KV-aware router relies on:

* **parents**: every ``BlockStored`` whose ``parent_block_hash`` is set comes
  after a store of its parent (same medium, same KV cache group) since the last
  ``AllBlocksCleared`` (a clear empties the set of stored blocks);
* **duplicates**: no event is published more often than every rank that
  reports it reported it (``max(1, min over those ranks of their report
  counts)``: an event stored, evicted and stored again by every rank may be
  published twice, a rank's own retry may not); and nothing is published that
  no rank reported.

Sequence numbers are checked by the subscriber (``kvmerge.subscribe``). The
expected report counts come from the workload (``Workload.report_counts``),
which the demo knows: it is deterministic.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

from .workload import MEDIA, LaneScript, Settings

_ENCODE = msgspec.msgpack.Encoder().encode
KIND_OF_MEDIUM = {medium: kind for kind, medium in MEDIA.items()}


def event_key(event: Any) -> bytes:
    """An event's identity: its msgpack encoding (what the publisher sends)."""
    return _ENCODE(event)


@dataclass
class StreamChecker:
    stored: set[tuple[Any, Any, Any]] = field(default_factory=set)
    published: collections.Counter[bytes] = field(default_factory=collections.Counter)
    #: Events out per medium (clears not included).
    by_medium: collections.Counter[str] = field(default_factory=collections.Counter)
    events: int = 0
    clears: int = 0
    stores: int = 0
    stores_with_parent: int = 0
    orphans: int = 0
    examples: list[str] = field(default_factory=list)

    def feed(self, events: list[Any]) -> None:
        stored = self.stored
        for event in events:
            self.events += 1
            if isinstance(event, AllBlocksCleared):
                self.clears += 1
                stored.clear()
                continue
            self.published[event_key(event)] += 1
            medium = event.medium
            self.by_medium[medium or "-"] += 1
            if not isinstance(event, BlockStored):
                continue
            self.stores += 1
            group = event.group_idx
            parent = event.parent_block_hash
            if parent is not None:
                self.stores_with_parent += 1
                if (medium, group, parent) not in stored:
                    self.orphans += 1
                    if len(self.examples) < 3:
                        self.examples.append(
                            f"store of {event.block_hashes[0]} ({medium}, group "
                            f"{group}) published before its parent {parent}"
                        )
            for h in event.block_hashes:
                stored.add((medium, group, h))


@dataclass
class ReportCounts:
    """Every rank's reports, as the workload made them."""

    world: int
    #: event key -> reports per rank
    counts: dict[bytes, list[int]] = field(default_factory=dict)
    #: event key -> the ranks that report it (None: every rank)
    designated: dict[bytes, frozenset[int] | None] = field(default_factory=dict)
    #: lane -> reports (every rank, every step)
    per_lane: collections.Counter[int] = field(default_factory=collections.Counter)
    resets: int = 0

    def allowed(self, key: bytes) -> int:
        per_rank = self.counts.get(key)
        if per_rank is None:
            return 0
        ranks = self.designated.get(key)
        chosen = range(self.world) if ranks is None else ranks
        return max(1, min(per_rank[r] for r in chosen))


def report_counts(settings: Settings, steps: int) -> ReportCounts:
    """Replay the workload for ``steps`` steps and count every rank's reports."""
    rc = ReportCounts(settings.workers)
    for lane, kind in enumerate(settings.kinds):
        script = LaneScript(settings, lane, kind)
        for _ in range(steps):
            step = script.next_step()
            for rep in step.truth:
                rc.designated.setdefault(event_key(rep.event), rep.ranks)
            for rank, batch in enumerate(step.batches):
                rc.per_lane[lane] += len(batch)
                for event in batch:
                    key = event_key(event)
                    per_rank = rc.counts.get(key)
                    if per_rank is None:
                        per_rank = rc.counts[key] = [0] * settings.workers
                    per_rank[rank] += 1
    rc.resets = sum(1 for s in range(steps) if settings.resets_at(s))
    return rc


@dataclass
class DuplicateReport:
    repeated: int = 0  # events published more than once, legitimately
    excess: int = 0  # publications beyond what every rank reported
    unknown: int = 0  # events published that no rank reported
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.excess and not self.unknown


def check_duplicates(checker: StreamChecker, reports: ReportCounts) -> DuplicateReport:
    out = DuplicateReport()
    for key, n in checker.published.items():
        allowed = reports.allowed(key)
        if allowed == 0:
            out.unknown += n
            if len(out.examples) < 3:
                out.examples.append(
                    f"published but never reported: {msgspec.msgpack.decode(key)}"
                )
        elif n > allowed:
            out.excess += n - allowed
            if len(out.examples) < 3:
                event = msgspec.msgpack.decode(key)
                out.examples.append(
                    f"published {n} times, reported at most {allowed} times by "
                    f"every rank: {event}"
                )
        elif n > 1:
            out.repeated += 1
    return out
