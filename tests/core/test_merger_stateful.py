"""Merger and the reference model, side by side, through long call sequences.

Invalid calls must raise their typed exception and leave the merger exactly
as it was: the comparison after every rule (stats, step) and the next
finish_step catch any partial effect, such as a batch half-added or a rank
marked as added by a call that failed.
"""

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from support.strategies import (
    base_sequence,
    block_stored,
    max_pending,
    pools,
    quorum_configs,
)

import kvmerge
from kvmerge.testing.reference import (
    DECODER,
    ReferenceMerger,
    assert_same_events,
    assert_same_stats,
)


@st.composite
def configs(draw):
    rule_ = draw(st.sampled_from(["all", "quorum", "any"]))
    if rule_ == "quorum":
        world_size, factors = draw(quorum_configs())
    else:
        world_size, factors = draw(st.integers(1, 5)), None
    return dict(
        world_size=world_size,
        rule=rule_,
        replication_factors=factors,
        max_pending_steps=draw(max_pending),
    )


class MergerMachine(RuleBasedStateMachine):
    @initialize(config=configs(), data=st.data())
    def setup(self, config, data):
        self.engine = kvmerge.Merger(**config)
        self.model = ReferenceMerger(**config)
        factors = config["replication_factors"]
        self.n_groups = None if factors is None else len(factors)
        self.pool = data.draw(pools(self.n_groups))
        self.last_step = []  # what every rank added in the previous step

    # -- helpers -------------------------------------------------------------

    def free_ranks(self):
        return [r for r in range(self.model.world_size) if r not in self.model.current]

    def batch(self, data):
        # Often a rank's previous batch again, so that merges happen.
        if self.last_step and data.draw(st.booleans()):
            return list(data.draw(st.sampled_from(self.last_step)))
        return data.draw(base_sequence(self.pool))

    # -- valid calls ---------------------------------------------------------

    @precondition(lambda self: self.free_ranks())
    @rule(data=st.data())
    def add(self, data):
        rank = data.draw(st.sampled_from(self.free_ranks()))
        events = self.batch(data)
        self.engine.add(rank, kvmerge.encode(events))
        self.model.add(rank, events)

    @precondition(lambda self: self.free_ranks())
    @rule(data=st.data())
    def add_rest(self, data):
        """Every rank that has not added yet adds the same batch."""
        events = self.batch(data)
        for rank in self.free_ranks():
            self.engine.add(rank, kvmerge.encode(events))
            self.model.add(rank, events)

    @precondition(lambda self: self.free_ranks())
    @rule(data=st.data())
    def add_all(self, data):
        ranks = data.draw(st.lists(st.sampled_from(self.free_ranks()), unique=True))
        reports = [(rank, self.batch(data)) for rank in ranks]
        self.engine.add_all([(r, kvmerge.encode(evs)) for r, evs in reports])
        self.model.add_all(reports)

    @rule(data=st.data())
    def add_all_with_one_bad_report(self, data):
        """All or nothing: one bad report among good ones adds none of them."""
        w = self.model.world_size
        free = self.free_ranks()
        good = data.draw(st.lists(st.sampled_from(free), unique=True)) if free else []
        reports = [(rank, self.batch(data)) for rank in good]
        bad_ranks = [-1, w]
        if good:
            bad_ranks.append(good[0])  # the same rank twice in one call
        if self.model.current:
            bad_ranks.append(min(self.model.current))  # added earlier this step
        bad = (data.draw(st.sampled_from(bad_ranks)), self.batch(data))
        reports.insert(data.draw(st.integers(0, len(reports))), bad)
        with pytest.raises(kvmerge.RankError):
            self.engine.add_all([(r, kvmerge.encode(evs)) for r, evs in reports])
        with pytest.raises(kvmerge.RankError):
            self.model.add_all(reports)

    @rule(how=st.sampled_from(["events", "raw", "batch"]))
    def finish_step(self, how):
        self.last_step = list(self.model.current.values())
        if how == "events":
            got = self.engine.finish_step()
        elif how == "raw":
            got = [DECODER.decode(r) for r in self.engine.finish_step_raw()]
        else:
            got = self.engine.finish_step_batch().decode()
        assert_same_events(got, self.model.finish_step())

    @rule()
    def reset(self):
        self.engine.reset()
        self.model.reset()

    # -- invalid calls -------------------------------------------------------

    @rule(data=st.data())
    def add_rank_outside_world(self, data):
        w = self.model.world_size
        rank = data.draw(st.sampled_from([-1, w, w + 1, -(2**31)]))
        with pytest.raises(kvmerge.RankError, match=str(rank)):
            self.engine.add(rank, kvmerge.encode(self.batch(data)))
        with pytest.raises(kvmerge.RankError):
            self.model.add(rank, [])

    @precondition(lambda self: self.model.current)
    @rule(data=st.data())
    def add_rank_twice(self, data):
        rank = data.draw(st.sampled_from(sorted(self.model.current)))
        events = self.batch(data)
        with pytest.raises(kvmerge.RankError, match=str(rank)):
            self.engine.add(rank, kvmerge.encode(events))
        with pytest.raises(kvmerge.RankError):
            self.model.add(rank, events)

    @precondition(lambda self: self.n_groups is not None and self.free_ranks())
    @rule(data=st.data())
    def add_group_without_factor(self, data):
        rank = data.draw(st.sampled_from(self.free_ranks()))
        bad_group = data.draw(st.sampled_from([self.n_groups, self.n_groups + 7, -1]))
        bad = msgspec.structs.replace(
            data.draw(block_stored(self.n_groups)), group_idx=bad_group
        )
        events = self.batch(data)
        events.insert(data.draw(st.integers(0, len(events))), bad)
        with pytest.raises(kvmerge.GroupError, match=str(bad_group)):
            self.engine.add(rank, kvmerge.encode(events))
        with pytest.raises(kvmerge.GroupError):
            self.model.add(rank, events)

    # -- after every rule ----------------------------------------------------

    @invariant()
    def same_state(self):
        if not hasattr(self, "engine"):
            return
        assert self.engine.step == self.model.step
        assert_same_stats(self.engine.stats(), self.model)


MergerMachine.TestCase.settings = settings(
    settings.default,
    max_examples=max(settings.default.max_examples // 2, 10),
    stateful_step_count=40,
)
test_merger_machine = MergerMachine.TestCase
