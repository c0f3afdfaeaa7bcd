"""The KVMergeMultiConnector's settings: which merge rule each MultiConnector
child gets, and the settings behind it.

A child's rule comes from its ``kv_connector_extra_config["kv_events_merge"]``
when set, else from the type of the container its worker side returns:

=========================  ==========  =========================================
container                  rule        notes
=========================  ==========  =========================================
``LMCacheKVEvents``        ``"all"``
``MooncakeStoreKVEvents``  ``"quorum"`` factors: the container's group TP
                                       replication factors
``UMBPStoreKVEvents``      ``"any"``
anything else              ``"native"`` the child's own container and methods
=========================  ==========  =========================================

The worker and the scheduler read the same configuration, so both sides agree
on which children are encoded and which carry the child's own container.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias, TypeGuard, get_args

from kvmerge import DEFAULT_MAX_PENDING_STEPS, RULES, ConfigError, Rule

#: Keys read from a child's ``kv_connector_extra_config``.
MERGE_KEY: Final = "kv_events_merge"
FACTORS_KEY: Final = "kv_events_replication_factors"
#: Keys read from the KVMergeMultiConnector's own ``kv_connector_extra_config``.
MAX_PENDING_KEY: Final = "max_pending_steps"
OUTPUT_KEY: Final = "kv_events_output"

#: What a child's ``kv_events_merge`` may say: a ``kvmerge.Merger`` rule, or
#: "native" (the child's own container and methods).
ChildRule: TypeAlias = Literal[Rule, "native"]
CHILD_RULES: Final[tuple[ChildRule, ...]] = (*RULES, "native")
#: How the scheduler treats a child: merged by a ``kvmerge.Merger``, or native.
Mode: TypeAlias = Literal["merge", "native"]
#: What ``take_events`` yields for merged events (``kv_events_output``).
Output: TypeAlias = Literal["raw", "objects"]
OUTPUTS: Final[tuple[Output, ...]] = get_args(Output)


def is_merged(rule: str | None) -> TypeGuard[Rule]:
    """Whether ``rule`` is one a ``kvmerge.Merger`` applies."""
    return rule in RULES


#: The family of a child's container, as the worker records it for each child
#: (plain strings: they travel pickled in every ``WorkerOutput``).
Family: TypeAlias = Literal["lmcache", "mooncake", "umbp", "other", "native", "refused"]
FAMILY_LMCACHE: Final = "lmcache"
FAMILY_MOONCAKE: Final = "mooncake"
FAMILY_UMBP: Final = "umbp"
#: An unknown container whose events were encoded because of an override.
FAMILY_OTHER: Final = "other"
#: The child's own container, carried as is.
FAMILY_NATIVE: Final = "native"
#: The worker could not encode the child's events: the entry says why.
FAMILY_REFUSED: Final = "refused"
#: Kinds whose child carries an ``EventBatch``.
ENCODED_FAMILIES: Final[frozenset[Family]] = frozenset(
    {FAMILY_LMCACHE, FAMILY_MOONCAKE, FAMILY_UMBP, FAMILY_OTHER}
)

_KNOWN_CONTAINERS: Final[tuple[tuple[str, str, Family], ...]] = (
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector",
        "LMCacheKVEvents",
        FAMILY_LMCACHE,
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector",
        "MooncakeStoreKVEvents",
        FAMILY_MOONCAKE,
    ),
    (
        "vllm.distributed.kv_transfer.kv_connector.v1.umbp.connector",
        "UMBPStoreKVEvents",
        FAMILY_UMBP,
    ),
)

INFERRED_RULES: Final[Mapping[Family, ChildRule]] = {
    FAMILY_LMCACHE: "all",
    FAMILY_MOONCAKE: "quorum",
    FAMILY_UMBP: "any",
    FAMILY_OTHER: "native",
    FAMILY_NATIVE: "native",
}


def container_family(container: object) -> Family:
    """The family of a child's container: one of the known vLLM types, else other.

    Looks the classes up in ``sys.modules`` instead of importing them: a
    container of a class can only exist once the class's module is loaded, so
    this costs no import and still honours subclasses.
    """
    for module_name, class_name, family in _KNOWN_CONTAINERS:
        module = sys.modules.get(module_name)
        cls = getattr(module, class_name, None) if module is not None else None
        if cls is not None and isinstance(container, cls):
            return family
    return FAMILY_OTHER


def container_factors(container: object, connector: object) -> tuple[int, ...] | None:
    """The group TP replication factors a Mooncake store container carries.

    ``MooncakeStoreKVEvents`` keeps them in a private attribute (vLLM 0.33.0 has
    no accessor); the worker connector exposes the same tuple publicly.
    """
    factors = getattr(container, "_group_tp_replication_factors", None)
    if factors is None:
        worker = getattr(connector, "connector_worker", None)
        factors = getattr(worker, "group_tp_replication_factors", None)
    return None if factors is None else tuple(int(f) for f in factors)


@dataclass(frozen=True)
class ChildSpec:
    """What the configuration says about one child, by position."""

    index: int
    name: str
    #: The configured rule, or None to infer it from the container type.
    rule: ChildRule | None
    #: Configured replication factors (rule "quorum"), or None.
    factors: tuple[int, ...] | None

    @property
    def label(self) -> str:
        return f"connectors[{self.index}] ({self.name})"

    def rule_for(self, family: Family) -> ChildRule:
        """The rule this child merges with, given its container family:
        the configured one, else the one the family implies (the worker, which
        decides whose bytes travel, and the scheduler must agree)."""
        return self.rule or INFERRED_RULES[family]

    @property
    def encodes(self) -> bool | None:
        """True: always encode; False: always native; None: by container type."""
        if self.rule is None:
            return None
        return self.rule != "native"


@dataclass(frozen=True)
class MultiSpec:
    children: tuple[ChildSpec, ...]
    max_pending_steps: int
    output: Output


def _prefix(where: str) -> str:
    return f"KVMergeMultiConnector {where}"


def parse_child(index: int, ktc: Mapping[str, Any]) -> ChildSpec:
    name = str(ktc.get("kv_connector"))
    label = f"connectors[{index}] ({name})"
    extra = ktc.get("kv_connector_extra_config") or {}
    if not isinstance(extra, Mapping):
        raise ConfigError(
            f"{_prefix(label)}: kv_connector_extra_config must be a mapping, "
            f"got {type(extra).__name__}"
        )
    rule = extra.get(MERGE_KEY)
    if rule is not None and rule not in CHILD_RULES:
        raise ConfigError(
            f"{_prefix(label)}: {MERGE_KEY}={rule!r} is not a merge rule; "
            f"use one of {', '.join(repr(r) for r in CHILD_RULES)}"
        )
    raw_factors = extra.get(FACTORS_KEY)
    factors: tuple[int, ...] | None = None
    if raw_factors is not None:
        if (
            isinstance(raw_factors, str | bytes)
            or not isinstance(raw_factors, Sequence)
            or not raw_factors
            or not all(
                isinstance(f, int) and not isinstance(f, bool) and f >= 1
                for f in raw_factors
            )
        ):
            raise ConfigError(
                f"{_prefix(label)}: {FACTORS_KEY}={raw_factors!r} must be a "
                "non-empty list of integers >= 1, one per KV cache group"
            )
        factors = tuple(raw_factors)
        if rule not in (None, "quorum"):
            raise ConfigError(
                f"{_prefix(label)}: {FACTORS_KEY} is only used by "
                f"{MERGE_KEY}='quorum', not {MERGE_KEY}={rule!r}"
            )
    return ChildSpec(index=index, name=name, rule=rule, factors=factors)


def parse_multi(extra: Mapping[str, Any]) -> MultiSpec:
    children_cfg = extra.get("connectors")
    if not isinstance(children_cfg, Sequence) or isinstance(children_cfg, str):
        raise ConfigError(
            f"{_prefix('')}: kv_connector_extra_config['connectors'] must be a "
            "list of child connector configs"
        )
    children = tuple(parse_child(i, c) for i, c in enumerate(children_cfg))
    mps = extra.get(MAX_PENDING_KEY, DEFAULT_MAX_PENDING_STEPS)
    if not isinstance(mps, int) or isinstance(mps, bool) or mps < 0:
        raise ConfigError(
            f"{_prefix('')}: {MAX_PENDING_KEY}={mps!r} must be an integer >= 0"
        )
    output = extra.get(OUTPUT_KEY, "raw")
    if output not in OUTPUTS:
        raise ConfigError(
            f"{_prefix('')}: {OUTPUT_KEY}={output!r} must be one of "
            f"{', '.join(repr(o) for o in OUTPUTS)}"
        )
    return MultiSpec(children=children, max_pending_steps=mps, output=output)
