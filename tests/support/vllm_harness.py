"""A small, real vLLM setting for the plugin tests (no mocks of vLLM).

* configs: ``kvmerge.sim.model.connector_config`` (``DeviceConfig("cpu")``, a
  ``KVTransferConfig`` naming ``KVMergeMultiConnector``) with children from
  ``support.vllm_children`` (``child``);
* connectors: ``kvmerge.sim.model.create_connector`` for the scheduler and for
  one worker per rank (each with its own ``parallel_config.rank``:
  ``worker_config``, as vLLM's ``WorkerBase`` sets it);
* a step: each worker builds its ``KVConnectorOutput`` as vLLM's model runner
  does and wraps it in a ``ModelRunnerOutput``; the outputs are pickled as the
  executor's shm ``MessageQueue`` pickles them
  (``kvmerge.sim.transport.shm_roundtrip``) and combined by a real
  ``KVOutputAggregator``; the scheduler connector gets
  ``update_connector_output`` then ``take_events``, and the events are
  published by a real ``ZmqEventPublisher`` on an ipc:// endpoint and read
  back with a zmq SUB socket and msgspec;
* worker processes: ``init_tp_group`` joins a real TP group (gloo on CPU).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvmerge.sim.children import umbp_container
from kvmerge.sim.model import (
    child_entry,
    connector_config,
    create_connector,
    worker_config,
)
from kvmerge.sim.transport import shm_roundtrip
from kvmerge.vllm.families import available_names

CHILDREN_MODULE = "support.vllm_children"


# --- events ------------------------------------------------------------------
def stored(
    h: int | bytes,
    parent: int | bytes | None = None,
    *,
    group: int | None = None,
    tokens: Sequence[int] = (1, 2, 3, 4),
    medium: str | None = "GPU",
) -> BlockStored:
    return BlockStored(
        block_hashes=[h],
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=len(tokens),
        lora_id=None,
        medium=medium,
        lora_name=None,
        group_idx=group,
    )


def removed(
    h: int | bytes, *, group: int | None = None, medium: str | None = "GPU"
) -> BlockRemoved:
    return BlockRemoved(block_hashes=[h], medium=medium, group_idx=group)


def cleared() -> AllBlocksCleared:
    return AllBlocksCleared()


# --- configs and connectors --------------------------------------------------
def child(name: str, **extra: Any) -> dict[str, Any]:
    """A child entry of ``connectors`` for a ``support.vllm_children`` class."""
    return child_entry(name, CHILDREN_MODULE, extra)


#: Whether the running vLLM has UMBP's family (vLLM 0.33 and later).
HAS_UMBP = "umbp" in available_names()


def any_child(**extra: Any) -> dict[str, Any]:
    """The child of rule ``"any"`` whose scheduler half has the removal hook:
    UMBP's where the running vLLM has the family, else a third-party list
    child set to ``"any"`` with the same hook (the connector takes the same
    path for both; UMBP's container only collapses a rank's duplicates, as
    the rule does)."""
    if HAS_UMBP:
        return child("UMBPChild", **extra)
    return child("HookListChild", **{"kv_events_merge": "any", **extra})


def any_container(events: list[Any]) -> list[Any]:
    """What ``any_child``'s worker side hands over for ``events``
    (``get_all_events()`` of its container)."""
    if HAS_UMBP:
        return umbp_container(events).get_all_events()
    return list(events)


def init_tp_group(cfg: Any, rank: int, port: int) -> None:
    """Join a real TP group of ``cfg``'s size (gloo on CPU, rendezvous on
    ``port``), as a vLLM worker does: a connector built after it takes its rank
    from the parallel state."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    tp = cfg.parallel_config.tensor_parallel_size
    with set_current_vllm_config(cfg):
        ps.init_distributed_environment(
            world_size=tp,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        ps.initialize_model_parallel(tp, 1, backend="gloo")


def worker_output(connector: Any, **fields: Any) -> ModelRunnerOutput:
    """A worker's step output, built like ``KVConnectorModelRunnerMixin``."""
    out = KVConnectorOutput(**fields)
    out.kv_cache_events = connector.get_kv_connector_kv_cache_events()
    out.kv_connector_worker_meta = connector.build_connector_worker_meta()
    return ModelRunnerOutput.with_kv_conn_output_only(out)


# --- publisher / subscriber --------------------------------------------------
class Bus:
    """A real ``ZmqEventPublisher`` on ipc:// and a SUB socket reading it."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvmerge-zmq-")
        self.endpoint = f"ipc://{os.path.join(self._dir, 'pub')}"
        self.publisher = ZmqEventPublisher(
            data_parallel_rank=0,
            endpoint=self.endpoint,
            replay_endpoint=f"ipc://{os.path.join(self._dir, 'replay')}",
            topic="kv",
        )
        self._ctx = zmq.Context.instance()
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        self.sub.connect(self.endpoint)
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.last_seq: int | None = None
        # Slow joiner: publish empty batches until the subscription is live.
        deadline = time.monotonic() + 10
        while True:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=[]))
            if self.sub.poll(100):
                self._recv()
                break
            assert time.monotonic() < deadline, "subscriber never connected"
        while self.sub.poll(200):  # drain the other warm-up batches
            self._recv()

    def _recv(self) -> KVEventBatch:
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == b"kv"
        seq = int.from_bytes(seq_bytes, "big")
        if self.last_seq is not None:
            assert seq == self.last_seq + 1, "gap in the publisher's sequence"
        self.last_seq = seq
        return self._decoder.decode(payload)

    def publish(self, events: list[Any]) -> list[Any]:
        """What the scheduler does with the step's events; returns them decoded."""
        if not events:  # Scheduler: `if events: publish(...)`
            return []
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
        while True:
            assert self.sub.poll(10_000), "published batch never arrived"
            batch = self._recv()
            if batch.events:  # not a straggling warm-up batch
                return list(batch.events)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.publisher.shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)


# --- a cluster: one scheduler, world_size workers ------------------------------
class Cluster:
    def __init__(
        self,
        children: Sequence[Mapping[str, Any]],
        bus: Bus,
        *,
        tp: int = 1,
        pp: int = 1,
        kv_events: bool = True,
        **extra: Any,
    ) -> None:
        # The tests publish through their own ZmqEventPublisher (Bus).
        self.cfg = connector_config(
            children, tp=tp, pp=pp, kv_events=kv_events, **extra
        )
        self.world_size = self.cfg.parallel_config.world_size
        self.scheduler = create_connector(self.cfg, KVConnectorRole.SCHEDULER)
        self.workers = [
            create_connector(worker_config(self.cfg, r), KVConnectorRole.WORKER)
            for r in range(self.world_size)
        ]
        self.aggregator = KVOutputAggregator.from_connector(
            self.scheduler, self.world_size
        )
        self.bus = bus
        self.oob_buffers = 0

    def children(self, role_or_rank: int | str) -> list[Any]:
        conn = (
            self.scheduler
            if role_or_rank == "scheduler"
            else self.workers[int(role_or_rank)]
        )
        return conn.sub_connectors

    def emit(self, rank: int, index: int, events: Sequence[Any] | None) -> None:
        self.workers[rank].sub_connectors[index].emit(events)

    def aggregate(self, ranks: Sequence[int] | None = None, **fields: Any) -> Any:
        """Every worker's output for one step, through the shm pickling and the
        aggregator; returns the aggregated ``ModelRunnerOutput``."""
        ranks = range(self.world_size) if ranks is None else ranks
        outputs = []
        for r in ranks:
            out, n_oob = shm_roundtrip(worker_output(self.workers[r], **fields))
            self.oob_buffers += n_oob
            outputs.append(out)
        return self.aggregator.aggregate(outputs, output_rank=0)

    def schedule(self, output: Any) -> list[Any]:
        """The scheduler's part of ``update_from_output`` for the connector."""
        kv_out = output.kv_connector_output if output is not None else None
        if kv_out:
            self.scheduler.update_connector_output(kv_out)
        return list(self.scheduler.take_events())

    def step(self, **fields: Any) -> list[Any]:
        """One engine step; returns the published (decoded) events."""
        return self.bus.publish(self.schedule(self.aggregate(**fields)))
