"""The demo's workload: what each demo connector reports, rank by rank, step by step.

Deterministic from the settings (seed included), so that every process that
needs it computes the same thing: each worker's demo connectors (their own
rank's reports), and the main process (every rank's reports, to check the
published stream and to replay the workload through vLLM's own path).

Per connector ("lane") there is one simulated store: a prefix tree of KV
blocks. Each step it stores new blocks (a chain of 1-4 blocks under a stored
parent, or a new root), evicts leaves, and re-stores blocks it evicted. That
is the *truth*; every rank of the TP group reports it, with the deviations real
workers show:

* LMCache and Mooncake: the last rank is sometimes a step late (the tail of its
  step's events, sometimes all of them, comes at the start of its next batch);
  a rank sometimes repeats a store (a retry: its own duplicate); a rank other
  than the last sometimes fails to report an eviction (its report is lost);
* Mooncake: two KV cache groups; the second one is replicated on half the
  ranks (GQA, when the world size is even), so only the ranks
  ``r % factor == 0`` report that group's stores;
* UMBP: the store is shared, every rank reports the same events in the same
  step.

Every ``clear_every`` steps on average the engine resets its prefix cache
(``reset_prefix_cache(reset_connector=True)``): the scheduler publishes the GPU
cache's ``AllBlocksCleared`` and resets the connectors, and every store starts
empty again. (vLLM 0.33.0's LMCache, Mooncake and UMBP containers cannot carry
``AllBlocksCleared``: it is not hashable, and they count events in a
``Counter`` or a dict. In vLLM the clear comes from the GPU block pool.)
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

#: Demo connector kinds, in their default configuration order.
KINDS = ("lmcache", "mooncake", "umbp")
CONNECTOR_NAMES = {
    "lmcache": "DemoLMCacheConnector",
    "mooncake": "DemoMooncakeConnector",
    "umbp": "DemoUMBPConnector",
}
#: The medium each demo store reports (free-form in vLLM): one per connector,
#: so that a subscriber can tell the children's events apart.
MEDIA = {"lmcache": "LMCACHE", "mooncake": "MOONCAKE", "umbp": "UMBP"}
#: kvmerge's rule for each connector's container (docs/vllm.md).
RULES = {"lmcache": "all", "mooncake": "quorum", "umbp": "any"}

BLOCK_SIZE = 16
VOCAB = 32_000
#: Probabilities of the deviations, per lane and step.
P_LATE = 0.25
P_DUPLICATE = 0.10
P_LOST = 0.05
#: Mooncake group 1's TP replication factor (when the world size is even).
GQA_FACTOR = 2


@dataclass(frozen=True)
class Settings:
    """What every process of one demo run agrees on."""

    workers: int = 4
    rate: int = 12
    seed: int = 0
    clear_every: int = 150
    kinds: tuple[str, ...] = KINDS

    def to_extra(self) -> dict[str, Any]:
        d = asdict(self)
        d["kinds"] = list(self.kinds)
        return d

    @classmethod
    def from_extra(cls, d: Mapping[str, Any]) -> Settings:
        d = dict(d)
        d["kinds"] = tuple(d.get("kinds", KINDS))
        return cls(**d)

    @property
    def late_rank(self) -> int | None:
        """The rank that is sometimes a step late (none in a world of one)."""
        return self.workers - 1 if self.workers > 1 else None

    def factors(self, kind: str) -> tuple[int, ...] | None:
        """Mooncake's group TP replication factors (None for other kinds)."""
        if kind != "mooncake":
            return None
        if self.workers % GQA_FACTOR == 0:
            return (1, GQA_FACTOR)
        return (1, 1)

    def resets_at(self, step: int) -> bool:
        """Whether the engine resets its prefix cache before this step."""
        if self.clear_every <= 0 or step == 0:
            return False
        rng = random.Random(f"kvmerge-demo/{self.seed}/reset/{step}")
        return rng.random() < 1.0 / self.clear_every


def _block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "big"))
    h.update(b"".join(t.to_bytes(4, "big") for t in tokens))
    return int.from_bytes(h.digest(), "big") >> 1  # 63 bits: a msgpack int


@dataclass
class _Block:
    parent: int | None
    tokens: list[int]
    step: int
    children: int = 0
    stored: bool = True


@dataclass
class Report:
    """One event of a lane's truth, and which ranks report it."""

    event: Any
    #: None: every rank.
    ranks: frozenset[int] | None = None

    def reported_by(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


@dataclass
class LaneStep:
    """One step of one lane: every rank's batch (index = rank)."""

    step: int
    reset: bool
    batches: list[list[Any]]
    #: What the lane's store did this step (each rank reports its share).
    truth: list[Report] = field(default_factory=list)


class LaneScript:
    """The deterministic workload of one demo connector (one lane).

    Call ``next_step()`` once per engine step, in order; each call returns every
    rank's batch for that step.
    """

    def __init__(self, settings: Settings, lane: int, kind: str) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown demo connector kind {kind!r}")
        self.settings = settings
        self.lane = lane
        self.kind = kind
        self.medium = MEDIA[kind]
        self.factors = settings.factors(kind)
        self.rng = random.Random(f"kvmerge-demo/{settings.seed}/lane/{lane}/{kind}")
        self.step = 0
        self.blocks: dict[int, _Block] = {}
        #: Stored blocks, least recently stored first.
        self.lru: dict[int, None] = {}
        #: Evicted blocks that may be stored again, oldest first.
        self.evicted: dict[int, None] = {}
        self.carried: list[Any] = []
        self.capacity = max(64, 24 * max(settings.rate, 1))
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        self._stored_cls = BlockStored
        self._removed_cls = BlockRemoved

    # --- events --------------------------------------------------------------
    def _stored(
        self,
        hashes: list[int],
        parent: int | None,
        tokens: list[int],
        group: int | None,
    ) -> Any:
        return self._stored_cls(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium=self.medium,
            lora_name=None,
            group_idx=group,
        )

    def _removed(self, h: int, group: int | None) -> Any:
        return self._removed_cls(block_hashes=[h], medium=self.medium, group_idx=group)

    def _store_reports(
        self, hashes: list[int], parent: int | None, tokens: list[int]
    ) -> list[Report]:
        if self.kind != "mooncake":
            return [Report(self._stored(hashes, parent, tokens, None))]
        assert self.factors is not None
        f = self.factors[1]
        replicas = frozenset(r for r in range(self.settings.workers) if r % f == 0)
        return [
            Report(self._stored(hashes, parent, tokens, 0)),
            # Group 1 is replicated on f ranks: one replica of each reports.
            Report(
                self._stored(hashes, parent, tokens, 1), None if f == 1 else replicas
            ),
        ]

    def _remove_report(self, h: int) -> Report:
        return Report(self._removed(h, 0 if self.kind == "mooncake" else None))

    # --- the simulated store -----------------------------------------------------
    def _mark_stored(self, h: int, s: int) -> None:
        b = self.blocks[h]
        b.stored, b.step, b.children = True, s, 0
        if b.parent is not None:
            self.blocks[b.parent].children += 1
        self.lru[h] = None

    def _store(self, s: int) -> list[Report]:
        """A request's new blocks: a chain under a recently stored block, or a
        new prompt (a root)."""
        rng = self.rng
        parent: int | None = None
        if self.lru and rng.random() < 0.75:
            recent = list(itertools.islice(reversed(self.lru), 32))
            parent = rng.choice(recent)
        hashes: list[int] = []
        tokens: list[int] = []
        prev = parent
        for _ in range(rng.randint(1, 4)):
            block_tokens = [rng.randrange(VOCAB) for _ in range(BLOCK_SIZE)]
            h = _block_hash(prev, block_tokens)
            if h in self.blocks:  # a 63-bit collision, in a demo: stop the chain
                break
            self.blocks[h] = _Block(prev, block_tokens, s)
            self._mark_stored(h, s)
            hashes.append(h)
            tokens.extend(block_tokens)
            prev = h
        if not hashes:
            return []
        return self._store_reports(hashes, parent, tokens)

    def _evict(self, s: int) -> list[Report]:
        """Evict one of the least recently stored leaves (not from this or the
        previous step)."""
        leaves = []
        for h in self.lru:
            b = self.blocks[h]
            if b.step > s - 2:
                break
            if b.children == 0:
                leaves.append(h)
                if len(leaves) == 4:
                    break
        if not leaves:
            return []
        h = self.rng.choice(leaves)
        b = self.blocks[h]
        b.stored = False
        if b.parent is not None:
            self.blocks[b.parent].children -= 1
        del self.lru[h]
        self.evicted[h] = None
        while len(self.evicted) > 64:
            old = next(iter(self.evicted))
            del self.evicted[old]
            if not self.blocks[old].stored:
                del self.blocks[old]
        return [self._remove_report(h)]

    def _restore(self, s: int) -> list[Report]:
        """Store an evicted block again (a one-block store: the same event as
        its first store when that one was a single block)."""
        candidates = []
        for h in self.evicted:
            parent = self.blocks[h].parent
            if parent is None or (
                (p := self.blocks.get(parent)) is not None and p.stored
            ):
                candidates.append(h)
        if not candidates:
            return self._store(s)
        h = self.rng.choice(candidates)
        del self.evicted[h]
        self._mark_stored(h, s)
        b = self.blocks[h]
        return self._store_reports([h], b.parent, list(b.tokens))

    def _truth(self, s: int) -> list[Report]:
        rng = self.rng
        rate = self.settings.rate
        n = rng.randint(rate - rate // 2, rate + rate // 2) if rate > 0 else 0
        reports: list[Report] = []
        for _ in range(n):
            r = rng.random()
            if len(self.lru) > self.capacity or 0.62 <= r < 0.9:
                reports.extend(self._evict(s))
            elif r < 0.62:
                reports.extend(self._store(s))
            else:
                reports.extend(self._restore(s))
        return reports

    def _reset(self) -> None:
        self.blocks.clear()
        self.lru.clear()
        self.evicted.clear()

    # --- one step, every rank ------------------------------------------------------
    def next_step(self) -> LaneStep:
        s = self.step
        self.step += 1
        world = self.settings.workers
        reset = self.settings.resets_at(s)
        if reset:
            # The stores were wiped: what a late rank still held back is moot.
            self._reset()
            self.carried = []
        truth = self._truth(s)
        rng = self.rng
        batches = [
            [rep.event for rep in truth if rep.reported_by(r)] for r in range(world)
        ]
        late = self.settings.late_rank
        if self.kind == "umbp":
            # A shared store: every rank reports the same events, same step.
            return LaneStep(s, reset, batches, truth)
        if truth and rng.random() < P_DUPLICATE:
            r = rng.randrange(world)
            stores = [e for e in batches[r] if isinstance(e, self._stored_cls)]
            if stores:
                batches[r].append(rng.choice(stores))
        if world > 1 and rng.random() < P_LOST:
            r = rng.randrange(world - 1)  # not the late rank
            removals = [
                i for i, e in enumerate(batches[r]) if isinstance(e, self._removed_cls)
            ]
            if removals:
                del batches[r][rng.choice(removals)]
        if late is not None:
            own = batches[late]
            carried, self.carried = self.carried, []
            if own and rng.random() < P_LATE:
                cut = rng.randint(0, len(own) - 1)
                own, self.carried = own[:cut], own[cut:]
            batches[late] = carried + own
        return LaneStep(s, reset, batches, truth)
