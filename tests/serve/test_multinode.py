"""kvmerge beyond one machine: vLLM's multi-node executor in the real
``vllm serve``, two nodes on this machine (``kvmerge.sim.server``: node 1
``--headless``, in mount and IPC namespaces of its own, with its own
``/dev/shm``, so that vLLM takes it for another host and its workers'
outputs reach the engine core by TCP).

Two configurations, each with the children's disagreements on (a late rank,
a lost eviction report, a repeated store, the Mooncake child's last rank
damaging every third report) and every check of the single-node run, read
back by Dynamo's indexer: TP 2 across the two nodes, and PP 2 x TP 1 across
them (kvmerge's world is then TP x PP: one stage a node).
"""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_vllm_serve import CHECKS, DAMAGE_EVERY, DAMAGES, kept_if_a_test_fails
from vllm.distributed.kv_events import MEDIUM_GPU

from kvmerge.sim.model import served_model_dir, word
from kvmerge.sim.served import (
    ServedOptions,
    ServedResult,
    connector_config,
    prompts,
)
from kvmerge.sim.server import Server, ServerOptions, cpu_python

pytestmark = pytest.mark.serve

#: Per configuration: the layout of its two nodes.
LAYOUTS = {
    "tp2": {"tp": 2, "pp": 1},
}
#: What only a run across nodes checks, and a damage only that check notices.
NODE_DAMAGES = {
    # Node 1's vllm serve did not exit cleanly.
    "nodes": lambda r: r.node_returncodes.__setitem__(0, 1),
    # No output crossed by TCP: the two nodes shared memory.
    "tcp": lambda r: r.remote_queues.clear(),
}
MULTI_CHECKS = (*CHECKS, *NODE_DAMAGES)


@pytest.fixture(scope="module", params=LAYOUTS, ids=LAYOUTS.keys())
def across(request, dynamo_python: str) -> Iterator[ServedResult]:
    cpu_python()
    opts = ServedOptions(damage=DAMAGE_EVERY, nodes=2, **LAYOUTS[request.param])
    with kept_if_a_test_fails(request, opts, dynamo_python) as run:
        yield run


def test_a_run_across_nodes_makes_every_check(across):
    assert sorted(c.name for c in across.checks()) == sorted(MULTI_CHECKS)


@pytest.mark.parametrize("name", MULTI_CHECKS)
def test_across_two_nodes_every_check_passes(across, name):
    (check,) = [c for c in across.checks() if c.name == name]
    assert check.ok, f"{check.text} (the run's files: {across.kept})"


def test_node_1s_outputs_cross_by_tcp(across):
    """Node 1's workers answer on vLLM's remote message queue, a TCP
    address of this machine: their outputs, kvmerge's buffers among them,
    are not in shared memory."""
    assert across.remote_queues
    assert all(a.startswith("tcp://127.0.0.1:") for a in across.remote_queues)


def test_the_rank_on_node_1_is_merged(across):
    """Every rank's reports reach the merger: under "all" (the LMCache
    child) nothing is published without node 1's rank, and its reports are
    counted."""
    lmcache = next(label for label in across.metrics if "SimLMCache" in label)
    assert across.metrics[lmcache]["published"] > 0
    assert across.metrics[lmcache]["reports"] > across.metrics[lmcache]["published"]


@pytest.mark.parametrize("name", MULTI_CHECKS)
def test_each_check_fails_on_a_run_across_nodes_damaged_on_purpose(across, name):
    damaged = copy.deepcopy(across)
    damaged.kept = None
    {**DAMAGES, **NODE_DAMAGES}[name](damaged)
    failed = {c.name for c in damaged.checks() if not c.ok}
    assert name in failed, [c.text for c in damaged.checks() if c.name == name]


def test_pp_across_nodes_is_where_the_cpu_platform_stops(tmp_path):
    """PP 2 x TP 1 across the two nodes cannot run here: vLLM 0.32's CPU
    build fails its second stage's first step (``sync_and_gather_intermediate_
    tensors``: no intermediate tensors), with no connector and no KV events.
    kvmerge's world of TP x PP is tested where vLLM runs it (the plugin
    tests' executors); this test fails once the CPU platform serves PP, to
    add the layout above."""
    opts = ServerOptions(
        model=served_model_dir(tmp_path, 2),
        tp=1,
        pp=2,
        nodes=2,
        kv_transfer=None,
        kv_events=False,
        startup_timeout=300,
    )
    statuses = []
    with Server(opts, tmp_path) as server:
        for _ in range(2):
            with contextlib.suppress(OSError):
                statuses.append(server.complete(f"{word(1)} {word(2)}", 4))
        log = server.log()
    assert 200 not in statuses
    assert "self.intermediate_tensors is not None" in log, log[-3000:]
    assert server.leaked_after_stop() == []


#: Requests in flight when node 1 dies, and how many answer first.
DEATH_REQUESTS = 36
DEATH_AFTER = 6


def test_a_node_that_dies_stops_the_server_cleanly(tmp_path):
    """SIGKILL to node 1 while requests are in flight: vLLM's engine stops
    (its remote workers are gone); kvmerge adds no hang (the first node's
    processes exit on their own, within a bounded wait), no stray process and
    no shared memory left behind, and the stream up to then passes
    ``kvmerge subscribe --check``."""
    opts = ServedOptions(tp=2, nodes=2, damage=DAMAGE_EVERY)
    config = connector_config(opts, tmp_path / "records", tmp_path / "example")
    server = Server(
        ServerOptions(
            model=served_model_dir(tmp_path, 2),
            tp=2,
            nodes=2,
            num_blocks=opts.num_blocks,
            kv_transfer=config,
            topic=opts.topic,
        ),
        tmp_path,
    )
    server.start()
    try:
        endpoint, replay = server.subscriber_endpoints()
        check = subprocess.Popen(
            [
                *(sys.executable, "-m", "kvmerge", "subscribe", endpoint),
                *("--replay", replay, "--topic", opts.topic, "--history"),
                *("--check", "--json", "--idle", "15", "--duration", "300"),
                *("--first-batch-timeout", "120", "--min-batches", "1"),
                *("--jsonl", str(tmp_path / "stream.jsonl")),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        answered = []
        with ThreadPoolExecutor(opts.concurrency) as pool:
            futures = [
                pool.submit(_complete, server, p)
                for p in prompts(opts)[:DEATH_REQUESTS]
            ]
            for f in futures[:DEATH_AFTER]:
                answered.append(f.result())
            pids = server.pids()
            server.kill_node(1)
            rest = [f.result() for f in futures[DEATH_AFTER:]]
        # The first node's engine stops on its own: nothing waits for ever.
        stopped = server.wait_stopped(timeout=180)
        out, err = check.communicate(timeout=120)
    finally:
        server.stop()
    assert answered.count(200) == DEATH_AFTER
    assert any(s != 200 for s in rest), "node 1's death went unnoticed"
    assert stopped, (
        f"the first node still runs 180 s after node 1 died:\n{server.log_tail()}"
    )
    assert not server.killed
    assert _alive(pids) == [], "a process of the server outlived it"
    # A segment of the dead engine's (vLLM's message queues') goes with
    # Python's resource tracker, which unlinks it once the process that made
    # it is gone: a moment after the stop.
    assert _gone(server.leaked_after_stop, 20) == []
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["final"], (summary, err[-2000:])
    # Every batch up to the death, each decoded; every store and removal of
    # the children's media one a router can apply. vLLM's GPU block pool's
    # own events are not kvmerge's (after a preemption vLLM 0.32's CPU build
    # publishes stores of blocks it holds: docs/routers.md), and are judged
    # as in every real-server run: apart.
    assert summary["batches"] >= 1 and summary["events"] > 0
    assert (summary["missing"], summary["undecodable"]) == (0, 0), summary
    ours = [v for v in summary["violations"] if v["medium"] not in (MEDIUM_GPU, None)]
    assert ours == [], ours
    # ... and there were children's events to judge: both children's media.
    media = Counter(
        e.get("medium")
        for line in (tmp_path / "stream.jsonl").read_text().splitlines()
        for e in json.loads(line)["events"]
    )
    assert media["CPU"] > 0 and media["STORAGE"] > 0, media


def _complete(server: Server, prompt: tuple[str, int]) -> int:
    try:
        return server.complete(*prompt)
    except OSError:
        return -1


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            out.append(pid)
    return out


def _gone(left: Callable[[], list[str]], timeout: float) -> list[str]:
    """What ``left()`` still lists after at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (found := left()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found
