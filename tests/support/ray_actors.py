"""Ray actors acting as vLLM 0.33.0 worker ranks, on a loopback-only local
Ray cluster (used by test_ray.py and benches/ray_transport.py).

* ``start_ray`` / ``stop_ray``: a local cluster whose every server binds
  127.0.0.1 (Ray's single-node mode), with usage reporting off, and a check
  that no Ray process outlives ``ray.shutdown()``.
* ``RankActor``: one process per rank holding one worker-side
  ``KVMergeMultiConnector`` with ``vllm_children``, optionally inside a real
  TP group (gloo), as a vLLM worker is. A step returns the worker's
  ``ModelRunnerOutput``, built as vLLM's model runner builds it, either as the
  actor method's result (Ray's serialization and object store: ``ray.get``)
  or through a response ``MessageQueue`` made as vLLM 0.33.0's
  ``RayWorkerProc`` makes it (``ResponseQueue``: shared memory for a worker
  on the executor's node, TCP for a worker on another node), enqueued by
  vLLM's own ``WorkerProc.enqueue_output``.
* ``probe_rebuild`` / ``BufferProbe``: pickle exactly as ``EventBatch`` does
  (``EventBatch.from_buffer`` of a protocol-5 ``PickleBuffer``) but record what
  the unpickler hands over, so a test can see whose memory Ray passes on.
* ``native_config`` (a child connector alone, returning vLLM's own container)
  and ``chain_events`` (long store chains) for the benchmark.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from pickle import PickleBuffer
from typing import Any

TESTS = Path(__file__).resolve().parents[1]

#: Set before ``ray.init``; the raylet, GCS and workers inherit them.
RAY_ENV = {
    # No usage-statistics report (it would go to the internet).
    "RAY_USAGE_STATS_ENABLED": "0",
    # Ray's single-node mode: the node IP is 127.0.0.1 and every server
    # (GCS, raylet, object manager, workers, agents) binds it. Without it,
    # Ray replaces a loopback _node_ip_address by the host's own address.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}

#: Processes a local Ray cluster starts (their names in /proc).
RAY_PROCESS_NAMES = ("raylet", "gcs_server", "plasma_store", "ray::")


def _ray_children() -> list[Any]:
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            name = proc.name()
            cmdline = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if any(n in name or n in cmdline for n in RAY_PROCESS_NAMES) or (
            "ray/" in cmdline and "python" in name
        ):
            found.append(proc)
    return found


def start_ray(num_cpus: int = 2, object_store_mb: int = 256) -> dict[str, Any]:
    """Start a local, loopback-only Ray cluster in a temporary directory of its
    own; returns what ``stop_ray`` restores and removes."""
    saved: dict[str, Any] = {k: os.environ.get(k) for k in (*RAY_ENV, "PYTHONPATH")}
    os.environ.update(RAY_ENV)
    # Workers import the test helpers (support.vllm_children, ...) by name.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(TESTS), saved["PYTHONPATH"]) if p
    )
    import ray
    from ray._private import ray_constants

    # Read when ray is imported: if something imported ray first, the
    # environment variable came too late for this process.
    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Sessions, logs and sockets here rather than in the shared /tmp/ray.
    temp_dir = tempfile.mkdtemp(prefix="kvmerge-ray-")
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            object_store_memory=object_store_mb * 1024 * 1024,
            _node_ip_address="127.0.0.1",
            _temp_dir=temp_dir,
            log_to_driver=False,
            logging_level="warning",
        )
    except BaseException:
        restore(saved, cluster_mode, temp_dir)
        raise
    return {"env": saved, "cluster_mode": cluster_mode, "temp_dir": temp_dir}


def restore(env: Mapping[str, str | None], cluster_mode: bool, temp_dir: str) -> None:
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(temp_dir, ignore_errors=True)


def _alive(proc: Any) -> bool:
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop_ray(saved: Mapping[str, Any], timeout: float = 30) -> list[str]:
    """Shut the cluster down, restore what ``start_ray`` changed, and return
    the Ray processes still alive after ``timeout`` seconds (none, normally).

    The processes are listed before ``ray.shutdown()`` (the raylet, GCS, their
    agents and every worker, all descendants of this process), so that one
    orphaned by its parent's exit is still checked.
    """
    import psutil
    import ray

    try:
        procs = _ray_children()
        ray.shutdown()
        deadline = time.monotonic() + timeout
        left = [p for p in procs if _alive(p)]
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [p for p in left if _alive(p)]
        described = []
        for proc in left:
            with contextlib.suppress(psutil.Error):
                described.append(f"{proc.pid} {proc.name()} {proc.cmdline()[:3]}")
        return described
    finally:
        restore(saved["env"], saved["cluster_mode"], saved["temp_dir"])


# --- where memory lives ------------------------------------------------------
def address_of(buffer: Any) -> int:
    """The address of the first byte of a (read-only) buffer."""
    view = memoryview(buffer)
    if view.nbytes == 0:
        return 0
    # ctypes cannot take the address of a read-only buffer; numpy can.
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def mapping_of(address: int) -> str:
    """The /proc/self/maps line of the mapping holding ``address``."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.rstrip("\n")
    return ""


def in_object_store(address: int) -> bool:
    """Whether ``address`` lies in Ray's plasma store mapping (shared memory
    mapped from /dev/shm/plasma* or a ``plasma`` file)."""
    line = mapping_of(address)
    return "plasma" in line and " rw-s " in f" {line.split()[1]} "


# --- the probe ---------------------------------------------------------------
#: What ``probe_rebuild`` saw, in the process that unpickled.
PROBES: list[dict[str, Any]] = []


def probe_rebuild(buffer: Any) -> Any:
    """``EventBatch.from_buffer``, recording what the unpickler handed over."""
    from kvmerge import EventBatch

    chain = []
    obj = buffer
    for _ in range(4):  # the exporter chain, as from_buffer walks it
        chain.append(f"{type(obj).__module__}.{type(obj).__qualname__}")
        if isinstance(obj, PickleBuffer):
            obj = obj.raw().obj
        elif isinstance(obj, memoryview):
            obj = obj.obj
        else:
            break
    view = memoryview(buffer)
    batch = EventBatch.from_buffer(buffer)
    PROBES.append(
        {
            "chain": chain,
            "readonly": view.readonly,
            "nbytes": view.nbytes,
            "buffer_address": address_of(buffer),
            "buffer_mapping": mapping_of(address_of(buffer)),
            "batch_address": address_of(batch),
            "exporter": obj,
            "batch": batch,
        }
    )
    return batch


class BufferProbe:
    """Pickles like ``EventBatch`` (a protocol-5 ``PickleBuffer`` of the batch
    handed to a rebuild function) but rebuilds through ``probe_rebuild``."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        assert protocol >= 5
        return (probe_rebuild, (PickleBuffer(self.batch),))


# --- ranks -------------------------------------------------------------------
class ResponseQueue:
    """vLLM 0.33.0 RayExecutorV2's response queue, on a worker actor."""

    #: The name WorkerProc.enqueue_output reads.
    worker_response_mq: Any = None

    def open_response_mq(self, same_node: bool) -> Any:
        """``RayWorkerProc._init_message_queues``: one reader, the executor;
        shared memory when on the executor's node, else TCP."""
        import ray
        from vllm.distributed.device_communicators.shm_broadcast import (
            MessageQueue,
        )

        self.close_response_mq()
        self.worker_response_mq = MessageQueue(
            n_reader=1,
            n_local_reader=1 if same_node else 0,
            connect_ip=ray.util.get_node_ip_address(),
        )
        return self.worker_response_mq.export_handle()

    def response_mq_ready(self) -> None:
        self.worker_response_mq.wait_until_ready()

    def close_response_mq(self) -> None:
        if self.worker_response_mq is not None:
            self.worker_response_mq.shutdown()
            self.worker_response_mq = None


class RankActor(ResponseQueue):
    """One worker rank: a worker-side ``KVMergeMultiConnector`` (children:
    ``vllm_children`` entries) in its own process.

    ``dist_port``: join a real TP group (gloo) so that the connector takes its
    rank from vLLM's parallel state, as in a vLLM worker; without it
    ``parallel_config.rank`` says which rank this is.
    """

    def __init__(
        self,
        rank: int,
        children: Sequence[Mapping[str, Any]],
        tp: int,
        *,
        dist_port: int | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import (
            KVConnectorRole,
        )

        from kvmerge.sim.model import connector_config, create_connector, worker_config
        from kvmerge.vllm import register

        from .vllm_harness import init_tp_group

        register()
        self.rank = rank
        cfg = connector_config(children, tp=tp, **dict(extra or {}))
        self.dist = dist_port is not None
        if dist_port is not None:
            init_tp_group(cfg, rank, dist_port)
        else:
            cfg = worker_config(cfg, rank)
        self.connector = create_connector(cfg, KVConnectorRole.WORKER)
        self.children = list(self.connector.sub_connectors)

    def ready(self) -> dict[str, Any]:
        times = os.times()
        return {
            "pid": os.getpid(),
            # CPU seconds this process spent so far (importing vLLM, mostly).
            "cpu_s": times.user + times.system,
            "rank": self.connector.worker_rank,
            "connector": type(self.connector).__name__,
        }

    # --- one step --------------------------------------------------------
    def _emit(self, per_child: Sequence[Any]) -> None:
        for child, events in zip(self.children, per_child, strict=True):
            if isinstance(events, tuple) and events and events[0] == "chain":
                events = chain_events(*events[1:])
            child.emit(events)

    def step(self, per_child: Sequence[Any], **fields: Any) -> Any:
        """Queue this step's events per child (a list, None, or
        ``("chain", n, start)``), return the step's ``ModelRunnerOutput``."""
        from .vllm_harness import worker_output

        self._emit(per_child)
        return worker_output(self.connector, **fields)

    # --- vLLM 0.33.0 RayExecutorV2's response queue -----------------------
    def step_mq(self, per_child: Sequence[Any], **fields: Any) -> None:
        """Like ``step``, but the output goes back as vLLM's worker sends it:
        ``WorkerProc.enqueue_output`` on the response ``MessageQueue``."""
        from vllm.v1.executor.multiproc_executor import WorkerProc

        WorkerProc.enqueue_output(self, self.step(per_child, **fields))  # type: ignore[arg-type]

    def close(self) -> None:
        self.close_response_mq()
        if self.dist:
            from vllm.distributed import parallel_state as ps

            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
            self.dist = False

    # --- probes ----------------------------------------------------------
    def probe(self, n: int) -> dict[str, Any]:
        """A chain of ``n`` stores as an ``EventBatch``, a ``BufferProbe`` of
        the same batch, and a numpy array of the same size (Ray's documented
        zero-copy case) to compare where each lands in the reader."""
        import numpy as np

        import kvmerge

        batch = kvmerge.encode(chain_events(n))
        return {
            "batch": batch,
            "probe": BufferProbe(batch),
            "array": np.frombuffer(bytes(batch), dtype=np.uint8),
            "nbytes": batch.nbytes,
        }


# --- configs and events --------------------------------------------------------
def native_config(child_entry: Mapping[str, Any], *, tp: int) -> Any:
    """A VllmConfig whose connector IS the child (vLLM's own container path)."""
    from kvmerge.sim.model import connector_config

    return connector_config(
        None,
        tp=tp,
        connector=child_entry["kv_connector"],
        module_path=child_entry["kv_connector_module_path"],
        **dict(child_entry.get("kv_connector_extra_config") or {}),
    )


def chain_events(
    n: int, start: int = 0, tokens: int = 16, group: int | None = None
) -> list[Any]:
    """``n`` stores of 32-byte hashes, each the parent of the next (the shape
    of a long prompt's blocks), ``tokens`` token ids per block, spread over a
    150k vocabulary as real ones are."""
    from .vllm_harness import stored

    return [
        stored(
            h.to_bytes(32, "big"),
            (h - 1).to_bytes(32, "big") if h > start else None,
            tokens=[(h * tokens + i) * 2_654_435_761 % 151_936 for i in range(tokens)],
            group=group,
        )
        for h in range(start, start + n)
    ]
