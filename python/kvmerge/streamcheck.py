"""Checking a KV-event stream as a KV-aware router reads it: ``StreamCheck``.

A router (NVIDIA Dynamo's KV indexer: docs/routers.md) follows a publisher's
stream and trusts it: every batch arrives, a block is stored under a parent it
already knows, stored once, and removed only while it is held.
``StreamCheck`` is fed the batches of one publisher (one ZMQ endpoint, one
sequence) in sequence order and counts what breaks that trust, per
data-parallel rank and per medium, since the last ``AllBlocksCleared`` of
that rank:

- **missing**: sequence numbers never fed (a gap, or batches lost before the
  first fed one or after the last, when the caller knows where the stream
  starts and ends);
- **orphan**: a ``BlockStored`` whose ``parent_block_hash`` is neither held in
  its medium nor, for a store in a lower tier, in a tier above it (Dynamo's
  tiers, highest first: device, host_pinned, disk, external;
  ``TIER_OF_MEDIUM``). Another medium of the same tier does not count (a
  publisher names one medium per tier), and a medium Dynamo does not know is
  a tier of its own with none above it;
- **duplicate**: a ``BlockStored`` of a block already held in its medium;
- **unknown_removal**: a ``BlockRemoved`` of a block not held in its medium.

"Held" means stored in that medium and not removed since the last clear.
Each medium is a flat set, the device tier too, although Dynamo keeps the
device tier as a tree and a removal there drops the block's descendants: a
child reports its own eviction, and vLLM's GPU block pool frees leaves first,
so a stream a router can follow removes every block it stored by name, and a
cascade would only hide an unknown removal.

Events are duck-typed on their class name (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) and the fields ``block_hashes``, ``parent_block_hash``
and ``medium``: ``kvmerge.events``' structs (what ``EventSubscriber`` decodes
with ``batch_type=kvmerge.events.KVEventBatch``) and vLLM's own classes alike.
Hashes are compared as decoded, ``int`` or ``bytes``; ``feed_json`` reads a
``kvmerge subscribe --jsonl`` line (bytes written as base64) back into them.

Nothing but the standard library is imported (``feed_json`` imports msgspec).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Final, TypeAlias

#: A block hash as vLLM publishes it (``ExternalBlockHash``).
Hash: TypeAlias = int | bytes

# --- Dynamo's tiers -------------------------------------------------------------
DEVICE: Final = "device"
#: Lower tiers, highest first: the order a router's query walks them.
LOWER: Final = ("host_pinned", "disk", "external")
#: The medium of an event -> the router tier it lands in (ai-dynamo-runtime
#: 1.6.1, case-sensitive); a medium not here is dropped by the router.
TIER_OF_MEDIUM: Final[dict[str | None, str]] = {
    None: DEVICE,
    "GPU": DEVICE,
    "DEVICE": DEVICE,
    "CPU": "host_pinned",
    "CPU_PINNED": "host_pinned",
    "CPU_TIER1": "host_pinned",
    "STORAGE": "disk",
    "DISK": "disk",
    "NVME": "disk",
    "CPU_TIER2": "disk",
    "EXTERNAL": "external",
    "NETWORK": "external",
    "REMOTE": "external",
    "SHARED": "external",
}
_TIERS: Final = (DEVICE, *LOWER)


def tier_level(medium: str | None) -> int | None:
    """0 for the device tier, larger lower down; None: a medium no router
    tier takes (a tier of its own, with none above it)."""
    tier = TIER_OF_MEDIUM.get(medium)
    return None if tier is None else _TIERS.index(tier)


# --- what the summary says ------------------------------------------------------
ORPHAN: Final = "orphan"
DUPLICATE: Final = "duplicate"
UNKNOWN_REMOVAL: Final = "unknown_removal"
#: The kinds of violation, in the order a summary lists them.
VIOLATIONS: Final = (ORPHAN, DUPLICATE, UNKNOWN_REMOVAL)
#: Why a summary is not ok, besides a violation.
MISSING: Final = "missing"
UNDECODABLE: Final = "undecodable"
TOO_FEW_BATCHES: Final = "too_few_batches"
#: Examples kept per (kind, dp rank, medium).
EXAMPLES: Final = 3
#: Missing ranges a summary lists (``missing`` counts them all).
RANGES: Final = 10


@dataclass(frozen=True)
class Example:
    """One violating block: the batch's sequence number (None: fed without
    one), the block, and the event it was in."""

    seq: int | None
    block: str
    event: str


@dataclass
class Violation:
    """Blocks of one kind of violation in one dp rank and medium."""

    kind: str
    dp_rank: int | None
    medium: str | None
    count: int = 0
    examples: list[Example] = field(default_factory=list)


@dataclass(frozen=True)
class RankSummary:
    dp_rank: int | None
    batches: int
    events: int
    clears: int
    #: Events before this rank's first clear in a stream joined mid-way
    #: (``first_seq=None``): what was held then is unknown, so they are not
    #: judged.
    unchecked: int


@dataclass(frozen=True)
class Summary:
    """What ``StreamCheck.summary`` found; ``to_dict()`` is its JSON form."""

    #: No violation, nothing missing or undecodable, enough batches.
    ok: bool
    #: Why not ok, in a fixed order: ``missing``, ``undecodable``,
    #: ``too_few_batches``, then each kind of violation seen (``VIOLATIONS``).
    failures: list[str]
    batches: int
    events: int
    first_seq: int | None
    last_seq: int | None
    expect_last_seq: int | None
    min_batches: int
    #: Sequence numbers never fed, ``lost_at_end`` included.
    missing: int
    #: The first ``RANGES`` ranges of them, inclusive.
    missing_ranges: list[tuple[int, int]]
    #: Those after the last fed batch, up to ``expect_last_seq``.
    lost_at_end: int
    #: Batches fed again (a sequence number not above the last), skipped.
    repeated: int
    #: Times the stream started over (``Checker.restart``).
    restarts: int
    #: Batches the subscriber could not decode (its ``Stats``).
    undecodable: int
    clears: int
    unchecked: int
    #: Violating blocks per kind, every kind present.
    counts: dict[str, int]
    ranks: list[RankSummary]
    violations: list[Violation]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        """One paragraph: a line, and a line per (kind, dp rank, medium) seen."""
        verdict = "ok" if self.ok else f"FAILED ({', '.join(self.failures)})"
        seq = (
            ""
            if self.first_seq is None
            else f" (seq {self.first_seq}..{self.last_seq})"
        )
        ranks = ", ".join(_rank_text(r.dp_rank) for r in self.ranks) or "none"
        parts = [
            f"check {verdict}: {self.batches:,} batches{seq}, {self.events:,} events",
            f"dp ranks {ranks}",
            f"missing {self.missing}" + _ranges_text(self.missing_ranges),
        ]
        if self.lost_at_end:
            parts.append(f"lost at the end {self.lost_at_end}")
        if self.undecodable:
            parts.append(f"undecodable {self.undecodable}")
        if self.restarts:
            parts.append(f"restarts {self.restarts}")
        if TOO_FEW_BATCHES in self.failures:
            parts.append(f"fewer than {self.min_batches} batches")
        parts.append(f"clears {self.clears}")
        if self.unchecked:
            parts.append(f"unchecked {self.unchecked} (before a clear)")
        parts.append(
            ", ".join(f"{k.replace('_', ' ')}s {self.counts[k]}" for k in VIOLATIONS)
        )
        lines = ["; ".join(parts)]
        lines.extend(_violation_text(v) for v in self.violations)
        return "\n".join(lines)


def _rank_text(dp_rank: int | None) -> str:
    return "-" if dp_rank is None else str(dp_rank)


def _ranges_text(ranges: list[tuple[int, int]]) -> str:
    if not ranges:
        return ""
    return " (" + ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in ranges) + ")"


def _violation_text(v: Violation) -> str:
    examples = "; ".join(
        f"seq {'-' if e.seq is None else e.seq} block {e.block}: {e.event}"
        for e in v.examples
    )
    medium = "-" if v.medium is None else v.medium
    return f"  {v.kind} dp {_rank_text(v.dp_rank)} {medium}: {v.count} ({examples})"


# --- describing events ----------------------------------------------------------
def hash_text(h: Any) -> str:
    if isinstance(h, bytes | bytearray | memoryview):
        raw = bytes(h)
        return "0x" + raw[:12].hex() + ("..." if len(raw) > 12 else "")
    return str(h)


def event_text(event: Any) -> str:
    """An event, short: its class, medium, blocks (the first 4) and parent."""
    kind = type(event).__name__
    if kind == "AllBlocksCleared":
        return kind
    hashes = list(event.block_hashes)
    blocks = ", ".join(hash_text(h) for h in hashes[:4])
    if len(hashes) > 4:
        blocks += f", ... ({len(hashes)} blocks)"
    text = f"{kind} medium={event.medium} blocks=[{blocks}]"
    if kind == "BlockStored":
        text += f" parent={hash_text(event.parent_block_hash)}"
    return text


def _key(h: Any) -> Hash:
    # msgspec and vLLM give int or bytes; a buffer from elsewhere compares as
    # its bytes.
    return bytes(h) if isinstance(h, bytearray | memoryview) else h


# --- the check --------------------------------------------------------------------
@dataclass
class _Rank:
    """One dp rank: what each medium holds since its last clear."""

    #: Whether what it holds is known (from the stream's start, or a clear).
    known: bool
    held: dict[str | None, set[Hash]] = field(default_factory=dict)
    batches: int = 0
    events: int = 0
    clears: int = 0
    unchecked: int = 0

    def holds_parent(self, medium: str | None, parent: Hash) -> bool:
        if parent in self.held.get(medium, ()):
            return True
        level = tier_level(medium)
        if level is None:
            return False
        return any(
            parent in blocks
            for other, blocks in self.held.items()
            if (above := tier_level(other)) is not None and above < level
        )

    def summary(self, dp_rank: int | None) -> RankSummary:
        return RankSummary(
            dp_rank, self.batches, self.events, self.clears, self.unchecked
        )


class StreamCheck:
    """Checks one publisher's stream; see the module's docstring.

    ``first_seq``: the sequence number the stream starts at (vLLM's publisher
    starts at 0), so that batches before the first fed one count as missing
    and every rank's blocks are known from the start; None for a stream
    joined mid-way: nothing before the first fed batch is missing, and a
    rank's events are judged only from its first ``AllBlocksCleared`` on
    (``unchecked`` counts those before). ``min_batches``: fewer batches fed
    is a failure (a stream that should have said something and did not).
    """

    def __init__(self, *, min_batches: int = 0, first_seq: int | None = 0) -> None:
        self.min_batches = min_batches
        self.first_seq = first_seq
        self._ranks: dict[int | None, _Rank] = {}
        self._violations: dict[tuple[str, int | None, str | None], Violation] = {}
        self._first: int | None = None
        self._last: int | None = None
        self._missing: list[tuple[int, int]] = []
        self._repeated = 0
        self._batches = 0
        self._events = 0
        self._restarts = 0

    # --- feeding --------------------------------------------------------------
    def feed(self, batch: Any, seq: int | None = None) -> None:
        """One ``KVEventBatch`` (``events``, ``data_parallel_rank``) and its
        sequence number (None: not tracked; gaps then come from the
        subscriber's ``Stats`` given to ``summary``)."""
        self.feed_events(batch.events, dp_rank=batch.data_parallel_rank, seq=seq)

    def feed_events(
        self,
        events: Iterable[Any],
        *,
        dp_rank: int | None = None,
        seq: int | None = None,
    ) -> None:
        """One batch's events, as ``feed``."""
        if seq is not None and not self._take_seq(seq):
            return
        rank = self._rank(dp_rank)
        rank.batches += 1
        self._batches += 1
        for event in events:
            rank.events += 1
            self._events += 1
            self._apply(rank, dp_rank, event, seq)

    def feed_json(self, line: str | bytes) -> None:
        """One line of ``kvmerge subscribe --jsonl`` (``seq``,
        ``data_parallel_rank``, ``events``; bytes hashes as base64)."""
        import msgspec

        from kvmerge.events import AllBlocksCleared, BlockRemoved, BlockStored

        events_type = list[BlockStored | BlockRemoved | AllBlocksCleared]
        obj = msgspec.json.decode(line)
        if obj.get("incarnation", 0) > self._restarts:
            self.restart()
        events = msgspec.convert(obj["events"], events_type)
        self.feed_events(
            events, dp_rank=obj.get("data_parallel_rank"), seq=obj.get("seq")
        )

    def restart(self) -> None:
        """A new publisher on the endpoint (a restarted server): its stream
        starts over at sequence number 0, and its ranks hold nothing the old
        one published (a router must forget those blocks)."""
        self._restarts += 1
        self.first_seq = 0
        self._last = None
        for rank in self._ranks.values():
            rank.held.clear()
            rank.known = True

    def _take_seq(self, seq: int) -> bool:
        """Whether a batch is new; a gap before it is recorded."""
        if self._last is not None and seq <= self._last:
            self._repeated += 1
            return False
        expected = self.first_seq if self._last is None else self._last + 1
        if expected is not None and seq > expected:
            self._missing.append((expected, seq - 1))
        if self._first is None:
            self._first = seq
        self._last = seq
        return True

    def _rank(self, dp_rank: int | None) -> _Rank:
        rank = self._ranks.get(dp_rank)
        if rank is None:
            rank = self._ranks[dp_rank] = _Rank(known=self.first_seq is not None)
        return rank

    # --- the router's view ----------------------------------------------------
    def _apply(
        self, rank: _Rank, dp_rank: int | None, event: Any, seq: int | None
    ) -> None:
        kind = type(event).__name__
        if kind == "AllBlocksCleared":
            rank.held.clear()
            rank.known = True
            rank.clears += 1
        elif not rank.known:
            rank.unchecked += 1
        elif kind == "BlockStored":
            self._store(rank, dp_rank, event, seq)
        elif kind == "BlockRemoved":
            self._remove(rank, dp_rank, event, seq)

    def _store(
        self, rank: _Rank, dp_rank: int | None, event: Any, seq: int | None
    ) -> None:
        medium = event.medium
        parent = event.parent_block_hash
        hashes = [_key(h) for h in event.block_hashes]
        # Only the first block can be an orphan: the others hang off it.
        if (
            hashes
            and parent is not None
            and not rank.holds_parent(medium, _key(parent))
        ):
            self._violation(ORPHAN, dp_rank, medium, seq, hashes[0], event)
        held = rank.held.setdefault(medium, set())
        for h in hashes:
            if h in held:
                self._violation(DUPLICATE, dp_rank, medium, seq, h, event)
            held.add(h)

    def _remove(
        self, rank: _Rank, dp_rank: int | None, event: Any, seq: int | None
    ) -> None:
        medium = event.medium
        held = rank.held.setdefault(medium, set())
        for h in map(_key, event.block_hashes):
            if h in held:
                held.remove(h)
            else:
                self._violation(UNKNOWN_REMOVAL, dp_rank, medium, seq, h, event)

    def _violation(
        self,
        kind: str,
        dp_rank: int | None,
        medium: str | None,
        seq: int | None,
        block: Hash,
        event: Any,
    ) -> None:
        key = (kind, dp_rank, medium)
        v = self._violations.get(key)
        if v is None:
            v = self._violations[key] = Violation(kind, dp_rank, medium)
        v.count += 1
        if len(v.examples) < EXAMPLES:
            v.examples.append(Example(seq, hash_text(block), event_text(event)))

    def held(self, dp_rank: int | None, medium: str | None) -> frozenset[Hash]:
        """The blocks a rank's medium holds now (what a router should)."""
        rank = self._ranks.get(dp_rank)
        return frozenset(rank.held.get(medium, ()) if rank else ())

    # --- the verdict ------------------------------------------------------------
    def summary(
        self, *, expect_last_seq: int | None = None, stats: Any = None
    ) -> Summary:
        """What was found so far. ``expect_last_seq``: the publisher's last
        sequence number, when known (batches after the last fed one are then
        missing too). ``stats``: the subscriber's ``Stats`` (its missing
        ranges and undecodable batches are added)."""
        lost = self._lost_at_end(expect_last_seq)
        missing = _merged(
            [*self._missing, *lost, *getattr(stats, "missing_ranges", ())]
        )
        n_missing = sum(b - a + 1 for a, b in missing)
        undecodable = getattr(stats, "decode_errors", 0)
        counts = {k: 0 for k in VIOLATIONS}
        for v in self._violations.values():
            counts[v.kind] += v.count
        failures = [
            name
            for name, failed in (
                (MISSING, n_missing > 0),
                (UNDECODABLE, undecodable > 0),
                (TOO_FEW_BATCHES, self._batches < self.min_batches),
                *((k, counts[k] > 0) for k in VIOLATIONS),
            )
            if failed
        ]
        ranks = sorted(self._ranks.items(), key=lambda kv: _order(kv[0]))
        return Summary(
            ok=not failures,
            failures=failures,
            batches=self._batches,
            events=self._events,
            first_seq=self._first,
            last_seq=self._last,
            expect_last_seq=expect_last_seq,
            min_batches=self.min_batches,
            missing=n_missing,
            missing_ranges=missing[:RANGES],
            lost_at_end=sum(b - a + 1 for a, b in lost),
            repeated=self._repeated,
            restarts=self._restarts,
            undecodable=undecodable,
            clears=sum(r.clears for r in self._ranks.values()),
            unchecked=sum(r.unchecked for r in self._ranks.values()),
            counts=counts,
            ranks=[r.summary(dp_rank) for dp_rank, r in ranks],
            violations=[
                _copy(v)
                for v in sorted(self._violations.values(), key=_violation_order)
            ],
        )

    def _lost_at_end(self, expect_last_seq: int | None) -> list[tuple[int, int]]:
        if expect_last_seq is None:
            return []
        if self._last is not None:
            start = self._last + 1
        elif self.first_seq is not None:
            start = self.first_seq
        else:
            start = expect_last_seq  # joined mid-way, and nothing came: the last
        return [(start, expect_last_seq)] if expect_last_seq >= start else []


def _order(value: int | str | None) -> tuple[bool, int | str]:
    # None first; then by value.
    return (value is not None, value if value is not None else 0)


def _violation_order(
    v: Violation,
) -> tuple[int, tuple[bool, int | str], tuple[bool, int | str]]:
    return (VIOLATIONS.index(v.kind), _order(v.dp_rank), _order(v.medium))


def _copy(v: Violation) -> Violation:
    # A summary is a snapshot: later feeding must not change it.
    return Violation(v.kind, v.dp_rank, v.medium, v.count, list(v.examples))


def _merged(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
