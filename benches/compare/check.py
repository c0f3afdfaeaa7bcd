"""Each path's output, per child and per step, against the reference model.

The model is ``kvmerge.testing.reference`` (a plain-Python reading of
docs/merge-rules.md, shipped in the package): one ``ReferenceMerger`` per
child, with the rule kvmerge gives that child (``"all"`` for LMCache,
``"quorum"`` with the container's replication factors for Mooncake, ``"all"``
for the list child), the connector's ``max_pending_steps`` and its guard (the
connector guards every child: events a router could not apply are withheld,
docs/merge-rules.md "Guard"), fed each rank's events of the step (what the
child's container returns from ``get_all_events()``). Both paths are compared
with it: vLLM's own path, which has no guard, shows as ``+N`` the events it
publishes that a router could not apply. Events are compared by their msgpack
encoding (the model's identity, and exactly what a publisher sends): same
events, same order.

The model is naive (quadratic in a step's reports), so large steps are left
unchecked; see ``check_limit``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvmerge import DEFAULT_MAX_PENDING_STEPS, Rule
from kvmerge.testing import reference

from . import children as bench_children
from .workload import Step

_ENCODER = msgspec.msgpack.Encoder()


def identity(event: Any) -> bytes:
    """An event's msgpack encoding (a ``msgspec.Raw`` already is one)."""
    if isinstance(event, msgspec.Raw):
        return bytes(event)
    return _ENCODER.encode(event)


_DECODER: Any = None


def describe(ident: bytes) -> str:
    global _DECODER
    if _DECODER is None:
        from vllm.distributed.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
        )

        _DECODER = msgspec.msgpack.Decoder(
            BlockStored | BlockRemoved | AllBlocksCleared
        )
    event = _DECODER.decode(ident)
    hashes = getattr(event, "block_hashes", None)
    if not hashes:
        return type(event).__name__
    h = hashes[0]
    h_text = h.hex()[:12] if isinstance(h, bytes) else f"{h:x}"[:12]
    return f"{type(event).__name__}({len(hashes)} hashes, first {h_text}…)"


@dataclass
class ChildDiff:
    """How one path's output for one child compares with the model."""

    steps: int = 0
    steps_equal: int = 0
    expected: int = 0
    got: int = 0
    #: Events the model published that the path did not (multiset, per step).
    missing: int = 0
    #: Events the path published that the model did not.
    extra: int = 0
    #: Steps with the same events in a different order.
    reordered: int = 0
    first: str | None = None

    @property
    def equal(self) -> bool:
        return self.steps_equal == self.steps

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "steps_equal": self.steps_equal,
            "expected": self.expected,
            "got": self.got,
            "missing": self.missing,
            "extra": self.extra,
            "reordered": self.reordered,
            "first_difference": self.first,
            "equal": self.equal,
        }

    def summary(self) -> str:
        if self.equal:
            return "="
        parts = []
        if self.missing:
            parts.append(f"-{self.missing}")
        if self.extra:
            parts.append(f"+{self.extra}")
        if self.reordered:
            parts.append(f"~{self.reordered} steps")
        return " ".join(parts) or "≠"

    def compare(self, step: int, want: list[bytes], got: list[bytes]) -> None:
        self.steps += 1
        self.expected += len(want)
        self.got += len(got)
        if want == got:
            self.steps_equal += 1
            return
        cw, cg = Counter(want), Counter(got)
        missing = sum((cw - cg).values())
        extra = sum((cg - cw).values())
        self.missing += missing
        self.extra += extra
        if not missing and not extra:
            self.reordered += 1
        if self.first is None:
            i = next(
                (i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b),
                min(len(want), len(got)),
            )
            w = describe(want[i]) if i < len(want) else "nothing"
            g = describe(got[i]) if i < len(got) else "nothing"
            self.first = (
                f"step {step}: expected {len(want)} events, got {len(got)} "
                f"({missing} missing, {extra} extra); first difference at "
                f"#{i}: expected {w}, got {g}"
            )


def rule_of(family: str) -> tuple[Rule, list[int] | None]:
    rule = bench_children.CHILDREN[family][1]
    factors = list(bench_children.MOONCAKE_FACTORS) if rule == "quorum" else None
    return rule, factors


@dataclass
class Checker:
    """Runs the model beside the paths, one step at a time."""

    world_size: int
    families: tuple[str, ...]
    models: list[Any] = field(default_factory=list)
    diffs: dict[str, list[ChildDiff]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for family in self.families:
            rule, factors = rule_of(family)
            self.models.append(
                reference.ReferenceMerger(
                    self.world_size,
                    rule,
                    factors,
                    DEFAULT_MAX_PENDING_STEPS,
                    guard=True,
                )
            )

    def expected(self, step: Step) -> list[list[bytes]]:
        """The model's output for this step, per child."""
        out = []
        for i, (family, model) in enumerate(
            zip(self.families, self.models, strict=True)
        ):
            for rank in range(self.world_size):
                model.add(rank, bench_children.reported(family, step.events[i][rank]))
            out.append([reference.identity(e) for e in model.finish_step()])
        return out

    def compare(
        self, path: str, step: int, want: list[list[bytes]], got: list[list[Any]]
    ) -> None:
        diffs = self.diffs.setdefault(path, [ChildDiff() for _ in self.families])
        for i, events in enumerate(got):
            diffs[i].compare(step, want[i], [identity(e) for e in events])
