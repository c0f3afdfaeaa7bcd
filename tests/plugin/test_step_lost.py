"""A step whose merged events cannot be handed on costs that step, not the
engine.

A child with a scheduler-side removal hook gets the step's removals decoded;
a forged removal (a worker that rewrote a batch and its checksum) passes
every structural check and fails only there. The step's merged events of
that child are lost: counted as refused, logged as an error; the other
children publish, vLLM's step goes on, and the next step publishes.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest
from support.vllm_harness import Cluster, any_child, child, removed, stored

import kvmerge
from kvmerge import _schema
from kvmerge.vllm import register

pytestmark = pytest.mark.vllm

TP = 2


class _Forged:
    """A decoder that fails as msgspec does on bytes that are not an event:
    what a forged removal makes of the hook's decode."""

    def decode(self, payload: Any) -> Any:
        raise msgspec.DecodeError("forged")


def raw(*events: Any) -> list[bytes]:
    """``events`` as the publisher gets them: each one's msgpack bytes."""
    return [bytes(kvmerge.encode([e]).raw()[0]) for e in events]


def test_a_hook_removal_that_does_not_decode_loses_the_step_not_the_engine(
    bus, monkeypatch, vllm_caplog
):
    register()
    # UMBP's (or its stand-in's) and Mooncake's schedulers have the hook,
    # LMCache's has none.
    c = Cluster(
        [
            any_child(kv_events_merge="any"),
            child("LMCacheChild"),
            child("MooncakeChild", test_factors=[TP]),
        ],
        bus,
        tp=TP,
    )
    published: list[list[bytes]] = []
    for h in (1, 2, 3):
        for rank in range(TP):
            for index in range(3):
                c.emit(rank, index, [stored(h)] + ([removed(h - 1)] if h > 1 else []))
        output = c.aggregate()
        with monkeypatch.context() as m:
            if h == 2:
                m.setattr(_schema, "_DECODER", _Forged())
            vllm_caplog.clear()
            published.append([bytes(e) for e in c.schedule(output)])
        errors = [
            r.getMessage() for r in vllm_caplog.records if r.levelno >= logging.ERROR
        ]
        if h == 2:
            assert len(errors) == 2, errors
            # The second step the scheduler ran: the OutputMerger's step 1
            # (StepResult.step counts from 0), as every other line names it.
            assert all(
                ": step 1: the merged events of this step are lost" in e for e in errors
            ), errors
            assert "UMBP" in errors[0] or "HookList" in errors[0], errors
            assert "MooncakeChild" in errors[1], errors
        else:
            assert errors == []
    # The hooks' children lost step 2, counted; the other child's events
    # went out.
    assert [ch.refused for ch in c.scheduler._children] == [1, 0, 1]
    assert published[0] == raw(stored(1)) * 3
    assert published[1] == raw(stored(2), removed(1))
    # The next step publishes every child's events again.
    assert published[2] == raw(stored(3), removed(2)) * 3
