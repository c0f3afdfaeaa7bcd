"""Which vLLM releases kvmerge supports: those its package metadata admits.

The range is written once, in ``pyproject.toml``'s ``vllm`` requirement (the
releases the test command tests, ``.ci/vllm-versions``); at start-up the
plugin reads it back from the installed distribution and warns, once per
process, when the running vLLM is outside it. It still tries: a newer vLLM
usually works, and the warning says where to look when it does not.
"""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .log import get_logger

logger = get_logger(__name__)

_warned = False


def supported_range(distribution: str = "kvmerge") -> SpecifierSet | None:
    """The ``vllm`` specifier in kvmerge's metadata (None if not installed)."""
    try:
        requires = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return None
    for line in requires:
        req = Requirement(line)
        if req.name == "vllm" and req.marker is None:
            return req.specifier
    return None


def installed_vllm() -> str | None:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def is_supported(version: str, supported: SpecifierSet) -> bool:
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    # A local or dev build of a supported release (0.34.0+cu130, 0.34.1.dev3)
    # is that release.
    return supported.contains(parsed.base_version, prereleases=True)


def warn_if_unsupported() -> bool:
    """Warns once per process if the running vLLM is outside the supported
    range; returns whether it is inside (or cannot tell)."""
    global _warned
    supported = supported_range()
    running = installed_vllm()
    if supported is None or running is None or is_supported(running, supported):
        return True
    if not _warned:
        _warned = True
        logger.warning(
            "kvmerge: vLLM %s is outside the releases this kvmerge is tested "
            "with (vllm%s); KVMergeMultiConnector will still try. If KV events "
            "go missing or the engine fails at start, install a kvmerge release "
            "that supports vLLM %s",
            running,
            supported,
            running,
        )
    return False
