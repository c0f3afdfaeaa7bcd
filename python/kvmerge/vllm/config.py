"""The KVMergeMultiConnector's settings: which merge rule each MultiConnector
child gets, and the settings behind it.

A child's rule comes from its ``kv_connector_extra_config["kv_events_merge"]``
when set, else from the family of the container its worker side returns
(``kvmerge.vllm.families``: each family's default rule); a container of no
known family is passed through, ``"native"``.

The worker and the scheduler read the same configuration, so both sides agree
on which children are encoded and which carry the child's own container.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias, TypeGuard, get_args

from kvmerge import DEFAULT_MAX_PENDING_STEPS, RULES, ConfigError, Rule
from kvmerge._kvmerge import FACTORS_KEY, MERGE_KEY, ChildConfig

from .families import Family, default_rule

__all__ = ["FACTORS_KEY", "MERGE_KEY"]
#: Keys read from the KVMergeMultiConnector's own ``kv_connector_extra_config``.
MAX_PENDING_KEY: Final = "max_pending_steps"
OUTPUT_KEY: Final = "kv_events_output"
#: Whether each merged child's events pass the guard (docs/merge-rules.md,
#: "Guard"): on unless set to false.
GUARD_KEY: Final = "kv_events_guard"

#: What a child's ``kv_events_merge`` may say: a ``kvmerge.Merger`` rule, or
#: "native" (the child's own container and methods).
ChildRule: TypeAlias = Literal[Rule, "native"]
CHILD_RULES: Final[tuple[ChildRule, ...]] = (*RULES, "native")
#: What ``take_events`` yields for merged events (``kv_events_output``).
Output: TypeAlias = Literal["raw", "objects"]
OUTPUTS: Final[tuple[Output, ...]] = get_args(Output)


def is_merged(rule: str | None) -> TypeGuard[Rule]:
    """Whether ``rule`` is one a ``kvmerge.Merger`` applies."""
    return rule in RULES


@dataclass(frozen=True)
class ChildSpec:
    """What the configuration says about one child, by position."""

    index: int
    name: str
    #: Its rule and factors, checked (``kvmerge_core::step::ChildConfig``:
    #: the worker and the scheduler's step decide with the same code).
    config: ChildConfig

    @property
    def label(self) -> str:
        return f"connectors[{self.index}] ({self.name})"

    @property
    def rule(self) -> ChildRule | None:
        """The configured rule, or None to infer it from the container type."""
        return self.config.rule

    @property
    def factors(self) -> tuple[int, ...] | None:
        """Configured replication factors (rule "quorum"), or None."""
        return self.config.factors

    def rule_for(self, family: Family) -> ChildRule:
        """The rule this child merges with, given its container family:
        the configured one, else the one the family implies (the worker, which
        decides whose bytes travel, and the scheduler must agree)."""
        return self.config.rule_for(default_rule(family))


@dataclass(frozen=True)
class MultiSpec:
    children: tuple[ChildSpec, ...]
    max_pending_steps: int
    output: Output
    guard: bool = True


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
    try:
        config = ChildConfig(extra.get(MERGE_KEY), extra.get(FACTORS_KEY))
    except ConfigError as e:
        raise ConfigError(f"{_prefix(label)}: {e}") from None
    return ChildSpec(index=index, name=name, config=config)


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
    guard = extra.get(GUARD_KEY, True)
    if not isinstance(guard, bool):
        raise ConfigError(f"{_prefix('')}: {GUARD_KEY}={guard!r} must be true or false")
    return MultiSpec(
        children=children, max_pending_steps=mps, output=output, guard=guard
    )
