"""vLLM's real scheduler loop, with the forward pass simulated.

``Engine`` holds vLLM's own ``Scheduler`` (prefix caching, KV events on its
own ``ZmqEventPublisher``, the KV connector of the config) and one worker per
TP rank. Each ``step`` does what vLLM's engine core does:

1. ``Scheduler.schedule()``;
2. the executor's ``execute_model`` (then ``sample_tokens``): with
   ``processes=True`` vLLM's own ``MultiprocExecutor``, whose ``WorkerProc``
   processes (``kvmerge.sim.executor.NoForwardWorker``) get the
   ``SchedulerOutput`` through its shm broadcast ``MessageQueue``, run the
   connector through vLLM's model-runner code and answer on their response
   ``MessageQueue``s, combined by the executor's ``KVOutputAggregator``; in
   this process, ``kvmerge.sim.worker.Worker``s behind the queue's pickling
   (``kvmerge.sim.transport``) and a ``KVOutputAggregator``;
3. ``Scheduler.update_from_output``, which calls the connector
   (``update_connector_output``, ``take_events``) and publishes the GPU block
   pool's events and the connector's in one batch.

``reset_prefix_cache`` is the engine's: the scheduler publishes
``AllBlocksCleared`` and resets the connector.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .model import BLOCK_SIZE, kv_cache_config
from .requests import Prompt
from .transport import dequeue, enqueue
from .worker import Worker, build_worker


@dataclass
class Step:
    """What one engine step did."""

    output: Any  # SchedulerOutput
    finished: list[str]
    preempted: int
    #: The scheduler side of the KV events: aggregating the workers' outputs
    #: (in this process; vLLM's executor aggregates in ``execute_model``) and
    #: ``update_from_output``.
    merge_ns: int
    #: What the engine core sends the front end's stat loggers (``log_stats``).
    scheduler_stats: Any = None
    #: In-process workers only (empty, 0 with an executor): each rank's side,
    #: its connector's calls and its output's pickling; the scheduler's
    #: unpickling of the outputs, besides ``merge_ns``.
    worker_ns: list[int] = field(default_factory=list)
    unpickle_ns: int = 0


def _hasher() -> Any:
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256_cbor)
    return get_request_block_hasher(BLOCK_SIZE, sha256_cbor)


class Engine:
    """The scheduler of ``config`` and its ``world_size`` workers.

    ``start_method``: how vLLM's executor starts its worker processes
    (``VLLM_WORKER_MULTIPROC_METHOD``, ``fork`` by default, as in vLLM)."""

    def __init__(
        self,
        config: Any,
        *,
        num_blocks: int,
        processes: bool = False,
        start_method: str = "fork",
        log_stats: bool = False,
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
        self.executor: Any = None
        self.workers: list[Worker] = []
        if processes:
            from .executor import build_executor

            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = start_method
            # Before the scheduler: the executor sets the config's worker class.
            self.executor = build_executor(config, num_blocks)
        try:
            self.scheduler = Scheduler(
                vllm_config=config,
                kv_cache_config=kv_cache_config(num_blocks),
                structured_output_manager=StructuredOutputManager(config),
                block_size=BLOCK_SIZE,
                log_stats=log_stats,
            )
            self.connector = self.scheduler.connector
            if self.executor is not None:
                self.executor.init_kv_output_aggregator(self.connector)
            else:
                self.aggregator = KVOutputAggregator.from_connector(
                    self.connector, self.world_size
                )
                self.workers = [
                    build_worker(config, r, num_blocks) for r in range(self.world_size)
                ]
        except BaseException:
            self.close()
            raise

    def _run_workers(self, so: Any, step: Step) -> Any:
        """Every rank's output for ``so``, aggregated; what each side took in
        this process goes into ``step``."""
        ex = self.executor
        if ex is not None:
            out = ex.execute_model(so)
            if out is None:
                out = ex.sample_tokens(self.scheduler.get_grammar_bitmask(so))
            return out
        # One pickling for every worker, as the broadcast queue does.
        received = dequeue(enqueue(so))
        wires = []
        for w in self.workers:
            t = time.perf_counter_ns()
            wires.append(enqueue(w.execute(received)))
            step.worker_ns.append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        outputs = [dequeue(wire) for wire in wires]
        t_aggregate = time.perf_counter_ns()
        out = self.aggregator.aggregate(outputs, output_rank=0)
        step.unpickle_ns = t_aggregate - t
        step.merge_ns = time.perf_counter_ns() - t_aggregate
        return out

    def describe(self) -> list[str]:
        """The worker processes and the queues' shared memory, one per line."""
        ex = self.executor
        if ex is None:
            return []
        lines = [
            f"worker {w.rank}: pid {w.proc.pid}, response queue shm "
            f"{w.worker_response_mq.buffer.shared_memory.name}"
            for w in ex.workers
        ]
        lines.append(
            f"broadcast queue shm {ex.rpc_broadcast_mq.buffer.shared_memory.name}"
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
        step = Step(
            output=so,
            finished=[],
            preempted=len(so.preempted_req_ids or ()),
            merge_ns=0,
        )
        out = self._run_workers(so, step)
        t = time.perf_counter_ns()
        results = self.scheduler.update_from_output(so, out)
        step.merge_ns += time.perf_counter_ns() - t
        step.finished = [
            o.request_id
            for eco in results.values()
            for o in eco.outputs
            if o.finish_reason is not None
        ]
        step.scheduler_stats = next(
            (eco.scheduler_stats for eco in results.values() if eco.scheduler_stats),
            None,
        )
        return step

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_running_requests=True,
        reset_connector=True)``: running requests are preempted."""
        return bool(
            self.scheduler.reset_prefix_cache(
                reset_running_requests=True, reset_connector=True
            )
        )

    # --- the end -------------------------------------------------------------------
    def close(self) -> None:
        if self.executor is not None:
            with contextlib.suppress(Exception):
                self.executor.shutdown()
            self.executor = None
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            with contextlib.suppress(Exception):
                scheduler.shutdown()
