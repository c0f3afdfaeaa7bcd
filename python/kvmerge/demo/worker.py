"""A demo worker process: one TP rank, as vLLM's ``WorkerProc`` runs it.

It builds ``KVMergeMultiConnector``'s worker side (with the demo children) from
the demo's ``VllmConfig`` with its own ``parallel_config.rank``, creates its
response ``MessageQueue`` (vLLM's shm ring buffer, this process writing, the
main process reading, as ``WorkerProc.worker_response_mq``), and reads step
commands from the main process's broadcast ``MessageQueue`` (as
``rpc_broadcast_mq``). For each step it builds its ``KVConnectorOutput`` as the
model runner does (``get_kv_connector_kv_cache_events``,
``build_connector_worker_meta``) and enqueues the ``ModelRunnerOutput``.

Start-up handshake over a pipe (the queues' ``wait_until_ready`` calls block,
so each side calls them only when the other side is known to be there):

1. worker -> main: ``("handle", pid, response handle, shm name)``
2. main -> worker: ``("go", broadcast handle)`` or ``("stop",)``
3. worker -> main: ``("subscribed",)``, then the worker's response queue is
   ready and it waits for the broadcast queue to be.

The worker ignores SIGINT (the main process decides when to stop, and sends
``("stop",)`` through the broadcast queue); SIGTERM ends it cleanly; a watchdog
ends it if the main process disappears. Its shared memory is unlinked on the
way out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import weakref
from typing import Any

STOP = ("stop",)


def release_queue(mq: Any) -> None:
    """Release a MessageQueue now: its shared memory (unlinked if we made it),
    its ZMQ sockets, and (writer) the files of its ipc:// sockets.

    vLLM does both only when the queue is garbage-collected
    (``ShmRingBuffer.__del__``, a ``weakref.finalize`` that is not run at
    exit); a process told to stop should not leave them behind.
    """
    buf = getattr(mq, "buffer", None)
    shm = getattr(buf, "shared_memory", None)
    if shm is not None:
        if buf is not None and getattr(buf, "is_creator", False):
            buf.is_creator = False
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()
        with contextlib.suppress(BufferError):  # a view still exported
            shm.close()
    # The queue's own finalizer: closes its sockets, terminates its context.
    for finalizer in list(getattr(weakref.finalize, "_registry", {})):
        info = finalizer.peek()
        if info is not None and info[0] is mq:
            with contextlib.suppress(Exception):
                finalizer()
    # libzmq leaves the files of bound ipc:// sockets behind: the writer bound
    # these two (in vLLM's RPC directory, /tmp by default).
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


def main(
    rank: int,
    settings_extra: dict[str, Any],
    max_pending: int,
    conn: Any,
    base_config: Any = None,
) -> None:
    """``base_config``: the scheduler's ``VllmConfig`` when forked (shared, not
    rebuilt); None when spawned (the worker builds it)."""
    # The main process handles Ctrl-C and tells the workers to stop.
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

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvmerge.vllm import register

    from .config import build, kvmerge_config, worker_config
    from .workload import Settings

    try:
        register()
        settings = Settings.from_extra(settings_extra)
        if base_config is None:
            base_config = kvmerge_config(settings, max_pending_steps=max_pending)
        cfg = worker_config(base_config, rank)
        connector = build(cfg, KVConnectorRole.WORKER)
        assert connector.worker_rank == rank
        response = MessageQueue(1, 1)
        queues.append(response)
        conn.send(
            (
                "handle",
                os.getpid(),
                response.export_handle(),
                response.buffer.handle()[3],
            )
        )
        msg = conn.recv()
        if msg[0] != "go":
            return
        broadcast = MessageQueue.create_from_handle(msg[1], rank)
        queues.append(broadcast)
        response.wait_until_ready()
        conn.send(("subscribed",))
        broadcast.wait_until_ready()
        while True:
            try:
                cmd = broadcast.dequeue(timeout=1.0)
            except TimeoutError:
                continue
            if cmd[0] == "stop":
                break
            out = KVConnectorOutput()
            out.kv_cache_events = connector.get_kv_connector_kv_cache_events()
            out.kv_connector_worker_meta = connector.build_connector_worker_meta()
            response.enqueue(ModelRunnerOutput.with_kv_conn_output_only(out))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass  # the main process went away or stopped us: nothing to report
    except Exception as e:
        import traceback

        with contextlib.suppress(OSError):
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        release_all()
        conn.close()
