"""A naive, independent Python model of `kvmerge.Merger`.

Written from docs/merge-rules.md, sentence by sentence, and from nothing else:
it must never call the engine (not even `EventBatch.identities()`), or the
property tests would compare the engine with itself. Speed does not matter
here; obviousness does.

An event's identity in this model is its msgspec msgpack encoding: vLLM's
encoder is deterministic, so equal events (vLLM `==`, field types as
declared) have equal bytes and different events different bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvmerge import (
    DEFAULT_MAX_PENDING_STEPS,
    RULES,
    ConfigError,
    GroupError,
    RankError,
    Rule,
)

COUNTERS = (
    "steps",
    "batches",
    "reports",
    "published",
    "consumed",
    "cleared",
    "expired",
    "pending",
    "withheld",
    "withheld_orphan",
    "withheld_duplicate",
    "withheld_unknown",
)


def identity(event: object) -> bytes:
    """The model's event identity: the canonical msgpack bytes."""
    return msgspec.msgpack.encode(event)


@dataclass(frozen=True)
class Report:
    """One event in one rank's batch. `position` orders reports globally."""

    step: int
    index: int
    rank: int
    event: object
    ident: bytes

    @property
    def position(self) -> tuple[int, int, int]:
        return (self.step, self.index, self.rank)

    @property
    def is_clear(self) -> bool:
        return isinstance(self.event, AllBlocksCleared)


@dataclass
class Stats:
    steps: int = 0
    batches: int = 0
    reports: int = 0
    published: int = 0
    consumed: int = 0
    cleared: int = 0
    expired: int = 0
    pending: int = 0
    withheld_orphan: int = 0
    withheld_duplicate: int = 0
    withheld_unknown: int = 0

    @property
    def withheld(self) -> int:
        return self.withheld_orphan + self.withheld_duplicate + self.withheld_unknown

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in COUNTERS}


@dataclass
class ReferenceMerger:
    world_size: int
    rule: Rule = "all"
    replication_factors: Sequence[int] | None = None
    max_pending_steps: int = DEFAULT_MAX_PENDING_STEPS
    guard: bool = False
    step: int = 0
    stats: Stats = field(default_factory=Stats)
    # This step's batches, by rank (a rank absent here added nothing).
    current: dict[int, list[object]] = field(default_factory=dict)
    # Per-rank FIFO of reports not used yet, in position order.
    queues: list[list[Report]] = field(default_factory=list)
    # The guard's state: per medium, the block hashes held.
    held: dict[str | None, set[int | bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # "ConfigError ... world_size < 1, an unknown rule, "quorum" without
        # replication_factors, factors given to another rule, a factor < 1,
        # max_pending_steps < 0."
        if self.world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {self.world_size}")
        if self.rule not in RULES:
            raise ConfigError(f"unknown rule {self.rule!r}")
        if self.rule == "quorum" and self.replication_factors is None:
            raise ConfigError('rule "quorum" needs replication_factors')
        if self.rule != "quorum" and self.replication_factors is not None:
            raise ConfigError(f"replication_factors given to rule {self.rule!r}")
        if self.replication_factors is not None:
            self.replication_factors = list(self.replication_factors)
            if any(f < 1 for f in self.replication_factors):
                raise ConfigError("a replication factor is < 1")
        if self.max_pending_steps < 0:
            raise ConfigError("max_pending_steps must be >= 0")
        self.queues = [[] for _ in range(self.world_size)]

    # ----------------------------------------------------------------- input

    def add(self, rank: int, events: Sequence[object]) -> None:
        # Every check runs before any state changes.
        if not 0 <= rank < self.world_size:
            raise RankError(f"rank {rank} outside [0, {self.world_size})")
        if rank in self.current:
            raise RankError(f"rank {rank} added twice in step {self.step}")
        if self.rule == "quorum":
            for event in events:
                if isinstance(event, BlockStored) and event.group_idx is not None:
                    self.factor(event)  # raises GroupError
        self.current[rank] = list(events)
        self.stats.batches += 1
        self.stats.reports += len(events)
        # Added reports are pending until the step decides their fate, which
        # is what keeps the counter invariant true between add and finish.
        self.stats.pending += len(events)

    def factor(self, event: object) -> int:
        """The replication factor of an event under "quorum"."""
        if isinstance(event, BlockStored) and event.group_idx is not None:
            g = event.group_idx
            assert self.replication_factors is not None
            if not 0 <= g < len(self.replication_factors):
                raise GroupError(f"group_idx {g} has no replication factor")
            return self.replication_factors[g]
        return 1

    def add_all(self, reports: Sequence[tuple[int, Sequence[object]]]) -> None:
        """Several ranks at once: all of them, or none on error."""
        staged = ReferenceMerger(self.world_size, self.rule, self.replication_factors)
        staged.current = {rank: [] for rank in self.current}
        for rank, events in reports:
            staged.add(rank, events)  # raises before self changes
        for rank, events in reports:
            self.add(rank, events)

    def reset(self) -> None:
        """Drop every pending report and the current step's batches.

        "counting their reports as cleared; the counters and the step number
        stay."
        """
        dropped = sum(len(q) for q in self.queues)
        dropped += sum(len(b) for b in self.current.values())
        self.stats.cleared += dropped
        self.stats.pending -= dropped
        self.current = {}
        self.queues = [[] for _ in range(self.world_size)]
        # "reset() empties the held sets too".
        self.held = {}

    # ---------------------------------------------------------------- output

    def finish_step(self) -> list[object]:
        step = self.step
        reports = [
            Report(step, index, rank, event, identity(event))
            for rank, batch in self.current.items()
            for index, event in enumerate(batch)
        ]
        reports.sort(key=lambda r: r.position)
        self.current = {}
        if self.rule == "any":
            out = self._any(reports)
        else:
            for report in reports:
                self.queues[report.rank].append(report)
            out = []
            while self._segment(out):
                pass
            self._expire(step)
        if self.guard:
            out = [event for event in out if self._passes_guard(event)]
        self.stats.published += len(out)
        self.stats.pending = sum(len(q) for q in self.queues)
        self.stats.steps += 1
        self.step += 1
        return out

    def _any(self, reports: list[Report]) -> list[object]:
        # "an AllBlocksCleared report is published unless the last event
        # published in this step is already a clear; publishing it empties
        # seen; any other report is published if its identity is not in seen".
        out: list[object] = []
        seen: set[bytes] = set()
        last_was_clear = False
        for report in reports:
            self.stats.consumed += 1  # published or collapsed: used either way
            if report.is_clear:
                if not last_was_clear:
                    last_was_clear = True
                    out.append(report.event)
                    seen = set()
            elif report.ident not in seen:
                last_was_clear = False
                out.append(report.event)
                seen.add(report.ident)
        return out

    def _passes_guard(self, event: object) -> bool:
        """Whether the guard publishes `event`, applying it to `held` if so.

        "A withheld event changes no state." An event both orphan and
        duplicate is counted as an orphan.
        """
        if isinstance(event, AllBlocksCleared):
            self.held = {}
            return True
        assert isinstance(event, BlockStored | BlockRemoved)
        held = self.held.get(event.medium, set())
        hashes = list(event.block_hashes)
        repeated = len(set(hashes)) != len(hashes)
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            if parent is not None and parent not in held:
                self.stats.withheld_orphan += 1
                return False
            if repeated or any(h in held for h in hashes):
                self.stats.withheld_duplicate += 1
                return False
            self.held[event.medium] = held | set(hashes)
            return True
        if repeated or any(h not in held for h in hashes):
            self.stats.withheld_unknown += 1
            return False
        self.held[event.medium] = held - set(hashes)
        return True

    def _segment(self, out: list[object]) -> bool:
        """Run one segment; True when a clear ended it and another may run."""
        fences: list[int | None] = []
        eligible: list[list[Report]] = []
        for queue in self.queues:
            fence = next((i for i, r in enumerate(queue) if r.is_clear), None)
            fences.append(fence)
            eligible.append(queue if fence is None else queue[:fence])

        # Completions: (position, event, reports used).
        completions: list[tuple[tuple[int, int, int], object, list[Report]]] = []
        idents = {r.ident for rank in eligible for r in rank}
        for ident in sorted(idents):
            per_rank = [[r for r in rank if r.ident == ident] for rank in eligible]
            if self.rule == "all":
                m = min(len(rs) for rs in per_rank)
                for j in range(m):
                    used = [rs[j] for rs in per_rank]
                    position = max(r.position for r in used)
                    completions.append((position, used[0].event, used))
            else:
                present = [rs for rs in per_rank if rs]
                f = self.factor(present[0][0].event)
                if len(present) * f >= self.world_size:
                    q = math.ceil(self.world_size / f)
                    firsts = sorted(rs[0].position for rs in present)
                    used = [r for rs in present for r in rs]
                    completions.append((firsts[q - 1], present[0][0].event, used))
        completions.sort(key=lambda c: c[0])

        used_ids: set[int] = set()
        for _, event, used in completions:
            out.append(event)
            self.stats.consumed += len(used)
            used_ids.update(id(r) for r in used)
        self.queues = [[r for r in q if id(r) not in used_ids] for q in self.queues]

        if any(f is None for f in fences):
            return False
        # Every rank has a fence: publish the clear, discard what is still
        # eligible (everything before the fence), consume the fences.
        out.append(AllBlocksCleared())
        for rank, queue in enumerate(self.queues):
            fence = next(i for i, r in enumerate(queue) if r.is_clear)
            self.stats.cleared += fence
            self.stats.consumed += 1
            self.queues[rank] = queue[fence + 1 :]
        return True

    def _expire(self, step: int) -> None:
        # A report made in step t still pending at the end of step
        # t + max_pending_steps is dropped.
        for rank, queue in enumerate(self.queues):
            keep = [r for r in queue if r.step + self.max_pending_steps > step]
            self.stats.expired += len(queue) - len(keep)
            self.queues[rank] = keep

    def check_invariant(self) -> None:
        s = self.stats
        assert s.reports == s.consumed + s.cleared + s.expired + s.pending, s
        pending = sum(len(q) for q in self.queues)
        pending += sum(len(b) for b in self.current.values())
        assert s.pending == pending, (s, pending)


# Helpers shared by the tests -------------------------------------------------

DECODER = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)


def assert_same_events(got: Sequence[object], want: Sequence[object]) -> None:
    """Same events, same order, same field types (bytes vs int hashes...)."""
    assert [type(e).__name__ for e in got] == [type(e).__name__ for e in want]
    assert [identity(e) for e in got] == [identity(e) for e in want]
    assert list(got) == list(want)


def assert_same_stats(engine_stats: Any, model: ReferenceMerger) -> None:
    got = {name: getattr(engine_stats, name) for name in COUNTERS}
    assert got == engine_stats.as_dict() == model.stats.as_dict()
    model.check_invariant()
