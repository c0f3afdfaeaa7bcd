"""The benchmark's workload: per step, per child connector, per rank, the KV
events a worker's store reports.

Deterministic per seed. Sizes follow vLLM's offloading connectors: block size
16, 1 to ``max_hashes`` (16) block hashes per ``BlockStored`` (16 token ids
per hash, drawn from a 128,256-token vocabulary), about 15% ``BlockRemoved``
(each removes one earlier store's hashes). By default every rank reports the
same events in the same order (TP workers store the same blocks); the knobs
skew that:

* ``missing``: the fraction of events that 1 to world_size-1 ranks (drawn per
  event) do not report at all;
* ``late``: the fraction of events one rank reports a step late (at the start
  of its next step's events);
* ``duplicate``: the fraction of events one rank reports twice (a separate,
  equal object right after the first);
* ``clear_every``: every N-th step each rank reports an ``AllBlocksCleared`` at
  the same place, in the children whose container can carry it (vLLM 0.33.0's
  ``AllBlocksCleared`` is not hashable, so only the ``"list"`` child);
* ``bytes_hashes``: 32-byte block hashes instead of 63-bit ints;
* ``late_rank``: the last rank reports every event one step late (a
  straggler: each step it reports the step before's events);
* ``silent_rank``: the last rank reports nothing (its peers' reports wait
  ``max_pending_steps`` and expire);
* ``max_hashes``: 1 for one block per ``BlockStored``, as vLLM's Mooncake
  store reports them.

The named workloads are ``presets.PRESETS``.

Ranks share the event objects of a step (only duplicates are separate
objects): in vLLM each worker builds its own, but nothing measured depends on
that (every path pickles per rank, and the scheduler side only ever sees
unpickled copies), and it keeps large workloads in memory.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from kvmerge import DEFAULT_MAX_PENDING_STEPS
from kvmerge.vllm.families import FAMILIES

from .presets import PRESETS

#: Children whose container can carry ``AllBlocksCleared``.
CLEARABLE = frozenset({"list"})
#: Medium each child reports: a registered family's, else the list's.
MEDIUM = {f.name: f.medium for f in FAMILIES} | {"list": "CPU"}
#: Children whose stores carry a KV cache group (``group_idx``): the
#: families whose rule reads replication factors.
GROUPED = frozenset(f.name for f in FAMILIES if f.factors is not None)


@dataclass(frozen=True)
class WorkloadConfig:
    world_size: int = 8
    #: Events per child per rank per step (before the knobs add or drop any).
    events: int = 512
    children: tuple[str, ...] = ("lmcache", "mooncake")
    seed: int = 0
    missing: float = 0.0
    late: float = 0.0
    duplicate: float = 0.0
    clear_every: int = 0
    bytes_hashes: bool = False
    late_rank: bool = False
    silent_rank: bool = False
    removed: float = 0.15
    block_size: int = 16
    max_hashes: int = 16
    vocab: int = 128_256

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.events < 0:
            raise ValueError("world_size must be >= 1 and events >= 0")
        for name in ("missing", "late", "duplicate", "removed"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a fraction in [0, 1]")
        if self.clear_every < 0 or self.max_hashes < 1:
            raise ValueError("clear_every must be >= 0 and max_hashes >= 1")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["children"] = list(self.children)
        return d


@dataclass
class Step:
    """One step's events: ``events[child][rank]`` is a list of events."""

    index: int
    events: list[list[list[Any]]]

    def count(self) -> int:
        return sum(len(r) for c in self.events for r in c)


@dataclass
class _ChildState:
    family: str
    #: Stores still live (their hash lists), for removals to pick from.
    live: list[list[Any]] = field(default_factory=list)
    last_hash: Any = None
    #: Events each rank reports at the start of the next step.
    carry: list[list[Any]] = field(default_factory=list)


def _clone(event: Any) -> Any:
    """An equal event that shares no object with ``event``."""
    if isinstance(event, BlockStored):
        return BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            group_idx=event.group_idx,
        )
    if isinstance(event, BlockRemoved):
        return BlockRemoved(
            block_hashes=list(event.block_hashes),
            medium=event.medium,
            group_idx=event.group_idx,
        )
    return AllBlocksCleared()


class Workload:
    """Generates the steps of one workload, in order."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._children = [
            _ChildState(family, carry=[[] for _ in range(config.world_size)])
            for family in config.children
        ]
        self._step = 0

    # --- events ------------------------------------------------------------
    def _hash(self) -> Any:
        if self.config.bytes_hashes:
            return self._rng.randbytes(32)
        return self._rng.getrandbits(63)

    def _tokens(self, n: int) -> list[int]:
        raw = memoryview(self._rng.randbytes(4 * n)).cast("I")
        vocab = self.config.vocab
        return [t % vocab for t in raw]

    def _event(self, child: _ChildState) -> Any:
        cfg, rng = self.config, self._rng
        medium = MEDIUM.get(child.family, "CPU")
        if child.live and rng.random() < cfg.removed:
            hashes = child.live.pop(rng.randrange(len(child.live)))
            return BlockRemoved(block_hashes=list(hashes), medium=medium)
        n = rng.randint(1, cfg.max_hashes)
        hashes = [self._hash() for _ in range(n)]
        # Mostly a continuation of the previous store (a prefix chain).
        parent = child.last_hash if rng.random() < 0.9 else None
        child.last_hash = hashes[-1]
        child.live.append(hashes)
        if len(child.live) > 4096:
            child.live.pop(0)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=self._tokens(n * cfg.block_size),
            block_size=cfg.block_size,
            lora_id=None,
            medium=medium,
            lora_name=None,
            group_idx=0 if child.family in GROUPED else None,
        )

    # --- steps -------------------------------------------------------------
    def _child_step(self, child: _ChildState, index: int) -> list[list[Any]]:
        cfg, rng = self.config, self._rng
        world = cfg.world_size
        ranks: list[list[Any]] = [list(c) for c in child.carry]
        child.carry = [[] for _ in range(world)]
        logical = [self._event(child) for _ in range(cfg.events)]
        if (
            cfg.clear_every
            and child.family in CLEARABLE
            and (index + 1) % cfg.clear_every == 0
        ):
            logical.insert(rng.randrange(len(logical) + 1), AllBlocksCleared())
        for event in logical:
            if isinstance(event, AllBlocksCleared):
                for r in range(world):
                    ranks[r].append(AllBlocksCleared())
                continue
            absent: set[int] = set()
            if world > 1 and cfg.missing and rng.random() < cfg.missing:
                absent = set(rng.sample(range(world), rng.randint(1, world - 1)))
            late = rng.randrange(world) if cfg.late and rng.random() < cfg.late else -1
            dup = (
                rng.randrange(world)
                if cfg.duplicate and rng.random() < cfg.duplicate
                else -1
            )
            for r in range(world):
                if r in absent:
                    continue
                if r == world - 1 and cfg.silent_rank:
                    continue
                if r == late or (r == world - 1 and cfg.late_rank):
                    child.carry[r].append(event)
                    continue
                ranks[r].append(event)
                if r == dup:
                    ranks[r].append(_clone(event))
        return ranks

    def next_step(self) -> Step:
        index = self._step
        self._step += 1
        return Step(index, [self._child_step(c, index) for c in self._children])

    def steps(self, n: int) -> Iterator[Step]:
        for _ in range(n):
            yield self.next_step()


#: Unmeasured steps a workload needs first: "silent" is measured with a full
#: window of pending reports (the connector's max_pending_steps, the default).
MIN_WARMUP: dict[str, int] = {"silent": DEFAULT_MAX_PENDING_STEPS + 2}


def preset(name: str, **sizes: Any) -> WorkloadConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(PRESETS)}")
    return WorkloadConfig(**{**PRESETS[name], **sizes})
