"""Every kind of refusal the step declares (``refusal_kinds!`` in
``rust/kvmerge-core/src/step/refusal.rs``, ``kvmerge._kvmerge._refusal_kinds()``) is
produced by some input, with the rank and child it names: one crafted step
per kind through ``OutputMerger.step``, so the registry and the step cannot
drift apart.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.vllm_harness import stored
from support.worker_outputs import RANK_END, cut, with_damaged_batch
from vllm.distributed.kv_events import KVConnectorKVEvents

import kvmerge
from kvmerge import ConfigError
from kvmerge._kvmerge import OutputMerger, WorkerOutput, WorkerSettings, _refusal_kinds
from kvmerge.sim.children import ListKVEvents
from kvmerge.vllm.families import implied_rules

pytestmark = pytest.mark.vllm

WORLD = 2
#: (label, rule, factors) per child: rule "any", then two whose rule is
#: inferred from their first batch (child 2 has none before the case's step).
CHILDREN = [
    ("connectors[0] (A)", "any", None),
    ("connectors[1] (B)", None, None),
    ("connectors[2] (C)", None, None),
]


def settings(rank: int, version: str = kvmerge.__version__) -> WorkerSettings:
    return WorkerSettings(version, WORLD, rank, True, CHILDREN)


def fresh() -> OutputMerger:
    """An ``OutputMerger`` as ``KVMergeMultiConnector`` builds one."""
    return OutputMerger(
        settings(-1),
        32,
        implied_rules(),
        KVConnectorKVEvents,
        [False] * len(CHILDREN),
    )


def started() -> OutputMerger:
    """``fresh()`` past its first step (each rank's first output, with its
    settings): child 0 took UMBP batches, child 1 LMCache's."""
    merger = fresh()
    first = [output(r, 0, settings=settings(r)) for r in range(WORLD)]
    result = merger.step(first)
    assert list(result.refusals) == [] and result.ranks == [0, 1]
    return merger


def batch(*events: Any) -> kvmerge.EventBatch:
    return kvmerge.encode(list(events) or [stored(5)])


def output(
    rank: int, seq: int = 1, entries: list[Any] | None = None, **kw: Any
) -> WorkerOutput:
    """A well-formed output of ``rank``: a UMBP batch for child 0, an
    LMCache batch for child 1, nothing for child 2; or ``entries``."""
    if entries is None:
        entries = [("umbp", batch(), None), ("lmcache", batch(), None), None]
    return WorkerOutput(rank, seq, entries, kw.get("settings"))


def entries(**at: Any) -> list[Any]:
    """``output``'s entries with those of the children named ``c0``.. replaced."""
    e: list[Any] = [("umbp", batch(), None), ("lmcache", batch(), None), None]
    for name, value in at.items():
        e[int(name[1:])] = value
    return e


#: Per kind: the outputs of one step, and the (kind, rank, child) of each
#: refusal it gives, in order.
Case = tuple[Callable[[], list[Any]], list[tuple[str, int | None, int | None]]]
CASES: dict[str, Case] = {
    "output": (lambda: [output(0), "not an output"], [("output", None, None)]),
    "output-damaged": (
        lambda: [output(0), cut(output(1), RANK_END + 1)],
        [("output", 1, None)],
    ),
    "output-damaged-before-its-rank": (
        lambda: [cut(output(1), RANK_END - 1), output(0)],
        [("output", None, None)],
    ),
    "rank": (lambda: [output(2), output(0)], [("rank", 2, None)]),
    "rank-negative": (lambda: [output(-1)], [("rank", -1, None)]),
    "duplicate": (lambda: [output(1), output(1)], [("duplicate", 1, None)]),
    "settings": (
        lambda: [output(0), output(1, settings=settings(1, "0.0.1"))],
        [("settings", 1, None)],
    ),
    "settings-rank": (
        lambda: [output(1, settings=settings(0))],
        [("settings", 1, None)],
    ),
    "misconfigured": (
        lambda: [output(1, settings=settings(1, "0.0.1")), output(1)],
        [("settings", 1, None), ("misconfigured", 1, None)],
    ),
    "children": (lambda: [output(1, entries=[None])], [("children", 1, None)]),
    "encode": (
        lambda: [output(1, entries=entries(c1="could not encode"))],
        [("encode", 1, 1)],
    ),
    "native": (
        lambda: [output(0), output(1, entries=entries(c2=b"not a container"))],
        [("native", 1, 2)],
    ),
    "family": (
        lambda: [output(1, entries=entries(c0=("bogus", batch(), None)))],
        [("family", 1, 0)],
    ),
    "family-another": (
        lambda: [output(0, entries=entries(c1=("umbp", batch(), None)))],
        [("family", 0, 1)],
    ),
    "family-native": (
        lambda: [output(1, entries=entries(c1=ListKVEvents([stored(3)])))],
        [("family", 1, 1)],
    ),
    # Rule "any" uses no factors: those a container reports are not read.
    "factors-unused": (
        lambda: [output(1, entries=entries(c0=("umbp", batch(), (0,))))],
        [],
    ),
    "factors-negative": (
        lambda: [output(1, entries=entries(c2=("mooncake", batch(), (-1,))))],
        [("factors", 1, 2)],
    ),
    # Mooncake's inferred rule is "quorum": its factors from the container.
    "factors-missing": (
        lambda: [output(1, entries=entries(c2=("mooncake", batch(), None)))],
        [("factors", 1, 2)],
    ),
    "factors-disagree": (
        lambda: [
            output(0, entries=entries(c2=("mooncake", batch(), (2,)))),
            output(1, entries=entries(c2=("mooncake", batch(), (1,)))),
        ],
        [("factors", 1, 2)],
    ),
    "batch": (
        lambda: [with_damaged_batch(output(1), 1), output(0)],
        [("batch", 1, 1)],
    ),
    # Rule "quorum" with one KV cache group: a store in group 3 is in none.
    "merge": (
        lambda: [
            output(0, entries=entries(c2=("mooncake", batch(stored(9, group=3)), (2,))))
        ],
        [("merge", 0, 2)],
    ),
}


@pytest.mark.parametrize(("make", "expected"), CASES.values(), ids=CASES.keys())
def test_each_refusal_names_its_kind_rank_and_child(
    make: Callable[[], list[Any]], expected: list[tuple[str, Any, Any]]
):
    merger = started()
    result = merger.step(make())
    got = [(r.kind, r.rank, r.child) for r in result.refusals]
    assert got == expected, [r.detail for r in result.refusals]
    assert all(r.detail for r in result.refusals)


def test_every_kind_is_produced_by_some_case():
    kinds = [name for name, _meaning in _refusal_kinds()]
    assert len(set(kinds)) == len(kinds)
    produced = {kind for _make, expected in CASES.values() for kind, *_ in expected}
    assert produced == set(kinds)


def test_settings_that_differ_on_the_first_step_stop_the_engine():
    """Start-up: a misconfigured deployment fails loudly, and the step
    changes nothing (the same outputs, agreeing, are then taken)."""
    merger = fresh()
    with pytest.raises(ConfigError, match="rank 1's settings differ"):
        merger.step([output(0, 0), output(1, 0, settings=settings(1, "0.0.1"))])
    result = merger.step([output(0, 0), output(1, 0, settings=settings(1))])
    assert list(result.refusals) == [] and result.ranks == [0, 1]
    assert result.gaps == []


def test_the_stubs_refusal_kind_is_every_kind():
    """``Refusal.kind``'s type in the stub names exactly the registry's
    kinds, in its order: a kind added in Rust must be added there too."""
    stub = Path(kvmerge._kvmerge.__file__).with_name("_kvmerge.pyi").read_text()
    literal = stub.split("_RefusalKind = Literal[")[1].split("]")[0]
    names = [n.strip().strip('"') for n in literal.split(",") if n.strip()]
    assert names == [name for name, _meaning in _refusal_kinds()]
    assert "def kind(self) -> _RefusalKind: ..." in stub


def test_robustness_md_lists_every_refusal_kind():
    """docs/robustness.md's table of refusal kinds is ``_refusal_kinds()``:
    name and meaning, in declaration order."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "robustness.md").read_text()
    table = doc.split("<!-- refusal-kinds:begin -->")[1]
    table = table.split("<!-- refusal-kinds:end -->")[0]
    rows = [
        tuple(c.strip() for c in line.strip().strip("|").split("|"))[:2]
        for line in table.strip().splitlines()[2:]
    ]
    assert [(k.strip("`"), m) for k, m in rows] == _refusal_kinds()
