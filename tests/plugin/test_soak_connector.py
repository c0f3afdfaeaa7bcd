"""The connector path holds its memory over a long run.

Many steps of what vLLM does with KVMergeMultiConnector each step (worker
sides encode, the shm queue's pickling, KVOutputAggregator, the scheduler
side's update_connector_output and take_events, its stats), with late ranks,
a damaged batch now and then, resets and evictions, and resident memory
measured after a warm-up: it must stay flat (the Rust side's soak,
docs/robustness.md, covers the merger alone over a million steps).
"""

from __future__ import annotations

import gc
import logging
import random
import resource

import pytest
from support.vllm_harness import (
    Bus,
    Cluster,
    any_child,
    child,
    removed,
    stored,
    worker_output,
)

from kvmerge.sim.transport import shm_roundtrip
from kvmerge.vllm import register

pytestmark = pytest.mark.vllm

STEPS = 20_000
WARMUP = 4_000
#: Allowed growth of the RSS after the warm-up, over the rest of the run:
BOUND_KIB = 1024  # 64 bytes a step


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def forget_test_records(c: Cluster) -> None:
    """The test children record what they receive; kvmerge must not."""
    for test_child in c.children("scheduler"):
        test_child.received.clear()
        recorder = getattr(test_child, "connector_scheduler", None)
        if recorder is not None:
            recorder.outputs.clear()
            recorder.invalidated.clear()


def test_the_connector_path_holds_its_memory():
    register()
    bus = Bus()
    # The incident lines would pile up in pytest's log capture, not in kvmerge.
    plugin_logger = logging.getLogger("vllm.kvmerge")
    level = plugin_logger.level
    plugin_logger.setLevel(logging.ERROR)
    try:
        c = Cluster(
            [child("LMCacheChild"), any_child()], bus, tp=2, max_pending_steps=4
        )
        rng = random.Random(7)
        before = 0
        for step in range(STEPS):
            if step == WARMUP:
                gc.collect()
                before = rss_kib()
            outputs = []
            for r in range(2):
                h = rng.randrange(64)
                events = [stored(h)] if rng.random() < 0.8 else [removed(h)]
                if r == 1 and rng.random() < 0.1:
                    events = []  # a late or silent rank
                for i in (0, 1):
                    c.emit(r, i, events)
                outputs.append(shm_roundtrip(worker_output(c.workers[r]))[0])
            c.schedule(c.aggregator.aggregate(outputs, 0))
            c.scheduler.get_kv_connector_stats()
            forget_test_records(c)
            if step % 997 == 0:
                c.scheduler.reset_cache()
        gc.collect()
        grown = rss_kib() - before
        print(f"RSS grew {grown} KiB over {STEPS - WARMUP} steps after warm-up")
        assert grown < BOUND_KIB, f"RSS grew {grown} KiB in {STEPS - WARMUP} steps"
        stats = c.scheduler.merge_stats()
        assert all(s is not None and s["steps"] == STEPS for s in stats)
    finally:
        plugin_logger.setLevel(level)
        bus.close()
