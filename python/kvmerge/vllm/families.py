"""The connector families kvmerge merges: one entry each, everything else
derives from this table.

A *family* is a kind of offloading connector whose worker side reports KV
events in a container kvmerge recognises by its class. Its entry says where
that class lives, the rule kvmerge merges it with unless a child's
configuration says otherwise, where ``"quorum"``'s replication factors come
from, whether the upstream scheduler half has a removal hook, and the medium
its simulated child reports under. ``kvmerge.vllm.config`` (the worker's
recognition, the inferred rules, the families a scheduler accepts), the
simulated children (``kvmerge.sim.children``), the benchmark's children and
the docs' tables read it; ``tests/plugin/test_families.py`` checks that they
agree.

A release of vLLM that lacks a family's module simply lacks the family
(``available``): nothing imports it there, and no worker can report it.

Adding a family: one ``FamilyInfo`` here, and its simulated child in
``kvmerge.sim.children`` (``test_families`` fails for a registered family
without one). ``tests/sim/test_sim.py`` runs a made-up family
(``tests/support/made_up_family.py``: an entry and a child, nothing else)
through vLLM's scheduler loop against the reference model.

Importing this module imports no vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias

from kvmerge import RULES, Rule

#: A family's name, as the worker records it for each encoded child (a plain
#: string: it travels in every ``WorkerOutput``), or one of the tags below.
Family: TypeAlias = str
#: An unknown container whose events were encoded because of an override.
FAMILY_OTHER: Final = "other"
#: What the scheduler's step calls a native child's container when it
#: compares families (``kvmerge_core::step``, as the rule of that name).
FAMILY_NATIVE: Final = "native"
#: Names no registered family may take.
TAGS: Final = (FAMILY_OTHER, FAMILY_NATIVE)

_V1: Final = "vllm.distributed.kv_transfer.kv_connector.v1"


@dataclass(frozen=True)
class Factors:
    """Where a ``"quorum"`` family's group TP replication factors come from:
    an attribute of the container, else one of the worker's connector (a
    dotted path), when the container has none."""

    container: str
    connector: str

    def read(self, container: object, connector: object) -> tuple[int, ...] | None:
        factors = getattr(container, self.container, None)
        if factors is None:
            found: Any = connector
            for name in self.connector.split("."):
                found = getattr(found, name, None)
            factors = found
        return None if factors is None else tuple(int(f) for f in factors)


@dataclass(frozen=True)
class FamilyInfo:
    """One connector family."""

    #: The name workers record (the first column of the docs' tables).
    name: str
    #: The module of the container class and of the upstream connector.
    module: str
    #: The container class the family's worker side returns.
    container: str
    #: The upstream connector class (its scheduler-side methods are what a
    #: child set to ``"native"`` runs).
    connector: str
    #: The rule kvmerge merges the family's containers with by default.
    rule: Rule
    #: Where its replication factors come from (``"quorum"`` only), or None.
    factors: Factors | None
    #: The upstream scheduler half (``module:Class``), which the connector
    #: reads as ``connector_scheduler``; None if the connector has none.
    scheduler: str | None
    #: Whether that scheduler half has the removal hook the connector feeds
    #: (``invalidate_kv_events``: it drops its own pending events of the
    #: blocks workers removed).
    hook: bool
    #: The medium its simulated child reports under: a tier of its own in a
    #: router (``kvmerge.sim.children``; docs/routers.md).
    medium: str

    def __post_init__(self) -> None:
        where = f"family {self.name!r}"
        if not self.name or self.name in TAGS:
            raise ValueError(f"{where}: the name is empty or a reserved tag {TAGS}")
        if self.rule not in RULES:
            raise ValueError(f"{where}: rule {self.rule!r} is not one of {RULES}")
        if self.factors is not None and self.rule != "quorum":
            raise ValueError(f"{where}: factors are read for rule 'quorum' only")
        if self.factors is None and self.rule == "quorum":
            raise ValueError(f"{where}: rule 'quorum' needs where its factors are read")
        if self.hook and self.scheduler is None:
            raise ValueError(f"{where}: a removal hook needs a scheduler half")

    @property
    def container_path(self) -> str:
        return f"{self.module}.{self.container}"

    # vLLM's classes, typed loosely: this module imports no vLLM.
    def container_class(self) -> type[Any]:
        """The container class (imports the family's module)."""
        cls: type[Any] = getattr(importlib.import_module(self.module), self.container)
        return cls

    def connector_class(self) -> type[Any]:
        """The upstream connector class (imports the family's module)."""
        cls: type[Any] = getattr(importlib.import_module(self.module), self.connector)
        return cls

    def loaded_container(self) -> type | None:
        """The container class if its module is loaded, else None (no import:
        a container can only exist once its module is loaded)."""
        module = sys.modules.get(self.module)
        cls = getattr(module, self.container, None) if module is not None else None
        return cls if isinstance(cls, type) else None


#: Every family kvmerge knows, in the simulation's default order.
FAMILIES: Final[tuple[FamilyInfo, ...]] = (
    FamilyInfo(
        name="lmcache",
        module=f"{_V1}.lmcache_connector",
        container="LMCacheKVEvents",
        connector="LMCacheConnectorV1",
        rule="all",
        factors=None,
        scheduler=None,
        hook=False,
        medium="CPU",
    ),
    FamilyInfo(
        name="mooncake",
        module=f"{_V1}.mooncake.store.connector",
        container="MooncakeStoreKVEvents",
        connector="MooncakeStoreConnector",
        rule="quorum",
        # vLLM 0.33 has no accessor on the container; the worker connector
        # exposes the same tuple publicly.
        factors=Factors(
            container="_group_tp_replication_factors",
            connector="connector_worker.group_tp_replication_factors",
        ),
        scheduler=f"{_V1}.mooncake.store.scheduler:MooncakeStoreScheduler",
        hook=False,
        medium="STORAGE",
    ),
    FamilyInfo(
        name="umbp",
        module=f"{_V1}.umbp.connector",
        container="UMBPStoreKVEvents",
        connector="UMBPStoreConnector",
        rule="any",
        factors=None,
        scheduler=f"{_V1}.umbp.scheduler:UMBPStoreConnectorScheduler",
        hook=True,
        # vLLM's own UMBP worker writes CPU, LMCache's tier in a router, where
        # each one's evictions would remove the other's blocks.
        medium="EXTERNAL",
    ),
)


def _by_name(families: tuple[FamilyInfo, ...]) -> dict[str, FamilyInfo]:
    """The families by name; ValueError if two share a name or a container."""
    by_name: dict[str, FamilyInfo] = {}
    containers: dict[str, str] = {}
    for f in families:
        if f.name in by_name:
            raise ValueError(f"family {f.name!r} is registered twice")
        if f.container_path in containers:
            raise ValueError(
                f"families {containers[f.container_path]!r} and {f.name!r} "
                f"share the container {f.container_path}"
            )
        by_name[f.name] = f
        containers[f.container_path] = f.name
    return by_name


#: The registered families by name, in order (derived from ``FAMILIES``).
BY_NAME: Final[dict[str, FamilyInfo]] = {}
#: What a worker may record for a child whose events it encoded (derived).
ENCODED: Final[set[Family]] = set()


def _derive(families: tuple[FamilyInfo, ...]) -> None:
    # In place: the modules that read them hold these very objects.
    by_name = _by_name(families)
    BY_NAME.clear()
    BY_NAME.update(by_name)
    ENCODED.clear()
    # Every family's workers encode its events: a container kvmerge would not
    # merge needs no entry.
    ENCODED.update({f.name for f in families} | {FAMILY_OTHER})


_derive(FAMILIES)


@contextmanager
def extended(*extra: FamilyInfo) -> Iterator[None]:
    """The registry with ``extra`` families added, while the block runs: how a
    test shows that an entry is all a new family needs."""
    _derive(FAMILIES + extra)
    try:
        yield
    finally:
        _derive(FAMILIES)


def default_rule(family: Family) -> Rule | Literal["native"]:
    """The rule a child of ``family`` gets unless configured: the family's,
    else ``"native"`` (a tag, or a family this kvmerge does not know)."""
    info = BY_NAME.get(family)
    return info.rule if info is not None else "native"


def implied_rules() -> dict[Family, Rule | Literal["native"]]:
    """Each family a worker may encode, and the rule it implies (what the
    scheduler's ``OutputMerger`` infers for a child whose rule is not
    configured)."""
    return {family: default_rule(family) for family in ENCODED}


def _module_file_exists(module: str) -> bool:
    """Whether ``module`` is installed, found from the files of its top-level
    package without importing anything (vLLM's import takes seconds; the
    CLI's option parsing asks this)."""
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return False
    for root in spec.submodule_search_locations:
        path = Path(root, *rest.split("."))
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return True
    return False


@cache
def _installed(module: str) -> bool:
    return module in sys.modules or _module_file_exists(module)


def available() -> tuple[FamilyInfo, ...]:
    """The registered families whose module the installed vLLM has, in order."""
    return tuple(f for f in BY_NAME.values() if _installed(f.module))


def available_names() -> tuple[str, ...]:
    return tuple(f.name for f in available())


def container_family(container: object) -> Family:
    """The family of a child's container: a known family's, else other
    (subclasses count; no module is imported)."""
    for f in BY_NAME.values():
        cls = f.loaded_container()
        if cls is not None and isinstance(container, cls):
            return f.name
    return FAMILY_OTHER
