"""StreamCheck: each violation shown on a valid stream damaged on purpose (and
not on the stream itself), Dynamo's tier rule for parents, dp ranks apart, a
stream joined mid-way, and properties: a stream of valid operations passes,
one damage always fails. kvmerge.events' structs; no vLLM."""

from __future__ import annotations

import copy
import itertools
import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmerge.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvmerge.streamcheck import (
    DUPLICATE,
    MISSING,
    ORPHAN,
    TIER_OF_MEDIUM,
    TOO_FEW_BATCHES,
    UNDECODABLE,
    UNKNOWN_REMOVAL,
    StreamCheck,
    Summary,
)

CLEAR = AllBlocksCleared()


def stored(hashes: list, parent: Any = None, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(range(2 * len(hashes))),
        block_size=2,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(hashes: list, medium: str | None = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


#: A batch: (seq, dp rank, events).
Batch = tuple[int, int | None, list[Any]]


def numbered(stream: list[tuple[int | None, list[Any]]]) -> list[Batch]:
    return [(seq, rank, events) for seq, (rank, events) in enumerate(stream)]


def check(
    batches: list[Batch],
    *,
    expect_last_seq: int | None = None,
    min_batches: int = 0,
    first_seq: int | None = 0,
) -> Summary:
    c = StreamCheck(min_batches=min_batches, first_seq=first_seq)
    for seq, rank, events in batches:
        c.feed(KVEventBatch(ts=0.0, events=events, data_parallel_rank=rank), seq)
    return c.summary(expect_last_seq=expect_last_seq)


# --- one valid stream, damaged on purpose ----------------------------------------
def valid() -> list[tuple[int | None, list[Any]]]:
    """Two dp ranks; a GPU chain offloaded to CPU and STORAGE, evicted leaves
    first, a block stored again after its removal, a clear and the stores
    after it; int and bytes hashes."""
    return [
        (0, [stored([1, 2]), stored([3], 2)]),
        (0, [stored([1, 2], None, "CPU"), stored([b"s1"], None, "STORAGE")]),
        (0, [stored([3], 2, "CPU"), removed([3])]),
        (1, [stored([1]), stored([b"\x00a", b"\x00b"], 1)]),
        # 3 on GPU again, then the chain evicted; STORAGE under a CPU parent.
        (0, [stored([3], 2), removed([3, 2, 1]), stored([4], 3, "STORAGE")]),
        (0, [CLEAR]),
        (0, [stored([1]), stored([2], 1)]),
        (1, [removed([b"\x00b"])]),
    ]


def test_the_valid_stream_passes():
    s = check(numbered(valid()), expect_last_seq=7, min_batches=1)
    assert s.ok and s.failures == [] and s.violations == [], s.text()
    assert (s.batches, s.events, s.first_seq, s.last_seq) == (8, 15, 0, 7)
    assert s.counts == {ORPHAN: 0, DUPLICATE: 0, UNKNOWN_REMOVAL: 0}
    assert (s.missing, s.lost_at_end, s.clears, s.unchecked) == (0, 0, 1, 0)
    assert [(r.dp_rank, r.batches, r.events, r.clears) for r in s.ranks] == [
        (0, 6, 12, 1),
        (1, 2, 3, 0),
    ]
    assert s.text().startswith("check ok: 8 batches (seq 0..7), 15 events")


def damaged(damage: Callable[[list], None]) -> list[Batch]:
    stream = copy.deepcopy(valid())
    damage(stream)
    return numbered(stream)


def one_violation(s: Summary, kind: str, dp_rank: int, medium: str | None) -> None:
    assert not s.ok and kind in s.failures, s.text()
    found = [v for v in s.violations if v.kind == kind]
    assert [(v.dp_rank, v.medium) for v in found] == [(dp_rank, medium)], s.text()


def test_a_dropped_removal_makes_the_next_store_a_duplicate():
    s = check(damaged(lambda stream: stream[2][1].remove(removed([3]))))
    one_violation(s, DUPLICATE, 0, "GPU")
    (v,) = s.violations
    assert v.count == 1 and [(e.seq, e.block) for e in v.examples] == [(4, "3")]
    assert "BlockStored medium=GPU blocks=[3] parent=2" in v.examples[0].event


def test_a_store_repeated_is_a_duplicate_of_each_block():
    s = check(
        damaged(lambda stream: stream[1][1].insert(1, stored([1, 2], None, "CPU")))
    )
    one_violation(s, DUPLICATE, 0, "CPU")
    assert s.counts[DUPLICATE] == 2 and s.failures == [DUPLICATE]


def test_a_parents_store_dropped_makes_an_orphan():
    s = check(damaged(lambda stream: stream[0][1].pop(0)))
    one_violation(s, ORPHAN, 0, "GPU")
    assert s.violations[0].examples[0].block == "3"
    # Its blocks are gone from the router's view too: their removals are unknown.
    assert s.counts[UNKNOWN_REMOVAL] == 2


def test_a_child_before_its_parent_is_an_orphan():
    s = check(damaged(lambda stream: stream[0][1].reverse()))
    one_violation(s, ORPHAN, 0, "GPU")
    assert s.failures == [ORPHAN]


def test_a_clear_is_legal_and_empties_its_rank():
    # A spurious clear on rank 0 before seq 4: what it held is gone then.
    s = check(damaged(lambda stream: stream[3][1].insert(0, CLEAR)), min_batches=1)
    assert s.ok, s.text()  # rank 1 holds nothing yet: nothing changes
    s = check(damaged(lambda stream: stream[4][1].insert(0, CLEAR)))
    assert s.failures == [ORPHAN, UNKNOWN_REMOVAL], s.text()
    assert s.counts == {ORPHAN: 2, DUPLICATE: 0, UNKNOWN_REMOVAL: 2}
    assert [r.clears for r in s.ranks] == [2, 0]


def test_a_batch_lost_at_the_end_is_found_when_the_last_seq_is_known():
    lost = damaged(lambda stream: stream.pop())
    assert check(lost).ok  # nothing says it was there
    s = check(lost, expect_last_seq=7)
    assert s.failures == [MISSING] and (s.missing, s.lost_at_end) == (1, 1)
    assert s.missing_ranges == [(7, 7)]
    assert "lost at the end 1" in s.text()


def test_a_batch_lost_in_the_middle_is_missing():
    batches = numbered(valid())
    del batches[3]  # rank 1's first batch: its later removal is unknown too
    s = check(batches, expect_last_seq=7)
    assert s.failures == [MISSING, UNKNOWN_REMOVAL], s.text()
    assert (s.missing, s.missing_ranges, s.lost_at_end) == (1, [(3, 3)], 0)
    s = check(numbered(valid())[1:])  # the first: read from the start, it is missing
    assert MISSING in s.failures and s.missing_ranges == [(0, 0)], s.text()


def test_zero_batches_fail_only_when_batches_were_expected():
    assert check([]).ok
    s = check([], min_batches=1)
    assert s.failures == [TOO_FEW_BATCHES] and "fewer than 1 batches" in s.text()
    s = check([], expect_last_seq=2)
    assert (s.failures, s.missing_ranges) == ([MISSING], [(0, 2)])


def test_a_batch_fed_again_is_skipped():
    batches = numbered(valid())
    s = check([*batches[:3], batches[1], *batches[3:]])
    assert s.ok and s.repeated == 1 and s.batches == 8, s.text()


# --- Dynamo's tiers -------------------------------------------------------------
@pytest.mark.parametrize(
    ("parent_medium", "medium", "ok"),
    [
        ("GPU", "CPU", True),
        ("CPU", "GPU", False),
        ("GPU", "STORAGE", True),
        ("CPU", "STORAGE", True),
        ("STORAGE", "EXTERNAL", True),
        ("EXTERNAL", "NVME", False),
        (None, "CPU_PINNED", True),
        # A medium no router tier takes has no tier above it, and is above none.
        ("GPU", "cpu", False),
        ("cpu", "CPU", False),
        # Another medium of the same tier is not above it.
        ("GPU", None, False),
        ("CPU", "CPU_PINNED", False),
    ],
)
def test_a_parent_may_be_held_in_a_tier_above(parent_medium, medium, ok):
    s = check([(0, 0, [stored([1], None, parent_medium), stored([2], 1, medium)])])
    assert s.ok is ok, s.text()
    if not ok:
        one_violation(s, ORPHAN, 0, medium)


def test_the_tier_table_is_dynamos():
    assert {m for m, t in TIER_OF_MEDIUM.items() if t == "device"} == {
        None,
        "GPU",
        "DEVICE",
    }
    from kvmerge.sim import routing

    assert routing.TIER_OF_MEDIUM is TIER_OF_MEDIUM  # one table


def test_a_parent_removed_above_no_longer_holds_a_child_below():
    s = check([(0, 0, [stored([1]), removed([1]), stored([2], 1, "CPU")])])
    one_violation(s, ORPHAN, 0, "CPU")


# --- dp ranks, mid-way, inputs --------------------------------------------------
def test_dp_ranks_are_checked_apart():
    s = check(
        numbered(
            [
                (0, [stored([1, 2])]),
                (1, [stored([3], 2), removed([1])]),  # rank 0's blocks
                (1, [CLEAR]),
                (0, [stored([4], 2), removed([1, 2, 4])]),  # rank 1's clear: kept
                (None, [stored([5], 4)]),  # no rank is a rank of its own
            ]
        )
    )
    assert s.counts == {ORPHAN: 2, DUPLICATE: 0, UNKNOWN_REMOVAL: 1}, s.text()
    assert [(v.kind, v.dp_rank) for v in s.violations] == [
        (ORPHAN, None),
        (ORPHAN, 1),
        (UNKNOWN_REMOVAL, 1),
    ]
    assert [(r.dp_rank, r.clears) for r in s.ranks] == [(None, 0), (0, 0), (1, 1)]


def test_a_stream_joined_mid_way_is_judged_from_each_ranks_clear():
    batches = [
        (40, 0, [removed([9]), stored([10], 9)]),  # held before we came
        (41, 1, [removed([7])]),
        (42, 0, [CLEAR, stored([1]), removed([9])]),
    ]
    s = check(batches, first_seq=None)
    assert (s.missing, s.unchecked, s.first_seq) == (0, 3, 40), s.text()
    one_violation(s, UNKNOWN_REMOVAL, 0, "GPU")
    assert "unchecked 3 (before a clear)" in s.text()
    # Read from the start, the same batches miss 0..39 and are all judged.
    s = check(batches)
    assert s.missing_ranges == [(0, 39)] and s.unchecked == 0
    assert s.counts[UNKNOWN_REMOVAL] == 3


@dataclass
class VLLMLike:
    """Any event classes with vLLM's names and fields will do."""

    block_hashes: list
    medium: str | None
    parent_block_hash: Any = None


class BlockStoredLike(VLLMLike):
    pass


BlockStoredLike.__name__ = "BlockStored"


def test_events_are_duck_typed_on_their_class_name():
    c = StreamCheck()
    c.feed_events([BlockStoredLike([1], "GPU"), BlockStoredLike([1], "GPU")], seq=0)
    assert c.summary().failures == [DUPLICATE]
    assert c.held(None, "GPU") == {1} and c.held(3, "GPU") == frozenset()


def test_json_lines_read_back_with_bytes_hashes_as_written():
    """What ``kvmerge subscribe --jsonl`` writes (bytes as base64) is checked
    as the batches themselves."""
    c = StreamCheck()
    for seq, rank, events in damaged(lambda s: s[3][1].append(stored([b"\x00a"], 1))):
        line = {"seq": seq, "data_parallel_rank": rank, "replayed": False}
        c.feed_json(msgspec.json.encode({**line, "events": events}))
    s = c.summary()
    one_violation(s, DUPLICATE, 1, "GPU")
    assert s.violations[0].examples[0].block == "0x0061"
    assert c.held(1, "GPU") == {1, b"\x00a"}


def test_the_subscribers_stats_add_missing_and_undecodable_batches():
    @dataclass
    class Stats:
        missing_ranges: list[tuple[int, int]]
        decode_errors: int

    c = StreamCheck()
    for seq in (0, 1, 4):
        c.feed_events([], seq=seq)
    s = c.summary(stats=Stats([(2, 3)], 0))
    assert (s.missing, s.missing_ranges) == (2, [(2, 3)])  # the same gap, once
    s = c.summary(stats=Stats([(5, 5)], 1), expect_last_seq=6)
    assert s.failures == [MISSING, UNDECODABLE]
    assert (s.missing, s.missing_ranges) == (4, [(2, 3), (5, 6)])


def test_a_summary_is_json_with_stable_keys_and_three_examples():
    c = StreamCheck()
    c.feed_events([removed(list(range(10)), "CPU")], dp_rank=2, seq=0)
    s = c.summary()
    d = json.loads(json.dumps(s.to_dict()))
    assert list(d) == [
        "ok",
        "failures",
        "batches",
        "events",
        "first_seq",
        "last_seq",
        "expect_last_seq",
        "min_batches",
        "missing",
        "missing_ranges",
        "lost_at_end",
        "repeated",
        "restarts",
        "undecodable",
        "clears",
        "unchecked",
        "counts",
        "ranks",
        "violations",
    ]
    (v,) = d["violations"]
    assert (v["kind"], v["dp_rank"], v["medium"], v["count"]) == (
        UNKNOWN_REMOVAL,
        2,
        "CPU",
        10,
    )
    assert [e["block"] for e in v["examples"]] == ["0", "1", "2"]
    assert set(v["examples"][0]) == {"seq", "block", "event"}
    # A summary is a snapshot.
    c.feed_events([removed([11], "CPU")], dp_rank=2, seq=1)
    assert s.violations[0].count == 10


# --- properties -------------------------------------------------------------------
MEDIA = ("GPU", "CPU", "STORAGE", "EXTERNAL", "cpu")
#: Where a store's parent may be held, besides its own medium (Dynamo's tiers).
ABOVE = {
    "GPU": (),
    "CPU": ("GPU",),
    "STORAGE": ("GPU", "CPU"),
    "EXTERNAL": ("GPU", "CPU", "STORAGE"),
    "cpu": (),
}


class _Model:
    """Per-(rank, medium) sets, and valid operations on them: a store's
    blocks are not held in its medium, its parent is (or in a tier above, or
    it has none); a removal's blocks are held; a clear empties a rank."""

    def __init__(self) -> None:
        self.held: dict[tuple[int, str], set[Any]] = defaultdict(set)
        #: Removed since the rank's last clear: stored again, now and then.
        self.gone: dict[tuple[int, str], set[Any]] = defaultdict(set)
        self.seen: set[Any] = set()
        self.fresh = itertools.count(1)

    def step(self, draw: Any, rank: int) -> Any:
        op = draw(
            st.sampled_from(("store", "store", "store", "remove", "remove", "clear"))
        )
        if op == "clear":
            return self.clear(rank)
        return self.store(draw, rank) if op == "store" else self.remove(draw, rank)

    def clear(self, rank: int) -> Any:
        for (r, _m), blocks in [*self.held.items(), *self.gone.items()]:
            if r == rank:
                blocks.clear()
        return CLEAR

    def remove(self, draw: Any, rank: int) -> Any:
        media = sorted(
            m for (r, m), blocks in self.held.items() if r == rank and blocks
        )
        if not media:
            return None
        medium = draw(st.sampled_from(media))
        mine = self.held[(rank, medium)]
        blocks = draw(
            st.lists(
                st.sampled_from(sorted(mine, key=repr)),
                min_size=1,
                max_size=3,
                unique=True,
            )
        )
        mine.difference_update(blocks)
        self.gone[(rank, medium)].update(blocks)
        return removed(blocks, medium)

    def store(self, draw: Any, rank: int) -> Any:
        medium = draw(st.sampled_from(("GPU", *MEDIA)))  # the device tier, most
        mine = self.held[(rank, medium)]
        parents = set(mine).union(*(self.held[(rank, m)] for m in ABOVE[medium]))
        parent = (
            draw(st.none() | st.sampled_from(sorted(parents, key=repr)))
            if parents
            else None
        )
        taken = {parent}
        blocks = [
            self.block(draw, rank, medium, taken)
            for _ in range(draw(st.integers(1, 3)))
        ]
        mine.update(blocks)
        self.gone[(rank, medium)].difference_update(blocks)
        self.seen.update(blocks)
        return stored(blocks, parent, medium)

    def block(self, draw: Any, rank: int, medium: str, taken: set[Any]) -> Any:
        """A block not held in this medium: new, stored here before (and
        removed), or known elsewhere (another medium or rank)."""
        out = taken | self.held[(rank, medium)]
        pool = {
            "new": set(),
            "again": self.gone[(rank, medium)] - out,
            "elsewhere": self.seen - out,
        }[draw(st.sampled_from(("new", "again", "elsewhere")))]
        if pool:
            h = draw(st.sampled_from(sorted(pool, key=repr)))
        else:
            n = next(self.fresh)
            h = n if draw(st.booleans()) else n.to_bytes(4, "big")
        taken.add(h)
        return h


@st.composite
def valid_streams(draw: Any) -> list[tuple[int, list[Any]]]:
    model = _Model()
    stream = []
    for _ in range(draw(st.integers(1, 12))):
        rank = draw(st.sampled_from((0, 1)))
        events = [model.step(draw, rank) for _ in range(draw(st.integers(0, 4)))]
        stream.append((rank, [e for e in events if e is not None]))
    return stream


@given(valid_streams())
def test_a_stream_of_valid_operations_passes(stream):
    s = check(numbered(stream), expect_last_seq=len(stream) - 1, min_batches=1)
    assert s.ok, s.text()


# Each damage: (the stream, draw) -> the failure it must cause, or None where
# it does not apply to this stream. Positions are (batch, event).
Damage = Callable[[list, Any], str | None]


def _events(stream: list) -> list[tuple[int, int, Any]]:
    return [
        (i, j, e) for i, (_r, events) in enumerate(stream) for j, e in enumerate(events)
    ]


def _pick(draw: Any, options: list) -> Any:
    return draw(st.sampled_from(options)) if options else None


def _after(stream: list, i: int, j: int) -> list[tuple[int, int, Any]]:
    """The events of batch i's rank after (i, j), up to its next clear."""
    rank = stream[i][0]
    out = []
    for k, m, e in _events(stream):
        if (k, m) <= (i, j) or stream[k][0] != rank:
            continue
        if type(e).__name__ == "AllBlocksCleared":
            break
        out.append((k, m, e))
    return out


def duplicate_a_store(stream: list, draw: Any) -> str | None:
    where = _pick(
        draw, [(i, j) for i, j, e in _events(stream) if isinstance(e, BlockStored)]
    )
    if where is None:
        return None
    i, j = where
    stream[i][1].insert(j + 1, copy.deepcopy(stream[i][1][j]))
    return DUPLICATE


def remove_an_unknown_block(stream: list, draw: Any) -> str | None:
    i = draw(st.integers(0, len(stream) - 1))
    stream[i][1].append(removed([b"never stored"], draw(st.sampled_from(MEDIA))))
    return UNKNOWN_REMOVAL


def drop_a_batch(stream: list, draw: Any) -> str | None:
    stream.pop(draw(st.integers(0, len(stream) - 1)))
    return MISSING  # numbered() is not told: seqs are taken before


def _drop_one_named_later(
    stream: list, draw: Any, kind: type, later: type, outcome: str
) -> str | None:
    """Drops one event of ``kind`` a later event of kind ``later`` names a
    block of (in its medium); ``outcome``, the check that must then fail."""

    def named_later(i: int, j: int, e: Any) -> bool:
        return any(
            isinstance(x, later)
            and x.medium == e.medium
            and set(x.block_hashes) & set(e.block_hashes)
            for _k, _m, x in _after(stream, i, j)
        )

    where = _pick(
        draw,
        [
            (i, j)
            for i, j, e in _events(stream)
            if isinstance(e, kind) and named_later(i, j, e)
        ],
    )
    if where is None:
        return None
    stream[where[0]][1].pop(where[1])
    return outcome


def drop_a_store_later_removed(stream: list, draw: Any) -> str | None:
    return _drop_one_named_later(
        stream, draw, BlockStored, BlockRemoved, UNKNOWN_REMOVAL
    )


def drop_a_removal_stored_again(stream: list, draw: Any) -> str | None:
    return _drop_one_named_later(stream, draw, BlockRemoved, BlockStored, DUPLICATE)


def move_a_child_before_its_parent(stream: list, draw: Any) -> str | None:
    """A store with no tier above it, moved before the store of its parent."""
    moves = []
    for i, j, child in _events(stream):
        if not isinstance(child, BlockStored) or ABOVE[child.medium]:
            continue
        parent_store = None
        for k, m, e in _events(stream):
            if (k, m) >= (i, j):
                break
            if (
                isinstance(e, BlockStored)
                and stream[k][0] == stream[i][0]
                and e.medium == child.medium
                and child.parent_block_hash in e.block_hashes
            ):
                parent_store = (k, m)
        if parent_store is not None:
            moves.append(((i, j), parent_store))
    move = _pick(draw, moves)
    if move is None:
        return None
    (i, j), (k, m) = move
    child = stream[i][1].pop(j)
    stream[k][1].insert(m, child)
    return ORPHAN


DAMAGES: tuple[Damage, ...] = (
    duplicate_a_store,
    remove_an_unknown_block,
    drop_a_batch,
    drop_a_store_later_removed,
    drop_a_removal_stored_again,
    move_a_child_before_its_parent,
)


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda d: d.__name__)
@given(stream=valid_streams(), data=st.data())
def test_one_damage_is_always_found(damage, stream, data):
    last_seq = len(stream) - 1
    batches = numbered(stream)
    # Damage the (rank, events) pairs, keeping each batch's seq.
    pairs = [[rank, list(events)] for _seq, rank, events in batches]
    seqs = {id(p): seq for p, (seq, _r, _e) in zip(pairs, batches, strict=True)}
    failure = damage(pairs, data.draw)
    if failure is None:
        return  # it does not apply to this stream
    s = check([(seqs[id(p)], p[0], p[1]) for p in pairs], expect_last_seq=last_seq)
    assert not s.ok and failure in s.failures, (damage.__name__, s.text())
