"""A clone passes on its own: no file of the project reads a ``shared``
folder beside the checkout (this project's own machines have one, with
notes in it; a user's clone has nothing beside it). What the tests read, the
project carries or makes: ``.ci/vllm_peer_tests.py`` writes the Hugging Face
config vLLM's own tests need, the simulation its tiny model's config.

The docs and the changelog may name such a folder (in prose); nothing else
may."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: Prose about the project, where a sibling folder may be mentioned, and this
#: file, whose examples name one.
EXEMPT = ("docs/", "CHANGELOG.md", "tests/cli/test_self_contained.py")
#: A path outside the clone: ``../shared``, a ``"shared"`` path component (as
#: in ``ROOT.parent / "shared"``), or the machines' own absolute path.
SIBLING = re.compile(r"\.\./+shared\b|[\"']shared[\"']|/work/+shared\b")


def project_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of the project's files")
    return [f for f in out.decode().split("\0") if f]


def offenders(files: list[str]) -> list[str]:
    """``path:line: text`` of each line of ``files`` that names a sibling
    ``shared`` folder."""
    found = []
    for name in files:
        if name.startswith(EXEMPT):
            continue
        path = ROOT / name
        if not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if SIBLING.search(line):
                found.append(f"{name}:{n}: {line.strip()}")
    return found


def test_no_file_reads_a_folder_beside_the_checkout():
    files = project_files()
    assert ".ci/vllm_peer_tests.py" in files
    assert offenders(files) == []


@pytest.mark.parametrize(
    "line",
    [
        'shutil.copytree(ROOT.parent / "shared" / "data" / "hf-offline", home)',
        "notes=$root/../shared/notes",
        "open('/work/shared/data/x.json')",
        "Path(ROOT, '..', 'shared')",
    ],
)
def test_the_guard_catches_a_sibling_path(line):
    assert SIBLING.search(line)


@pytest.mark.parametrize(
    "line",
    [
        "from multiprocessing import shared_memory",
        "# the tests' shared machinery (tests/support)",
        "prompts with shared prefixes",
    ],
)
def test_the_guard_leaves_the_word_alone(line):
    assert not SIBLING.search(line)
