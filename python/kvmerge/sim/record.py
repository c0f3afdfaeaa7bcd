"""What each rank of a simulated child reported, step by step, and what the
rules make of it: the reference for a stream whose engine runs elsewhere.

In ``kvmerge.sim.run`` the expected stream follows the scheduler's outputs
in the same process. In the real ``vllm serve`` the workers are vLLM's own
processes: a simulated child whose settings name a ``record`` folder writes,
at each step of its worker, one line to ``child<index>-rank<rank>.jsonl``
in its replica's folder there (``replica_folder``, ``Recorder``): the step,
whether the step began with a reset of the child's tier, whether its report
was damaged (the connector must refuse it), and the events the family's
container holds (what kvmerge reads from it).

``expected`` replays those lines through ``ReferenceMerger`` (the rules of
docs/merge-rules.md, written independently of the engine): per step, a reset
first where a rank saw one (the connector's ``reset_cache`` came between
two steps), then every rank's report, a refused one as an empty report (what
the connector merges in its place), then the step's publications.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvmerge import Rule

from .tier import Hash

#: A simulated child's settings key naming the folder it records into.
RECORD_KEY = "record"


@dataclass(frozen=True)
class Line:
    """One step of one rank of one child."""

    step: int
    reset: bool
    refused: bool
    #: Each event's msgpack bytes (none for a refused report).
    events: tuple[bytes, ...]


def replica_folder(folder: str | Path, dp_rank: int) -> Path:
    """Where a data-parallel replica's ranks record (each replica has its
    own TP ranks 0 to world size - 1, and its own merger)."""
    return Path(folder) / f"dp{dp_rank}"


def path(folder: str | Path, child: int, rank: int) -> Path:
    return Path(folder) / f"child{child}-rank{rank}.jsonl"


class Recorder:
    """Appends a rank's reports of one child to its file, a line a step."""

    def __init__(self, folder: str | Path, child: int, rank: int) -> None:
        self.path = path(folder, child, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(
        self, step: int, reset: bool, refused: bool, events: Sequence[Any]
    ) -> None:
        encode = msgspec.msgpack.encode
        line = {
            "step": step,
            "reset": reset,
            "refused": refused,
            "events": [] if refused else [encode(e).hex() for e in events],
        }
        # One write of one line: a reader never sees half of it.
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def recorded(folder: str | Path) -> bool:
    """Whether the ranks recorded their reports there (vLLM's own
    MultiConnector never asks its children for them)."""
    return path(folder, 0, 0).exists()


def truth_path(folder: str | Path, child: int) -> Path:
    return Path(folder) / f"child{child}-truth.jsonl"


class TruthRecorder:
    """Appends what one child's tier really does, a line a save: whether it
    was emptied first, the blocks it stored and those it evicted. Every
    rank's tier holds the same blocks (only their reports differ), so one
    rank records it."""

    def __init__(self, folder: str | Path, child: int) -> None:
        self.path = truth_path(folder, child)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(
        self, reset: bool, stored: Sequence[Hash], removed: Sequence[Hash]
    ) -> None:
        encode = msgspec.msgpack.encode
        line = {
            "reset": reset,
            "stored": encode(list(stored)).hex(),
            "removed": encode(list(removed)).hex(),
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def held(folder: str | Path, child: int) -> set[Hash]:
    """The blocks the child's tier holds now, replayed from its truth (empty
    when nothing was recorded yet)."""
    out: set[Hash] = set()
    p = truth_path(folder, child)
    if not p.exists():
        return out
    decode = msgspec.msgpack.decode
    for text in p.read_text().splitlines():
        d = json.loads(text)
        if d["reset"]:
            out.clear()
        out.update(decode(bytes.fromhex(d["stored"])))
        out.difference_update(decode(bytes.fromhex(d["removed"])))
    return out


def read(folder: str | Path, child: int, rank: int) -> list[Line]:
    lines = []
    for text in path(folder, child, rank).read_text().splitlines():
        d = json.loads(text)
        lines.append(
            Line(
                int(d["step"]),
                bool(d["reset"]),
                bool(d["refused"]),
                tuple(bytes.fromhex(h) for h in d["events"]),
            )
        )
    return lines


@dataclass(frozen=True)
class ChildRecord:
    """A recorded child: its position, kvmerge's rule for it and its group
    replication factors (rule "quorum")."""

    index: int
    rule: Rule
    factors: tuple[int, ...] | None


@dataclass
class Replayed:
    """One child's records replayed through the rules."""

    #: What the connector must publish for the child, step by step.
    steps: list[list[Any]]
    #: Events in the reports the connector accepted (every rank's).
    reports: int
    #: Reports the connector must refuse (a rank's damaged step).
    refused: int
    #: The reference merger's counters at the end (``Stats.as_dict``).
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def events(self) -> list[Any]:
        return [e for step in self.steps for e in step]


def expected(
    folder: str | Path,
    child: ChildRecord,
    world_size: int,
    max_pending_steps: int,
) -> Replayed:
    """``child``'s expected publications from its ranks' records."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    from kvmerge.testing.reference import ReferenceMerger

    decoder = msgspec.msgpack.Decoder(BlockStored | BlockRemoved | AllBlocksCleared)
    ranks = [read(folder, child.index, r) for r in range(world_size)]
    steps = {len(lines) for lines in ranks}
    if len(steps) != 1:
        raise ValueError(
            f"child {child.index}: the ranks recorded different numbers of "
            f"steps ({[len(lines) for lines in ranks]})"
        )
    merger = ReferenceMerger(
        world_size,
        child.rule,
        list(child.factors) if child.factors is not None else None,
        max_pending_steps=max_pending_steps,
        # The connector guards every child it merges.
        guard=True,
    )
    out = Replayed([], 0, 0)
    for step in range(steps.pop()):
        lines = [lines[step] for lines in ranks]
        if any(line.step != step for line in lines):
            raise ValueError(f"child {child.index}: step {step} out of order")
        if any(line.reset for line in lines):
            merger.reset()
        for rank, line in enumerate(lines):
            events = [decoder.decode(b) for b in line.events]
            out.refused += line.refused
            out.reports += len(events)
            merger.add(rank, events)
        out.steps.append(merger.finish_step())
    out.counters = merger.stats.as_dict()
    return out


def expected_stream(
    folder: str | Path,
    children: Sequence[ChildRecord],
    world_size: int,
    max_pending_steps: int,
) -> tuple[list[Any], list[Replayed]]:
    """The children's expected events in the order the connector publishes
    them (step by step, children in config order), and each child's replay."""
    replayed = [expected(folder, c, world_size, max_pending_steps) for c in children]
    steps = {len(r.steps) for r in replayed}
    if len(steps) > 1:
        raise ValueError(f"the children recorded different numbers of steps: {steps}")
    stream = [
        e
        for step in range(steps.pop() if steps else 0)
        for r in replayed
        for e in r.steps[step]
    ]
    return stream, replayed
