"""Worker loss and return, at the core level (kvmerge.Merger).

What docs/robustness.md promises, each with the test that holds it to it:
- a rank that stops reporting stalls nothing for longer than
  ``max_pending_steps``: the reports waiting for it expire, and are counted;
- pending state is bounded by the window, however long a rank stays away;
- a rank's batch added in step ``s`` is a report of step ``s``, whenever its
  events happened: a salvaged output joining a later step competes with that
  step's positions and starts its own expiry clock there;
- a repeated rank within a step is refused (``RankError``) and changes
  nothing; ``reset()`` leaves a merger that behaves like a fresh one on new
  reports, with the counters kept.
"""

from __future__ import annotations

import pytest
from support.bad_inputs import stored
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

import kvmerge
from kvmerge import EventBatch, Merger, RankError

pytestmark = pytest.mark.vllm


def rm(h: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h], medium=None)


def st(h: int, group: int | None = None) -> BlockStored:
    return stored(h, group_idx=group)


def step(m: Merger, reports: dict[int, list | EventBatch]) -> list:
    """One step: each listed rank adds its events; returns what is published."""
    for rank, events in reports.items():
        m.add(
            rank, events if isinstance(events, EventBatch) else kvmerge.encode(events)
        )
    out = m.finish_step()
    s = m.stats()
    # The counter identity holds after every step, whatever happened.
    assert s.reports == s.consumed + s.cleared + s.expired + s.pending, s
    return out


def merger(rule: str, world_size: int = 3, window: int = 4) -> Merger:
    factors = [1] if rule == "quorum" else None
    return Merger(world_size, rule, factors, max_pending_steps=window)


# -- a rank goes silent ----------------------------------------------------------


@pytest.mark.parametrize("rule", ["all", "quorum"])
def test_silent_rank_expires_the_others_reports_and_counts_them(rule):
    """Ranks 0 and 1 report one event a step, rank 2 nothing for 10 steps."""
    m, window = merger(rule), 4
    for s in range(10):
        assert step(m, {0: [rm(s)], 1: [rm(s)]}) == []
        stats = m.stats()
        # Reports of steps t with t + window <= s are gone, two per step.
        assert stats.expired == 2 * max(0, s - window + 1)
        assert stats.pending == 2 * min(s + 1, window)
    # Rank 2 comes back (a restarted worker: what it missed is lost). Its new
    # events complete at once; the expired ones can no longer.
    assert step(m, {0: [rm(10)], 1: [rm(10)], 2: [rm(10), rm(2)]}) == [rm(10)]
    assert step(m, {0: [], 1: [], 2: []}) == []


def test_any_rule_never_waits_for_a_silent_rank():
    m = merger("any")
    for s in range(10):
        assert step(m, {0: [rm(s)], 1: [rm(s)]}) == [rm(s)]
        assert m.stats().pending == 0
    assert m.stats().expired == 0


def test_quorum_group_replicated_on_some_ranks_is_not_stalled():
    """World 4, group 1 replicated on 2 ranks: two ranks away stall nothing."""
    m = Merger(4, "quorum", [1, 2], max_pending_steps=2)
    assert step(m, {0: [st(1, 1)], 1: [st(1, 1)]}) == [st(1, 1)]
    # Group 0 (factor 1) needs all four: it waits, then expires.
    for _ in range(3):
        assert step(m, {0: [st(2, 0)], 1: [st(2, 0)]}) == []
    assert m.stats().expired == 2


def test_same_step_window_drops_at_the_end_of_the_step():
    """max_pending_steps=0 is vLLM's same-step behaviour."""
    m = merger("all", window=0)
    assert step(m, {0: [rm(1)], 1: [rm(1)]}) == []
    assert (m.stats().pending, m.stats().expired) == (0, 2)
    # Rank 2 one step late: too late.
    assert step(m, {2: [rm(1)]}) == []
    assert m.stats().expired == 3


# -- bounded memory ----------------------------------------------------------------


@pytest.mark.parametrize("rule", ["all", "quorum", "any"])
@pytest.mark.parametrize("window", [0, 3, 16])
def test_pending_stays_bounded_by_the_window(rule, window):
    """A rank away for good: pending never exceeds one window of reports."""
    m, per_step, live = merger(rule, window=window), 3, 2
    bound = live * per_step * window if rule != "any" else 0
    for s in range(4 * window + 20):
        # Hot keys: the same events again and again must not pile up either.
        events = [rm(s % 5), rm(100 + s), st(s % 2)]
        for r in range(live):
            m.add(r, kvmerge.encode(events))
        # Before the step closes, its own batches are pending too.
        assert m.stats().pending <= bound + live * per_step
        m.finish_step()
        assert m.stats().pending <= bound
    # The bound is reached, not just respected: the window really is used.
    assert m.stats().pending == bound


# -- a rank comes back with what it missed (salvaged outputs) ----------------------


def test_salvaged_reports_within_the_window_complete_at_their_new_position():
    """Rank 2 misses steps 0-1 and delivers both in step 2, in its own order.

    Its reports are reports of step 2: each completion's position is rank
    2's report (the greatest of the three), so they are published in the
    order of rank 2's batch, not in the order the events first happened.
    """
    m = merger("all")
    assert step(m, {0: [rm(1)], 1: [rm(1)]}) == []
    assert step(m, {0: [rm(2)], 1: [rm(2)]}) == []
    assert step(m, {0: [], 1: [], 2: [rm(2), rm(1)]}) == [rm(2), rm(1)]
    stats = m.stats()
    assert (stats.pending, stats.expired, stats.published) == (0, 0, 2)


def test_salvaged_reports_start_their_own_expiry_clock():
    """Rank 2 comes back after 6 steps with all 6 steps' events, window 4.

    The others' reports of steps 0 and 1 expired at the end of steps 4 and
    5; rank 2's copies of them are reports of step 6, nothing completes
    them, and they expire in their turn at the end of step 10.
    """
    m, window = merger("all"), 4
    for s in range(6):
        assert step(m, {0: [rm(s)], 1: [rm(s)]}) == []
    assert m.stats().expired == 4
    out = step(m, {0: [], 1: [], 2: [rm(s) for s in range(6)]})
    assert out == [rm(2), rm(3), rm(4), rm(5)]
    assert (m.stats().pending, m.stats().expired) == (2, 4)
    for _ in range(window - 1):
        step(m, {})
    assert (m.stats().pending, m.stats().expired) == (2, 4)
    step(m, {})
    assert (m.stats().pending, m.stats().expired) == (0, 6)


def test_salvaged_clear_is_a_barrier_in_its_new_step():
    """A clear in the salvaged batch discards the others' pending reports."""
    m = merger("all")
    assert (
        step(m, {0: [AllBlocksCleared(), rm(1)], 1: [AllBlocksCleared(), rm(1)]}) == []
    )
    out = step(m, {0: [], 1: [], 2: [rm(9), AllBlocksCleared(), rm(1)]})
    assert out == [AllBlocksCleared(), rm(1)]
    stats = m.stats()
    assert (stats.cleared, stats.pending) == (1, 0)  # rank 2's rm(9)


def test_salvaged_output_arriving_with_the_current_one_is_one_report():
    """Rank 2's step-0 output reaches the scheduler in step 1, together with
    its step-1 output. Adding both is a repeated rank (refused); the core's
    answer is `EventBatch.concat`: one report of step 1, older events first.
    """
    m = merger("all")
    assert step(m, {0: [rm(1)], 1: [rm(1)]}) == []
    salvaged, current = kvmerge.encode([rm(1)]), kvmerge.encode([rm(2)])
    m.add(0, kvmerge.encode([rm(2)]))
    m.add(1, kvmerge.encode([rm(2)]))
    m.add(2, salvaged)
    with pytest.raises(RankError, match="rank 2 already added"):
        m.add(2, current)
    # The same two steps again, rank 2's outputs concatenated this time.
    both = EventBatch.concat([salvaged, current])
    assert both.decode() == [rm(1), rm(2)]
    assert both.identities() == salvaged.identities() + current.identities()
    m = merger("all")
    assert step(m, {0: [rm(1)], 1: [rm(1)]}) == []
    assert step(m, {0: [rm(2)], 1: [rm(2)], 2: both}) == [rm(1), rm(2)]
    assert len(EventBatch.concat([])) == 0
    assert bytes(EventBatch.concat([current])) == bytes(current)


# -- a repeated rank within a step ---------------------------------------------------


def twins(rule):
    return merger(rule), merger(rule)


@pytest.mark.parametrize("rule", ["all", "quorum", "any"])
def test_repeated_rank_in_a_step_is_refused_and_changes_nothing(rule):
    """The second batch of rank 0 in a step (say, a salvaged output arriving
    with the current one) is refused; the merger goes on exactly like its
    twin that never saw the call."""
    m, twin = twins(rule)
    first, second = kvmerge.encode([rm(1), rm(2)]), kvmerge.encode([rm(3)])
    for x in (m, twin):
        x.add(0, first)
    before = m.stats()
    with pytest.raises(RankError, match="rank 0 already added a batch in step 0"):
        m.add(0, second)
    with pytest.raises(RankError, match="rank 0"):
        m.add_all([(1, second), (0, second)])  # all or nothing
    with pytest.raises(RankError, match="rank 1"):
        m.add_all([(1, second), (1, second)])
    assert m.stats() == before
    for x in (m, twin):
        x.add(1, first)
        x.add(2, first)
    assert m.finish_step() == twin.finish_step()
    assert m.stats() == twin.stats()
    # Next step, rank 0 may report again (its `second` can come now).
    for x in (m, twin):
        x.add(0, second)
        x.add(1, second)
        x.add(2, second)
    assert m.finish_step() == twin.finish_step() == [rm(3)]
    assert m.stats() == twin.stats()


# -- reset ------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["all", "quorum", "any"])
def test_reset_mid_incident_leaves_a_consistent_merger(rule):
    """reset_cache while rank 2 is away: everything pending is dropped and
    counted as cleared; what rank 2 then salvages finds nothing to complete,
    and new events merge as in a fresh merger."""
    m, window = merger(rule), 4
    for s in range(3):
        step(m, {0: [rm(s)], 1: [rm(s)]})
    m.add(0, kvmerge.encode([rm(50)]))  # a batch of the current step, too
    before = m.stats()
    m.reset()
    after = m.stats()
    assert after.pending == 0
    assert after.cleared == before.cleared + before.pending
    assert (after.reports, after.steps, m.step) == (before.reports, before.steps, 3)
    # The current step's batches were dropped too: rank 0 may add again.
    fresh = merger(rule)
    for x in (m, fresh):
        out = step(x, {0: [rm(7)], 1: [rm(7)], 2: [rm(0), rm(1), rm(2), rm(7)]})
        if rule == "any":
            # By (index, rank): one step, no memory of the reset ones.
            assert out == [rm(7), rm(0), rm(1), rm(2)]
        else:
            assert out == [rm(7)]  # rm(0..2) of rank 2 complete nothing
    for _ in range(window):
        assert step(m, {}) == step(fresh, {}) == []
    assert m.stats().pending == fresh.stats().pending == 0
    assert m.stats().expired - after.expired == fresh.stats().expired


def test_reset_does_not_let_old_reports_complete():
    """Nothing reported before a reset is ever published after it."""
    m = merger("all")
    step(m, {0: [rm(1)], 1: [rm(1)]})
    m.reset()
    assert step(m, {2: [rm(1)]}) == []
    assert m.stats().pending == 1  # rank 2's, waiting for new reports
