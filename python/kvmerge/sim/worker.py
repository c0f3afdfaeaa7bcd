"""A worker: one TP rank's model runner, with the forward pass simulated.

``Worker.execute`` takes the scheduler's ``SchedulerOutput`` and drives the
rank's KV connector in the order vLLM's model runner does
(``KVConnectorModelRunnerMixin``: bind the metadata, start the loads, the
forward pass, wait for the saves, the transfer results, stats, events, worker
metadata, clear), then returns a ``ModelRunnerOutput`` with one sampled token
for every request whose scheduled tokens reach its end (none for a partial
prefill, as the model runner discards those). Tokens are a hash of the request
and position: every rank samples the same ones, and a rerun the same stream.

``serve`` runs a worker in its own process, as vLLM's ``WorkerProc``: it reads
each step from the executor's broadcast ``MessageQueue`` and writes its output
to its own response ``MessageQueue`` (vLLM's shm ring buffers).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import zlib
from typing import Any, Final

from .model import VOCAB

#: What the engine broadcasts to stop the workers.
STOP: Final = "stop"


def sampled_token(req_id: str, position: int) -> int:
    return zlib.crc32(f"{req_id}/{position}".encode()) % VOCAB


def _output_fields() -> frozenset[str]:
    from vllm.v1.outputs import ModelRunnerOutput

    return frozenset(ModelRunnerOutput.__dataclass_fields__)


class Worker:
    """One rank: its connector and what its model runner knows of requests."""

    def __init__(self, connector: Any) -> None:
        self.connector = connector
        #: request -> its number of tokens (prompt and sampled)
        self.num_tokens: dict[str, int] = {}
        self._has_index = "req_id_to_index" in _output_fields()

    def execute(self, so: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        for req_id in so.finished_req_ids:
            self.num_tokens.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            # A request resumed after preemption comes back with its outputs
            # to prefill again (vLLM 0.34: as a new request).
            tokens = new.prefill_token_ids or new.prompt_token_ids or ()
            self.num_tokens[new.req_id] = len(tokens)
        cached = so.scheduled_cached_reqs
        # vLLM 0.33 resumes a preempted request as a cached one.
        for req_id in getattr(cached, "resumed_req_ids", ()):
            self.num_tokens[req_id] = len(cached.all_token_ids[req_id])
        computed = dict(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for new in so.scheduled_new_reqs:
            computed[new.req_id] = new.num_computed_tokens

        conn = self.connector
        kv_out = KVConnectorOutput()
        conn.bind_connector_metadata(so.kv_connector_metadata)
        conn.start_load_kv(None)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            req_ids.append(req_id)
            total = self.num_tokens.get(req_id, 0)
            if computed.get(req_id, 0) + n < total:
                sampled.append([])  # a partial prefill: nothing sampled
                continue
            sampled.append([sampled_token(req_id, total)])
            self.num_tokens[req_id] = total + 1
        conn.wait_for_save()
        results = conn.get_transfer_results(so.finished_req_ids)
        kv_out.finished_sending = results.finished_sending
        kv_out.finished_recving = results.finished_recving
        kv_out.invalid_block_ids = conn.get_block_ids_with_load_errors()
        kv_out.kv_connector_stats = conn.get_kv_connector_stats()
        kv_out.kv_cache_events = conn.get_kv_connector_kv_cache_events()
        kv_out.kv_connector_worker_meta = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        fields: dict[str, Any] = {
            "req_ids": req_ids,
            "sampled_token_ids": sampled,
            "kv_connector_output": kv_out,
        }
        if self._has_index:
            fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(**fields)


def build_worker(config: Any, rank: int, num_blocks: int) -> Worker:
    """The worker of ``rank``: its own copy of the config, as ``WorkerBase``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from .model import create_connector, kv_cache_config, worker_config

    connector = create_connector(
        worker_config(config, rank), KVConnectorRole.WORKER, kv_cache_config(num_blocks)
    )
    return Worker(connector)


def release_queue(mq: Any) -> None:
    """Release a MessageQueue now: its shared memory (unlinked by its creator)
    and its ZMQ sockets. vLLM does both only when the queue is collected, in a
    finalizer that does not run at exit."""
    import weakref

    buf = getattr(mq, "buffer", None)
    shm = getattr(buf, "shared_memory", None)
    if shm is not None:
        if buf is not None and getattr(buf, "is_creator", False):
            buf.is_creator = False
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
        with contextlib.suppress(BufferError):  # a view still exported
            shm.close()
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        info = finalizer.peek()
        if info is not None and info[0] is mq:
            with contextlib.suppress(Exception):
                finalizer()
    # libzmq leaves the files of bound ipc:// sockets behind.
    if getattr(mq, "_is_writer", False):
        handle = getattr(mq, "handle", None)
        for addr in (
            getattr(handle, "local_subscribe_addr", None),
            getattr(handle, "local_notify_addr", None),
        ):
            if isinstance(addr, str) and addr.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(addr[len("ipc://") :])


def _watchdog(parent: int, on_orphan: Any) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            on_orphan()
            os._exit(1)


def serve(rank: int, config: Any, num_blocks: int, conn: Any) -> None:
    """A worker process (``multiprocessing`` target). Start-up over ``conn``:

    1. worker -> engine: ``("handle", pid, response queue handle)``;
    2. engine -> worker: ``("go", broadcast queue handle)`` or ``("stop",)``;
    3. worker -> engine: ``("ready",)``; then steps arrive on the broadcast
       queue until ``STOP``.

    SIGINT is ignored (the engine decides when to stop), SIGTERM ends it, and
    a watchdog ends it when the engine process disappears. A start-up error
    goes back as ``("error", message)``.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_term)
    queues: list[Any] = []

    def release_all() -> None:
        for q in queues:
            release_queue(q)

    threading.Thread(
        target=_watchdog, args=(os.getppid(), release_all), daemon=True
    ).start()
    try:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        from kvmerge.vllm import register

        register()
        worker = build_worker(config, rank, num_blocks)
        response = MessageQueue(1, 1)
        queues.append(response)
        conn.send(("handle", os.getpid(), response.export_handle()))
        msg = conn.recv()
        if msg[0] != "go":
            return
        broadcast = MessageQueue.create_from_handle(msg[1], rank)
        queues.append(broadcast)
        response.wait_until_ready()
        conn.send(("ready",))
        broadcast.wait_until_ready()
        while True:
            try:
                so = broadcast.dequeue(timeout=1.0)
            except TimeoutError:
                continue
            if so == STOP:
                break
            response.enqueue(worker.execute(so))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the engine went away or stopped us: nothing to report
    except Exception as e:
        import traceback

        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        release_all()
        conn.close()
