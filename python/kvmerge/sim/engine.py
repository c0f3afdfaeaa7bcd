"""vLLM's real scheduler loop, with the forward pass simulated.

``Engine`` holds vLLM's own ``Scheduler`` (prefix caching, KV events on its
own ``ZmqEventPublisher``, the KV connector of the config) and one worker per
TP rank. Each ``step`` does what vLLM's engine core and multiprocess executor
do:

1. ``Scheduler.schedule()``;
2. the ``SchedulerOutput`` to every worker: through vLLM's shm broadcast
   ``MessageQueue`` to worker processes (``processes=True``), or, in this
   process, pickled once as that queue pickles it;
3. each worker's ``ModelRunnerOutput`` back (its response ``MessageQueue``, or
   the queue's pickling emulated, ``kvmerge.sim.transport``);
4. ``KVOutputAggregator.aggregate`` and ``Scheduler.update_from_output``, which
   calls the connector (``update_connector_output``, ``take_events``) and
   publishes the GPU block pool's events and the connector's in one batch.

``reset_prefix_cache`` is the engine's: the scheduler publishes
``AllBlocksCleared`` and resets the connector.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

from .model import BLOCK_SIZE, kv_cache_config
from .requests import Prompt
from .transport import dequeue, enqueue, shm_roundtrip
from .worker import STOP, Worker, build_worker, release_queue, serve

#: How long a worker may take to start (fork: build its connector).
START_TIMEOUT_S: Final = 120
#: How long one step's output may take.
STEP_TIMEOUT_S: Final = 60


class WorkerFailed(RuntimeError):
    pass


@dataclass
class Step:
    """What one engine step did."""

    output: Any  # SchedulerOutput
    scheduled: int  # requests scheduled
    finished: list[str]
    preempted: int


def _hasher() -> Any:
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256_cbor)
    return get_request_block_hasher(BLOCK_SIZE, sha256_cbor)


class Engine:
    """The scheduler of ``config`` and its ``world_size`` workers."""

    def __init__(
        self,
        config: Any,
        *,
        num_blocks: int,
        processes: bool = False,
        start_method: str = "fork",
    ) -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import (
            KVOutputAggregator,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.config = config
        self.world_size = int(config.parallel_config.world_size)
        self.num_blocks = num_blocks
        self._hasher = _hasher()
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config(num_blocks),
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK_SIZE,
            log_stats=False,
        )
        self.connector = self.scheduler.connector
        self.aggregator = KVOutputAggregator.from_connector(
            self.connector, self.world_size
        )
        self.steps = 0
        self._procs: list[Any] = []
        self._pipes: list[Any] = []
        self._responses: list[Any] = []
        self._broadcast: Any = None
        self.workers: list[Worker] = []
        try:
            if processes:
                self._start(start_method)
            else:
                self.workers = [
                    build_worker(config, r, num_blocks) for r in range(self.world_size)
                ]
        except BaseException:
            self.close()
            raise

    # --- workers in processes ------------------------------------------------
    def _start(self, start_method: str) -> None:
        import multiprocessing as mp

        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        ctx: Any = mp.get_context(start_method)
        if start_method == "fork":
            # What survives the fork is not traversed by the workers' GC, so
            # its pages stay shared instead of being copied.
            gc.collect()
            gc.freeze()
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=serve,
                args=(rank, self.config, self.num_blocks, child),
                name=f"kvmerge-sim-worker-{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._pipes.append(parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, pipe in enumerate(self._pipes):
            _tag, _pid, handle = self._recv(rank, pipe, deadline)
            self._responses.append(MessageQueue.create_from_handle(handle, 0))
        self._broadcast = MessageQueue(self.world_size, self.world_size)
        handle = self._broadcast.export_handle()
        for pipe in self._pipes:
            pipe.send(("go", handle))
        for q in self._responses:
            q.wait_until_ready()
        for rank, pipe in enumerate(self._pipes):
            self._recv(rank, pipe, deadline)
        self._broadcast.wait_until_ready()

    def _recv(self, rank: int, pipe: Any, deadline: float) -> Any:
        while not pipe.poll(0.1):
            proc = self._procs[rank]
            if not proc.is_alive():
                raise WorkerFailed(
                    f"worker {rank} exited with code {proc.exitcode} while starting"
                )
            if time.monotonic() > deadline:
                raise WorkerFailed(f"worker {rank} did not start in time")
        msg = pipe.recv()
        if msg[0] == "error":
            raise WorkerFailed(f"worker {rank} failed: {msg[1]}\n{msg[2]}")
        return msg

    def _run_workers(self, so: Any) -> list[Any]:
        if self._broadcast is None:
            # One pickling for every worker, as the broadcast queue does.
            received = dequeue(enqueue(so))
            return [shm_roundtrip(w.execute(received))[0] for w in self.workers]
        self._broadcast.enqueue(so)
        outputs = []
        for rank, q in enumerate(self._responses):
            try:
                outputs.append(q.dequeue(timeout=STEP_TIMEOUT_S))
            except TimeoutError:
                proc = self._procs[rank]
                state = "alive" if proc.is_alive() else f"exit code {proc.exitcode}"
                raise WorkerFailed(f"worker {rank} sent no output ({state})") from None
        return outputs

    def describe(self) -> list[str]:
        """The worker processes and the queues' shared memory, one per line."""
        lines = [
            f"worker {rank}: pid {proc.pid}, response queue shm "
            f"{q.buffer.shared_memory.name}"
            for rank, (proc, q) in enumerate(
                zip(self._procs, self._responses, strict=True)
            )
        ]
        if self._broadcast is not None:
            lines.append(
                f"broadcast queue shm {self._broadcast.buffer.shared_memory.name}"
            )
        return lines

    # --- the loop ----------------------------------------------------------------
    def add(self, prompts: Iterable[Prompt]) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        for p in prompts:
            self.scheduler.add_request(
                Request(
                    p.req_id,
                    p.token_ids,
                    SamplingParams(max_tokens=p.max_tokens, ignore_eos=True),
                    None,
                    block_hasher=self._hasher,
                )
            )

    def step(self) -> Step:
        so = self.scheduler.schedule()
        outputs = self._run_workers(so)
        merged = self.aggregator.aggregate(outputs, output_rank=0)
        results = self.scheduler.update_from_output(so, merged)
        finished = [
            o.request_id
            for eco in results.values()
            for o in eco.outputs
            if o.finish_reason is not None
        ]
        self.steps += 1
        return Step(
            output=so,
            scheduled=len(so.num_scheduled_tokens),
            finished=finished,
            preempted=len(so.preempted_req_ids or ()),
        )

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_running_requests=True,
        reset_connector=True)``: running requests are preempted."""
        return bool(
            self.scheduler.reset_prefix_cache(
                reset_running_requests=True, reset_connector=True
            )
        )

    @property
    def unfinished(self) -> int:
        return int(self.scheduler.get_num_unfinished_requests())

    # --- the end -------------------------------------------------------------------
    def close(self) -> None:
        if self._broadcast is not None:
            with contextlib.suppress(Exception):
                self._broadcast.enqueue(STOP, timeout=5)
        for proc in self._procs:
            proc.join(5)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        for q in [*self._responses, self._broadcast]:
            if q is not None:
                release_queue(q)
        self._responses, self._broadcast = [], None
        for pipe in self._pipes:
            pipe.close()
        self._pipes, self._procs = [], []
        with contextlib.suppress(Exception):
            self.scheduler.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
