"""One version, the Cargo workspace's: the extension, the distribution's
metadata and ``kvmerge --version`` all say it. And the package imports no
test framework: ``kvmerge.testing`` is plain Python."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import kvmerge
from kvmerge import cli

ROOT = Path(__file__).resolve().parents[2]


def cargo_version() -> str:
    with open(ROOT / "Cargo.toml", "rb") as f:
        return tomllib.load(f)["workspace"]["package"]["version"]


def vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def test_version_is_cargo_workspace_version():
    assert kvmerge.__version__ == kvmerge._kvmerge.__version__
    assert kvmerge.__version__ == cargo_version()
    assert kvmerge.__version__ == importlib.metadata.version("kvmerge")


def test_the_extension_allocates_with_mimalloc():
    """The default build's allocator (rust/kvmerge-py, feature "mimalloc"):
    a build without it still works, but pays glibc's malloc on the step
    path (docs/benchmarks.md, "The allocator")."""
    assert kvmerge._kvmerge._allocator == "mimalloc"  # type: ignore[attr-defined]


def test_pyproject_takes_the_version_from_cargo():
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert "version" not in project
    assert "version" in project["dynamic"]


def test_cli_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    want = f"kvmerge {kvmerge.__version__} (vLLM {vllm_version()})"
    assert capsys.readouterr().out.strip() == want


def test_cli_version_without_vllm(monkeypatch):
    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli.version_text() == f"kvmerge {kvmerge.__version__} (vLLM not installed)"


def test_python_m_kvmerge_version_does_not_import_vllm():
    code = (
        "import sys, runpy\n"
        "sys.argv = ['kvmerge', '--version']\n"
        "try:\n"
        "    runpy.run_module('kvmerge', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "assert 'vllm' not in sys.modules, 'kvmerge --version imported vLLM'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    want = f"kvmerge {kvmerge.__version__} (vLLM {vllm_version()})"
    assert out.stdout.strip() == want
    plain = subprocess.run(
        [sys.executable, "-m", "kvmerge", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode == 0, plain.stderr
    assert plain.stdout.strip() == want


def test_no_module_of_the_package_imports_a_test_framework():
    code = (
        "import pkgutil, sys, importlib, kvmerge\n"
        "for m in pkgutil.walk_packages(kvmerge.__path__, 'kvmerge.'):\n"
        "    if not m.name.endswith('.__main__'):  # those run the command\n"
        "        importlib.import_module(m.name)\n"
        "bad = sorted(n for n in sys.modules\n"
        "             if n.split('.')[0] in ('pytest', '_pytest', 'hypothesis'))\n"
        "assert not bad, bad\n"
        "print(len([n for n in sys.modules if n.startswith('kvmerge.')]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert int(out.stdout.split()[-1]) > 20  # every module, kvmerge.testing too
