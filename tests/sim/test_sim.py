"""kvmerge inside vLLM's real scheduler loop (``kvmerge.sim``).

The parts without vLLM first (the tier, the ranks' faults, the router model),
then whole runs: vLLM's ``Scheduler`` with ``KVMergeMultiConnector`` over the
simulated children, workers in processes behind vLLM's shm ``MessageQueue``
or in this process, the scheduler's own ``ZmqEventPublisher`` read back, and
NVIDIA Dynamo's indexer following the stream.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvmerge.sim import FAMILY_NAMES, routing
from kvmerge.sim.routing import Match, RouterModel
from kvmerge.sim.tier import Block, Faults, Removed, Reporter, Stored, Tier
from kvmerge.vllm.families import available


def chain(*hashes: int) -> tuple[Block, ...]:
    return tuple(
        Block(h, hashes[i - 1] if i else None, (h,) * 4) for i, h in enumerate(hashes)
    )


# --- the tier ------------------------------------------------------------------
def test_a_tier_stores_parents_first_and_evicts_leaves_first():
    tier = Tier(4)
    assert tier.save([chain(1, 2, 3)]) == [Stored(b) for b in chain(1, 2, 3)]
    # A second chain sharing block 1: only its own blocks are new; over
    # capacity, the oldest leaf goes (3), never a parent of a held block.
    changes = tier.save([chain(1, 4, 5)])
    assert changes == [Stored(chain(1, 4)[1]), Stored(chain(1, 4, 5)[2]), Removed(3)]
    changes = tier.save([chain(1, 6)])
    assert changes == [Stored(chain(1, 6)[1]), Removed(2)]
    for h in (1, 4, 5, 6):
        assert h in tier
    tier.clear()
    assert len(tier) == 0


def test_a_tier_never_holds_a_block_without_its_parent():
    tier = Tier(6)
    chains = [chain(1, 2, 3, 4), chain(1, 2, 5), chain(1, 6, 7), chain(8, 9)]
    for i in range(40):
        tier.save([chains[i % 4], chains[(i * 7) % 4]])
        parents = {b.hash: b.parent for c in chains for b in c}
        for h in parents:
            if h in tier and parents[h] is not None:
                assert parents[h] in tier, (i, h)


# --- the ranks' faults -----------------------------------------------------------
def test_faults_are_per_rank_deterministic_and_as_described():
    faults = Faults(seed=3, late=True, lost=True, repeat=True)
    tier = Tier(8)
    steps = [tier.save([chain(10 * s + 1, 10 * s + 2, 10 * s + 3)]) for s in range(200)]
    runs = []
    for _ in range(2):
        reporters = [Reporter(faults, 0, r, 4) for r in range(4)]
        runs.append(
            [[rep.report(s, ch) for rep in reporters] for s, ch in enumerate(steps)]
        )
    assert runs[0] == runs[1]
    late = lost = repeated = 0
    for s, per_rank in enumerate(runs[0]):
        truth = steps[s]
        for rank, reports in enumerate(per_rank[:3]):
            # Ranks 0-2 are never late: the truth, give or take one lost
            # removal or one repeated store.
            missing = [c for c in truth if c not in reports]
            assert all(isinstance(c, Removed) for c in missing), (s, rank)
            lost += len(missing)
            extra = len(reports) - (len(truth) - len(missing))
            assert extra in (0, 1)
            repeated += extra
        late += per_rank[3] != truth
    assert late > 10 and lost > 0 and repeated > 10
    # The last rank loses nothing: over the run it reports every change.
    flat = [c for per_rank in runs[0] for c in per_rank[3]]
    assert all(c in flat for ch in steps for c in ch)


# --- the router model ------------------------------------------------------------
def _stored(h, parent, medium="GPU"):
    from kvmerge.events import BlockStored

    return BlockStored(
        block_hashes=[h],
        parent_block_hash=parent,
        token_ids=[h] * 4,
        block_size=4,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def _removed(h, medium="GPU"):
    from kvmerge.events import BlockRemoved

    return BlockRemoved(block_hashes=[h], medium=medium)


def test_the_router_model_follows_dynamos_tiers():
    from kvmerge.events import AllBlocksCleared

    m = RouterModel()
    m.apply([_stored(1, None), _stored(2, 1), _stored(9, 8)])  # 9: parent unknown
    m.apply([_stored(3, 2, "CPU"), _stored(4, 3, "STORAGE"), _stored(5, 4, "EXTERNAL")])
    m.apply([_stored(7, 6, "CPU"), _stored(5, 4, "lowercase")])  # no parent check
    assert m.match([1, 2, 3, 4, 5]) == Match(gpu=2, cpu=3, disk=5)
    assert m.match([6, 7]) == Match(gpu=0, cpu=0, disk=0)  # 6 is held nowhere
    m.apply([_removed(1)])  # drops its descendant 2 too
    assert m.match([1, 2, 3]) == Match(gpu=0, cpu=0, disk=0)
    m.apply([_removed(2), _removed(3, "CPU"), _removed(42, "CPU")])
    assert m.applied == {
        ("stored", "ok"): 2,
        ("stored", "parent_block_not_found"): 1,
        ("removed", "ok"): 1,
        ("removed", "block_not_found"): 1,
    }
    m.apply([_stored(1, None), AllBlocksCleared()])
    assert m.match([1]) == Match(0, 0, 0) and not m.tiers["disk"]
    assert m.applied[("cleared", "ok")] == 1


class _LaggingIndexer:
    """Answers lookups as ``behind`` (the events it has not applied yet)
    until it has answered ``lag`` of them, then as ``caught_up``: the part
    of a Dynamo indexer ``RouterCheck`` asks (``query(tokens).blocks``)."""

    def __init__(
        self, behind: RouterModel, caught_up: RouterModel, lag: int, chains: dict
    ) -> None:
        self.behind, self.caught_up, self.lag = behind, caught_up, lag
        self.chains = chains
        self.queries = 0

    def query(self, tokens: list[int]) -> Any:
        self.queries += 1
        model = self.caught_up if self.queries > self.lag else self.behind
        m = model.match(self.chains[tuple(tokens)])
        tiers = {"gpu": m.gpu, "cpu": m.cpu, "disk": m.disk}
        return SimpleNamespace(blocks=lambda instance, tier: tiers[tier])


@pytest.mark.parametrize("lag", [0, 3, 22, None])
def test_a_lookup_is_wrong_only_if_the_indexer_never_catches_up(monkeypatch, lag):
    """The indexer applies the lower tiers' events after the device tier's,
    which is all ``sync`` can wait for: a differing answer is asked again
    until the limit, and counts as wrong only if it still differs then."""
    monkeypatch.setattr(routing, "SETTLE_S", 0.001)
    monkeypatch.setattr(routing, "SETTLE_LIMIT_S", 0.05)
    events = [_stored(1, None), _stored(2, 1, "CPU"), _stored(3, 2, "STORAGE")]
    rules = RouterModel()
    rules.apply(events)
    t = rules.tokens
    chains = {t[1]: [1], t[1] + t[2]: [1, 2], t[1] + t[2] + t[3]: [1, 2, 3]}
    # Behind, the indexer holds nothing: every answer differs.
    never = 10**9
    indexer = _LaggingIndexer(
        RouterModel(), rules, never if lag is None else lag, chains
    )
    check = routing.RouterCheck(indexer, 1, 4, seed=0)
    check.learn(events)
    found = check.ask(rules, 20)
    assert found.asked == 20
    if lag is None:
        assert found.wrong == 20 and len(found.examples) == 3
    else:
        assert found.wrong == 0
        # Each differing answer asked again, until it matches: with a lag of
        # 22, the first 20 differ, and 2 of them still at the first retry.
        assert indexer.queries == {0: 20, 3: 23, 22: 42}[lag]


# --- whole runs in vLLM's scheduler loop ---------------------------------------------
@pytest.mark.vllm
def test_the_stream_is_exactly_what_the_rules_publish():
    """vLLM's MultiprocExecutor and its worker processes; the stream read back
    from the scheduler's publisher equals the reference model's merge of every
    rank's reports, the GPU pool's events beside it; in-process workers give
    the same stream."""
    from kvmerge.sim.run import Options, run

    opts = Options(steps=300, rate=1.5, seed=11, clear_every=100, interval=0.0)
    result = run(opts)
    checks = {c.name: c for c in result.checks()}
    assert all(c.ok for c in checks.values()), checks
    assert set(checks) == {"sequence", "stream", "rules"}
    assert result.finished > 100 and result.preempted > 0 and result.resets > 0
    # Every family of this vLLM reported under its medium (UMBP: 0.33 on).
    media = {f.medium for f in available()}
    assert {"GPU", *media} <= set(result.by_medium)
    assert len(result.expected) > 1000
    # Every rule had work: reports waited, expired and were cleared.
    stats = dict(zip(FAMILY_NAMES, result.merge_stats, strict=True))
    lmcache, mooncake = stats["lmcache"], stats["mooncake"]
    assert lmcache and lmcache["expired"] > 0 and lmcache["cleared"] > 0
    assert mooncake and mooncake["published"] > 0
    if "umbp" in stats:
        umbp = stats["umbp"]
        assert umbp and umbp["pending"] == 0 and umbp["expired"] == 0
    in_process = run(Options(**{**opts.__dict__, "processes": False}))
    assert [e for e in in_process.stream] == [e for e in result.stream]


@pytest.mark.vllm
def test_vllms_own_path_is_not_what_the_rules_publish():
    """The same run through each child's own connector (vLLM's path): the
    rules check would fail, and a router could not apply some of its events:
    stores of a block already held and removals of a block not held, which
    the connector's guard withholds. (The checks can fail: they are not the
    stream compared with itself.)"""
    from kvmerge.sim.expect import same_events
    from kvmerge.sim.run import Options, run

    result = run(Options(steps=200, seed=11, rule="native", processes=False))
    assert same_events(result.children_stream, result.expected) is not None
    counts = result.stream_check.counts
    assert counts["duplicate"] > 0 and counts["unknown_removal"] > 0, counts
    assert not {c.name: c for c in result.checks()}["stream"].ok


@pytest.mark.vllm
def test_compare_never_publishes_on_the_callers_endpoint(tmp_path):
    """``compare`` runs two engines at once: on the caller's endpoint (the
    demo's ``--endpoint``) they would take one ipc path from each other, and
    a router or subscriber there would read either stream (a CI run's
    kvmerge side once answered vLLM's wrong lookups). A subscriber connected
    there before the runs start hears nothing."""
    import zmq

    from kvmerge.sim.run import Options, compare

    endpoint = f"ipc://{tmp_path}/kv"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    try:
        opts = Options(steps=40, seed=3, endpoint=endpoint, interval=0.0)
        ours, theirs = compare(opts)
        heard = 0
        while sub.poll(200):
            sub.recv_multipart()
            heard += 1
    finally:
        sub.close()
        ctx.term()
    assert ours.published > 0 and theirs.published > 0
    assert heard == 0, f"{heard} messages on the caller's endpoint"


@pytest.mark.vllm
@pytest.mark.dynamo
def test_dynamos_indexer_applies_every_store_and_its_lookups_are_exact(dynamo_python):
    from kvmerge.sim.dynamo import DynamoIndexer
    from kvmerge.sim.model import BLOCK_SIZE
    from kvmerge.sim.run import Options, run

    opts = Options(
        steps=300, seed=5, processes=False, lookup_every=75, lookups=80, interval=0.0
    )
    with DynamoIndexer(dynamo_python, BLOCK_SIZE) as indexer:
        result = run(opts, router=indexer)
        warnings = indexer.warnings()
    checks = {c.name: c for c in result.checks()}
    assert all(c.ok for c in checks.values()), checks
    assert result.lookups is not None and result.lookups.asked >= 300
    assert result.router_applied is not None
    assert result.router_applied[("stored", "ok")] > 100
    assert result.router_applied[("stored", "parent_block_not_found")] == 0
    # Unknown removals: none, as the rules imply for this stream.
    assert result.router_applied[("removed", "block_not_found")] == 0
    assert not [w for w in warnings if "decode" in w.lower()], warnings


@pytest.mark.vllm
def test_a_made_up_family_is_its_entry_and_its_child_end_to_end():
    """A family kvmerge has never heard of (``support.made_up_family``): its
    registry entry and its simulated child are all it takes. Through vLLM's
    scheduler loop and worker processes, beside LMCache's child, nothing
    configured: the worker encodes its containers, the scheduler infers its
    rule ("any") from the family, the stream is exactly what the rules make
    of every rank's reports, in its own medium, and a router can apply it."""
    from support import made_up_family as made_up

    from kvmerge.sim import children
    from kvmerge.sim.run import Options, run
    from kvmerge.vllm import families

    with families.extended(made_up.FOO), children.extended(made_up.sim_child()):
        opts = Options(
            families=("lmcache", "foo"),
            workers=2,
            steps=120,
            seed=5,
            clear_every=60,
            interval=0.0,
        )
        result = run(opts)
    checks = {c.name: c for c in result.checks()}
    assert all(c.ok for c in checks.values()), [
        c.text for c in checks.values() if not c.ok
    ]
    assert set(checks) == {"sequence", "stream", "rules"}
    _, foo = result.merge_stats
    # Its merger was made from its first batch, with the family's rule.
    assert foo is not None and foo["published"] > 0, result.merge_stats
    assert result.by_medium.get("DISK", 0) == foo["published"]
    assert "foo" not in families.BY_NAME and "foo" not in children.FAMILY
