"""kvmerge.Merger agrees with the reference model (kvmerge.testing.reference).

Every property compares the engine with the model or with an oracle written
out here (multiset intersection, the "same sequence" consequences of the
spec); none compares the engine with itself.
"""

from collections import Counter

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.strategies import (
    CLEAR,
    Scenario,
    base_sequence,
    block_removed,
    block_stored,
    key,
    max_pending,
    pools,
    quorum_configs,
    scenarios,
)
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

import kvmerge
from kvmerge.testing.reference import (
    DECODER,
    ReferenceMerger,
    assert_same_events,
    assert_same_stats,
)


def raw_and_decode(m):
    """``finish_step_raw_and_decode``: the raw events (compared with the model
    by the caller), and the removals among them decoded, in order."""
    raws, removed = m.finish_step_raw_and_decode("BlockRemoved")
    events = [DECODER.decode(r) for r in raws]
    assert removed == [e for e in events if type(e) is BlockRemoved]
    return events


FINISH = {
    "finish_step": lambda m: m.finish_step(),
    "finish_step_raw": lambda m: [DECODER.decode(r) for r in m.finish_step_raw()],
    "finish_step_raw_and_decode": raw_and_decode,
    "finish_step_batch": lambda m: m.finish_step_batch().decode(),
}


def lean_encode(events, rank, config):
    """What a worker of this merger sends: the bytes only of the events this
    rank carries (every event's record kept)."""
    batch = kvmerge.encode(
        events,
        rank=rank,
        world_size=config["world_size"],
        rule=config.get("rule", "all"),
        replication_factors=config.get("replication_factors"),
    )
    assert batch.identities() == kvmerge.encode(events).identities()
    return batch


def run(config, scenario, data=None, finish="finish_step", lean=False):
    """Drive engine and model through a scenario, comparing after each step.

    With `data`, each step adds the ranks in a freshly drawn order: the model
    ignores add order by construction, so this checks the engine does too.
    With `lean`, the engine gets the batches workers send (`lean_encode`);
    the model always has every event.
    """
    engine = kvmerge.Merger(**config)
    model = ReferenceMerger(**config)
    for batches in scenario.steps:
        ranks = sorted(batches)
        if data is not None:
            ranks = data.draw(st.permutations(ranks), label="add order")
        for rank in ranks:
            events = batches[rank]
            engine.add(
                rank,
                lean_encode(events, rank, config) if lean else kvmerge.encode(events),
            )
            model.add(rank, batches[rank])
        assert_same_stats(engine.stats(), model)
        got = FINISH[finish](engine)
        assert_same_events(got, model.finish_step())
        assert_same_stats(engine.stats(), model)
        assert engine.step == model.step


@given(
    st.sampled_from(["all", "any"]),
    scenarios(),
    max_pending,
    st.sampled_from(sorted(FINISH)),
    st.booleans(),
    st.data(),
)
def test_all_and_any_agree_with_reference(rule, scenario, mps, finish, lean, data):
    config = dict(world_size=scenario.world_size, rule=rule, max_pending_steps=mps)
    run(config, scenario, data, finish, lean)


@st.composite
def quorum_cases(draw):
    world_size, factors = draw(quorum_configs())
    scenario = draw(scenarios(world_size=world_size, n_groups=len(factors)))
    return world_size, factors, scenario


@given(
    quorum_cases(),
    max_pending,
    st.sampled_from(sorted(FINISH)),
    st.booleans(),
    st.data(),
)
def test_quorum_agrees_with_reference(case, mps, finish, lean, data):
    world_size, factors, scenario = case
    config = dict(
        world_size=world_size,
        rule="quorum",
        replication_factors=factors,
        max_pending_steps=mps,
    )
    run(config, scenario, data, finish, lean)


@st.composite
def replicated_scenarios(draw, world_size, n_groups):
    """GQA-like: each event of a step is reported by its own subset of ranks."""
    pool = draw(pools(n_groups))
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        seq = draw(base_sequence(pool, clears=draw(st.booleans())))
        holders = [
            draw(st.sets(st.integers(0, world_size - 1), min_size=1)) for _ in seq
        ]
        steps.append(
            {
                r: [e for e, h in zip(seq, holders, strict=True) if r in h]
                for r in range(world_size)
            }
        )
    return Scenario(world_size, steps)


@given(replicated_scenarios(8, 3), max_pending, st.data())
def test_quorum_gqa_world_8_factors_1_4_2(scenario, mps, data):
    config = dict(
        world_size=8,
        rule="quorum",
        replication_factors=[1, 4, 2],
        max_pending_steps=mps,
    )
    run(config, scenario, data)


@given(st.integers(1, 8), block_stored(n_groups=3), st.data())
def test_quorum_threshold(n_holders, event, data):
    # factor f needs ceil(8 / f) distinct ranks, whatever the group.
    factors = [1, 4, 2]
    holders = data.draw(st.permutations(range(8)))[:n_holders]
    engine = kvmerge.Merger(8, "quorum", factors, max_pending_steps=0)
    for r in range(8):
        engine.add(r, kvmerge.encode([event] if r in holders else []))
    f = 1 if event.group_idx is None else factors[event.group_idx]
    want = [event] if n_holders * f >= 8 else []
    assert_same_events(engine.finish_step(), want)


@given(
    st.integers(1, 5).flatmap(
        lambda w: scenarios(world_size=w, n_steps=st.just(1), clears=False)
    )
)
def test_all_is_multiset_intersection(scenario):
    (batches,) = scenario.steps
    w = scenario.world_size
    engine = kvmerge.Merger(w, "all", max_pending_steps=0)
    for rank, batch in batches.items():
        engine.add(rank, kvmerge.encode(batch))
    out = engine.finish_step()
    counts = [Counter(key(e) for e in batches.get(r, [])) for r in range(w)]
    want = counts[0]
    for c in counts[1:]:
        want &= c
    assert Counter(key(e) for e in out) == want


@given(
    st.integers(2, 5),
    st.data(),
    pools(),
    st.integers(0, 4),
    max_pending,
    st.booleans(),
)
def test_late_rank(world_size, data, pool, lateness, mps, silent_meanwhile):
    """One rank reports the common sequence `lateness` steps after the others."""
    seq = data.draw(base_sequence(pool, clears=False), label="sequence")
    late = data.draw(st.integers(0, world_size - 1), label="late rank")
    config = dict(world_size=world_size, rule="all", max_pending_steps=mps)
    engine, model = kvmerge.Merger(**config), ReferenceMerger(**config)
    published = []
    # Long enough for every report to be either published or expired.
    for step in range(lateness + mps + 1):
        for r in range(world_size):
            on_time = step == (lateness if r == late else 0)
            if not on_time and silent_meanwhile:
                continue
            batch = seq if on_time else []
            engine.add(r, kvmerge.encode(batch))
            model.add(r, batch)
        out = engine.finish_step()
        assert_same_events(out, model.finish_step())
        assert_same_stats(engine.stats(), model)
        published += out
    # The spec's own statement, checked without the model:
    assert_same_events(published, seq if lateness <= mps else [])
    stats = engine.stats()
    assert stats.expired == (0 if lateness <= mps else world_size * len(seq))
    assert stats.pending == 0


@given(st.integers(1, 5), st.data(), block_removed())
def test_own_duplicate_never_stands_in_for_another_rank(world_size, data, event):
    counts = data.draw(
        st.lists(st.integers(0, 3), min_size=world_size, max_size=world_size)
    )
    engine = kvmerge.Merger(world_size, "all", max_pending_steps=5)
    for r, n in enumerate(counts):
        engine.add(r, kvmerge.encode([event] * n))
    assert_same_events(engine.finish_step(), [event] * min(counts))
    # The surplus waits: one more report from each short rank publishes more.
    for r, n in enumerate(counts):
        engine.add(r, kvmerge.encode([event] * (max(counts) - n)))
    assert_same_events(engine.finish_step(), [event] * (max(counts) - min(counts)))


@given(
    st.integers(2, 5),
    st.data(),
    block_stored(n_groups=1) | block_removed(),
    st.sampled_from(["all", "quorum"]),
    max_pending,
)
def test_nothing_before_a_clear_is_published_after_it(w, data, x, rule, mps):
    """Every rank but one reports [x, CLEAR]; that one reports CLEAR, then x."""
    r = data.draw(st.integers(0, w - 1))
    factors = [1] if rule == "quorum" else None
    engine = kvmerge.Merger(w, rule, factors, max_pending_steps=mps)
    for rank in range(w):
        engine.add(rank, kvmerge.encode([CLEAR] if rank == r else [x, CLEAR]))
    assert_same_events(engine.finish_step(), [AllBlocksCleared()])
    for step in range(3):
        engine.add(r, kvmerge.encode([x] if step == 0 else []))
        assert_same_events(engine.finish_step(), [])
    stats = engine.stats()
    assert stats.cleared == w - 1
    assert stats.consumed == w


def collapse_between_clears(seq):
    """The spec's "quorum" consequence: first occurrences, reset at clears."""
    out, seen = [], set()
    for e in seq:
        if isinstance(e, AllBlocksCleared):
            out.append(e)
            seen = set()
        elif key(e) not in seen:
            seen.add(key(e))
            out.append(e)
    return out


def collapse_in_step(seq):
    """The "any" rule on one sequence: first occurrences since the last clear,
    consecutive clears collapsed into one."""
    out, seen = [], set()
    for e in seq:
        if isinstance(e, AllBlocksCleared):
            if not (out and isinstance(out[-1], AllBlocksCleared)):
                out.append(e)
                seen = set()
        elif key(e) not in seen:
            seen.add(key(e))
            out.append(e)
    return out


SAME_SEQUENCE = {
    "all": list,
    "quorum": collapse_between_clears,
    "any": collapse_in_step,
}


@given(
    st.data(), st.sampled_from(sorted(SAME_SEQUENCE)), st.integers(1, 8), max_pending
)
def test_identical_sequences(data, rule, world_size, mps):
    """When all ranks report the same sequence, it comes out (almost) as is."""
    factors = [1, 2, 4] if rule == "quorum" else None
    pool = data.draw(pools(n_groups=3 if rule == "quorum" else None))
    engine = kvmerge.Merger(world_size, rule, factors, max_pending_steps=mps)
    for _ in range(data.draw(st.integers(1, 4))):
        seq = data.draw(base_sequence(pool))
        for r in data.draw(st.permutations(range(world_size))):
            engine.add(r, kvmerge.encode(seq))
        assert_same_events(engine.finish_step(), SAME_SEQUENCE[rule](seq))
        assert engine.stats().pending == 0


@given(st.sampled_from(["all", "quorum", "any"]), st.data())
def test_finish_variants_agree(rule, data):
    """finish_step, finish_step_raw and finish_step_batch: same events."""
    if rule == "quorum":
        world_size, factors = data.draw(quorum_configs())
        scenario = data.draw(scenarios(world_size=world_size, n_groups=len(factors)))
    else:
        factors = None
        scenario = data.draw(scenarios())
    config = dict(
        world_size=scenario.world_size, rule=rule, replication_factors=factors
    )
    engines = [kvmerge.Merger(**config) for _ in range(3)]
    model = ReferenceMerger(**config)
    for batches in scenario.steps:
        for rank, batch in batches.items():
            encoded = kvmerge.encode(batch)
            for engine in engines:
                engine.add(rank, encoded)  # one batch feeds several mergers
            model.add(rank, batch)
        want = model.finish_step()
        events = engines[0].finish_step()
        raws = engines[1].finish_step_raw()
        batch = engines[2].finish_step_batch()
        assert_same_events(events, want)
        assert [bytes(r) for r in raws] == [key(e) for e in want]
        assert isinstance(batch, kvmerge.EventBatch) and len(batch) == len(want)
        assert_same_events(batch.decode(), want)
        assert [bytes(r) for r in batch.raw()] == [bytes(r) for r in raws]
        for engine in engines:
            assert_same_stats(engine.stats(), model)


@given(st.integers(1, 4), st.sampled_from(["all", "quorum", "any"]), st.data())
def test_int_and_bytes_hashes_never_merge(world_size, rule, data):
    h = data.draw(st.integers(0, 255))
    as_int = BlockRemoved(block_hashes=[h], medium=None)
    as_bytes = BlockRemoved(block_hashes=[bytes([h])], medium=None)
    factors = [1] if rule == "quorum" else None
    engine = kvmerge.Merger(world_size + 1, rule, factors, max_pending_steps=0)
    for r in range(world_size):
        engine.add(r, kvmerge.encode([as_int]))
    engine.add(world_size, kvmerge.encode([as_bytes]))
    # world_size ranks out of world_size + 1 complete nothing, even with
    # factor 1; "any" walks rank 0..world_size at index 0.
    want = [as_int, as_bytes] if rule == "any" else []
    assert_same_events(engine.finish_step(), want)


group_0_stores = st.lists(
    block_stored(n_groups=1).map(lambda e: msgspec.structs.replace(e, group_idx=0)),
    unique_by=key,
    min_size=1,
    max_size=6,
)


@given(st.integers(1, 6), st.sampled_from(["all", "quorum"]), group_0_stores, st.data())
def test_an_event_comes_out_at_the_report_that_completes_it(w, rule, pool, data):
    """Ranks report the same distinct events in different orders, in one step.

    The publication order follows the report that completed each event: the
    q-th smallest first-report position, q = world_size for "all" (the last
    rank to report it) and ceil(world_size / factor) for "quorum".
    """
    orders = [data.draw(st.permutations(pool), label=f"rank {r}") for r in range(w)]
    f = data.draw(st.sampled_from([1, 2, 3, 8])) if rule == "quorum" else 1
    engine = kvmerge.Merger(
        w, rule, [f] if rule == "quorum" else None, max_pending_steps=0
    )
    for r in data.draw(st.permutations(range(w)), label="add order"):
        engine.add(r, kvmerge.encode(orders[r]))
    q = -(-w // f)

    def completed_at(e):
        firsts = sorted((order.index(e), r) for r, order in enumerate(orders))
        return firsts[q - 1]

    assert_same_events(engine.finish_step(), sorted(pool, key=completed_at))


@given(
    st.integers(2, 6),
    st.sampled_from(["all", "quorum"]),
    st.lists(block_removed(), min_size=1, max_size=12, unique_by=key),
)
def test_each_event_travels_with_its_bytes_once_under_all(world_size, rule, events):
    """Under "all" (and "quorum" with factor 1) exactly one rank carries each
    event's bytes; every rank reports every event."""
    factors = [1] if rule == "quorum" else None
    batches = [
        kvmerge.encode(
            events,
            rank=r,
            world_size=world_size,
            rule=rule,
            replication_factors=factors,
        )
        for r in range(world_size)
    ]
    assert sum(len(b) - b.uncarried for b in batches) == len(events)
    assert all(len(b) == len(events) for b in batches)


def test_wrongly_uncarried_bytes_are_refused_and_change_nothing():
    events = [BlockRemoved(block_hashes=[h], medium=None) for h in range(40)]
    # Encoded for a world of 4, merged in a world of 2: rank 0 leaves out some
    # events a world of 2 gives it to carry.
    lean = kvmerge.encode(events, rank=0, world_size=4)
    assert lean.uncarried > 0
    merger = kvmerge.Merger(2, "all")
    with pytest.raises(kvmerge.ConfigError, match="must carry"):
        merger.add(0, lean)
    assert merger.stats().batches == 0
    merger.add(0, kvmerge.encode(events))
    merger.add(1, kvmerge.encode(events))
    assert len(merger.finish_step()) == len(events)
    with pytest.raises(kvmerge.IncompleteBatchError, match="without their bytes"):
        lean.decode()
    with pytest.raises(kvmerge.IncompleteBatchError):
        lean.raw()
    with pytest.raises(kvmerge.ConfigError, match="together"):
        kvmerge.encode(events, rank=0)
    with pytest.raises(kvmerge.RankError):
        kvmerge.encode(events, rank=4, world_size=4)
    with pytest.raises(kvmerge.ConfigError, match="replication_factors"):
        kvmerge.encode(events, rank=0, world_size=4, rule="quorum")
