"""The plugin across real processes (slow: each process imports vLLM).

* Worker processes (spawned, in a real TP group) send their step outputs
  through vLLM's shm ``MessageQueue`` to this process, which aggregates them with a real
  ``KVOutputAggregator``, runs the scheduler connector and publishes through a
  real ``ZmqEventPublisher``; a SUB socket reads the events back.
* A fresh interpreter loads vLLM's general plugins and gets
  ``KVMergeMultiConnector`` from ``KVConnectorFactory`` by name.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import vllm_mq_worker as script
from support.vllm_harness import Bus
from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvmerge import EventBatch
from kvmerge.sim.model import connector_config, create_connector
from kvmerge.sim.transport import OOB_THRESHOLD
from kvmerge.vllm import register

pytestmark = pytest.mark.vllm

TESTS = Path(__file__).resolve().parents[1]


def test_workers_through_the_shm_message_queue():
    register()
    ctx = mp.get_context("spawn")
    with socket.socket() as s:  # a free port for the workers' gloo group
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes, procs = [], []
    for rank in range(script.TP):
        parent, child_end = ctx.Pipe()
        proc = ctx.Process(
            target=script.main, args=(rank, port, child_end), daemon=True
        )
        proc.start()
        pipes.append(parent)
        procs.append(proc)
    bus = Bus()
    try:
        queues = []
        for pipe in pipes:
            assert pipe.poll(120), "worker did not start"
            queues.append(MessageQueue.create_from_handle(pipe.recv(), 0))
        for q in queues:
            q.wait_until_ready()
        cfg = connector_config(script.children(), tp=script.TP)
        scheduler = create_connector(cfg, KVConnectorRole.SCHEDULER)
        aggregator = KVOutputAggregator.from_connector(scheduler, script.TP)
        for step in range(script.STEPS):
            outputs = [q.dequeue(timeout=120) for q in queues]
            if step == 0:
                # The big batch came out of band: a bytearray, borrowed as is.
                batch = (
                    outputs[0].kv_connector_output.kv_cache_events.outputs[0].entries[0]
                )
                assert isinstance(batch, EventBatch)
                assert batch.nbytes >= OOB_THRESHOLD and len(batch) == script.BIG
            out = aggregator.aggregate(outputs, output_rank=0)
            kv_out = out.kv_connector_output
            assert kv_out.finished_sending == {f"req-{step}"}
            assert kv_out.kv_cache_events.get_number_of_workers() == script.TP
            scheduler.update_connector_output(kv_out)
            published = bus.publish(list(scheduler.take_events()))
            assert published == script.expected(step), f"step {step}"
            if step == script.DAMAGED_STEP:
                # Dequeued without raising; dropped by the connector, counted.
                damaged = kv_out.kv_cache_events.outputs[1].entries[0]
                assert damaged.error is not None
                assert [child.refused for child in scheduler._children] == [1, 0, 0]
    finally:
        for pipe in pipes:
            pipe.send("done")
        for proc in procs:
            proc.join(60)
        bus.close()
    assert [p.exitcode for p in procs] == [0] * script.TP


def test_general_plugin_registers_the_connector_in_a_fresh_interpreter():
    code = textwrap.dedent(
        """
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        import kvmerge.vllm

        kvmerge.vllm.register()  # again: idempotent
        from support.vllm_harness import child

        from kvmerge.sim.model import connector_config, create_connector

        cfg = connector_config([child("LMCacheChild")], module_path=None)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            conn = create_connector(cfg, role)
            assert type(conn) is kvmerge.vllm.KVMergeMultiConnector, type(conn)
        cls = KVConnectorFactory.get_connector_class_by_name("KVMergeMultiConnector")
        assert cls is kvmerge.vllm.KVMergeMultiConnector
        print("PLUGIN-OK")
        """
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(TESTS), env.get("PYTHONPATH")) if p
    )
    env.pop("VLLM_PLUGINS", None)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "PLUGIN-OK" in proc.stdout
