"""Child connectors whose events follow what vLLM's scheduler really did.

Each stands for an offloading connector family where KV events are
concerned, and moves no KV:

* scheduler side: for every request it schedules, once new blocks of it are
  computed, puts the request's chain of full blocks (vLLM's own block hashes,
  parents, token ids) in the step's connector metadata (``SaveMeta``);
  ``reset_cache()`` makes the next metadata empty every rank's tier;
* worker side: saves those chains in its ``Tier`` (LRU under a capacity) when
  the model runner waits for the save, and returns the changes as the REAL
  vLLM container of the family, with this rank's ``Faults`` applied.

==================  ======================================================
child               who reports what
==================  ======================================================
``SimLMCache``      every rank; None when it has nothing to report
``SimMooncake``     stores: the ranks that write a replica (group 0
                    replicated ``factor`` times); removals: every rank
``SimUMBP``         every rank the same (a pool shared by the ranks)
==================  ======================================================

Each stands for one family of ``kvmerge.vllm.families``, whose entry gives its
container, its rule, its medium and whether its scheduler half has a removal
hook (``SimChild.FAMILY``). ``FAMILY`` holds those the running vLLM has: a
family its release lacks (UMBP before vLLM 0.33) is absent, and its child
class, though defined, never imports the family's module.

Their scheduler sides also carry the upstream connectors' own
``update_connector_output`` / ``take_events``, so that a child set to
``"kv_events_merge": "native"`` shows what vLLM's own path publishes.

``NoTransfer`` is the part every test child shares: the abstract methods of
``KVConnectorBase_V1`` for a connector that moves no KV.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvmerge import Rule
from kvmerge.vllm.config import MERGE_KEY, ChildRule
from kvmerge.vllm.families import BY_NAME, FamilyInfo

from . import FAMILY_NAMES
from .model import child_entry
from .record import RECORD_KEY, Recorder, TruthRecorder, replica_folder
from .tier import Block, Chain, Change, Faults, Removed, Reporter, Stored, Tier

#: The key of a child's settings in its ``kv_connector_extra_config``.
EXTRA_KEY: Final = "kvmerge_sim"


def lmcache_container(events: list[KVCacheEvent]) -> KVConnectorKVEvents | None:
    """``LMCacheConnectorV1.get_kv_connector_kv_cache_events``, from events:
    None when there are none."""
    if not events:
        return None
    container: KVConnectorKVEvents = BY_NAME["lmcache"].container_class()(num_workers=1)
    container.add_events(events)
    return container


def mooncake_container(
    events: list[KVCacheEvent], factors: tuple[int, ...] = (1,)
) -> KVConnectorKVEvents:
    """``MooncakeStoreConnector.get_kv_connector_kv_cache_events``: always a
    container, empty or not (it counts the worker), with the group TP
    replication ``factors``."""
    container: KVConnectorKVEvents = BY_NAME["mooncake"].container_class()(
        num_workers=1, group_tp_replication_factors=factors
    )
    container.add_events(events)
    return container


def umbp_container(events: list[KVCacheEvent]) -> KVConnectorKVEvents:
    """``UMBPStoreConnector.get_kv_connector_kv_cache_events``: always a
    container of the events."""
    container: KVConnectorKVEvents = BY_NAME["umbp"].container_class()(events)
    return container


class ListKVEvents(KVConnectorKVEvents):
    """A third-party container: every worker's events, in order."""

    def __init__(self, events: Sequence[KVCacheEvent] = ()) -> None:
        self.events = list(events)
        self.workers = 1

    def add_events(self, events: Iterable[KVCacheEvent]) -> None:
        self.events.extend(events)

    def aggregate(self) -> ListKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self.events)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.events.clear()
        self.workers = 1


def list_container(events: list[KVCacheEvent]) -> ListKVEvents:
    """A worker's ``ListKVEvents`` of events."""
    return ListKVEvents(events)


class NoTransfer(KVConnectorBase_V1):
    """A connector that loads and saves no KV (the abstract methods)."""

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()


@dataclass
class SaveMeta(KVConnectorMetadata):
    """One step's saves for one child: chains to store, after a reset if set."""

    chains: list[Chain] = field(default_factory=list)
    reset: bool = False


@dataclass(frozen=True)
class ChildSettings:
    """A simulated child's settings, under ``EXTRA_KEY`` in its
    ``kv_connector_extra_config`` (``entry`` writes them): its position among
    the children (its faults' seed), its tier's capacity, its faults, and
    the folder its ranks record their reports in (``kvmerge.sim.record``),
    if any."""

    index: int
    capacity: int
    faults: Faults
    record: str | None = None

    def to_extra(self) -> dict[str, Any]:
        return {
            EXTRA_KEY: {
                "index": self.index,
                "capacity": self.capacity,
                "faults": self.faults.to_extra(),
                RECORD_KEY: self.record,
            }
        }

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> ChildSettings:
        d = extra.get(EXTRA_KEY)
        if not isinstance(d, Mapping) or "capacity" not in d:
            raise ValueError(
                f"a simulated child needs its {EXTRA_KEY!r} settings in its "
                "kv_connector_extra_config (kvmerge.sim.children.entry builds them)"
            )
        return cls(
            index=int(d.get("index", 0)),
            capacity=int(d["capacity"]),
            faults=Faults.from_extra(d.get("faults") or {}),
            record=d.get(RECORD_KEY),
        )


class StoreScheduler:
    """The store-side scheduler object upstream store connectors' methods call
    (``connector_scheduler``): no store behind it, no events of its own, and
    no ``invalidate_kv_events`` (vLLM's ``MooncakeStoreScheduler`` has none),
    so the connector decodes no removals for it."""

    def update_connector_output(self, connector_output: Any) -> None:
        return None

    def take_events(self) -> list[KVCacheEvent]:
        return []

    def reset_store(self) -> bool:
        return True


class HookScheduler(StoreScheduler):
    """A scheduler half with the removal hook (UMBP's): it drops its own
    pending events of the blocks workers removed (``invalidate_kv_events``,
    which the connector feeds)."""

    def invalidate_kv_events(self, events: Iterable[KVCacheEvent]) -> None:
        return None


def scheduler_for(info: FamilyInfo) -> type[StoreScheduler]:
    """The stand-in for a family's scheduler half: with the hook where the
    family's has one."""
    return HookScheduler if info.hook else StoreScheduler


class SimChild(NoTransfer):
    """Scheduler side: saves; worker side: a tier and this rank's reports.

    A subclass names its family (``class SimFoo(SimChild, family="foo")``):
    its medium, its scheduler half's stand-in and the upstream connector whose
    scheduler-side methods it runs come from the family's entry."""

    #: The family this child stands for (``kvmerge.vllm.families``).
    FAMILY: str
    MEDIUM: str
    #: What upstream's scheduler-side methods call (``connector_scheduler``).
    SCHEDULER: type[StoreScheduler] = StoreScheduler

    def __init_subclass__(cls, family: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        info = BY_NAME[family]
        cls.FAMILY, cls.MEDIUM, cls.SCHEDULER = family, info.medium, scheduler_for(info)

    @classmethod
    def reports_store(cls, rank: int, world_size: int) -> bool:
        """Whether ``rank`` reports the blocks its tier stores."""
        return True

    @classmethod
    def factors(cls, world_size: int) -> tuple[int, ...] | None:
        """The group TP replication factors its containers carry (a
        ``"quorum"`` family's, which its rule reads), else None."""
        return None

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.settings = ChildSettings.from_extra(ktc.kv_connector_extra_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.world_size = int(vllm_config.parallel_config.world_size)
        self.rank = int(vllm_config.parallel_config.rank)
        # Scheduler side.
        self._requests: dict[str, Any] = {}
        self._chains: dict[str, list[Block]] = {}
        self._reset = False
        # Worker side.
        self.tier = Tier(self.settings.capacity)
        self.reporter = Reporter(
            self.settings.faults, self.settings.index, self.rank, self.world_size
        )
        self.step = 0
        self._changes: list[Change] = []
        # What the upstream scheduler-side methods use.
        self._kv_cache_events: Any = None
        self.connector_scheduler = self.SCHEDULER()
        self._was_reset = False
        self.recorder = (
            None
            if self.settings.record is None
            else Recorder(
                # The replica's rank, as its publisher takes it (vLLM resets
                # data_parallel_rank in independent replicas, not the index).
                replica_folder(
                    self.settings.record,
                    int(vllm_config.parallel_config.data_parallel_index),
                ),
                self.settings.index,
                self.rank,
            )
        )
        # What the tier really holds, beside what the ranks report: rank 0's
        # (every rank's tier holds the same), recorded here, where every
        # connector (vLLM's own MultiConnector too) makes the tier save.
        self.truth = (
            TruthRecorder(self.recorder.path.parent, self.settings.index)
            if self.recorder is not None and self.rank == 0
            else None
        )
        self._upstream = BY_NAME[self.FAMILY].connector_class()

    # --- scheduler side ------------------------------------------------------
    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        self._requests[request.request_id] = request

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._chains.pop(request.request_id, None)
        return False, None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = SaveMeta(reset=self._reset)
        self._reset = False
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None:
                continue
            full = min(
                (request.num_computed_tokens + n) // self.block_size,
                len(request.block_hashes),
            )
            chain = self._chains.setdefault(req_id, [])
            if full <= len(chain):
                continue
            tokens = request.all_token_ids
            bs = self.block_size
            for i in range(len(chain), full):
                chain.append(
                    Block(
                        hash=maybe_convert_block_hash(request.block_hashes[i]),
                        parent=chain[i - 1].hash if i else None,
                        tokens=tuple(tokens[i * bs : (i + 1) * bs]),
                    )
                )
            meta.chains.append(tuple(chain))
        return meta

    def reset_cache(self) -> bool | None:
        self._reset = True
        self._chains.clear()
        return True

    def update_connector_output(self, connector_output: Any) -> None:
        # The family's own scheduler-side logic (what "native" publishes).
        self._upstream.update_connector_output(self, connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        events: Iterable[KVCacheEvent] = self._upstream.take_events(self)
        return events

    # --- worker side -----------------------------------------------------------
    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, SaveMeta):
            return
        if meta.reset:
            self.tier.clear()
            self.reporter.reset()
            self._changes = []
            self._was_reset = True
        changes = self.tier.save(meta.chains)
        self._changes.extend(changes)
        if self.truth is not None:
            self.truth.write(
                meta.reset,
                [c.block.hash for c in changes if isinstance(c, Stored)],
                [c.hash for c in changes if isinstance(c, Removed)],
            )

    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        changes, self._changes = self._changes, []
        step, self.step = self.step, self.step + 1
        reports = self.reporter.report(step, changes)
        own = events(type(self), self.rank, self.world_size, self.block_size, reports)
        container = self.make_container(self.world_size, own)
        read = list(container.get_all_events()) if container is not None else []
        damaged = bool(read) and self.reporter.damages(step)
        if self.recorder is not None:
            self.recorder.write(step, self._was_reset, damaged, read)
        self._was_reset = False
        if damaged:
            container = self.make_container(self.world_size, damage(read))
        return container

    @classmethod
    def make_container(
        cls, world_size: int, events: list[KVCacheEvent]
    ) -> KVConnectorKVEvents | None:
        """The family's container of a rank's events, as its worker builds it."""
        raise NotImplementedError


class SimLMCache(SimChild, family="lmcache"):
    """LMCache's events: ``LMCacheKVEvents``, None when there are none;
    medium ``CPU`` (LMCache's local CPU backend)."""

    @classmethod
    def make_container(
        cls, world_size: int, events: list[KVCacheEvent]
    ) -> KVConnectorKVEvents | None:
        return lmcache_container(events)


#: The Mooncake child's group 0 replication factor, when the world allows it.
REPLICAS: Final = 2


class SimMooncake(SimChild, family="mooncake"):
    """The Mooncake store's events: ``MooncakeStoreKVEvents`` always, with the
    group replication factors; a replicated block is written (and its store
    reported) by one rank of each replica set. Medium ``STORAGE`` (vLLM's
    ``MEDIUM_STORAGE``; vLLM's own Mooncake store worker writes ``"cpu"`` in
    lower case, which routers that match media exactly, Dynamo's among them,
    drop)."""

    @classmethod
    def reports_store(cls, rank: int, world_size: int) -> bool:
        # One writer per replica set: the others' stores are its.
        return rank % cls.factors(world_size)[0] == 0

    @classmethod
    def factors(cls, world_size: int) -> tuple[int, ...]:
        """Group 0 replicated on ``REPLICAS`` ranks (GQA with fewer KV heads
        than ranks) when the world size allows it."""
        return (REPLICAS,) if world_size % REPLICAS == 0 else (1,)

    @classmethod
    def make_container(
        cls, world_size: int, events: list[KVCacheEvent]
    ) -> KVConnectorKVEvents:
        return mooncake_container(events, cls.factors(world_size))


class SimUMBP(SimChild, family="umbp"):
    """UMBP's events: a pool shared by the ranks, ``UMBPStoreKVEvents``, medium
    ``EXTERNAL`` (a tier routers know: Dynamo's external tier)."""

    @classmethod
    def make_container(
        cls, world_size: int, events: list[KVCacheEvent]
    ) -> KVConnectorKVEvents:
        return umbp_container(events)


def damage(events: Sequence[KVCacheEvent]) -> list[KVCacheEvent]:
    """``events`` with the first one's block hashes sent as text: what a
    worker bug might send, and what kvmerge's worker side cannot encode."""
    first, *rest = events
    text = [str(h) for h in getattr(first, "block_hashes", ())]
    return [msgspec.structs.replace(first, block_hashes=text), *rest]


def events(
    cls: type[SimChild],
    rank: int,
    world_size: int,
    block_size: int,
    reports: list[Change],
) -> list[KVCacheEvent]:
    """The events a rank of child ``cls`` sends for its ``reports``."""
    stores = cls.reports_store(rank, world_size)
    out: list[KVCacheEvent] = []
    for c in reports:
        if isinstance(c, Stored):
            if stores:
                b = c.block
                out.append(
                    BlockStored(
                        block_hashes=[b.hash],
                        parent_block_hash=b.parent,
                        token_ids=list(b.tokens),
                        block_size=block_size,
                        lora_id=None,
                        medium=cls.MEDIUM,
                        lora_name=None,
                        group_idx=0,
                    )
                )
        else:
            out.append(
                BlockRemoved(block_hashes=[c.hash], medium=cls.MEDIUM, group_idx=0)
            )
    return out


@dataclass(frozen=True)
class SimFamily:
    """A simulated family: its child class, the faults its ranks show, and
    its tier's default capacity (blocks: the families differ in size, so
    their tiers differ in content). Its rule is the family's
    (``kvmerge.vllm.families``)."""

    cls: type[SimChild]
    faults: Mapping[str, bool]
    capacity: int

    @property
    def rule(self) -> Rule:
        return BY_NAME[self.cls.FAMILY].rule


_ALL_FAULTS: Final = {"late": True, "lost": True, "repeat": True}
#: Every registered family's simulated child (its test child: a family
#: without one fails tests/plugin/test_families.py).
SIMULATED: Final = {
    "lmcache": SimFamily(SimLMCache, _ALL_FAULTS, 96),
    "mooncake": SimFamily(SimMooncake, _ALL_FAULTS, 192),
    # A pool shared by the ranks: they report the same events.
    "umbp": SimFamily(SimUMBP, {"repeat": True}, 32),
}
#: The simulated families of the running vLLM, in ``kvmerge.sim.FAMILY_NAMES``'
#: order.
FAMILY: Final = {name: SIMULATED[name] for name in FAMILY_NAMES if name in SIMULATED}


@contextmanager
def extended(*extra: SimFamily) -> Iterator[None]:
    """The simulated families with ``extra`` added while the block runs (their
    entries registered too: ``kvmerge.vllm.families.extended``): how a test
    shows that a new family is its entry and its child, end to end."""
    names = [k.cls.FAMILY for k in extra]
    for name, k in zip(names, extra, strict=True):
        SIMULATED[name] = FAMILY[name] = k
    try:
        yield
    finally:
        for name in names:
            SIMULATED.pop(name, None)
            FAMILY.pop(name, None)


def entry(
    family: str,
    index: int,
    *,
    capacity: int | None = None,
    seed: int = 0,
    faults: bool = True,
    rule: ChildRule | None = None,
    damage: int = 0,
    record: str | None = None,
) -> dict[str, Any]:
    """A ``connectors`` entry for the simulated child of ``family``; ``rule``
    overrides kvmerge's (``"native"``: vLLM's own path); ``damage`` and
    ``record`` as in ``Faults`` and ``ChildSettings``."""
    k = FAMILY[family]
    f = Faults(seed=seed, damage=damage, **(k.faults if faults else {}))
    extra = ChildSettings(index, capacity or k.capacity, f, record).to_extra()
    if rule is not None:
        extra[MERGE_KEY] = rule
    return child_entry(k.cls.__name__, k.cls.__module__, extra)
