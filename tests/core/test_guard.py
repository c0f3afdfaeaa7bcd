"""The guard (docs/merge-rules.md, "Guard"): the engine agrees with the
reference model with the guard on, every guarded stream is valid for a
router, and the guard only ever withholds what the rule published."""

from hypothesis import given
from hypothesis import strategies as st
from support.strategies import (
    chain_pools,
    max_pending,
    quorum_configs,
    scenarios,
)
from support.vllm_harness import removed, stored
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

import kvmerge
from kvmerge.testing.reference import (
    ReferenceMerger,
    assert_same_events,
    assert_same_stats,
)


def invalid(stream):
    """The events of `stream` a router could not apply, replayed from
    nothing: written here, not taken from the model."""
    held: dict[str | None, set] = {}
    bad = []
    for e in stream:
        if isinstance(e, AllBlocksCleared):
            held.clear()
            continue
        blocks = held.setdefault(e.medium, set())
        hashes = list(e.block_hashes)
        if isinstance(e, BlockStored):
            ok = (
                e.parent_block_hash is None or e.parent_block_hash in blocks
            ) and not any(h in blocks for h in hashes)
        else:
            ok = all(h in blocks for h in hashes)
        if ok and len(set(hashes)) == len(hashes):
            (blocks.update if isinstance(e, BlockStored) else blocks.difference_update)(
                hashes
            )
        else:
            bad.append(e)
    return bad


@st.composite
def guard_cases(draw):
    """A config of any rule and a scenario over a few blocks: late ranks,
    lost reports (removals too), repeated stores, clears, silent ranks."""
    rule = draw(st.sampled_from(["all", "quorum", "any"]))
    config = {"rule": rule, "max_pending_steps": draw(max_pending)}
    n_groups = None
    if rule == "quorum":
        world_size, factors = draw(quorum_configs())
        config["replication_factors"] = factors
        n_groups = len(factors)
    else:
        world_size = draw(st.integers(1, 4))
    config["world_size"] = world_size
    pool = draw(chain_pools(n_groups))
    scenario = draw(scenarios(world_size=world_size, pool=pool))
    resets = draw(st.lists(st.booleans(), min_size=len(scenario.steps)))
    return config, scenario, resets


@given(guard_cases())
def test_the_guard_agrees_with_the_reference(case):
    config, scenario, resets = case
    engine = kvmerge.Merger(**config, guard=True)
    plain = kvmerge.Merger(**config)
    model = ReferenceMerger(**config, guard=True)
    assert engine.guard and not plain.guard
    stream, unguarded = [], []
    for batches, reset in zip(scenario.steps, resets, strict=False):
        for rank, events in sorted(batches.items()):
            engine.add(rank, kvmerge.encode(events))
            plain.add(rank, kvmerge.encode(events))
            model.add(rank, events)
        out = engine.finish_step()
        assert_same_events(out, model.finish_step())
        assert_same_stats(engine.stats(), model)
        stream += out
        unguarded += plain.finish_step()
        if reset:
            # As vLLM's scheduler does after a reset: a clear of its own.
            for m in (engine, model, plain):
                m.reset()
            stream.append(AllBlocksCleared())
            unguarded.append(AllBlocksCleared())
    assert invalid(stream) == []
    s, p = engine.stats(), plain.stats()
    assert s.published + s.withheld == p.published
    # The guard withholds something exactly when the rule's stream is invalid.
    assert (s.withheld == 0) == (invalid(unguarded) == [])
    for name in ("reports", "consumed", "cleared", "expired", "pending"):
        assert getattr(s, name) == getattr(p, name), name
    assert s.reports == s.consumed + s.cleared + s.expired + s.pending
    assert p.withheld == 0


def test_quorum_publishes_an_invalid_stream_the_guard_withholds():
    """Under "quorum" at world 2, factor 2, a store completes with one rank
    and a removal needs both. Rank 1, a step late, reports a store rank 0
    completed already, the removal, and a child of the removed block: the
    rule publishes a second store of a held block and an orphan."""
    a = stored(1, group=0, medium="CPU")
    gone = removed(1, medium="CPU")
    child = stored(b"\x02", 1, group=0, medium="CPU")

    def run(guard):
        m = kvmerge.Merger(2, "quorum", [2], guard=guard)
        m.add(0, kvmerge.encode([a, gone]))
        m.add(1, kvmerge.encode([]))
        out = m.finish_step()
        m.add(0, kvmerge.encode([]))
        m.add(1, kvmerge.encode([a, gone, child]))
        return out + m.finish_step(), m.stats()

    stream, stats = run(False)
    assert_same_events(stream, [a, a, gone, child])
    assert invalid(stream) == [a, child]
    assert stats.withheld == 0
    stream, stats = run(True)
    assert_same_events(stream, [a, gone])
    assert invalid(stream) == []
    assert (stats.withheld_orphan, stats.withheld_duplicate) == (1, 1)
    assert (stats.withheld, stats.withheld_unknown, stats.published) == (2, 0, 2)
    assert stats.as_dict()["withheld"] == 2


def test_a_lost_removal_report_is_not_published_twice():
    """Under "any", two ranks each report a removal in another step: the
    second publication removes a block no longer held."""
    a = stored(7, medium=None)
    gone = removed(7, medium=None)
    for guard in (False, True):
        m = kvmerge.Merger(2, "any", guard=guard)
        model = ReferenceMerger(2, "any", guard=guard)
        for batches in ({0: [a, gone], 1: [a]}, {1: [gone]}):
            for rank, events in batches.items():
                m.add(rank, kvmerge.encode(events))
                model.add(rank, events)
            assert_same_events(m.finish_step(), model.finish_step())
            assert_same_stats(m.stats(), model)
        assert m.stats().withheld_unknown == int(guard)


def test_reset_forgets_what_was_held():
    a = stored(b"a")
    m = kvmerge.Merger(1, guard=True)
    m.add(0, kvmerge.encode([a]))
    assert m.finish_step() == [a]
    m.reset()
    m.add(0, kvmerge.encode([a, a]))
    assert m.finish_step() == [a]
    assert m.stats().withheld_duplicate == 1
    assert "guard=True" in repr(m)


def _published(config, steps, guard):
    """Each step's events, engine and reference model agreeing."""
    engine = kvmerge.Merger(**config, guard=guard)
    model = ReferenceMerger(**config, guard=guard)
    out = []
    for batches in steps:
        for rank, events in batches.items():
            engine.add(rank, kvmerge.encode(events))
            model.add(rank, events)
        got = engine.finish_step()
        assert_same_events(got, model.finish_step())
        out.append(got)
    return out, engine.stats()


def test_quorum_loses_a_block_a_late_rank_stored_again():
    """The limit docs/merge-rules.md names ("Consequences"): every rank
    stores block B, removes it and stores it again, so B is held; one rank
    is a step late. Under "quorum" the router ends without B (until its next
    store or a clear); engine and reference model agree. A rule that keeps
    the late ranks' order fails this test and changes the docs with it."""
    b, gone = stored(1, group=0, medium="CPU"), removed(1, group=0, medium="CPU")
    # World 4, factor 2: the new store completes without the late rank, in
    # the step the removal does (it needs every rank), at a smaller position.
    quorum_of_2 = {
        "world_size": 4,
        "rule": "quorum",
        "replication_factors": [2],
        "max_pending_steps": 2,
    }
    steps = [
        {0: [b], 1: [b], 2: [b], 3: []},
        {0: [gone], 1: [gone], 2: [gone], 3: [b]},
        {0: [b], 1: [b], 2: [b], 3: [gone]},
        {0: [], 1: [], 2: [], 3: [b]},
    ]
    out, stats = _published(quorum_of_2, steps, guard=False)
    assert out == [[b], [], [b, gone], []]
    out, stats = _published(quorum_of_2, steps, guard=True)
    assert out == [[b], [], [gone], []]
    assert stats.withheld_duplicate == 1
    # World 2, factor 1: rank 0's second store, in the step rank 1's first
    # completes the first store, is consumed as its duplicate; "all" keeps it.
    steps = [{0: [b], 1: []}, {0: [gone, b], 1: [b]}, {0: [], 1: [gone, b]}, {}]
    config = {"world_size": 2, "max_pending_steps": 2}
    out, _ = _published(
        {**config, "rule": "quorum", "replication_factors": [1]}, steps, True
    )
    assert out == [[], [b], [gone], []]
    out, _ = _published({**config, "rule": "all"}, steps, True)
    assert out == [[], [b], [gone, b], []]
    # No rank late: the three in one step, the second store a duplicate.
    steps = [{0: [b, gone, b], 1: [b, gone, b]}]
    out, _ = _published(
        {**config, "rule": "quorum", "replication_factors": [1]}, steps, True
    )
    assert out == [[b, gone]]
