"""Late ranks, nothing lost or repeated: every rank reports the same stores
and removals of a few blocks, each rank a fixed number of steps late (fewer
than `max_pending_steps`). Under "all" the published stream, guard on, ends
holding exactly the blocks the ranks hold: a late rank never costs a router
a block or leaves it one (docs/merge-rules.md, "Consequences"). Under
"quorum" it can (tests/core/test_guard.py pins the two ways)."""

from hypothesis import given
from hypothesis import strategies as st
from support.vllm_harness import removed, stored
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

import kvmerge
from kvmerge.testing.reference import ReferenceMerger, assert_same_events

MEDIUM = "CPU"


def truth(ops: list[list[int]]) -> tuple[list[list[object]], set[int]]:
    """Each step's events (a block not held is stored, a held one removed)
    and the blocks held at the end."""
    held: set[int] = set()
    steps = []
    for step in ops:
        events: list[object] = []
        for h in step:
            if h in held:
                held.discard(h)
                events.append(removed(h, medium=MEDIUM))
            else:
                held.add(h)
                events.append(stored(h, medium=MEDIUM))
        steps.append(events)
    return steps, held


def replayed(stream: list[object]) -> set[int]:
    """The blocks a router holds after ``stream``, applied from nothing."""
    held: set[int] = set()
    for e in stream:
        if isinstance(e, AllBlocksCleared):
            held.clear()
        elif isinstance(e, BlockStored):
            held.update(e.block_hashes)
        else:
            assert isinstance(e, BlockRemoved)
            held.difference_update(e.block_hashes)
    return held


@st.composite
def late_runs(draw):
    world_size = draw(st.integers(2, 4))
    horizon = draw(st.integers(1, 3))
    delays = draw(
        st.lists(st.integers(0, horizon - 1), min_size=world_size, max_size=world_size)
    )
    ops = draw(
        st.lists(st.lists(st.integers(1, 3), max_size=3), min_size=1, max_size=8)
    )
    return world_size, horizon, delays, ops


@given(late_runs())
def test_under_all_late_ranks_end_with_the_ranks_blocks(run):
    world_size, horizon, delays, ops = run
    steps, held = truth(ops)
    engine = kvmerge.Merger(world_size, "all", max_pending_steps=horizon, guard=True)
    model = ReferenceMerger(world_size, "all", max_pending_steps=horizon, guard=True)
    stream: list[object] = []
    # Until the latest rank's last report has arrived and been merged.
    for t in range(len(steps) + max(delays) + 1):
        for rank, delay in enumerate(delays):
            events = steps[t - delay] if 0 <= t - delay < len(steps) else []
            engine.add(rank, kvmerge.encode(events))
            model.add(rank, events)
        out = engine.finish_step()
        assert_same_events(out, model.finish_step())
        stream += out
    assert replayed(stream) == held
    # Nothing was lost: every report was used, none expired or withheld.
    stats = engine.stats()
    assert stats.expired == stats.pending == stats.withheld == 0, stats
