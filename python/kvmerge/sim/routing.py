"""What a KV-aware router should answer, computed from the rules.

``RouterModel`` applies a stream as NVIDIA Dynamo's KV indexer does (the
semantics ``kvmerge.sim.dynamo`` documents, found by experiment on
ai-dynamo-runtime 1.6.1): the device tier (medium ``GPU``) is a tree, a store
whose parent it does not hold is refused, a removal drops the block and its
descendants; each lower tier (``CPU`` and its aliases, ``STORAGE`` and its
aliases, ``EXTERNAL`` and its aliases) is a flat map of ``(parent, block)``
with no parent check and no cascade; ``AllBlocksCleared`` empties every tier;
any other medium is dropped. ``match`` walks a chain as the indexer's query
does: the device tier first, then each lower tier once, in order, each going
on from the last block matched.

Fed with the GPU block pool's events and the reference model's merge of the
children's reports (``kvmerge.sim.expect``), it says what the indexer must
answer for any prefix; ``RouterCheck`` asks a live indexer and counts the
answers that differ.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from kvmerge.streamcheck import DEVICE, LOWER, TIER_OF_MEDIUM

from .dynamo import as_i64
from .tier import Hash

#: How long a differing answer waits before it is asked again, and how long
#: it may go on differing before it counts as wrong (seconds). A loaded
#: machine (CI's) has kept the indexer more than one wait behind.
SETTLE_S: Final = 0.5
SETTLE_LIMIT_S: Final = 10.0
_ABSENT: Final = object()


@dataclass(frozen=True)
class Match:
    """Leading blocks matched: in the device tier, then with the host tier
    added, then with the disk and external tiers added (the indexer's
    ``gpu``, ``cpu`` and ``disk``, in blocks)."""

    gpu: int
    cpu: int
    disk: int


@dataclass
class RouterModel:
    #: tier -> block -> parent
    tiers: dict[str, dict[Hash, Hash | None]] = field(
        default_factory=lambda: {t: {} for t in (DEVICE, *LOWER)}
    )
    #: device block -> its children
    children: dict[Hash, set[Hash]] = field(default_factory=dict)
    #: block -> its token ids (every block ever stored, for queries)
    tokens: dict[Hash, tuple[int, ...]] = field(default_factory=dict)
    #: Device-tier events applied, by (event type, status), as the indexer's
    #: ``dynamo_kvrouter_kv_cache_events_applied`` counts them.
    applied: dict[tuple[str, str], int] = field(default_factory=dict)

    def _count(self, kind: str, status: str) -> None:
        self.applied[(kind, status)] = self.applied.get((kind, status), 0) + 1

    @property
    def device_events(self) -> int:
        return sum(self.applied.values())

    def apply(self, events: Iterable[Any]) -> None:
        for e in events:
            kind = type(e).__name__
            if kind == "AllBlocksCleared":
                for blocks in self.tiers.values():
                    blocks.clear()
                self.children.clear()
                self._count("cleared", "ok")
                continue
            tier = TIER_OF_MEDIUM.get(e.medium)
            if tier is None:
                continue  # a medium the indexer does not know: dropped
            if kind == "BlockStored":
                self._store(tier, e)
            elif kind == "BlockRemoved":
                self._remove(tier, e.block_hashes)

    def held(self) -> dict[str, set[int]]:
        """Each tier's blocks, as the indexer's ``/dump`` writes their hashes
        (signed 64-bit ints)."""
        return {t: {as_i64(int(h)) for h in blocks} for t, blocks in self.tiers.items()}

    def _store(self, tier: str, e: Any) -> None:
        blocks = self.tiers[tier]
        parent = e.parent_block_hash
        size = e.block_size
        for i, h in enumerate(e.block_hashes):
            self.tokens.setdefault(h, tuple(e.token_ids[i * size : (i + 1) * size]))
        if tier != DEVICE:
            for h in e.block_hashes:
                blocks[h] = parent
                parent = h
            return
        if parent is not None and parent not in blocks:
            self._count("stored", "parent_block_not_found")
            return
        for h in e.block_hashes:
            if h not in blocks:
                blocks[h] = parent
                if parent is not None:
                    self.children.setdefault(parent, set()).add(h)
            parent = h
        self._count("stored", "ok")

    def _remove(self, tier: str, hashes: Sequence[Hash]) -> None:
        blocks = self.tiers[tier]
        if tier != DEVICE:
            for h in hashes:
                blocks.pop(h, None)
            return
        unknown = False
        for h in hashes:
            if h not in blocks:
                unknown = True
                continue
            stack = [h]
            while stack:
                b = stack.pop()
                parent = blocks.pop(b, None)
                if parent is not None and parent in self.children:
                    self.children[parent].discard(b)
                stack.extend(self.children.pop(b, ()))
        self._count("removed", "block_not_found" if unknown else "ok")

    def match(self, chain: Sequence[Hash]) -> Match:
        n, prev = 0, None
        device = self.tiers[DEVICE]
        while n < len(chain) and device.get(chain[n], _ABSENT) == prev:
            prev = chain[n]
            n += 1
        gpu = n
        counts = []
        for tier in LOWER:
            blocks = self.tiers[tier]
            while n < len(chain) and blocks.get(chain[n], _ABSENT) == prev:
                prev = chain[n]
                n += 1
            counts.append(n)
        return Match(gpu=gpu, cpu=counts[0], disk=counts[2])


@dataclass
class Lookups:
    #: Lookups meant to be asked, asked, and answered otherwise than the
    #: model: a check passes only when every one meant was asked.
    wanted: int = 0
    asked: int = 0
    wrong: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.wanted > 0 and self.asked == self.wanted and self.wrong == 0

    def add(self, other: Lookups) -> None:
        self.wanted += other.wanted
        self.asked += other.asked
        self.wrong += other.wrong
        self.examples.extend(other.examples[: max(0, 3 - len(self.examples))])


class RouterCheck:
    """Asks a live Dynamo indexer about random prefixes of stored chains and
    compares its answers with a ``RouterModel``'s."""

    def __init__(self, indexer: Any, instance_id: int, block_size: int, seed: int):
        self.indexer = indexer
        self.instance_id = instance_id
        self.block_size = block_size
        self.rng = random.Random(f"kvmerge-sim/lookups/{seed}")
        #: block -> parent, over every store seen (any medium)
        self.parents: dict[Hash, Hash | None] = {}
        self.lookups = Lookups()

    def learn(self, events: Iterable[Any]) -> None:
        for e in events:
            if type(e).__name__ == "BlockStored":
                p = e.parent_block_hash
                for h in e.block_hashes:
                    self.parents.setdefault(h, p)
                    p = h

    def chain(self, h: Hash) -> list[Hash]:
        """The chain ending at ``h``, root first."""
        out = [h]
        while (p := self.parents.get(out[-1])) is not None and len(out) < 4096:
            out.append(p)
        return out[::-1]

    def sync(self, model: RouterModel, timeout: float = 30.0) -> None:
        """Wait until the indexer has applied the device-tier events the
        model has (it counts those alone)."""
        self.indexer.wait_applied(model.device_events, timeout=timeout)

    def tiers(self, dp_rank: int = 0) -> dict[str, set[int]]:
        """What the indexer holds for this instance and ``dp_rank``, per tier
        (``/dump``): block hashes as its signed 64-bit ints."""
        held: dict[str, set[int]] = {t: set() for t in (DEVICE, *LOWER)}
        for b in self.indexer.dump_blocks():
            if b.worker_id == self.instance_id and b.dp_rank == dp_rank:
                held.setdefault(b.tier, set()).add(as_i64(b.block_hash))
        return held

    def settled_tiers(
        self, model: RouterModel, dp_rank: int = 0, timeout: float = SETTLE_LIMIT_S
    ) -> dict[str, set[int]]:
        """``tiers``, once they equal ``model``'s or ``timeout`` has passed
        (asked again every ``SETTLE_S``: the indexer counts device-tier
        events alone, so ``sync`` cannot wait for the lower tiers' last)."""
        want = model.held()
        deadline = time.monotonic() + timeout
        while True:
            have = self.tiers(dp_rank)
            if have == want or time.monotonic() >= deadline:
                return have
            time.sleep(SETTLE_S)

    def _match(self, tokens: list[int]) -> Match:
        got = self.indexer.query(tokens)
        return Match(
            gpu=got.blocks(self.instance_id, "gpu"),
            cpu=got.blocks(self.instance_id, "cpu"),
            disk=got.blocks(self.instance_id, "disk"),
        )

    def ask(self, model: RouterModel, n: int) -> Lookups:
        """``n`` lookups of random prefixes of stored chains. An answer that
        differs is asked again every ``SETTLE_S``, for up to
        ``SETTLE_LIMIT_S``: the lower tiers' events of the last batch may
        still be on their way (the indexer counts device-tier events only,
        so ``sync`` cannot wait for them). One that still differs then is
        wrong."""
        hashes = list(self.parents)
        # Before any store there is nothing to ask.
        found = Lookups(wanted=n if hashes else 0)
        differ: list[tuple[list[Hash], list[int], Match]] = []
        # A drawn chain may reach a block whose tokens the model never saw:
        # drawn again, a bounded number of times.
        for _ in range(4 * n if hashes else 0):
            if found.asked == n:
                break
            chain = self.chain(self.rng.choice(hashes))
            chain = chain[: self.rng.randint(1, len(chain))]
            if any(h not in model.tokens for h in chain):
                continue
            tokens = [t for h in chain for t in model.tokens[h]]
            want = model.match(chain)
            found.asked += 1
            if self._match(tokens) != want:
                differ.append((chain, tokens, want))
        deadline = time.monotonic() + SETTLE_LIMIT_S
        while differ:
            time.sleep(SETTLE_S)
            last = time.monotonic() >= deadline
            still = []
            for chain, tokens, want in differ:
                have = self._match(tokens)
                if have == want:
                    continue
                if not last:
                    still.append((chain, tokens, want))
                    continue
                found.wrong += 1
                if len(found.examples) < 3:
                    found.examples.append(
                        f"a {len(chain)}-block prefix: indexer {have}, rules {want}"
                    )
            differ = still
        self.lookups.add(found)
        return found


def tier_differences(
    have: dict[str, set[int]], want: dict[str, set[int]]
) -> dict[str, tuple[int, int]]:
    """Per tier where two views differ: ``(blocks only in have, blocks only
    in want)``."""
    return {
        t: (
            len(have.get(t, set()) - want.get(t, set())),
            len(want.get(t, set()) - have.get(t, set())),
        )
        for t in sorted(set(have) | set(want))
        if have.get(t, set()) != want.get(t, set())
    }
