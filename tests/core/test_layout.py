"""``encode`` reads lists and small ints in place, with the layout of this
interpreter's objects (``rust/kvmerge-py/src/layout.rs``), only after reading
known objects back agrees with CPython's API; a layout that disagrees falls
back to the API. ``KVMERGE_ASSUME_LAYOUT`` makes the extension assume another
layout, so that the fallback is seen on every interpreter: the test command
runs these tests on each Python it supports (``.ci/test-pythons``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvmerge

ASSUME = "KVMERGE_ASSUME_LAYOUT"
LAYOUTS = {(3, 11): "sized", (3, 12): "tagged", (3, 13): "tagged", (3, 14): "tagged"}
# An interpreter missing here has no layout the extension knows: a failure,
# until layout.rs and this table say what it is.
THIS = LAYOUTS[sys.version_info[:2]]
OTHER = ({"sized", "tagged"} - {THIS}).pop()
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_assumption(monkeypatch):
    monkeypatch.delenv(ASSUME, raising=False)
    return monkeypatch


def test_this_interpreter_takes_its_layout(no_assumption):
    assert kvmerge._kvmerge._layout() == THIS


@pytest.mark.parametrize(
    ("assumed", "taken"), [(THIS, THIS), (OTHER, None), ("none", None)]
)
def test_an_assumed_layout_is_taken_only_where_it_agrees(no_assumption, assumed, taken):
    no_assumption.setenv(ASSUME, assumed)
    assert kvmerge._kvmerge._layout() == taken


# Ints of every width and sign, lists and nested lists of them, bytes hashes:
# test_write.py's cases that take no examples from Hypothesis.
WRITE_CASES = "edges or length or other_types or refusals"


def test_encode_with_a_layout_that_disagrees_takes_the_api_path():
    """In a process whose extension assumes the other interpreters' layout,
    that layout is refused at start-up and every list and int is read through
    the API: the events still come out as msgspec writes them. (On 3.11,
    ints read as "tagged" would come out as zeros.)"""
    check = (
        "import sys, pytest, kvmerge\n"
        "assert kvmerge._kvmerge._layout() is None\n"
        "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider',"
        f" 'tests/core/test_write.py', '-k', {WRITE_CASES!r}]))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", check],
        cwd=ROOT,
        env={**os.environ, ASSUME: OTHER},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert " passed" in run.stdout and " deselected" in run.stdout, run.stdout
