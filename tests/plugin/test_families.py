"""The family registry (``kvmerge.vllm.families``) and everything derived from
it agree, on the running vLLM: the classes it names exist and behave as it
says, every family has its simulated child, the docs' tables say what it
says, and an entry is all a new family needs."""

from __future__ import annotations

import importlib
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support import vllm_children
from support.vllm_harness import Cluster, child, removed, stored
from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

import kvmerge.sim
from benches.compare import children as bench_children
from kvmerge import RULES
from kvmerge._kvmerge import ChildConfig
from kvmerge.sim import children as sim_children
from kvmerge.vllm import families
from kvmerge.vllm.config import CHILD_RULES, ChildSpec
from kvmerge.vllm.families import (
    BY_NAME,
    ENCODED,
    FAMILIES,
    FAMILY_OTHER,
    TAGS,
    FamilyInfo,
    available,
    container_family,
    default_rule,
)

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
PRESENT = [f.name for f in available()]
ABSENT = [f.name for f in FAMILIES if f.name not in PRESENT]
#: The hook the connector feeds (``_Child.invalidate``).
HOOK = "invalidate_kv_events"


def _events() -> list:
    return [stored(1), stored(2, 1), removed(1)]


# --- the registry itself ----------------------------------------------------------
def test_the_supported_releases_have_lmcache_and_mooncake():
    # What the simulation's defaults and the benchmark rely on everywhere.
    assert {"lmcache", "mooncake"} <= set(PRESENT)


#: A family no vLLM has: the test below runs on every release with it.
NOWHERE = FamilyInfo(
    name="nowhere",
    module="vllm.distributed.kv_transfer.kv_connector.v1.no_such_connector",
    container="NoSuchKVEvents",
    connector="NoSuchConnector",
    rule="all",
    factors=None,
    scheduler=None,
    hook=False,
    medium="CPU",
)


@pytest.mark.parametrize("name", [*ABSENT, NOWHERE.name])
def test_a_family_this_vllm_lacks_is_absent_everywhere(name):
    with families.extended(NOWHERE):
        info = BY_NAME[name]
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(info.module)
        assert name not in families.available_names()
        # Recognised nowhere, yet its name stays a family a scheduler accepts
        # (a worker of another release could only be misconfigured).
        assert name in ENCODED
    assert name not in kvmerge.sim.FAMILY_NAMES
    assert name not in sim_children.FAMILY


@pytest.mark.parametrize("name", PRESENT)
def test_each_present_family_names_real_classes_that_behave_as_registered(name):
    info = BY_NAME[name]
    container_cls = info.container_class()
    assert issubclass(container_cls, KVConnectorKVEvents)
    assert issubclass(info.connector_class(), KVConnectorBase_V1)
    assert info.loaded_container() is container_cls
    if info.scheduler is None:
        assert not info.hook
    else:
        module, _, cls = info.scheduler.partition(":")
        scheduler = getattr(importlib.import_module(module), cls)
        # The simulation's and the benches' stand-ins have it where vLLM's has.
        assert hasattr(scheduler, HOOK) is info.hook
        assert hasattr(sim_children.scheduler_for(info), HOOK) is info.hook
    sim = sim_children.SIMULATED[name].cls
    container = sim.make_container(4, _events())
    assert isinstance(container, container_cls)
    assert container_family(container) == name
    # A subclass of the container is the family too.
    sub = type("Sub", (container_cls,), {})
    assert container_family(sub.__new__(sub)) == name
    if info.factors is not None:
        reported = info.factors.read(container, None)
        assert reported == sim.factors(4)


def test_a_container_of_no_family_is_other():
    assert container_family(sim_children.ListKVEvents()) == FAMILY_OTHER
    assert container_family(object()) == FAMILY_OTHER


def test_the_derived_tables_are_the_registry():
    assert list(BY_NAME) == [f.name for f in FAMILIES]
    assert {f.name for f in FAMILIES} | {FAMILY_OTHER} == ENCODED
    for f in FAMILIES:
        assert default_rule(f.name) == f.rule in RULES
    for tag in TAGS:
        assert default_rule(tag) == "native"


@given(st.text(max_size=12), st.sampled_from([None, *CHILD_RULES]))
def test_a_childs_rule_is_defined_for_any_family_string(family, rule):
    """``rule_for`` runs on the worker's step: it cannot raise, whatever family
    a container resolves to (issue 29: a family left out of a table raised
    KeyError there)."""
    spec = ChildSpec(index=0, name="X", config=ChildConfig(rule))
    assert spec.rule_for(family) in CHILD_RULES


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"name": "native"}, "reserved tag"),
        ({"name": ""}, "reserved tag"),
        ({"rule": "native"}, "is not one of"),
        ({"rule": "all"}, "for rule 'quorum' only"),
        ({"factors": None}, "rule 'quorum' needs where its factors are read"),
        ({"scheduler": None, "hook": True}, "needs a scheduler half"),
    ],
)
def test_an_inconsistent_entry_cannot_be_made(change, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        replace(BY_NAME["mooncake"], **change)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (replace(FAMILIES[0], module="x"), "registered twice"),
        (replace(FAMILIES[0], name="again"), "share the container"),
    ],
)
def test_two_entries_cannot_claim_one_family(extra, needle):
    with pytest.raises(ValueError, match=needle), families.extended(extra):
        pass
    assert list(BY_NAME) == [f.name for f in FAMILIES]


# --- what derives from it -----------------------------------------------------------
def test_every_family_has_its_simulated_child_and_the_defaults_are_the_present_ones():
    assert list(sim_children.SIMULATED) == [f.name for f in FAMILIES]
    # (Its rule, medium and scheduler class are read from the registry, not
    # restated: nothing to compare.)
    for name, sim in sim_children.SIMULATED.items():
        info = BY_NAME[name]
        assert name == sim.cls.FAMILY
        # A "quorum" family's child carries factors; no other's does.
        assert (sim.cls.factors(4) is None) == (info.factors is None)
    assert tuple(PRESENT) == kvmerge.sim.FAMILY_NAMES
    assert list(sim_children.FAMILY) == PRESENT


def test_the_test_and_bench_children_follow_the_registry():
    assert set(vllm_children.FAMILY_OF.values()) == set(BY_NAME)
    for cls_name, family in vllm_children.FAMILY_OF.items():
        assert family == getattr(vllm_children, cls_name).FAMILY
    # A bench child of a registered family says so (its rule is read from
    # the registry); the others are the benches' own.
    for family, (cls_name, _rule) in bench_children.CHILDREN.items():
        cls = getattr(bench_children, cls_name)
        assert (family in BY_NAME) == (getattr(cls, "FAMILY", None) == family)


def _table(path: Path, mark: str) -> list[list[str]]:
    text = path.read_text()
    start, end = text.index(mark), text.rindex(mark)
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in text[start + len(mark) : end].strip().splitlines()
    ]
    return [r for r in rows[2:] if r and r[0]]


def test_the_docs_family_table_is_the_registry():
    """docs/vllm.md's table of families: one row per entry, in order, with its
    container, connector, rule, factors, hook, medium; the releases it lists
    for a family include the running one exactly when the family is present."""
    rows = _table(ROOT / "docs" / "vllm.md", "<!-- families -->")
    assert [r[0] for r in rows] == [f"`{f.name}`" for f in FAMILIES]
    from packaging.version import Version

    from kvmerge.vllm.versions import installed_vllm

    running = Version(installed_vllm() or "0").base_version
    running_minor = ".".join(running.split(".")[:2])
    for row, f in zip(rows, FAMILIES, strict=True):
        name, container, rule, factors, hook, medium, releases = row
        assert container == f"`{f.container}` (`{f.connector}`)"
        assert rule == f'`"{f.rule}"`'
        assert (factors == "the container's") is (f.factors is not None)
        assert hook == ("yes" if f.hook else "no")
        assert medium == f"`{f.medium}`"
        listed = {r.strip() for r in releases.split(",")}
        assert (running_minor in listed) is (f.name in PRESENT), (name, releases)


def test_the_readmes_table_of_simulated_children_is_the_registry():
    """The README's table of the demo's children: each row's container, rule
    and medium are its family's."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.strip().startswith("| `Sim")
    ]
    by_class = {sim.cls.__name__: sim.cls for sim in sim_children.SIMULATED.values()}
    assert sorted(r[0].strip("`") for r in rows) == sorted(by_class)
    for name, container, rule, medium in rows:
        info = BY_NAME[by_class[name.strip("`")].FAMILY]
        assert container.startswith(f"`{info.container}`"), name
        assert rule.startswith(f"`{info.rule}"), name
        assert medium == f"`{info.medium}`", name


# --- one entry is all a new family needs ---------------------------------------------
FOO = FamilyInfo(
    name="foo",
    module=vllm_children.__name__,
    container="FooKVEvents",
    connector="FooChild",
    rule="any",
    factors=None,
    scheduler=None,
    hook=False,
    medium="EXTERNAL",
)


@pytest.mark.usefixtures("registered")
def test_an_entry_is_all_a_new_family_needs(bus):
    """A child returning a container of an unregistered class is passed through
    (its own scheduler side publishes what at least two ranks reported); with
    one registry entry naming that class and rule "any", the same child's
    events are encoded and merged by the rule, nothing configured."""
    each = [[stored(1), stored(2)], [stored(1)], [stored(3)]]

    def run() -> list:
        c = Cluster([child("FooChild")], bus, tp=3)
        for rank, events in enumerate(each):
            c.emit(rank, 0, events)
        return c.step()

    assert run() == [stored(1)]  # native: its own rule, at least 2 reports
    with families.extended(FOO):
        # "any": the union, in position order (index, then rank).
        assert run() == [stored(1), stored(3), stored(2)]
    assert "foo" not in BY_NAME
