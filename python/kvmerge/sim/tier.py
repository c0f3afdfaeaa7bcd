"""One rank's offloading tier: what a simulated child connector holds and reports.

Pure Python, no vLLM: the worker processes run it inside the child connectors,
and the scheduler side of a check runs the same code for every rank to know
what each rank reported (``kvmerge.sim.expect``).

A tier stores the chains the scheduler asked it to save (``Save``: a request's
full blocks, root first) and evicts by LRU under a capacity. A chain is
touched child first, so every block is at least as recent as its children and
eviction always takes a leaf: a tier never holds a block whose parent it has
dropped, as vLLM's own block pool frees a request's blocks tail first. Each
``save`` returns the events a real tier emits: one ``BlockStored`` per block it
did not hold (parents before children), then one ``BlockRemoved`` per evicted
block.

``Faults`` are what one rank does wrong in one step, drawn from a seed that
every process shares: a report one step late, an eviction report lost, a store
reported twice. What the tier holds is the same on every rank; only the reports
differ.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

#: A block hash as vLLM publishes it (``ExternalBlockHash``).
Hash: TypeAlias = int | bytes


@dataclass(frozen=True, slots=True)
class Block:
    """One full block of a request: its hash, its parent's, its tokens."""

    hash: Hash
    parent: Hash | None
    tokens: tuple[int, ...]


#: A request's full blocks, root first (each one's parent is the one before).
Chain: TypeAlias = tuple[Block, ...]


@dataclass(frozen=True, slots=True)
class Stored:
    block: Block


@dataclass(frozen=True, slots=True)
class Removed:
    hash: Hash


Change: TypeAlias = Stored | Removed


class Tier:
    """An LRU block store of ``capacity`` blocks."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"a tier holds at least one block, not {capacity}")
        self.capacity = capacity
        self._blocks: OrderedDict[Hash, Block] = OrderedDict()

    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def save(self, chains: Sequence[Chain]) -> list[Change]:
        """Store every block of ``chains`` it does not hold, then evict."""
        blocks = self._blocks
        changes: list[Change] = []
        for chain in chains:
            for block in chain:
                if block.hash not in blocks:
                    blocks[block.hash] = block
                    changes.append(Stored(block))
            # Child first, so that each parent ends up more recent than it.
            for block in reversed(chain):
                blocks.move_to_end(block.hash)
        while len(blocks) > self.capacity:
            h, _ = blocks.popitem(last=False)
            changes.append(Removed(h))
        return changes

    def clear(self) -> None:
        self._blocks.clear()


#: Chances, per rank and step, of each fault.
P_LATE: Final = 0.25
P_LOST: Final = 0.05
P_REPEAT: Final = 0.10


@dataclass(frozen=True)
class Faults:
    """Which faults a child's ranks show, and the seed they are drawn from.

    * ``late``: the last rank sometimes reports a step late (the tail of its
      step's reports, sometimes all of them, lead its next report);
    * ``lost``: a rank other than the last sometimes loses an eviction report;
    * ``repeat``: a rank sometimes reports a store twice (its own retry);
    * ``damage``: every ``damage``-th step (0: never) the last rank damages
      its report, if it has one: a block hash sent as text, which kvmerge
      refuses (the worker cannot encode it), so the connector drops that
      report and counts it.
    """

    seed: int = 0
    late: bool = False
    lost: bool = False
    repeat: bool = False
    damage: int = 0

    def to_extra(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "late": self.late,
            "lost": self.lost,
            "repeat": self.repeat,
            "damage": self.damage,
        }

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> Faults:
        return cls(
            seed=int(extra.get("seed", 0)),
            late=bool(extra.get("late", False)),
            lost=bool(extra.get("lost", False)),
            repeat=bool(extra.get("repeat", False)),
            damage=int(extra.get("damage", 0)),
        )


class Reporter:
    """One rank's reports of one child, step by step: its tier's changes with
    its faults applied."""

    def __init__(self, faults: Faults, child: int, rank: int, world_size: int) -> None:
        self.faults = faults
        self.child = child
        self.rank = rank
        self.last = rank == world_size - 1 and world_size > 1
        self._held: list[Change] = []

    def report(self, step: int, changes: list[Change]) -> list[Change]:
        f = self.faults
        rng = random.Random(f"kvmerge-sim/{f.seed}/{self.child}/{self.rank}/{step}")
        out = self._held + changes
        self._held = []
        if f.lost and not self.last and rng.random() < P_LOST:
            lost = [i for i, c in enumerate(out) if isinstance(c, Removed)]
            if lost:
                del out[rng.choice(lost)]
        if f.repeat and rng.random() < P_REPEAT:
            stores = [c for c in out if isinstance(c, Stored)]
            if stores:
                out.append(rng.choice(stores))
        if f.late and self.last and out and rng.random() < P_LATE:
            keep = rng.randrange(len(out))
            out, self._held = out[:keep], out[keep:]
        return out

    def damages(self, step: int) -> bool:
        """Whether this rank damages its report of ``step`` (if it has one)."""
        every = self.faults.damage
        return every > 0 and self.last and step % every == every - 1

    def reset(self) -> None:
        self._held = []
