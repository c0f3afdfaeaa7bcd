"""How many workers the scheduler hears from, and which one this worker is.

vLLM 0.33.0's executors (``v1/executor/``):

* ``MultiprocExecutor`` and ``RayExecutorV2`` (a subclass) read every worker's
  output and combine them with ``KVOutputAggregator``, built with
  ``parallel_config.world_size`` (TP x PP x PCP of one data-parallel replica;
  each DP replica has its own scheduler, executor and aggregator).
  Worker ``rank`` is the index into that list: ``(pp * PCP + pcp) * TP + tp``,
  the layout of ``initialize_model_parallel`` inside a DP replica, and the
  value ``WorkerBase`` stores in ``parallel_config.rank``.
* ``UniProcExecutor`` (world size 1) returns its only worker's output.
* ``ExecutorWithExternalLauncher`` (``distributed_executor_backend=
  "external_launcher"``) runs one scheduler per process, and that scheduler
  sees only its own worker's output: one worker, rank 0.

The denominator is therefore fixed by the configuration, never by how many
containers arrived in a step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

EXTERNAL_LAUNCHER = "external_launcher"


def _external_launcher(vllm_config: VllmConfig) -> bool:
    return vllm_config.parallel_config.distributed_executor_backend == (
        EXTERNAL_LAUNCHER
    )


def aggregated_world_size(vllm_config: VllmConfig) -> int:
    """The number of workers whose outputs the executor aggregates per step."""
    if _external_launcher(vllm_config):
        return 1
    return int(vllm_config.parallel_config.world_size)


def worker_rank(vllm_config: VllmConfig) -> int:
    """This worker's index among the outputs the executor aggregates.

    From vLLM's parallel state when the model-parallel groups exist (every real
    worker), else from ``parallel_config.rank``, which vLLM's ``WorkerBase`` sets
    to the rank the executor gave the worker.
    """
    if _external_launcher(vllm_config):
        return 0
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        tp = ps.get_tp_group()
        pp = ps.get_pp_group()
        try:
            pcp = ps.get_pcp_group()
            pcp_rank, pcp_size = pcp.rank_in_group, pcp.world_size
        except AssertionError:  # no PCP group: size 1
            pcp_rank, pcp_size = 0, 1
        return (pp.rank_in_group * pcp_size + pcp_rank) * tp.world_size + (
            tp.rank_in_group
        )
    return int(vllm_config.parallel_config.rank)
